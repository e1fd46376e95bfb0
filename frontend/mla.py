"""Multi-head Latent Attention (DeepSeek-V2/V3 MLA), with the lightning indexer on top for DSA layers
(MODEL_SPEC 3.2, 3.3).

x: [B, T, D] (the normalised layer input), writing at positions pos .. pos+T-1 of the cache:
  q      = q_proj(x)  or  q_b_proj(cq), cq = RMSNorm(q_a_proj(x))      [T, H, dn + dr]
  c, kpe = split(kv_a_proj(x));  c = RMSNorm(c)                         [T, r_kv], [T, dr]
  RoPE on q_pe and k_pe (DeepSeek, K2: interleaved pairs, YaRN); none at all when mla_use_nope (Kimi)
  cache <- (c, k_pe);  attention over the cache slots s <= pos + t, or the DSA selection of them
  o      = softmax(scores) V;  K3: o *= sigmoid(g_proj(x));  out = o_proj(o)

Attention is computed in the absorbed form every serving stack uses: kv_b_proj splits into
W_UK [H, dn, r_kv] and W_UV [H, dv, r_kv], q_nope is folded into the latent space, and the
cache holds only the latent and k_pe (576 values a token at DeepSeek size); the attention itself is in
frontend/dsa.py. Shapes stay static (the whole cache is scored and masked), which is what export
needs; with `fused_sparse_attention` (model.use_fused_units) a DSA layer calls the sparse-attention unit instead, which the
compiler turns into attention over the selected rows only.
State per layer: latent [B, S, r_kv], k_pe [B, S, dr] (+ index_keys [B, S, d_I] with an indexer).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from . import units
from .dsa import latent_attention, visible_slots
from .indexer import LightningIndexer
from .layers import BlockScaledLinear, Linear, RMSNorm, Step, apply_rope, widen_to_f32

# The q/kv latent norms use 1e-6 whatever rms_norm_eps says, as Moonshot's own modeling code and
# transformers do (sglang and llama.cpp use rms_norm_eps; the difference is below bf16 noise).
LATENT_NORM_EPS = 1e-6


def write_rows(cache: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [B, S, d] with rows [B, T, d] written at slots positions [B or 1, T] (functional)."""
    # IREE-WORKAROUND(export): a scatter, not index_copy, which has no lowering when export skips
    # torch-mlir's decompositions (README "Findings")
    index = positions.unsqueeze(-1).expand(rows.shape[0], -1, rows.shape[-1])
    return cache.scatter(1, index, rows)


