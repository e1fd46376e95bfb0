"""DeepSeek-V3.2's lightning indexer and the DSA selection mask (MODEL_SPEC 3.3).

For query t and cached key s (s <= t):
  qI = wq_b(cq)  [T, H_I, d_I]   (cq: the MLA q latent after q_a_layernorm)
  kI = LayerNorm(wk(x))  [S, d_I] (one shared key head, weight + bias, eps 1e-6)
  RoPE, half-split, on the first qk_rope_head_dim dims of both (same frequencies as MLA)
  I[t, s] = sum_h w[t, h] * ReLU(qI[t, h] . kI[s] * d_I^-0.5),   w = weights_proj(x) * H_I^-0.5 (fp32)
Then the top `min(index_topk, keys)` keys per query are kept (frontend/dsa.py, the DSA unit): the
rest get -inf in the MLA scores. With index_topk >= keys nothing is dropped and the layer is the
dense layer, exactly.
State per layer: the indexer key cache [B, S, d_I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, apply_rope, widen_to_f32


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        # token selection is sensitive to these three's precision: no lossy option rounds their rows
        for linear in (self.wq_b, self.wk, self.weights_proj):
            linear.exact = True

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.cfg.index_use_rope:
            return x
        dr = self.cfg.qk_rope_head_dim
        return torch.cat((apply_rope(x[..., :dr], cos, sin, interleaved=False), x[..., dr:]), dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """kI for new tokens: [B, T, d_I], what the key cache stores."""
        k = self.wk(x)
        k = F.layer_norm(k, (self.head_dim,), widen_to_f32(self.k_norm.weight), widen_to_f32(self.k_norm.bias), self.k_norm.eps)
        return self._rope(k, cos, sin)

    def queries(self, x: torch.Tensor, cq: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qI [B, T, H_I, d_I] and the head weights w [B, T, H_I] (fp32) of the new tokens."""
        B, T, _ = x.shape
        qI = self._rope(self.wq_b(cq).view(B, T, self.n_heads, self.head_dim), cos, sin)
        return qI, self.weights_proj(x) * self.n_heads ** -0.5

    @property
    def score_scale(self) -> float:
        return self.head_dim ** -0.5
