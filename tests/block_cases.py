"""The cases the differential suite runs (tests/test_backend_ops.py): each fusion unit and each block of the
model as a small nn.Module with seeded random weights and inputs, built from a handful of shape
parameters so that a table row or a sampled draw names a case completely.

Blocks are called the way KimiModel calls them (frontend/model.py): the mixer adapters derive cache
positions and RoPE from a position input, and a prefill block takes a `length` below its size when
its tail is padding (KDA must then leave the padding out of its state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kimi_iree.frontend import formats, units
from kimi_iree.frontend.config import ModelConfig
from kimi_iree.frontend.kda import KDA
from kimi_iree.frontend.layers import Linear, set_linear_format
from kimi_iree.frontend.mla import MLA
from kimi_iree.frontend.model import AttnResMix, make_step, use_fused_units
from kimi_iree.frontend.moe import FloatExperts, MoE, set_expert_format
from kimi_iree.frontend.units import FusedUnits

from backend_ops import Case

# f32 sums in another order, over contractions of at most a few hundred terms: 1e-6 is typical, a real
# fault is 1e-2 or more (a wrong row, a dropped block, a NaN).
UNIT_TOL = 1e-4
# KDA's chunked form subtracts nearly equal terms (U - W S) and exponentiates cumulative decays
BLOCK_TOL = 1e-4


def small_config(**fields) -> ModelConfig:
    """A one-layer ModelConfig with every knob a block reads; `fields` override."""
    base = dict(model_type="kimi_k3", text_model_type="kimi_linear", vocab_size=64, hidden_size=48, num_layers=1,
                rms_norm_eps=1e-6, tie_word_embeddings=False, layer_kinds=("kda",), ffn_kinds=("moe",),
                intermediate_size=64, kda_num_heads=3, kda_head_dim=16, kda_conv_size=4, num_heads=3, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
                num_experts=6, experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32)
    base.update(fields)
    return ModelConfig(**base)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Seeded weights of a sensible scale: linear maps ~ 1/sqrt(fan_in), norms near 1, MXFP4 bytes
    uniform with scales near 2^0, KDA's decay parameters small (so that decays stay in (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dtype == torch.uint8:
                if name.endswith("scales"):
                    t.copy_(torch.randint(124, 131, t.shape, generator=g, dtype=torch.uint8))
                else:
                    t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
            elif name.endswith(("A_log", "dt_bias", "conv", "bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif "norm" in name or name.endswith(("o_norm",)):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    return module.eval()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------- units
class WeightDecode(nn.Module):
    """kimi::weight_expert_matmul: J rows, each through its own expert (decode's k slots, prefill's pairs)."""

    def __init__(self, fmt: str, E: int, O: int, K: int):
        super().__init__()
        f, self.fmt = formats.FORMATS[fmt], fmt
        self.register_buffer("packed", torch.zeros(E, *f.packed_shape(O, K), dtype=f.packed_dtype))
        self.register_buffer("scales", torch.zeros(E, *f.scales_shape(O, K), dtype=f.scales_dtype))

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return units.weight_expert_matmul(x=x, packed=self.packed, scales=self.scales, experts=experts, fmt=self.fmt,
                                          fused=True)


class WeightBatched(WeightDecode):
    """kimi::weight_batched_matmul: every expert on its column of M rows (the all-experts prefill form; a
    block-scaled linear layer is E = 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return units.weight_batched_matmul(x=x, packed=self.packed, scales=self.scales, fmt=self.fmt, fused=True)


def _block_scaled_codes(module: nn.Module, fmt: str, seed: int) -> None:
    """Codes over their whole range (FP8 without its two NaN codes), scales of a few binades."""
    g = _gen(seed)
    with torch.no_grad():
        if fmt == "fp8_e4m3_b128":
            codes = torch.randint(0, 256, module.packed.shape, generator=g, dtype=torch.int32)
            module.packed.copy_(torch.where((codes & 127) == 127, 0, codes).to(torch.uint8))
        else:
            module.packed.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, module.packed.shape, generator=g,
                                              dtype=torch.int64).to(torch.int32))
        scales = torch.exp2(torch.randint(-6, 2, module.scales.shape, generator=g).float()) * (
            1 + torch.rand(module.scales.shape, generator=g))
        module.scales = scales.to(module.scales.dtype)


def _block_scaled_weights(module: WeightDecode, seed: int, scales_as: str | None) -> WeightDecode:
    """`_block_scaled_codes`; bf16 scales optionally held as their bits, as the exporter hands them to
    SPIR-V targets (i16, or i32 words of two)."""
    if module.fmt == "mxfp4":
        return randomize(module, seed)
    _block_scaled_codes(module, module.fmt, seed)
    if scales_as == "i16":
        module.scales = module.scales.view(torch.int16)
    elif scales_as == "i32":
        module.scales = module.scales.view(torch.int32)
    return module.eval()