def per_head(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """x [B, T, H, K] through each head's own weight [H, O, K] -> [B, T, H, O]: the absorbed projections.
    fused (a bf16 weight on llvm-cpu): one token takes the dense decode kernel with the heads as experts,
    which reads the bf16 weight where IREE's own matvec read an f32 copy (DeepSeek-V3.2 bench decode:
    1.46 -> 0.67 ms); a block of tokens takes the per-head unit, a batched matmul in IREE's packed
    (mmt4d) form, where IREE's own [T, H, O, K] contraction ran at ~25 GFLOP/s (README "Findings")."""
    B, T, H, K = x.shape
    if not fused:
        return torch.einsum("bthk,hok->btho", x, widen_to_f32(weight))
    if B * T == 1:
        heads = torch.arange(H, device=x.device).unsqueeze(0)
        y = units.dense_expert_matmul(x=x.reshape(1, H, K), weight=weight, experts=heads, fused=True)
    else:
        y = units.per_head_matmul(x=x.reshape(B * T, H, K), weight=weight, fused=True)
    return y.reshape(B, T, H, -1)


def per_head_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [B, T, H, K] through each head's block-scaled weight (packed [H, O, K], scales per 128 x 128 block)
    -> [B, T, H, O], the codes read as published: one token as the heads' decode rows (the weight-matmul
    unit with head h as row h's expert), a block of tokens as the batched unit (head h on column h)."""
    B, T, H, K = x.shape
    if B * T == 1:
        heads = torch.arange(H, device=x.device).unsqueeze(0)
        y = units.weight_expert_matmul(x=x.reshape(1, H, K), packed=packed, scales=scales, experts=heads, fmt=fmt,
                                       fused=True)
    else:
        y = units.weight_batched_matmul(x=x.reshape(B * T, H, K), packed=packed, scales=scales, fmt=fmt, fused=True)
    return y.reshape(B, T, H, -1)


def fp8_absorbed_weights(kv_b: BlockScaledLinear, H: int, dn: int, dv: int) -> tuple[tuple, tuple]:
    """W_UK^T [H, r, dn] and W_UV [H, dv, r] of an FP8 kv_b_proj as (codes, scales), each head's rows whole
    128-row blocks (dn, dv multiples of 128): the codes and the block scales rearranged, not decoded (a
    transpose of 128 x 128 blocks keeps every code with its scale)."""
    r = kv_b.in_features
    codes = kv_b.packed.view(H, dn + dv, r)
    scales = kv_b.scales.view(H, (dn + dv) // 128, -1)
    uk_t = (codes[:, :dn].transpose(1, 2), scales[:, :dn // 128].transpose(1, 2))
    uv = (codes[:, dn:], scales[:, dn // 128:])
    return uk_t, uv


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, with_indexer: bool | None = None):
        """with_indexer: a DSA layer (default: when the config has index_* keys). `fused_sparse_attention`
        (set by model.use_fused_units) makes a DSA layer call the sparse-attention unit."""
        super().__init__()
        self.cfg = cfg
        D, H = cfg.hidden_size, cfg.num_heads
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * (dn + dr))
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * (dn + dr))
        self.kv_a_proj = Linear(D, r + dr)
        self.kv_a_norm = RMSNorm(r, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(r, H * (dn + dv))
        if cfg.mla_output_gate:
            self.g_proj = Linear(D, H * dv)
        self.o_proj = Linear(H * dv, D)
        self.indexer = LightningIndexer(cfg) if (cfg.has_indexer if with_indexer is None else with_indexer) else None
        self.index_topk = cfg.index_topk
        self.fused_sparse_attention = False
        # llvm-cpu (model.use_fused_units): an FP8 kv_b_proj's absorbed projections read its codes
        # (per_head_blocks), where IREE hoisted a dequantised f32 copy (4x the bytes, read every step)
        self.fused_per_head = False

    def init_state(self, batch: int, max_context: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        state = {"latent": torch.zeros(batch, max_context, cfg.kv_lora_rank),
                 "k_pe": torch.zeros(batch, max_context, cfg.qk_rope_head_dim)}
        if self.indexer is not None:
            state["index_keys"] = torch.zeros(batch, max_context, cfg.index_head_dim)
        return state

    def forward(self, x: torch.Tensor, step: Step,
                state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """step.positions: [B or 1, T] int64 cache slots of the new tokens; step.rope: (cos, sin) at them.
        Padding tokens (past step.length) are written to slots past the real ones, which no real query sees."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        positions = step.positions
        cos, sin = step.rope

        if cfg.q_lora_rank is None:
            cq = None
            q = self.q_proj(x)
        else:
            cq = self.q_a_norm(self.q_a_proj(x))
            q = self.q_b_proj(cq)
        q = q.view(B, T, H, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        latent, k_pe = self.kv_a_proj(x).split([r, dr], dim=-1)
        latent = self.kv_a_norm(latent)
        if not cfg.mla_use_nope:
            q_pe = apply_rope(q_pe, cos, sin, interleaved=cfg.rope_interleave)
            k_pe = apply_rope(k_pe, cos, sin, interleaved=cfg.rope_interleave)

        new_state = {"latent": write_rows(state["latent"], positions, latent),
                     "k_pe": write_rows(state["k_pe"], positions, k_pe)}
        if self.indexer is not None:
            new_state["index_keys"] = write_rows(state["index_keys"], positions, self.indexer.key(x, cos, sin))
        # Attention reads the step's window of the cache: the slots past it are empty for every real query
        # (a padding token's own row may land there, unread), so the result is the whole cache's.
        S = min(step.window or new_state["latent"].shape[1], new_state["latent"].shape[1])
        cache_c, cache_pe = new_state["latent"][:, :S], new_state["k_pe"][:, :S]

        # Absorbed attention: fold W_UK into the query, attend in the latent space, then W_UV.
        kv_b = self.kv_b_proj
        fused = isinstance(kv_b, Linear) and kv_b.fused and kv_b.weight.dtype == torch.bfloat16
        fp8 = (self.fused_per_head and isinstance(kv_b, BlockScaledLinear) and kv_b.fused
               and kv_b.format == "fp8_e4m3_b128" and dn % 128 == 0 and dv % 128 == 0)
        if fp8:
            uk_t, uv = fp8_absorbed_weights(kv_b, H, dn, dv)
            q_latent = per_head_blocks(q_nope, *uk_t, kv_b.format)              # [B, T, H, r]
        else:
            w_kv = (kv_b.weight if fused else kv_b.weight_f32()).view(H, dn + dv, r)
            w_uk, w_uv = w_kv[:, :dn], w_kv[:, dn:]
            q_latent = per_head(q_nope, w_uk.transpose(1, 2), fused)          # [B, T, H, r]
        scale = cfg.attention_softmax_scale
        if self.indexer is not None and self.index_topk < S:   # static: topk >= every slot drops nothing
            index_q, index_w = self.indexer.queries(x, cq, cos, sin)
            o_latent = units.sparse_mla_attention(
                q_latent=q_latent, q_pe=q_pe, latent=cache_c, k_pe=cache_pe, index_q=index_q, index_w=index_w,
                index_keys=new_state["index_keys"][:, :S], positions=positions.expand(B, T), softmax_scale=scale,
                index_scale=self.indexer.score_scale, topk=self.index_topk, fused=self.fused_sparse_attention)
        else:
            o_latent = latent_attention(q_latent, q_pe, cache_c, cache_pe, visible_slots(positions, S), scale)
        o = per_head_blocks(o_latent, *uv, kv_b.format) if fp8 else per_head(o_latent, w_uv, fused)
        o = o.reshape(B, T, H * dv)
        if cfg.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o), new_state
