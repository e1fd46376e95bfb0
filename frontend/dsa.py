"""Attention over the MLA latent cache, dense or DSA-selected (MODEL_SPEC 3.2, 3.3).

Absorbed MLA attention for queries t at cache slots positions[t], over cache slots s:
  score[h, t, s] = (q_latent[t, h] . latent[s] + q_pe[t, h] . k_pe[s]) * softmax_scale
  o_latent[t, h] = sum_s softmax_s(score over the kept s) * latent[s]
Dense attention keeps every visible slot (s <= positions[t]). DSA keeps the top `topk` visible slots
by the lightning indexer's score
  I[t, s] = sum_h index_w[t, h] * ReLU(index_q[t, h] . index_keys[s] * index_scale)
with ties to the earliest slot (frontend/selection.py), and all visible slots when fewer than `topk`.

`sparse_mla_attention` is the reference of the DSA unit (frontend/units.py): it scores the whole
cache and applies the selection as a mask, which is correct on every target. The sparse-attention
pass (passes/sparse_attention.py) replaces it with a form that attends to the selected rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .selection import slot_numbers, topk_members


def visible_slots(positions: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[..., T, S] bool: slot s is visible to the query at positions[..., t] iff s <= positions[..., t]."""
    # IREE-WORKAROUND(spirv, cuda, rocm): the slots numbered by a running count, not an iota. An iota fused
    # into a reduction (the softmax over the slots; the selection's pairwise rank, on both sides of its
    # compare) asked the stock Vulkan and Metal configurations for a workgroup buffer of `index` values they
    # cannot lower (a dense MLA layer sent whole modules to the portable form), and failed CUDA's and ROCm's
    # reduction distribution
    return slot_numbers(num_slots, positions.device) <= positions.unsqueeze(-1)


def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                     keep: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """o_latent [B, T, H, r] from queries [B, T, H, r|dr], caches [B, S, r|dr] and keep [B or 1, T, S] bool."""
    scores = (torch.einsum("bthr,bsr->bhts", q_latent, latent)
              + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)) * softmax_scale
    probs = torch.softmax(scores.masked_fill(~keep.unsqueeze(1), float("-inf")), dim=-1)   # [B, H, T, S] fp32
    return torch.einsum("bhts,bsr->bthr", probs, latent)


def index_scores(index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor,
                 index_scale: float) -> torch.Tensor:
    """The lightning indexer's I [B, T, S] (fp32) of queries [B, T, HI, dI] against every cached key."""
    dots = torch.einsum("bthd,bsd->bths", index_q, index_keys) * index_scale
    return torch.einsum("bth,bths->bts", index_w, F.relu(dots))


def sparse_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                         index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor,
                         positions: torch.Tensor, softmax_scale: float, index_scale: float,
                         topk: int) -> torch.Tensor:
    """DSA attention, the mask form: the top-`topk` visible slots of each query by indexer score
    (every visible slot when topk covers the cache: then there is nothing to select)."""
    visible = visible_slots(positions, latent.shape[1])            # [B, T, S]
    if topk < latent.shape[1]:
        visible = topk_members(index_scores(index_q, index_w, index_keys, index_scale), topk, visible)
    return latent_attention(q_latent, q_pe, latent, k_pe, visible, softmax_scale)
