"""Tiny random checkpoints written by transformers (the oracle) with `save_pretrained`.

Random weights are scaled up (x3) so that routing and DSA selection are far from uniform. Exact score
ties (every indexer head's ReLU at 0) are common with few indexer heads; `stable_topk` makes the
oracle break them as we do (the earliest key), so any input can be compared.

Families: the fixtures' own configs (`kimi_linear`, `deepseek_v3`, `deepseek_v32`, `kimi_k25`) and
further shapes of the same families: `kimi_linear_odd` (odd head counts, width 80) and
`deepseek_v32_issue16` (the configuration that found wrong Vulkan logits: 3 heads, 12 experts top-3,
4 indexer heads, index_topk 24 below the default 32-token prefill block).
"""

from __future__ import annotations

import contextlib
import re
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


def kimi_linear_odd_config() -> tf.KimiLinearConfig:
    return kimi_linear_config(hidden_size=80, num_attention_heads=5, num_key_value_heads=5, kv_lora_rank=24,
                              qk_nope_head_dim=24, v_head_dim=20, linear_num_heads=3, linear_head_dim=24,
                              num_experts=6, num_experts_per_token=3, moe_intermediate_size=40, intermediate_size=120,
                              num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                "linear_attention"])


def deepseek_v32_issue16_config() -> tf.DeepseekV32Config:
    return tf.DeepseekV32Config(vocab_size=256, hidden_size=96, intermediate_size=160, moe_intermediate_size=64,
                                num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=32,
                                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
                                n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1,
                                first_k_dense_replace=1, index_n_heads=4, index_head_dim=32, index_topk=24,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def kimi_k25_config() -> tf.Kimi_K25Config:
    text = dict(COMMON, **MOE, model_type="deepseek_v3", num_hidden_layers=2, q_lora_rank=24, n_routed_experts=8,
                n_group=2, topk_group=1)
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2)
    return tf.Kimi_K25Config(text_config=text, vision_config=vision)


def _scaled_matrices(model: torch.nn.Module) -> torch.nn.Module:
    """Issue 16's scaling: every parameter of 2 or more dims outside the norms, x3."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.mul_(SCALE)
    return model.eval()


BUILDERS = {
    "kimi_linear": (tf.KimiLinearForCausalLM, kimi_linear_config, _scaled),
    "kimi_linear_odd": (tf.KimiLinearForCausalLM, kimi_linear_odd_config, _scaled),
    "deepseek_v3": (tf.DeepseekV3ForCausalLM, deepseek_v3_config, _scaled),
    "deepseek_v32": (tf.DeepseekV32ForCausalLM, deepseek_v32_config, _scaled),
    "deepseek_v32_issue16": (tf.DeepseekV32ForCausalLM, deepseek_v32_issue16_config, _scaled_matrices),
    "kimi_k25": (tf.Kimi_K25ForConditionalGeneration, kimi_k25_config, _scaled),
}


def write_hf_checkpoint(family: str, directory: Path) -> torch.nn.Module:
    """Save a tiny random `family` model to `directory`; returns the transformers model (the oracle)."""
    cls, make_config, scale = BUILDERS[family]
    torch.manual_seed(0)
    model = scale(cls(make_config()))
    model.save_pretrained(directory)
    vocab = model.config.get_text_config().vocab_size
    write_tokenizer(directory, vocab)
    return model


def write_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """The synthetic checkpoints' byte-level tokenizer (ids 0..255 are bytes), so text can be scored."""
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(vocab)))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))


@contextlib.contextmanager
def stable_topk():
    """Within the block, Tensor.topk keeps the earliest of equal values (a stable descending sort), the
    tie rule of our selection (frontend/selection.py). transformers' indexer calls `scores.topk(k)`,
    whose choice among exact ties (ReLU zeros) is arbitrary; its values and order are otherwise as before."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def oracle_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [B, T, vocab] (f32) for `ids`, exact top-k ties broken as ours are."""
    with torch.no_grad(), stable_topk():
        return model(input_ids=ids).logits.float()


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


# ------------------------------------------------------------------ published quantised layouts (issue 19)
# Which linear layers the published FP8 checkpoints quantise (DeepSeek-V3/V3.2, Kimi-K2): every attention
# projection, dense MLP, shared and routed experts, and V3.2's indexer wq_b and wk; never the embeddings,
# lm_head, norms, the router (`mlp.gate`) or the indexer's weights_proj.
FP8_LINEAR = re.compile(r".*\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj"
                        r"|indexer\.(wq_b|wk))|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight")
INT4_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def fp8_block_quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, K] -> (float8_e4m3fn codes, f32 scale_inv [ceil(O/128), ceil(K/128)]) as DeepSeek's quantiser:
    scale = amax / 448 per 128x128 block (edge blocks partial); ue8m0 rounds it up to a power of two."""
    O, K = w.shape
    R, C = -(-O // 128), -(-K // 128)
    padded = torch.zeros(R * 128, C * 128)
    padded[:O, :K] = w.float()
    amax = padded.reshape(R, 128, C, 128).abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:O, :K]
    return (w.float() / expanded).to(torch.float8_e4m3fn), scale


def fp8_block_dequantize(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The oracle's dequantiser, independent of ours: torch's own float8 decode, times the cropped block scale."""
    O, K = codes.shape
    return codes.to(torch.float32) * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:O, :K]


