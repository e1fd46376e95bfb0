"""Fusion units: the places in the model that our MLIR passes (passes/) rewrite, each one torch custom op.

With a unit on, the model calls its op: torch.export keeps the call as one node and the FX importer
writes it as `torch.operator "torch.kimi.NAME"(...)`, which the unit's pass finds and replaces with a
fused implementation. With a unit off (the default, and `--no-*-fusion`), the model calls the op's
reference function instead, which exports as plain torch ops: the correctness fallback. The op's
eager implementation is that same reference, so eager numbers never depend on the switch.

  kimi::weight_expert_matmul(x [N, J, K] f32, packed [E, O, *], scales [E, *, *], experts [N, J] i64,
                             fmt) -> [N, J, O] f32
      y[n, j] = dequant(W[experts[n, j]]) @ x[n, j]: decode, each token's selected experts only.
  kimi::weight_batched_matmul(x [M, E, K] f32, packed [E, O, *], scales [E, *, *], fmt) -> [M, E, O] f32
      y[:, e] = x[:, e] @ dequant(W[e])^T: prefill, every expert on its group of token rows; a
      block-scaled linear layer is the one-expert case.
      fmt is a block-scaled format (frontend/formats.py: mxfp4, fp8_e4m3_b128, int4_g32).
  kimi::dense_batched_matmul, kimi::dense_expert_matmul: the same two with a plain bf16 weight [E, O, K].
  kimi::dense_exact_matmul: dense_batched_matmul for a linear layer whose rows are never rounded, even
      under kimi-compile --bf16-activations (the lightning indexer's: token selection is sensitive to them).
  kimi::per_head_matmul(x [N, H, K] f32, weight [H, O, K] bf16) -> [N, H, O] f32
      y[n, h] = widen(W[h]) @ x[n, h]: MLA's absorbed projections on a block of tokens, each head its own
      weight (frontend/mla.py `per_head`).
  kimi::kda_decode(q [B, H, dk], k [B, H, dk], v [B, H, dv], decay [B, H, dk], beta [B, H],
                   state [B, H, dk, dv]) -> (o [B, H, dv], state [B, H, dk, dv])   (all f32)
      one token of Kimi Delta Attention's recurrence (frontend/kda.py `kda_step`), every head.
  kimi::sparse_mla_attention(q_latent [B, T, H, r], q_pe [B, T, H, dr], latent [B, S, r], k_pe [B, S, dr],
                             index_q [B, T, HI, dI], index_w [B, T, HI], index_keys [B, S, dI],
                             positions [B, T] i64, softmax_scale, index_scale, topk) -> [B, T, H, r] f32
      a DSA layer's lightning-indexer scoring, top-k selection and latent attention (frontend/dsa.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dsa, formats, kda


@dataclass(frozen=True)
class FusedUnits:
    """Which units the model emits as custom ops (each needs its pass to compile)."""

    weight_matmul: bool = False
    sparse_attention: bool = False
    dense_matmul: bool = False       # bf16 linear layers (llvm-cpu: IREE's own matvec of a widened bf16 weight is slow)
    kda_decode: bool = False         # KDA's decode step (x86 llvm-cpu: IREE's own ran 2.5-6x the time its state's bytes take)


# ------------------------------------------------------------------- block-scaled weights
@torch.library.custom_op("kimi::weight_expert_matmul", mutates_args=())
def _weight_expert_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                          fmt: str) -> torch.Tensor:
    return formats.expert_matmul(x, packed, scales, experts, fmt)


@_weight_expert_matmul.register_fake
def _(x, packed, scales, experts, fmt):
    return x.new_empty(*x.shape[:2], packed.shape[1])


@torch.library.custom_op("kimi::weight_batched_matmul", mutates_args=())
def _weight_batched_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    return formats.batched_matmul(x, packed, scales, fmt)


@_weight_batched_matmul.register_fake
def _(x, packed, scales, fmt):
    return x.new_empty(x.shape[0], packed.shape[0], packed.shape[1])


# ------------------------------------------------- bf16 weights (llvm-cpu: kernels of passes/weights.py)
def _dense_batched_op(name: str):
    """kimi::NAME(x [M, E, K], weight [E, O, K]) -> [M, E, O]: `dense_batched_reference` as a unit. Two
    names, one math: a pass may treat kimi::dense_exact_matmul's rows differently (never rounds them)."""
    def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dense_batched_reference(x, weight)

    op = torch.library.custom_op(f"kimi::{name}", reference, mutates_args=())
    op.register_fake(lambda x, weight: x.new_empty(x.shape[0], weight.shape[0], weight.shape[1]))
    return op


