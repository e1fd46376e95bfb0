"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692; fla-org's `fla/layers/kda.py`), MODEL_SPEC 3.1.

One layer, input a: [B, T, D]:
  q, k, v = SiLU(causal depthwise conv(a W{q,k,v}^T))          [B, T, H, d]   (conv tails in the state)
  q, k    = l2norm(q), l2norm(k);  q *= d^-0.5
  g       = -exp(A_log) * softplus(f_b(f_a(a)) + dt_bias)      Kimi-Linear (log decay per channel, < 0)
          = lb * sigmoid(exp(A_log) * (f_b(f_a(a)) + dt_bias)) K3's safe gate, in (lb, 0)
  beta    = sigmoid(b_proj(a))                                  [B, T, H]
  per head, S [dk, dv] in fp32:  S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
  out     = o_proj(RMSNorm(o) * o_norm.weight * sigmoid(gate)),  gate = g_b(g_a(a)) or K3's g_proj(a)

Prefill uses the chunked WY/UT form (`kda_chunked`), decode the token recurrence
(`kda_recurrent`); both are exact rewrites of the same recurrence, with fp32 state.
State per layer: conv tails [B, W-1, H*d] for q, k and v, and S [B, H, dk, dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import units
from .config import ModelConfig
from .layers import Linear, Step, widen_to_f32

CHUNK_SIZE = 32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA puts eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
             S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the delta rule. q, k, decay = exp(g): [B, H, dk]; v: [B, H, dv]; beta: [B, H];
    S: [B, H, dk, dv] fp32. Returns o [B, H, dv] and the new S."""
    S = S * decay.unsqueeze(-1)                                   # decay row d by exp(g[d])
    predicted = torch.einsum("bhkv,bhk->bhv", S, k)               # what the memory says for k
    delta = (v - predicted) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule. q, k, g: [B, T, H, dk]; v: [B, T, H, dv]; beta: [B, T, H];
    state: [B, H, dk, dv] fp32. Returns o [B, T, H, dv] (fp32) and the new state. `fused`: each step as
    the kimi::kda_decode unit (frontend/units.py)."""
    S = widen_to_f32(state)
    outs = []
    for t in range(q.shape[1]):
        o, S = units.kda_decode(q=q[:, t], k=k[:, t], v=v[:, t], decay=g[:, t].exp(), beta=beta[:, t], state=S,
                                fused=fused)
        outs.append(o)
    return torch.stack(outs, dim=1), S


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], C a power of two.

    IREE-WORKAROUND(spirv): recursive block inversion instead of row-by-row forward substitution: log2(C) rounds of two
    batched matmuls, not C - 1 dependent row updates (which IREE fused into SPIR-V kernels of
    over 200 KB each). With X the inverse of the block diagonal of I + L in blocks of s, and E the
    part of L coupling each 2s-block's second half to its first half, the inverse in blocks of 2s
    is X - X E X (exact: (X E)^2 = 0 within a 2s-block): the standard recursive triangular inverse."""
    C = L.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size {C} is not a power of two")
    row = torch.arange(C, device=L.device).view(C, 1)
    col = torch.arange(C, device=L.device).view(1, C)
    X = torch.eye(C, dtype=L.dtype, device=L.device).expand(L.shape)
    s = 1
    while s < C:
        same_block = row // (2 * s) == col // (2 * s)
        coupling = torch.logical_and(same_block, torch.logical_and((row // s) % 2 == 1, (col // s) % 2 == 0))
        E = L * coupling.to(L.dtype)
        X = X - X @ E @ X
        s *= 2
    return X


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, chunk by chunk (FLA `chunk_kda`; MODEL_SPEC 3.1 "Chunked-parallel form").

    T is padded to a multiple of the chunk with k = v = g = beta = 0, which leaves the state as it is.
    Within a chunk (local positions i, j; G = cumulative log decay):
      L[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j)   (j < i)
      T      = (I + L)^-1 Diag(beta)                  (the WY/UT transform)
      W = T (exp(G) * K),   U = T V,   Vnew = U - W S
      O      = (Q * exp(G)) S + Aqk Vnew,   Aqk[i,j] = sum_d q_i k_j exp(G_i - G_j)  (j <= i)
      S     <- Diag(exp(G_last)) S + (K * exp(G_last - G))^T Vnew
    """
    B, T, H, dk = k.shape
    C = chunk_size
    pad = (-T) % C
    # [B, H, T, d] in fp32, padded
    q, k, v, g = (F.pad(widen_to_f32(x).transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(widen_to_f32(beta).transpose(1, 2), (0, pad))
    n = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, C)

    G = g.cumsum(dim=-2)                                                     # [B, H, n, C, dk]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()      # j <= i
    # exp(G_i - G_j) only where j <= i; elsewhere the exponent is positive and unused.
    # IREE-WORKAROUND(spirv without Int64): the mask goes into the decay, before the sums over d; an index
    # comparison after a reduction needs a workgroup buffer of `index` values valhall/adreno cannot lower.
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)                                  # [B, H, n, C, C, dk]
    decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()
    # Aqk and L's sums in one contraction over d of [q; k]_i with k_j exp(G_i - G_j): L's (j < i) are the
    # causal ones with the diagonal zeroed by a constant 0/1 factor (no index comparison). On llvm-cpu one
    # decay tensor and one batched matmul; a second, strict decay and two sums were a second exp and two
    # 16 x 32 x 32 x 128 tensors written and read per chunk of the bench K3 (its KDA prefill 5.1 -> 2.8 ms).
    strict = torch.ones(C, C, dtype=torch.float32, device=q.device).tril(-1)  # 1 where j < i
    qk = torch.stack([q, k])                                                 # [2, B, H, n, C, dk]
    both = (qk.unsqueeze(-2) * (k.unsqueeze(-3) * decay)).sum(-1)          # sum_d [q;k]_i k_j exp(G_i - G_j)
    Aqk, kk = both[0], both[1] * strict
    L = beta.unsqueeze(-1) * kk

    X = unit_lower_inverse(L)
    T_wy = X * beta.unsqueeze(-2)                                             # (I+L)^-1 Diag(beta)
    W = T_wy @ (G.exp() * k)                                                  # [B, H, n, C, dk]
    U = T_wy @ v                                                              # [B, H, n, C, dv]

    S = widen_to_f32(state)
    outs = []
    for c in range(n):
        v_new = U[:, :, c] - W[:, :, c] @ S
        outs.append((q[:, :, c] * G[:, :, c].exp()) @ S + Aqk[:, :, c] @ v_new)
        G_last = G[:, :, c, -1:]                                              # [B, H, 1, dk]
        S = S * G_last.transpose(-1, -2).exp() + (k[:, :, c] * (G_last - G[:, :, c]).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, -1)[:, :, :T]
    return o.transpose(1, 2), S


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
                length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU. x: [B, T, C]; tail: [B, W-1, C] (the previous inputs, time-major
    like x: held [B, C, W-1] as vLLM does, it cost a decode step two transposes a conv, 36 of K3's ~420
    dispatches);
    weight: [C, 1, W] (last tap = current token). Returns y [B, T, C] and the new tail: the last
    W-1 inputs, or those ending at each row's token `length` [B or 1] when the block is padded past it
    (length 0: the tail as it was).

    The W taps as shifted multiply-adds over [B, T, C] rows (channels contiguous): IREE lowered
    `conv1d(groups=C)` to a depthwise convolution at ~2 GFLOP/s (1.7-2.2 ms of a 64-token K3 prefill
    block on the Zen 5 VM; now fused into its neighbours)."""
    width = weight.shape[-1]
    taps = widen_to_f32(weight)[:, 0].t()                                     # [W, C]
    seq = torch.cat((widen_to_f32(tail), x), dim=1)                          # [B, W-1+T, C]
    T = x.shape[1]
    y = seq[:, 0:T] * taps[0]
    for w in range(1, width):
        y = y + seq[:, w: w + T] * taps[w]
    if length is None:
        new_tail = seq[:, seq.shape[1] - (width - 1):]
    else:
        ends = length.view(-1, 1, 1).to(torch.int64) + torch.arange(width - 1, device=x.device).view(1, -1, 1)
        new_tail = seq.gather(1, ends.expand(seq.shape[0], width - 1, seq.shape[2]))   # [B, W-1, C]
    return F.silu(y), new_tail


class KDA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, H, d, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        self.num_heads, self.head_dim = H, d
        self.q_proj = Linear(D, H * d)
        self.k_proj = Linear(D, H * d)
        self.v_proj = Linear(D, H * d)
        self.q_conv = nn.Parameter(torch.zeros(H * d, 1, W))
        self.k_conv = nn.Parameter(torch.zeros(H * d, 1, W))
        self.v_conv = nn.Parameter(torch.zeros(H * d, 1, W))
        self.f_a_proj = Linear(D, d)
        self.f_b_proj = Linear(d, H * d)
        self.b_proj = Linear(D, H)
        # One decay rate per head. K3 publishes A_log as [head_dim] with more entries than heads:
        # the loader keeps the tensor as stored and the gate reads the first `num_heads` entries,
        # as sglang and llama.cpp do (MODEL_SPEC "K3 facts").
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * d))
        if cfg.kda_full_rank_gate:
            self.g_proj = Linear(D, H * d)
        else:
            self.g_a_proj = Linear(D, d)
            self.g_b_proj = Linear(d, H * d)
        self.o_norm = nn.Parameter(torch.ones(d))
        self.o_proj = Linear(H * d, D)
        self.fused_decode = False            # model.use_fused_units: decode through kimi::kda_decode

    STATE_NAMES = ("conv_q", "conv_k", "conv_v", "recurrent")

    def init_state(self, batch: int, max_context: int) -> dict[str, torch.Tensor]:
        """Conv tails and the recurrent state (STATE_NAMES): the same size whatever the context."""
        H, d, W = self.num_heads, self.head_dim, self.cfg.kda_conv_size
        tail = torch.zeros(batch, W - 1, H * d)
        return dict(zip(self.STATE_NAMES, (tail, tail.clone(), tail.clone(),
                                           torch.zeros(batch, H, d, d, dtype=torch.float32))))

    def log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, d] (fp32): per-channel log decay, Kimi-Linear's softplus gate or K3's safe gate."""
        f = self.f_b_proj(self.f_a_proj(a)) + widen_to_f32(self.dt_bias)
        f = f.view(*a.shape[:2], self.num_heads, self.head_dim)
        rate = widen_to_f32(self.A_log)[: self.num_heads].exp().view(1, 1, -1, 1)
        lb = self.cfg.kda_gate_lower_bound
        if lb is not None:
            return lb * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)

    def forward(self, a: torch.Tensor, step: Step,
                state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """a: [B, T, D]. step.length: tokens of the block that are real (the rest is padding that must not
        reach the conv tails or the recurrent state); None = all T. KDA needs no positions."""
        B, T, _ = a.shape
        length = step.length
        H, d = self.num_heads, self.head_dim
        q, conv_q = causal_conv(self.q_proj(a), state["conv_q"], self.q_conv, length)
        k, conv_k = causal_conv(self.k_proj(a), state["conv_k"], self.k_conv, length)
        v, conv_v = causal_conv(self.v_proj(a), state["conv_v"], self.v_conv, length)
        q = l2norm(q.view(B, T, H, d)) * d ** -0.5
        k = l2norm(k.view(B, T, H, d))
        v = v.view(B, T, H, d)
        g = self.log_decay(a)
        beta = torch.sigmoid(self.b_proj(a))
        if length is not None:
            # Padding tokens get beta = 0 and g = 0: they write nothing and decay nothing.
            real = (torch.arange(T, device=a.device) < length.view(-1, 1)).unsqueeze(-1)        # [B|1, T, 1]
            beta = beta * real
            g = g * real.unsqueeze(-1)
        if T == 1:
            o, recurrent = kda_recurrent(q, k, v, g, beta, state["recurrent"], fused=self.fused_decode)
        else:
            o, recurrent = kda_chunked(q, k, v, g, beta, state["recurrent"])

        gate = self.g_proj(a) if self.cfg.kda_full_rank_gate else self.g_b_proj(self.g_a_proj(a))
        gate = gate.view(B, T, H, d)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)   # gated RMSNorm, fp32
        o = o * widen_to_f32(self.o_norm) * torch.sigmoid(gate)
        out = self.o_proj(o.reshape(B, T, H * d))
        return out, {"conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "recurrent": recurrent}
