"""DeepSeek-V3.2's lightning indexer and the DSA selection mask (MODEL_SPEC 3.3).

For query t and cached key s (s <= t):
  qI = wq_b(cq)  [T, H_I, d_I]   (cq: the MLA q latent after q_a_layernorm)
  kI = LayerNorm(wk(x))  [S, d_I] (one shared key head, weight + bias, eps 1e-6)
  RoPE, half-split, on the first qk_rope_head_dim dims of both (same frequencies as MLA)
  I[t, s] = sum_h w[t, h] * ReLU(qI[t, h] . kI[s] * d_I^-0.5),   w = weights_proj(x) * H_I^-0.5 (fp32)
Then the top `min(index_topk, keys)` keys per query are kept: the rest get -inf in the MLA scores.
With index_topk >= keys nothing is dropped and the layer is the dense layer, exactly.

The selection breaks ties towards the earliest key, so it depends only on the scores, never on
the cache's padding, on how a prompt was split into calls, or on how a compiler sorts.
State per layer: the indexer key cache [B, S, d_I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, apply_rope, f32
from .selection import topk_members


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.cfg.index_use_rope:
            return x
        dr = self.cfg.qk_rope_head_dim
        return torch.cat((apply_rope(x[..., :dr], cos, sin, interleaved=False), x[..., dr:]), dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """kI for new tokens: [B, T, d_I], what the key cache stores."""
        k = self.wk(x)
        k = F.layer_norm(k, (self.head_dim,), f32(self.k_norm.weight), f32(self.k_norm.bias), self.k_norm.eps)
        return self._rope(k, cos, sin)

    def scores(self, x: torch.Tensor, cq: torch.Tensor, key_cache: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """I [B, T, S] (fp32) of the new queries against every cached key (unmasked)."""
        B, T, _ = x.shape
        qI = self._rope(self.wq_b(cq).view(B, T, self.n_heads, self.head_dim), cos, sin)
        dots = torch.einsum("bthd,bsd->bths", qI, key_cache) * self.head_dim ** -0.5
        w = self.weights_proj(x) * self.n_heads ** -0.5   # fp32
        return torch.einsum("bth,bths->bts", w, F.relu(dots))


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Additive mask [B, T, S]: 0 at the top-`topk` visible keys of each query, -inf elsewhere.

    scores: [B, T, S] indexer scores; visible: [B or 1, T, S] bool (causal and written).
    When fewer than `topk` keys are visible they are all kept (invisible ones are masked anyway).
    Ties go to the earliest key (frontend/selection.py: a radix select, no sort).
    """
    keep = topk_members(scores, topk, visible)
    return torch.zeros_like(scores).masked_fill(~keep, float("-inf"))
