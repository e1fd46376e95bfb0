"""Mixture of experts: DeepSeek-V3's noaux_tc router, routed experts (MXFP4 or float), shared experts,
and K3's latent MoE (MODEL_SPEC 3.4).

For a token h [D]:
  s   = sigmoid(h W_gate^T) in fp32;  s' = s + e_score_correction_bias   (the bias only chooses)
  groups: keep the topk_group groups with the best sum-of-top-2 s'; then idx = top-k(s')
  w   = s[idx] (unbiased), renormalised if norm_topk_prob, times routed_scaling_factor
  y   = sum_i w_i Expert_{idx_i}(h) + Shared(h),   Expert(h) = w2(act(w1 h) * (w3 h))
K3's latent MoE: experts run on z = routed_expert_down_proj(h) and their weighted sum goes through
RMSNorm (latent_moe_use_norm) and routed_expert_up_proj; the shared experts see the full h.

Routed experts stay in the checkpoint's form: block-scaled codes (MXFP4, FP8, INT4; read by the
weight-matmul units, for the selected experts only) or float weights. Shapes are static either way, in one of two forms:
  routed pairs  each (token, slot) pair reads its expert's weights: N*k rows, one expert each
                (decode; prefill too where it is cheaper, see `routed_pairs_cheaper`, with the
                pairs grouped by expert so a kernel can decode each weight block once per group)
  all experts   every expert runs on the whole block and a [tokens, E] combine matrix (zero off the
                selection) weights the results: each expert's weights are decoded once for N rows
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import formats, units
from .config import ModelConfig
from .layers import GatedFFN, Linear, RMSNorm, gated_activation, widen_to_f32
from .selection import kth_largest, member_slots, stable_order, topk_members


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))   # e_score_correction_bias, fp32

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, D] -> combine [N, E] fp32: each token's expert weights, zero off its k experts."""
        cfg = self.cfg
        scores = torch.sigmoid(h @ widen_to_f32(self.weight).t())           # fp32 router
        choice = scores + widen_to_f32(self.bias)
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
            group_score = grouped.amax(-1) + kth_largest(grouped, 2)[..., 0]        # sum of the top 2
            keep_group = topk_members(group_score, cfg.topk_group)                   # [N, n_group]
            choice = grouped.masked_fill(~keep_group.unsqueeze(-1), float("-inf")).view(-1, cfg.num_experts)
        chosen = topk_members(choice, cfg.experts_per_token)
        weights = scores.masked_fill(~chosen, 0.0)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor


class FloatExperts(nn.Module):
    """One projection of all routed experts as float weights [E, out, in], in the checkpoint's dtype."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.shape = (num_experts, out_features, in_features)
        self.weight = nn.Parameter(torch.zeros(num_experts, out_features, in_features))
        self.fused = False             # bf16 weights through the kimi::dense_* units (llvm-cpu)

    def selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, J, in] through expert experts[n, j] -> [N, J, out]: reads only those experts' weights."""
        if self.fused and self.weight.dtype == torch.bfloat16:
            return units.dense_expert_matmul(x=x, weight=self.weight, experts=experts, fused=True)
        # IREE-WORKAROUND(cuda, rocm): the selected experts as rows of an [E, out * in] table (an embedding
        # lookup): IREE fused an indexing gather (`weight[experts]`) of f32 weights into the matvec's
        # reduction, which CUDA's and ROCm's reduction distribution then failed on (in >= 128)
        N, J = experts.shape
        weight = F.embedding(experts, self.weight.flatten(1)).view(N, J, *self.weight.shape[1:])
        return torch.einsum("nji,njoi->njo", x, widen_to_f32(weight))

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, E, in], column e the rows for expert e -> [M, E, out]."""
        if self.fused and self.weight.dtype == torch.bfloat16:
            return units.dense_grouped_matmul(x=x, weight=self.weight, fused=True)
        return torch.einsum("mei,eoi->meo", x, widen_to_f32(self.weight))


class BlockScaledExperts(nn.Module):
    """One projection of all routed experts in a block-scaled format (frontend/formats.py) as the checkpoint
    ships it: `packed` [E, O, *] codes and `scales` [E, *, *].

    The matmuls go through the weight-matmul units (frontend/units.py): with `fused`, the compiler's pass
    reads the packed codes inside the contraction; otherwise they are dequantised first."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, fmt: str):
        super().__init__()
        self.shape = (num_experts, out_features, in_features)
        self.format = fmt
        self.fused = False
        f = formats.FORMATS[fmt]
        self.register_buffer("packed", torch.zeros(num_experts, *f.packed_shape(out_features, in_features),
                                                   dtype=f.packed_dtype))
        self.register_buffer("scales", torch.zeros(num_experts, *f.scales_shape(out_features, in_features),
                                                   dtype=f.scales_dtype))

    def selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return units.weight_expert_matmul(x=x, packed=self.packed, scales=self.scales, experts=experts,
                                          fmt=self.format, fused=self.fused)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        return units.weight_batched_matmul(x=x, packed=self.packed, scales=self.scales, fmt=self.format,
                                           fused=self.fused)


EXPERT_FORMATS = ("float", *formats.FORMATS)


