"""ModelConfig parsing: both encodings of each key, and one clear error per bad config."""

import json

import pytest

from kimi_iree.frontend import ConfigError, load_config, parse_config

KIMI_LINEAR = {
    "model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
    "intermediate_size": 96, "num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
}


def test_layer_kinds_from_one_based_lists():
    cfg = parse_config(KIMI_LINEAR)
    assert cfg.layer_kinds == ("kda", "kda", "kda", "mla")
    assert cfg.ffn_kinds == ("dense", "moe", "moe", "moe")
    assert cfg.mla_use_nope and cfg.kda_num_heads == 2


def test_layer_kinds_from_layer_types_agree():
    raw = dict(KIMI_LINEAR, layer_types=["kda_attention"] * 3 + ["full_attention"])
    assert parse_config(raw).layer_kinds == ("kda", "kda", "kda", "mla")


def test_contradicting_layer_encodings_are_an_error():
    raw = dict(KIMI_LINEAR, layer_types=["full_attention"] + ["linear_attention"] * 3)
    with pytest.raises(ConfigError, match="layer_types contradicts"):
        parse_config(raw)


def test_both_moe_spellings_accepted_and_must_agree():
    raw = {k: v for k, v in KIMI_LINEAR.items() if k not in ("num_experts", "num_experts_per_token")}
    cfg = parse_config(dict(raw, n_routed_experts=8, num_experts_per_tok=2))
    assert (cfg.num_experts, cfg.experts_per_token) == (8, 2)
    with pytest.raises(ConfigError, match="contradicting keys num_experts=8, n_routed_experts=16"):
        parse_config(dict(KIMI_LINEAR, n_routed_experts=16))


def test_missing_key_is_named():
    raw = {k: v for k, v in KIMI_LINEAR.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="missing key 'kv_lora_rank'"):
        parse_config(raw)


def test_unsupported_model_type_is_named():
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        parse_config({"model_type": "llama"})


def test_multimodal_wrapper_reads_text_config_and_quantization_at_either_level():
    text = dict(KIMI_LINEAR, model_type="kimi_linear")
    q = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    for raw in ({"model_type": "kimi_k3", "text_config": dict(text, quantization_config=q)},
                {"model_type": "kimi_k3", "text_config": text, "quantization_config": q}):
        cfg = parse_config(raw)
        assert cfg.model_type == "kimi_k3" and cfg.expert_format == "mxfp4"


def test_unsupported_quantization_is_named():
    for q, message in (({"quant_method": "awq"}, "quant_method 'awq'"),
                       ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
                       ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
                       ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"g": {"format": "pack-quantized", "weights": {"num_bits": 8}}}},
                        "weights.num_bits 8"),
                       ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"g": {"format": "pack-quantized", "weights": {"group_size": 128}}}},
                        "weights.group_size 128"),
                       ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "float-quantized")):
        with pytest.raises(ConfigError, match=message):
            parse_config(dict(KIMI_LINEAR, quantization_config=q))


def test_published_quantization_configs_name_their_formats():
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
           "scale_fmt": "ue8m0"}
    cfg = parse_config(dict(KIMI_LINEAR, quantization_config=fp8))
    assert (cfg.expert_format, cfg.weight_format) == ("fp8_e4m3_b128", "fp8_e4m3_b128")
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"format": "pack-quantized", "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    cfg = parse_config(dict(KIMI_LINEAR, quantization_config=int4))
    assert (cfg.expert_format, cfg.weight_format) == ("int4_g32", None)


def test_indexer_keys_need_q_lora_rank():
    raw = dict(KIMI_LINEAR, index_n_heads=2, index_head_dim=16, index_topk=8)
    with pytest.raises(ConfigError, match="q_lora_rank"):
        parse_config(raw)


def test_yarn_rope_parameters(tmp_path):
    raw = {"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
           "intermediate_size": 96, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path)
    assert cfg.yarn.factor == 40 and not cfg.mla_use_nope
    # DeepSeek-V3.2's softmax scale with YaRN: 192^-0.5 * mscale^2 (MODEL_SPEC 3.2), here 24^-0.5 * 1.3689^2
    assert abs(cfg.attention_softmax_scale - 24 ** -0.5 * (0.1 * __import__("math").log(40) + 1) ** 2) < 1e-12


def test_bad_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_config(tmp_path)
