"""Tiny random checkpoints written by transformers (the oracle) with `save_pretrained`.

Random weights are scaled up (x3) so that routing and DSA selection are far from uniform, and
the indexer gets 8 heads so that exact score ties (every head's ReLU at 0) are rare.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from kimi_iree.frontend import mxfp4
from kimi_iree.frontend.synthetic import byte_level_tokenizer

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, first_k_dense_replace=1)
SCALE = 3.0


def _scaled(model: torch.nn.Module) -> torch.nn.Module:
    """Weights x3, but not KDA's decay parameters: exp(3 * A_log) would make the per-token decay so
    strong that the cumulative log-decay loses all fp32 precision in any implementation."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                p.mul_(SCALE)
    return model.eval()


def kimi_linear_config(**over) -> tf.KimiLinearConfig:
    kw = dict(COMMON, num_hidden_layers=4, q_lora_rank=None, num_experts=8, num_shared_experts=1,
              num_experts_per_token=2, first_k_dense_replace=1, linear_num_heads=2, linear_head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    kw.update(over)
    return tf.KimiLinearConfig(**kw)


def deepseek_v3_config(**over) -> tf.DeepseekV3Config:
    kw = dict(COMMON, **MOE, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1,
              max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                               "mscale": 1.0, "mscale_all_dim": 1.0})
    kw.update(over)
    return tf.DeepseekV3Config(**kw)


def deepseek_v32_config(**over) -> tf.DeepseekV32Config:
    kw = dict(COMMON, **MOE, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1,
              index_topk=4, index_head_dim=16, index_n_heads=8)
    kw.update(over)
    return tf.DeepseekV32Config(**kw)


def kimi_k25_config() -> tf.Kimi_K25Config:
    text = dict(COMMON, **MOE, model_type="deepseek_v3", num_hidden_layers=2, q_lora_rank=24, n_routed_experts=8,
                n_group=2, topk_group=1)
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2)
    return tf.Kimi_K25Config(text_config=text, vision_config=vision)


BUILDERS = {
    "kimi_linear": (tf.KimiLinearForCausalLM, kimi_linear_config),
    "deepseek_v3": (tf.DeepseekV3ForCausalLM, deepseek_v3_config),
    "deepseek_v32": (tf.DeepseekV32ForCausalLM, deepseek_v32_config),
    "kimi_k25": (tf.Kimi_K25ForConditionalGeneration, kimi_k25_config),
}


def write_hf_checkpoint(family: str, directory: Path) -> torch.nn.Module:
    """Save a tiny random `family` model to `directory`; returns the transformers model (the oracle)."""
    cls, make_config = BUILDERS[family]
    torch.manual_seed(0)
    model = _scaled(cls(make_config()))
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def write_tokenizer(directory: Path) -> None:
    """The synthetic checkpoints' byte-level tokenizer (ids 0..255 are bytes), so text can be scored."""
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(VOCAB)))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))


def write_kimi_linear_mxfp4(directory: Path) -> torch.nn.Module:
    """A kimi_linear checkpoint whose routed experts are compressed-tensors MXFP4.

    The oracle's experts are first rounded through MXFP4 (quantise, dequantise), so it runs on
    exactly the values the packed checkpoint holds.
    """
    torch.manual_seed(0)
    model = _scaled(tf.KimiLinearForCausalLM(kimi_linear_config()))
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if ".experts." in name and name.endswith(".weight"):
            packed, scales = mxfp4.quantize(t)
            out[name[: -len("weight")] + "weight_packed"] = packed
            out[name[: -len("weight")] + "weight_scale"] = scales
            tensors[name] = mxfp4.dequantize(packed, scales)
        else:
            out[name] = t
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                      "weights": {"num_bits": 4, "group_size": 32, "strategy": "group"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    # the oracle: the same model on the dequantised expert values
    model.load_state_dict(_hf_state_from_tensors(model, tensors))
    return model


def _hf_state_from_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put per-expert checkpoint weights back into transformers' fused expert parameters."""
    state = model.state_dict()
    for key in state:
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len("mlp.experts.gate_up_proj")]
            E = state[key].shape[0]
            state[key] = torch.stack([torch.cat([tensors[f"{prefix}block_sparse_moe.experts.{e}.w1.weight"],
                                                 tensors[f"{prefix}block_sparse_moe.experts.{e}.w3.weight"]])
                                      for e in range(E)])
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len("mlp.experts.down_proj")]
            E = state[key].shape[0]
            state[key] = torch.stack([tensors[f"{prefix}block_sparse_moe.experts.{e}.w2.weight"] for e in range(E)])
    return state