_dense_batched_matmul = _dense_batched_op("dense_batched_matmul")
_dense_exact_matmul = _dense_batched_op("dense_exact_matmul")


@torch.library.custom_op("kimi::dense_expert_matmul", mutates_args=())
def _dense_expert_matmul(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return dense_expert_reference(x, weight, experts)


@_dense_expert_matmul.register_fake
def _(x, weight, experts):
    return x.new_empty(*x.shape[:2], weight.shape[1])


@torch.library.custom_op("kimi::per_head_matmul", mutates_args=())
def _per_head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return per_head_reference(x, weight)


@_per_head_matmul.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:2], weight.shape[1])


def per_head_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, H, K], row h through head h's weight of [H, O, K] (widened to f32) -> [N, H, O]."""
    return torch.einsum("nhk,hok->nho", x, formats.widen(weight))


def per_head_matmul(*, x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    op = torch.ops.kimi.per_head_matmul if fused else per_head_reference
    return op(x, weight)


def dense_batched_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, E, K], column e through weight e of [E, O, K] (stored bf16, widened to f32) -> [M, E, O]."""
    return torch.einsum("mek,eok->meo", x, formats.widen(weight))


def dense_expert_reference(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """x [N, J, K] through weight experts[n, j] of [E, O, K] -> [N, J, O]: reads only those experts."""
    return torch.einsum("njk,njok->njo", x, formats.widen(weight[experts]))


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, *, fused: bool, exact: bool = False) -> torch.Tensor:
    """x [.., K] @ widen(weight [O, K])^T, as `kimi::dense_batched_matmul` when fused (the same numbers);
    `exact`: as `kimi::dense_exact_matmul`, whose rows no lossy compile option rounds."""
    if not fused:
        return torch.nn.functional.linear(x, formats.widen(weight))
    op = torch.ops.kimi.dense_exact_matmul if exact else torch.ops.kimi.dense_batched_matmul
    y = op(x.reshape(-1, 1, x.shape[-1]), weight[None])
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dense_expert_matmul(*, x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, fused: bool) -> torch.Tensor:
    op = torch.ops.kimi.dense_expert_matmul if fused else dense_expert_reference
    return op(x, weight, experts)


def dense_grouped_matmul(*, x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    op = torch.ops.kimi.dense_batched_matmul if fused else dense_batched_reference
    return op(x, weight)


def weight_expert_matmul(*, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                         fmt: str, fused: bool) -> torch.Tensor:
    op = torch.ops.kimi.weight_expert_matmul if fused else formats.expert_matmul
    return op(x, packed, scales, experts, fmt)


def weight_batched_matmul(*, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                          fused: bool) -> torch.Tensor:
    op = torch.ops.kimi.weight_batched_matmul if fused else formats.batched_matmul
    return op(x, packed, scales, fmt)


# ------------------------------------------------------------------------------- KDA decode
@torch.library.custom_op("kimi::kda_decode", mutates_args=())
def _kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kda.kda_step(q, k, v, decay, beta, state)


@_kda_decode.register_fake
def _(q, k, v, decay, beta, state):
    return v.new_empty(v.shape), torch.empty_like(state)


def kda_decode(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's recurrence step (arguments as `kda.kda_step`) -> (o, new state)."""
    op = torch.ops.kimi.kda_decode if fused else kda.kda_step
    return op(q, k, v, decay, beta, state)


# ------------------------------------------------------------------------- sparse attention
@torch.library.custom_op("kimi::sparse_mla_attention", mutates_args=())
def _sparse_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                          index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor,
                          positions: torch.Tensor, softmax_scale: float, index_scale: float,
                          topk: int) -> torch.Tensor:
    return dsa.sparse_mla_attention(q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions,
                                    softmax_scale, index_scale, topk)


@_sparse_mla_attention.register_fake
def _(q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions, softmax_scale, index_scale, topk):
    return torch.empty_like(q_latent)


def sparse_mla_attention(*, q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                         index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor,
                         positions: torch.Tensor, softmax_scale: float, index_scale: float, topk: int,
                         fused: bool) -> torch.Tensor:
    """The DSA unit (arguments as `dsa.sparse_mla_attention`); the op takes them in this order."""
    op = torch.ops.kimi.sparse_mla_attention if fused else dsa.sparse_mla_attention
    return op(q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions, softmax_scale, index_scale, topk)