def int4_group_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, K] -> (compressed-tensors pack_to_int32 words, bf16 scales [O, ceil(K/32)]): symmetric, scale =
    amax / 7.5 per 32 (compressed-tensors' own rule), q = round(w / s) clamped to -8..7."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    O, K = w.shape
    G = -(-K // 32)
    padded = torch.zeros(O, G * 32)
    padded[:, :K] = w.float()
    scale = (padded.reshape(O, G, 32).abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(w.float() / scale.float().repeat_interleave(32, 1)[:, :K]).clamp(-8, 7).to(torch.int8)
    return pack_to_int32(q, 4), scale


def int4_group_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The oracle: compressed-tensors' unpack, then q * scale in bf16 (as its dequantisation computes it)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    q = unpack_from_int32(packed, 4, torch.Size(shape))
    return (q.to(torch.bfloat16) * scale.repeat_interleave(32, 1)[:, : shape[1]]).float()


def deepseek_v32_fp8_config() -> tf.DeepseekV32Config:
    """Every FP8 weight has a partial edge block and some have two (hidden 144, kv_b_proj 192 rows,
    intermediate 160); index_topk 8 keeps the selection active at 42 tokens."""
    return tf.DeepseekV32Config(vocab_size=256, hidden_size=144, intermediate_size=160, moe_intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=32,
                                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                first_k_dense_replace=1, index_n_heads=4, index_head_dim=32, index_topk=8,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def kimi_k2_fp8_config() -> tf.DeepseekV3Config:
    return deepseek_v3_config(hidden_size=136, intermediate_size=144, num_hidden_layers=2, vocab_size=256)


def deepseek_v32_fp8_real_dims_config() -> tf.DeepseekV32Config:
    """DeepSeek-V3.2's real head dims (kv_lora 512, rope 64, dn = dv = 128, index head 128) in a narrow
    model: GPU codegen failures that only these dims reach (README "Findings") are compiled for here."""
    return deepseek_v32_config(vocab_size=256, hidden_size=384, intermediate_size=320, moe_intermediate_size=192,
                               num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=192,
                               kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                               n_group=1, topk_group=1, index_head_dim=128, index_topk=8)


PUBLISHED = {
    # family: (transformers class, config, how its weights are scaled, model_type to publish, format)
    "deepseek_v32_fp8": (tf.DeepseekV32ForCausalLM, deepseek_v32_fp8_config, _scaled_matrices, None, "fp8-ue8m0"),
    "kimi_k2_fp8": (tf.DeepseekV3ForCausalLM, kimi_k2_fp8_config, _scaled, "kimi_k2", "fp8"),
    "kimi_k25_int4": (tf.Kimi_K25ForConditionalGeneration, kimi_k25_config, _scaled, None, "int4"),
}
# compiled for GPU targets only (tests/test_cross_targets.py), not in the family-wide tests
REAL_DIMS = {"deepseek_v32_fp8_real_dims": (tf.DeepseekV32ForCausalLM, deepseek_v32_fp8_real_dims_config,
                                            _scaled_matrices, None, "fp8-ue8m0")}


def write_published_checkpoint(family: str, directory: Path) -> torch.nn.Module:
    """A tiny checkpoint in a published quantised layout (FP8 block-scaled or INT4 pack-quantized experts);
    returns the oracle: the transformers model loaded from the same weights dequantised (by
    `fp8_block_dequantize` / compressed-tensors), written beside it as `<directory>-dequantised`."""
    cls, make_config, scale, model_type, fmt = {**PUBLISHED, **REAL_DIMS}[family]
    torch.manual_seed(0)
    model = scale(cls(make_config()))
    model.save_pretrained(directory)
    dense_dir = directory.parent / f"{directory.name}-dequantised"
    model.save_pretrained(dense_dir)
    tensors = load_file(directory / "model.safetensors")
    quantized, dense = {}, {}
    for name, t in tensors.items():
        if fmt.startswith("fp8") and FP8_LINEAR.fullmatch(name):
            codes, scale_inv = fp8_block_quantize(t, ue8m0=fmt == "fp8-ue8m0")
            quantized[name], quantized[f"{name}_scale_inv"] = codes, scale_inv
            dense[name] = fp8_block_dequantize(codes, scale_inv).to(t.dtype)
        elif fmt == "int4" and INT4_EXPERT.fullmatch(name):
            packed, scales = int4_group_quantize(t)
            base = name[: -len("weight")]
            quantized[base + "weight_packed"], quantized[base + "weight_scale"] = packed, scales
            quantized[base + "weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            dense[name] = int4_group_dequantize(packed, scales, tuple(t.shape)).to(t.dtype)
        else:
            # as published: what is not quantised ships bf16, except the f32 routing bias
            if t.is_floating_point() and not name.endswith("e_score_correction_bias"):
                t = t.to(torch.bfloat16)
            quantized[name] = dense[name] = t
    save_file(quantized, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    if fmt.startswith("fp8"):
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if fmt == "fp8-ue8m0":
            qc["scale_fmt"] = "ue8m0"
    else:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                  "dynamic": False, "actorder": None, "observer": "minmax"}}},
              "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                         "re:.*vision_tower.*", "re:.*mm_projector.*"]}
    config["quantization_config"] = qc
    if model_type:
        config["model_type"] = model_type
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, model.config.get_text_config().vocab_size)
    oracle = cls.from_pretrained(dense_dir, dtype=torch.float32).eval()
    return oracle
