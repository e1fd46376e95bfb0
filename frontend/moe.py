"""Mixture of experts: DeepSeek-V3's noaux_tc router, routed experts (MXFP4 or float), shared experts,
and K3's latent MoE (MODEL_SPEC 3.4).

For a token h [D]:
  s   = sigmoid(h W_gate^T) in fp32;  s' = s + e_score_correction_bias   (the bias only chooses)
  groups: keep the topk_group groups with the best sum-of-top-2 s'; then idx = top-k(s')
  w   = s[idx] (unbiased), renormalised if norm_topk_prob, times routed_scaling_factor
  y   = sum_i w_i Expert_{idx_i}(h) + Shared(h),   Expert(h) = w2(act(w1 h) * (w3 h))
K3's latent MoE: experts run on z = routed_expert_down_proj(h) and their weighted sum goes through
RMSNorm (latent_moe_use_norm) and routed_expert_up_proj; the shared experts see the full h.

Routed experts stay in the checkpoint's form: MXFP4 bytes (dequantised inside the forward, for
the selected experts only) or float weights. Shapes are static either way: with few tokens each
(token, slot) gathers its expert's weights; with many, every expert runs on every token and a
[tokens, E] combine matrix (zero off the selection) weights the results.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mxfp4
from .config import ModelConfig
from .layers import GatedFFN, Linear, RMSNorm, f32, gated_activation
from .selection import kth_largest, member_slots, topk_members


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))   # e_score_correction_bias, fp32

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, D] -> combine [N, E] fp32: each token's expert weights, zero off its k experts."""
        cfg = self.cfg
        scores = torch.sigmoid(h @ f32(self.weight).t())           # fp32 router
        choice = scores + f32(self.bias)
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


class ExpertWeights(nn.Module):
    """One projection of all routed experts: [E, out, in] as MXFP4 bytes (`packed`, `scales`) or floats."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, quantized: bool):
        super().__init__()
        self.quantized = quantized
        if quantized:
            self.register_buffer("packed", torch.zeros(num_experts, out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.zeros(num_experts, out_features, in_features // mxfp4.BLOCK, dtype=torch.uint8))
        else:
            self.weight = nn.Parameter(torch.zeros(num_experts, out_features, in_features))

    def select(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Float weights [*idx.shape, out, in] of the experts in idx (all experts when None)."""
        if not self.quantized:
            return f32(self.weight if idx is None else self.weight[idx])
        if idx is None:
            return mxfp4.dequantize(self.packed, self.scales)
        return mxfp4.dequantize(self.packed[idx], self.scales[idx])


class RoutedExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: bool):
        super().__init__()
        self.cfg = cfg
        E, I, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_input_size
        self.w1 = ExpertWeights(E, I, d, quantized)   # gate
        self.w3 = ExpertWeights(E, I, d, quantized)   # up
        self.w2 = ExpertWeights(E, d, I, quantized)   # down

    def forward(self, z: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """z: [N, d]; combine: [N, E] router weights (k nonzero a row) -> sum_e combine_e Expert_e(z): [N, d]."""
        N, k = combine.shape[0], self.cfg.experts_per_token
        if N * k < self.cfg.num_experts:
            # Few tokens (decode): read only the selected experts' weights. The k slots come from
            # the selection mask by comparison (no sort, no scatter), in expert-index order.
            slots = member_slots(combine > 0, k)                                          # [N, k, E]
            idx = (slots * torch.arange(self.cfg.num_experts, device=z.device)).sum(-1).to(torch.int64)
            weights = (slots * combine.unsqueeze(1)).sum(-1)                              # [N, k]
            gate = torch.einsum("nd,nkid->nki", z, self.w1.select(idx))
            up = torch.einsum("nd,nkid->nki", z, self.w3.select(idx))
            out = torch.einsum("nki,nkdi->nkd", gated_activation(gate, up, self.cfg), self.w2.select(idx))
            return (out * weights.unsqueeze(-1)).sum(1)
        # Many tokens (prefill): every expert on every token, weighted by the sparse combine matrix.
        gate = torch.einsum("nd,eid->eni", z, self.w1.select())
        up = torch.einsum("nd,eid->eni", z, self.w3.select())
        out = torch.einsum("eni,edi->end", gated_activation(gate, up, self.cfg), self.w2.select())
        return torch.einsum("end,ne->nd", out, combine)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: bool):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = RoutedExperts(cfg, quantized)
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