def set_expert_format(model: nn.Module, expert_format: str) -> nn.Module:
    """Hold every routed-expert projection of `model` in `expert_format` ("float" or a block-scaled format),
    with empty weights to be loaded (as gpt-fast's quantisation handlers swap modules before loading a
    state dict)."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format {expert_format!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    for experts in [m for m in model.modules() if isinstance(m, RoutedExperts)]:
        for name in ("w1", "w2", "w3"):
            old = getattr(experts, name)
            if expert_format == "float" and not isinstance(old, FloatExperts):
                setattr(experts, name, FloatExperts(*old.shape))
            elif expert_format != "float" and getattr(old, "format", None) != expert_format:
                setattr(experts, name, BlockScaledExperts(*old.shape, expert_format))
    return model


# The fused MXFP4 kernels' work per 32 weights in the linalg forms (passes/mxfp4_cpu.py; the portable
# one is alike): decoding a block costs about 11 vector ops, applying it to one row about 4, and the
# routed-pairs kernel decodes for every row. The AVX-512 dispatch (passes/mxfp4_avx512.py) decodes once
# per run of grouped pairs, which only makes the pairs cheaper still; the export does not know the target.
DECODE_OPS, ROW_OPS = 11, 4


def routed_pairs_cheaper(tokens: int, k: int, experts: int, fused_mxfp4: bool) -> bool:
    """Whether the routed-pairs form costs less than running all experts on the block.

    Fused MXFP4: pairs cost tokens*k*(decode + row), all experts experts*(decode + tokens*row): at a
    32-token block pairs win from about 28 experts at top-8 (DeepSeek-V3.2: 256, K3: 896). Otherwise
    (float experts, or the unfused fallback that dequantises what it reads) pairs gather a wide copy
    of every pair's weights, so they are used only when the pairs are fewer than the experts."""
    pairs = tokens * k
    if fused_mxfp4:
        return pairs * (DECODE_OPS + ROW_OPS) < experts * (DECODE_OPS + tokens * ROW_OPS)
    return pairs < experts


class RoutedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """Held in the checkpoint's format (its block-scaled codes when it has them, else float); `set_expert_format`
        changes it."""
        super().__init__()
        self.cfg = cfg
        E, I, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_input_size
        fmt = cfg.expert_format
        self.w1 = BlockScaledExperts(E, I, d, fmt) if fmt else FloatExperts(E, I, d)   # gate
        self.w3 = BlockScaledExperts(E, I, d, fmt) if fmt else FloatExperts(E, I, d)   # up
        self.w2 = BlockScaledExperts(E, d, I, fmt) if fmt else FloatExperts(E, d, I)   # down

    def forward(self, z: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """z: [N, d]; combine: [N, E] router weights (k nonzero a row) -> sum_e combine_e Expert_e(z): [N, d]."""
        N, k, E = combine.shape[0], self.cfg.experts_per_token, self.cfg.num_experts
        if N == 1 or routed_pairs_cheaper(N, k, E, self.w1.fused):
            # Read only the selected experts' weights. The k slots come from the selection mask by
            # comparison (no sort, no scatter), in expert-index order.
            slots = member_slots(combine > 0, k)                                          # [N, k, E]
            idx = (slots * torch.arange(E, device=z.device)).sum(-1).to(torch.int64)
            weights = (slots * combine.unsqueeze(1)).sum(-1)                              # [N, k]
            experts = idx.reshape(1, -1)                                                  # [1, N*k]
            if N == 1:
                x = z.unsqueeze(0).expand(1, k, z.shape[-1])                              # [1, k, d]
            else:
                # Prefill: the N*k pairs grouped by expert (a stable counting sort, static shapes), so that
                # a kernel that shares each weight block's decode over a run of rows with one expert can
                # (passes/mxfp4_avx512.py); the results go back to pair order through the inverse.
                order, rank = stable_order(idx.reshape(-1))
                experts, x = experts[:, order], z[order // k].unsqueeze(0)                # sorted; [1, N*k, d]
            hidden = gated_activation(self.w1.selected(x, experts), self.w3.selected(x, experts), self.cfg)
            out = self.w2.selected(hidden, experts)[0]                                    # [N*k, d]
            if N > 1:
                out = out[rank]
            return (out.view(N, k, -1) * weights.unsqueeze(-1)).sum(1)
        # All experts: each takes the whole block as its group, and the sparse combine matrix
        # (zero off the selection) weights the results.
        x = z.unsqueeze(1).expand(N, E, z.shape[-1])
        hidden = gated_activation(self.w1.grouped(x), self.w3.grouped(x), self.cfg)
        return torch.einsum("ned,ne->nd", self.w2.grouped(hidden), combine)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = RoutedExperts(cfg)
        if cfg.routed_expert_hidden_size:
            self.latent_down = Linear(cfg.hidden_size, cfg.routed_expert_hidden_size)
            if cfg.latent_moe_use_norm:
                self.latent_norm = RMSNorm(cfg.routed_expert_hidden_size, cfg.rms_norm_eps)
            self.latent_up = Linear(cfg.routed_expert_hidden_size, cfg.hidden_size)
        if cfg.num_shared_experts:
            self.shared = GatedFFN(cfg, cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        combine = self.router(h)
        if self.cfg.routed_expert_hidden_size:
            routed = self.experts(self.latent_down(h), combine)
            if self.cfg.latent_moe_use_norm:
                routed = self.latent_norm(routed)
            routed = self.latent_up(routed)
        else:
            routed = self.experts(h, combine)
        if self.cfg.num_shared_experts:
            routed = routed + self.shared(h)
        return routed.view(shape)