def weight_decode(fmt: str, J: int, K: int, O: int, E: int, scales_as: str | None = None, sort: bool = False,
                  seed: int = 0) -> Case:
    """J rows through random experts of a block-scaled weight; sort: grouped by expert, as the frontend
    sorts a prefill's pairs (runs of every length)."""
    g = _gen(seed)
    x = torch.randn(1, J, K, generator=g)
    experts = torch.randint(0, E, (1, J), generator=g)
    experts = experts.sort(-1).values if sort else experts
    module = _block_scaled_weights(WeightDecode(fmt, E, O, K), seed, scales_as)
    return Case(f"{fmt}_decode J={J} K={K} O={O} E={E} scales={scales_as or 'as stored'} sorted={sort}", module,
                (x, experts), UNIT_TOL)


def weight_batched(fmt: str, M: int, K: int, O: int, E: int, scales_as: str | None = None, seed: int = 0) -> Case:
    x = torch.randn(M, E, K, generator=_gen(seed))
    module = _block_scaled_weights(WeightBatched(fmt, E, O, K), seed, scales_as)
    return Case(f"{fmt}_batched M={M} K={K} O={O} E={E} scales={scales_as or 'as stored'}", module, (x,), UNIT_TOL)


def dense_bf16(M: int, K: int, O: int, seed: int = 0) -> Case:
    """kimi::dense_batched_matmul: a bf16 linear layer (layers.Linear, fused as kimi-compile fuses it on
    llvm-cpu) on M rows."""
    g = _gen(seed)
    linear = Linear(K, O)
    with torch.no_grad():
        linear.weight = nn.Parameter((torch.randn(O, K, generator=g) / K ** 0.5).to(torch.bfloat16), requires_grad=False)
    linear.fused = True
    return Case(f"dense_bf16 M={M} K={K} O={O}", linear.eval(), (torch.randn(M, K, generator=g),), UNIT_TOL)


