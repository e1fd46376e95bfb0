"""A synthetic Kimi-K3.1 (or K3) checkpoint in the published layout, deterministic from a seed.

No real K3.1 weights exist here, so tests, `make demo` and the benchmarks use this. It writes what
a real multimodal K3.1 checkpoint has (MODEL_SPEC "What we build", 2.x):
  config.json          model_type kimi_k3 wrapper: text_config (kimi_linear + K3 keys + index_*),
                       vision_config, quantization_config (compressed-tensors mxfp4-pack-quantized)
  *.safetensors        several shards + model.safetensors.index.json
    language_model.model.layers.{i}.*   KDA (safe gate, full-rank g_proj, fp32 A_log [head_dim]
                                        with zeros past num_heads) or MLA (q-LoRA, NoPE, output
                                        gate) + self_attn.indexer.*; latent MoE with MXFP4
                                        experts.{e}.w{1,2,3}.weight_packed/weight_scale;
                                        attention-residual tensors
    language_model.model.mtp.layers.0.*  MTP (dropped by our loader)
    vision_tower.*, mm_projector.*       MoonViT-style (dropped)
  tokenizer.json       byte-level BPE (256 byte tokens + specials), tokenizer_config.json (with a chat template)

Every tensor is drawn from its own generator seeded by (seed, name), so the K3 variant (no
indexer) has bit-identical weights everywhere else.

    python -m kimi_iree.frontend.synthetic OUT [--variant k3.1|k3] [--layers N] [--size tiny|bench]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import mxfp4

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# A role-tagged chat template over the byte-level vocabulary: the eos token ends every turn, so it is
# also what stops an assistant's reply (the published K2/K3 templates use their own <|im_*|> tokens).
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message.role }}: {{ message.content }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


@dataclass(frozen=True)
class SyntheticSize:
    hidden: int
    kda_heads: int
    kda_head_dim: int
    mla_heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    experts: int
    experts_per_token: int
    shared_experts: int
    moe_intermediate: int
    latent: int
    intermediate: int
    vocab: int
    attn_res_block: int


SIZES = {
    "tiny": SyntheticSize(hidden=64, kda_heads=2, kda_head_dim=32, mla_heads=4, q_lora=32, kv_lora=32, nope=16,
                          rope=8, v_dim=16, index_heads=8, index_head_dim=16, index_topk=8, experts=8,
                          experts_per_token=2, shared_experts=2, moe_intermediate=32, latent=32, intermediate=96,
                          vocab=512, attn_res_block=2),
    # MODEL_SPEC-shaped but small enough for 2 cores: the decode benchmark's model
    "bench": SyntheticSize(hidden=1024, kda_heads=8, kda_head_dim=128, mla_heads=8, q_lora=512, kv_lora=256,
                           nope=64, rope=32, v_dim=64, index_heads=16, index_head_dim=64, index_topk=256,
                           experts=32, experts_per_token=4, shared_experts=1, moe_intermediate=512, latent=512,
                           intermediate=2048, vocab=32768, attn_res_block=4),
}


def attention_layers(num_layers: int) -> list[int]:
    """1-based attention layers: every 4th and the last (K3: 3 KDA : 1 attention, 92 and 93 both attention)."""
    return sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})


def text_config(size: SyntheticSize, num_layers: int, variant: str) -> dict:
    full = attention_layers(num_layers)
    cfg = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": size.vocab, "hidden_size": size.hidden, "num_hidden_layers": num_layers,
        "intermediate_size": size.intermediate, "num_attention_heads": size.mla_heads,
        "num_key_value_heads": size.mla_heads, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "q_lora_rank": size.q_lora, "kv_lora_rank": size.kv_lora, "qk_nope_head_dim": size.nope,
        "qk_rope_head_dim": size.rope, "v_head_dim": size.v_dim, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": size.kda_heads, "head_dim": size.kda_head_dim,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": [i for i in range(1, num_layers + 1) if i not in full],
                               "full_attn_layers": full},
        "num_experts": size.experts, "num_experts_per_token": size.experts_per_token,
        "num_shared_experts": size.shared_experts, "moe_intermediate_size": size.moe_intermediate,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "routed_expert_hidden_size": size.latent, "latent_moe_use_norm": True,
        "attn_res_block_size": size.attn_res_block, "num_nextn_predict_layers": 0,
        "model_max_length": 1048576, "bos_token_id": size.vocab - 3, "eos_token_id": size.vocab - 2,
        "pad_token_id": size.vocab - 1,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "strategy": "group", "symmetric": True,
                                                      "scale_dtype": "uint8"},
                                          "input_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:vision_tower.*", "re:mm_projector.*"]},
    }
    if variant == "k3.1":
        cfg.update(index_n_heads=size.index_heads, index_head_dim=size.index_head_dim, index_topk=size.index_topk)
    return cfg


class _Weights:
    """Deterministic tensors: each from its own generator seeded by (seed, name)."""

    def __init__(self, seed: int):
        self.seed, self.tensors = seed, {}

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def linear(self, name: str, out: int, inp: int, dtype=torch.bfloat16, gain: float = 1.0) -> None:
        w = torch.randn(out, inp, generator=self._gen(name)) * (gain / math.sqrt(inp))
        self.tensors[name] = w.to(dtype)

    def norm(self, name: str, dim: int, dtype=torch.bfloat16) -> None:
        self.tensors[name] = (1 + 0.1 * torch.randn(dim, generator=self._gen(name))).to(dtype)

    def vector(self, name: str, shape: tuple, std: float, dtype=torch.float32) -> None:
        self.tensors[name] = (std * torch.randn(*shape, generator=self._gen(name))).to(dtype)

    def mxfp4_linear(self, name: str, out: int, inp: int) -> None:
        w = torch.randn(out, inp, generator=self._gen(name)) / math.sqrt(inp)
        self.tensors[name + ".weight_packed"], self.tensors[name + ".weight_scale"] = mxfp4.quantize(w)


def synthetic_tensors(size: SyntheticSize, num_layers: int, variant: str, seed: int) -> dict[str, torch.Tensor]:
    # Unit-gain projections keep activations O(1); the router and the indexer get a gain of 3 so
    # that routing and token selection are far from uniform.
    w = _Weights(seed)
    sharp = 3.0
    D, H, d = size.hidden, size.kda_heads, size.kda_head_dim
    full = set(attention_layers(num_layers))
    p = "language_model.model."
    w.vector(p + "embed_tokens.weight", (size.vocab, D), 1.0, torch.bfloat16)
    w.norm(p + "norm.weight", D)
    w.linear("language_model.lm_head.weight", size.vocab, D)
    w.vector(p + "output_attn_res_proj.weight", (1, D), D ** -0.5, torch.bfloat16)
    w.norm(p + "output_attn_res_norm.weight", D)
    for i in range(num_layers):
        L = f"{p}layers.{i}."
        w.norm(L + "input_layernorm.weight", D)
        w.norm(L + "post_attention_layernorm.weight", D)
        for r in ("self_attention_res", "mlp_res"):
            w.vector(L + f"{r}_proj.weight", (1, D), D ** -0.5, torch.bfloat16)
            w.norm(L + f"{r}_norm.weight", D)
        a = L + "self_attn."
        if i + 1 in full:
            w.linear(a + "q_a_proj.weight", size.q_lora, D)
            w.norm(a + "q_a_layernorm.weight", size.q_lora)
            w.linear(a + "q_b_proj.weight", size.mla_heads * (size.nope + size.rope), size.q_lora)
            w.linear(a + "kv_a_proj_with_mqa.weight", size.kv_lora + size.rope, D)
            w.norm(a + "kv_a_layernorm.weight", size.kv_lora)
            w.linear(a + "kv_b_proj.weight", size.mla_heads * (size.nope + size.v_dim), size.kv_lora)
            w.linear(a + "g_proj.weight", size.mla_heads * size.v_dim, D)
            w.linear(a + "o_proj.weight", D, size.mla_heads * size.v_dim)
            if variant == "k3.1":
                w.linear(a + "indexer.wq_b.weight", size.index_heads * size.index_head_dim, size.q_lora, gain=sharp)
                w.linear(a + "indexer.wk.weight", size.index_head_dim, D, gain=sharp)
                w.norm(a + "indexer.k_norm.weight", size.index_head_dim)
                w.vector(a + "indexer.k_norm.bias", (size.index_head_dim,), 0.1, torch.bfloat16)
                w.linear(a + "indexer.weights_proj.weight", size.index_heads, D, gain=sharp)
        else:
            for x in ("q", "k", "v"):
                w.linear(a + f"{x}_proj.weight", H * d, D)
                w.vector(a + f"{x}_conv1d.weight", (H * d, 1, 4), 0.5)
            w.linear(a + "f_a_proj.weight", d, D)
            w.linear(a + "f_b_proj.weight", H * d, d)
            w.linear(a + "b_proj.weight", H, D)
            w.linear(a + "g_proj.weight", H * d, D)
            w.linear(a + "o_proj.weight", D, H * d)
            w.norm(a + "o_norm.weight", d)
            # K3 publishes A_log as fp32 [head_dim] with the entries past num_heads zero
            a_log = torch.zeros(d)
            a_log[:H] = torch.empty(H).uniform_(1.0, 16.0, generator=w._gen(a + "A_log")).log()
            w.tensors[a + "A_log"] = a_log
            w.vector(a + "dt_bias", (H * d,), 0.5)
        m = L + "block_sparse_moe." if i >= 1 else L + "mlp."
        if i == 0:
            for x, shape in (("gate", (size.intermediate, D)), ("up", (size.intermediate, D)),
                             ("down", (D, size.intermediate))):
                w.linear(m + f"{x}_proj.weight", *shape)
            continue
        w.linear(m + "gate.weight", size.experts, D, gain=sharp)
        w.vector(m + "gate.e_score_correction_bias", (size.experts,), 0.1)
        shared = size.moe_intermediate * size.shared_experts
        w.linear(m + "shared_experts.gate_proj.weight", shared, D)
        w.linear(m + "shared_experts.up_proj.weight", shared, D)
        w.linear(m + "shared_experts.down_proj.weight", D, shared)
        w.linear(m + "routed_expert_down_proj.weight", size.latent, D)
        w.norm(m + "routed_expert_norm.weight", size.latent)
        w.linear(m + "routed_expert_up_proj.weight", D, size.latent)
        for e in range(size.experts):
            w.mxfp4_linear(m + f"experts.{e}.w1", size.moe_intermediate, size.latent)
            w.mxfp4_linear(m + f"experts.{e}.w3", size.moe_intermediate, size.latent)
            w.mxfp4_linear(m + f"experts.{e}.w2", size.latent, size.moe_intermediate)
    # what the loader must drop: one MTP layer, a MoonViT block and the projector
    mtp = p + "mtp.layers.0."
    w.linear(mtp + "eh_proj.weight", D, 2 * D)
    w.norm(mtp + "enorm.weight", D)
    w.norm(mtp + "hnorm.weight", D)
    w.linear("vision_tower.patch_embed.proj.weight", 32, 3 * 14 * 14)
    w.linear("vision_tower.encoder.blocks.0.wqkv.weight", 96, 32)
    w.linear("vision_tower.encoder.blocks.0.wo.weight", 32, 32)
    w.norm("vision_tower.encoder.final_layernorm.weight", 32)
    w.linear("mm_projector.proj.0.weight", 128, 128)
    w.linear("mm_projector.proj.2.weight", D, 128)
    w.norm("mm_projector.post_norm.weight", D)
    return w.tensors


def byte_level_tokenizer(vocab: int) -> dict:
    """tokenizer.json for a byte-level BPE with no merges: ids 0..255 are the bytes, the last three specials,
    the ones between placeholders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_to_char = _bytes_to_unicode()   # ByteLevel's printable stand-in for each byte; id = byte value
    assert set(byte_to_char.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    token_vocab = {byte_to_char[b]: b for b in range(256)}
    token_vocab.update({f"<|unused_{i}|>": i for i in range(256, vocab - len(SPECIAL_TOKENS))})  # every id decodes
    for j, tok in enumerate(SPECIAL_TOKENS):
        token_vocab[tok] = vocab - 3 + j
    tok = Tokenizer(models.BPE(vocab=token_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return json.loads(tok.to_str())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_checkpoint(out: str | Path, tensors: dict[str, torch.Tensor], files: dict[str, str],
                     num_shards: int) -> None:
    """`tensors` in `num_shards` safetensors shards with their index, plus `files` (name -> text), written
    atomically: into a temp dir next to `out`, renamed into place only once everything is on disk."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        names = sorted(tensors)
        weight_map = {}
        for j in range(num_shards):
            shard = names[j::num_shards]
            file = f"model-{j + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in shard}, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        for file, text in files.items():
            (tmp / file).write_text(text)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_synthetic_checkpoint(out: str | Path, *, variant: str = "k3.1", num_layers: int = 6, size: str = "tiny",
                               seed: int = 0, num_shards: int = 3) -> Path:
    """Write the checkpoint into `out` (atomically: a temp dir renamed into place). Returns `out`."""
    if variant not in ("k3.1", "k3"):
        raise ValueError(f"variant must be k3.1 or k3, got {variant!r}")
    if num_layers < 2:
        raise ValueError("--layers must be at least 2 (a dense first layer and one MoE layer)")
    dims = SIZES[size]
    out = Path(out)
    tensors = synthetic_tensors(dims, num_layers, variant, seed)
    config = {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text_config(dims, num_layers, variant),
        "vision_config": {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 1, "patch_size": 14},
        "media_placeholder_token_id": dims.vocab - 1, "tie_word_embeddings": False,
    }
    files = {
        "config.json": json.dumps(config, indent=2),
        "tokenizer.json": json.dumps(byte_level_tokenizer(dims.vocab)),
        "tokenizer_config.json": json.dumps(
            {"add_bos_token": False, "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1],
             "model_max_length": 1048576, "chat_template": CHAT_TEMPLATE}),
    }
    write_checkpoint(out, tensors, files, num_shards)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_iree.frontend.synthetic", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output checkpoint directory")
    ap.add_argument("--variant", choices=["k3.1", "k3"], default="k3.1")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        path = write_synthetic_checkpoint(args.out, variant=args.variant, num_layers=args.layers, size=args.size,
                                          seed=args.seed, num_shards=args.shards)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