class DensePairs(nn.Module):
    """kimi::dense_expert_matmul: rows through their experts' bf16 weights (a prefill's routed pairs)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x, experts):
        return units.dense_expert_matmul(x=x, weight=self.weight, experts=experts, fused=True)


def dense_pairs_bf16(J: int, K: int, O: int, E: int, seed: int = 0) -> Case:
    """J rows grouped by expert as the frontend sorts a prefill's pairs: runs of every length."""
    g = _gen(seed)
    weight = (torch.randn(E, O, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    experts = torch.randint(0, E, (1, J), generator=g).sort(-1).values
    return Case(f"dense_pairs_bf16 J={J} K={K} O={O} E={E}", DensePairs(weight).eval(),
                (torch.randn(1, J, K, generator=g), experts), UNIT_TOL)


class PerHead(nn.Module):
    """kimi::per_head_matmul: MLA's absorbed projection on N rows, each head its own bf16 weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return units.per_head_matmul(x=x, weight=self.weight, fused=True)


def per_head_bf16(N: int, H: int, K: int, O: int, seed: int = 0) -> Case:
    g = _gen(seed)
    weight = (torch.randn(H, O, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    return Case(f"per_head_bf16 N={N} H={H} K={K} O={O}", PerHead(weight).eval(),
                (torch.randn(N, H, K, generator=g),), UNIT_TOL)


def mxfp4_decode(J: int, K: int, O: int, E: int, seed: int = 0) -> Case:
    return weight_decode("mxfp4", J, K, O, E, seed=seed)


def mxfp4_batched(M: int, K: int, O: int, E: int, seed: int = 0) -> Case:
    return weight_batched("mxfp4", M, K, O, E, seed=seed)


class SparseAttention(nn.Module):
    """kimi::sparse_mla_attention on given queries, caches and positions (no weights)."""

    def __init__(self, topk: int, softmax_scale: float, index_scale: float, fused: bool = True):
        super().__init__()
        self.topk, self.softmax_scale, self.index_scale, self.fused = topk, softmax_scale, index_scale, fused

    def forward(self, q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions):
        return units.sparse_mla_attention(q_latent=q_latent, q_pe=q_pe, latent=latent, k_pe=k_pe, index_q=index_q,
                                          index_w=index_w, index_keys=index_keys, positions=positions,
                                          softmax_scale=self.softmax_scale, index_scale=self.index_scale,
                                          topk=self.topk, fused=self.fused)


def sparse_attention(T: int, S: int, K: int, first: int, H: int = 3, R: int = 16, P: int = 8, HI: int = 4,
                     DI: int = 16, fused: bool = True, seed: int = 0) -> Case:
    """T queries at cache slots first..first+T-1 of an S-slot cache, topk K."""
    g = _gen(seed)
    inputs = (torch.randn(1, T, H, R, generator=g), torch.randn(1, T, H, P, generator=g),
              torch.randn(1, S, R, generator=g), torch.randn(1, S, P, generator=g),
              torch.randn(1, T, HI, DI, generator=g), torch.randn(1, T, HI, generator=g),
              torch.randn(1, S, DI, generator=g), torch.arange(first, first + T)[None])
    return Case(f"sparse_attention T={T} S={S} K={K} first={first} H={H} R={R} P={P} HI={HI} DI={DI}",
                SparseAttention(K, (R + P) ** -0.5, DI ** -0.5, fused), inputs, UNIT_TOL)


# ---------------------------------------------------------------------------------------- blocks
class KDAStep(nn.Module):
    """One KDA layer on a block (prefill, `length` real tokens) or one token (decode), state in and out."""

    def __init__(self, cfg: ModelConfig, prefill: bool, fused: bool = False):
        super().__init__()
        self.cfg, self.mixer, self.prefill = cfg, use_fused_units(KDA(cfg), FusedUnits(kda_decode=fused)), prefill

    def forward(self, a, *args):
        length, state = (args[0], args[1:]) if self.prefill else (None, args)
        step = make_step(self.cfg, torch.zeros((), dtype=torch.int32), a.shape[1], length)
        out, new = self.mixer(a, step, dict(zip(("conv_q", "conv_k", "conv_v", "recurrent"), state)))
        return (out, *new.values())


def kda(T: int, heads: int, head_dim: int, hidden: int, length: int | None = None, safe_gate: bool = True,
        full_rank_gate: bool = True, fused: bool = False, seed: int = 0) -> Case:
    """KDA on T tokens (T = 1: the decode recurrence) from a nonzero state; prefill with `length` real.
    fused: the decode step as kimi::kda_decode (x86 llvm-cpu only)."""
    cfg = small_config(hidden_size=hidden, kda_num_heads=heads, kda_head_dim=head_dim,
                       kda_gate_lower_bound=-5.0 if safe_gate else None, kda_full_rank_gate=full_rank_gate)
    g = _gen(seed)
    step = randomize(KDAStep(cfg, prefill=T > 1, fused=fused), seed)
    state = [torch.randn(t.shape, generator=g) * 0.5 for t in step.mixer.init_state(1, T).values()]
    a = torch.randn(1, T, hidden, generator=g)
    inputs = (a, torch.tensor(T if length is None else length, dtype=torch.int32), *state) if T > 1 else (a, *state)
    kind = "kda_decode" if T == 1 else "kda_prefill"
    return Case(f"{kind} T={T} length={length} H={heads} d={head_dim} D={hidden} safe_gate={safe_gate} "
                f"full_rank_gate={full_rank_gate} fused={fused}", step, inputs, BLOCK_TOL)


class MLAStep(nn.Module):
    """One MLA/DSA layer on T tokens at cache slots position.., as KimiModel.prefill calls it."""

    def __init__(self, cfg: ModelConfig, fused: bool, bf16: bool = False, fp8_kv_b: bool = False):
        super().__init__()
        self.cfg = cfg
        mixer = MLA(cfg)
        if fp8_kv_b:
            set_linear_format(mixer, "kv_b_proj", "fp8_e4m3_b128")
        # an FP8 kv_b_proj as kimi-compile fuses it on llvm-cpu: the weight-matmul unit, per head
        self.mixer = use_fused_units(mixer, FusedUnits(sparse_attention=fused, dense_matmul=bf16 or fp8_kv_b,
                                                       weight_matmul=fp8_kv_b))

    def forward(self, x, position, *state):
        names = ("latent", "k_pe", "index_keys")[: len(state)]
        out, new = self.mixer(x, make_step(self.cfg, position, x.shape[1]), dict(zip(names, state)))
        return (out, *new.values())


def mla(T: int, S: int, position: int, heads: int = 3, kv_lora: int = 16, rope: int = 8, nope: int = 16,
        v_dim: int = 16, hidden: int = 48, q_lora: int | None = 24, topk: int | None = None, index_heads: int = 4,
        index_dim: int = 16, nope_only: bool = False, output_gate: bool = False, bf16: bool = False,
        fp8_kv_b: bool = False, seed: int = 0) -> Case:
    """MLA (topk None) or DSA (with the indexer, top `topk`) on T tokens at slots position.., an S-slot cache
    holding random rows for the earlier slots. bf16: the projections' weights bf16 through the llvm-cpu
    dense units (the absorbed kv_b_proj per head: kimi::dense_expert_matmul for one token,
    kimi::per_head_matmul for a block). fp8_kv_b: kv_b_proj FP8 (codes over their whole range, scales of
    a few binades), its absorbed projections per head through the weight-matmul unit (frontend/mla.py
    `per_head_blocks`; dn and dv whole 128-row blocks)."""
    cfg = small_config(hidden_size=hidden, layer_kinds=("mla",), num_heads=heads, kv_lora_rank=kv_lora,
                       qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim, q_lora_rank=q_lora,
                       index_n_heads=index_heads if topk else 0, index_head_dim=index_dim if topk else 0,
                       index_topk=topk, mla_use_nope=nope_only, mla_output_gate=output_gate)
    g = _gen(seed)
    step = randomize(MLAStep(cfg, fused=True, bf16=bf16, fp8_kv_b=fp8_kv_b), seed)
    if fp8_kv_b:
        _block_scaled_codes(step.mixer.kv_b_proj, "fp8_e4m3_b128", seed)
    if bf16:
        for module in step.modules():
            if isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    state = []
    for t in step.mixer.init_state(1, S).values():
        rows = torch.randn(t.shape, generator=g)
        rows[:, position:] = 0                      # slots not yet written
        state.append(rows)
    x = torch.randn(1, T, hidden, generator=g)
    kind = "dsa" if topk else "mla"
    return Case(f"{kind} T={T} S={S} position={position} topk={topk} H={heads} r={kv_lora} dr={rope} dn={nope} "
                f"dv={v_dim} D={hidden} q_lora={q_lora} HI={index_heads} DI={index_dim} bf16={bf16} fp8_kv_b={fp8_kv_b}",
                step, (x, torch.tensor(position, dtype=torch.int32), *state), BLOCK_TOL)


class MoEStep(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: bool, bf16: bool = False):
        super().__init__()
        self.moe = set_expert_format(MoE(cfg), "mxfp4" if quantized else "float")
        # dense_matmul: bf16 weights (`_bf16_matrices`, after randomize) through the llvm-cpu units
        self.moe = use_fused_units(self.moe, FusedUnits(weight_matmul=True, dense_matmul=bf16))

    def forward(self, h):
        return self.moe(h)


def _bf16_matrices(step: MoEStep) -> MoEStep:
    """The routed and shared experts' weights in bf16, as a bf16 checkpoint holds them."""
    for module in step.modules():
        if isinstance(module, (Linear, FloatExperts)):
            module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    return step


def moe(T: int, hidden: int, experts: int, top_k: int, inter: int, quantized: bool, latent: int | None = None,
        n_group: int = 1, topk_group: int = 1, shared: int = 1, situ: bool = False, bf16: bool = False,
        seed: int = 0) -> Case:
    """The MoE FFN on T tokens: float or MXFP4 experts, dense (experts on the hidden state) or K3's latent MoE;
    bf16: every weight bf16 through the llvm-cpu dense units."""
    extra = dict(hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0) if situ else {}
    cfg = small_config(hidden_size=hidden, num_experts=experts, experts_per_token=top_k, moe_intermediate_size=inter,
                       routed_expert_hidden_size=latent, latent_moe_use_norm=latent is not None, n_group=n_group,
                       topk_group=topk_group, num_shared_experts=shared, **extra)
    step = randomize(MoEStep(cfg, quantized, bf16), seed)
    if bf16:
        step = _bf16_matrices(step)
    h = torch.randn(1, T, hidden, generator=_gen(seed))
    return Case(f"moe T={T} D={hidden} E={experts} k={top_k} I={inter} mxfp4={quantized} latent={latent} "
                f"groups={n_group}/{topk_group} situ={situ} bf16={bf16}", step, (h,), BLOCK_TOL)


class AttnResStep(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mix = AttnResMix(dim, 1e-6)

    def forward(self, *rows):
        return self.mix(list(rows[:-1]), rows[-1])


def attn_res(T: int, hidden: int, bank: int, seed: int = 0) -> Case:
    g = _gen(seed)
    rows = tuple(torch.randn(1, T, hidden, generator=g) * (1 + i) for i in range(bank + 1))
    return Case(f"attn_res T={T} D={hidden} bank={bank}", randomize(AttnResStep(hidden), seed), rows, BLOCK_TOL)


@dataclass(frozen=True)
class Row:
    """A table row: a case builder and its arguments, with an id for pytest."""

    id: str
    build: object
    kwargs: dict

    def case(self) -> Case:
        return self.build(**self.kwargs)
