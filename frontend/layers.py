"""Small shared pieces: RMSNorm, the gated activations (SwiGLU's SiLU and K3's SiTU), RoPE + YaRN,
and the dense gated FFN (MODEL_SPEC 0, 3.2, 3.4, 3.5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import formats, units
from .config import ModelConfig, YarnScaling


def widen_to_f32(t: torch.Tensor) -> torch.Tensor:
    """t widened to float32 (a no-op, recorded as nothing in an export, when it already is).

    Every activation in the model is f32; weights may be stored narrower and are widened at use.
    int16 is bf16 held as raw bits (for targets without bf16, e.g. SPIR-V): widened with integer
    ops, f32 bits = bf16 bits << 16, which is exact. int32 is two bf16 values a word along the last
    dim (for SPIR-V targets without 16-bit storage, where IREE's emulated 16-bit loads computed
    wrong numbers): element 2i is the low half of word i, 2i + 1 the high half."""
    if t.dtype == torch.float32:
        return t
    # IREE-WORKAROUND(spirv): bf16 arrives as its bits (no bf16 type), as int16 or, without 16-bit
    # storage (IREE's emulated 16-bit loads computed wrong numbers), as int32 words of two values
    if t.dtype == torch.int16:
        return (t.to(torch.int32) << 16).view(torch.float32)
    if t.dtype == torch.int32:
        low, high = (t << 16).view(torch.float32), (t & -65536).view(torch.float32)
        return torch.stack((low, high), dim=-1).flatten(-2)
    return t.to(torch.float32)


@dataclass(frozen=True)
class Step:
    """Where a forward call writes in the sequence, shared by every mixer of the call, per sequence of the
    batch (Bp = B, or 1 when every sequence is at the same place):
    positions [Bp, T] int64 cache slots of the new tokens, rope (cos, sin) [Bp, T, dr/2] at those positions,
    length [Bp] int32 when only the first `length` tokens of a row are real (a padded prefill block, a
    batch slot with nothing to do at length 0); None = all T.
    window: attention reads only cache slots [0, window) (every real query of the call is below it: a
    short sequence need not pay for the whole cache); None = every slot."""

    positions: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    length: torch.Tensor | None = None
    window: int | None = None


class Linear(nn.Linear):
    """nn.Linear without bias whose weight may be stored narrower (bf16, f16) than the activations:
    it is widened to the activation dtype (f32) at use, so a module exported with the checkpoint's
    dtypes reads the stored bytes."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.fused = False              # a bf16 weight goes through kimi::dense_batched_matmul (units.py)
        self.exact = False              # ... or kimi::dense_exact_matmul: rows never rounded (--bf16-activations)

    def weight_f32(self) -> torch.Tensor:
        return widen_to_f32(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and self.weight.dtype == torch.bfloat16:
            return units.dense_matmul(x, self.weight, fused=True, exact=self.exact)
        return F.linear(x, widen_to_f32(self.weight))


class BlockScaledLinear(nn.Module):
    """A linear layer whose weight stays in a block-scaled format (frontend/formats.py; FP8 in DeepSeek-V3
    and Kimi-K2 checkpoints): `packed` [O, *] and `scales` as published. It is the one-expert case of
    the batched weight-matmul unit, so the compiler's pass reads the codes inside the contraction."""

    def __init__(self, in_features: int, out_features: int, fmt: str):
        super().__init__()
        f = formats.FORMATS[fmt]
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        self.fused = False
        self.register_buffer("packed", torch.zeros(f.packed_shape(out_features, in_features), dtype=f.packed_dtype))
        self.register_buffer("scales", torch.zeros(f.scales_shape(out_features, in_features), dtype=f.scales_dtype))

    def weight_f32(self) -> torch.Tensor:
        """The dequantised [O, K] weight (for the few places that use a weight other than as x @ W^T)."""
        return formats.FORMATS[self.format].dequantize(self.packed, self.scales, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, 1, self.in_features)
        y = units.weight_batched_matmul(x=rows, packed=self.packed.unsqueeze(0), scales=self.scales.unsqueeze(0),
                                        fmt=self.format, fused=self.fused)
        return y.reshape(*x.shape[:-1], self.out_features)


def set_linear_format(model: nn.Module, name: str, fmt: str | None) -> None:
    """Hold the Linear `name` of `model` in block-scaled format `fmt` (None: a float Linear), empty."""
    owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
    holder = model.get_submodule(owner) if owner else model
    old = getattr(holder, attr)
    if fmt is None and not isinstance(old, Linear):
        setattr(holder, attr, Linear(old.in_features, old.out_features))
    elif fmt is not None and getattr(old, "format", None) != fmt:
        setattr(holder, attr, BlockScaledLinear(old.in_features, old.out_features, fmt))


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (no +1 on the weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return widen_to_f32(self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """act(gate) * up for SwiGLU, or K3's SiTU: beta*tanh(gate/beta)*sigmoid(gate) * lb*tanh(up/lb).

    SiTU is computed in fp32 (MODEL_SPEC "K3 facts"); its two betas come from the config.
    """
    if cfg.hidden_act == "silu":
        return F.silu(gate) * up
    beta, lb = cfg.situ_beta, cfg.situ_linear_beta
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (lb * torch.tanh(up / lb))


class GatedFFN(nn.Module):
    """down(act(gate(x)) * up(x)): the dense FFN of the first layers and the shared experts."""

    def __init__(self, cfg: ModelConfig, dim: int, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.cfg))


# ------------------------------------------------------------------------ RoPE
def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale ("attention_factor") for RoPE, with YaRN's
    blend of interpolated and extrapolated frequencies when `yarn` is set (MODEL_SPEC 3.2).
    Built from arange, so it can be computed inside a traced forward (no data to embed)."""
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv_freq = 1.0 / pos
    if yarn is None:
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 takes the interpolated one
    inv_freq = inv_freq / yarn.factor * (1 - extrapolate) + inv_freq * extrapolate

    def mscale(f: float, m: float) -> float:
        return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

    if yarn.mscale and yarn.mscale_all_dim:
        attention_factor = mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attention_factor = mscale(yarn.factor, 1.0)
    return inv_freq, attention_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, dim/2] (one angle per rotated pair)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x ([..., T, (heads,) d]) by per-position angles.

    interleaved: pairs are adjacent dims (2i, 2i+1) — DeepSeek's MLA; the output keeps that order.
    half-split:  pairs are (i, i + d/2) — the lightning indexer.
    cos/sin: [B, T, d/2], broadcast over any head dim between T and d.
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        # pairs as a trailing dim of 2 rather than stride-2 slices: SPIR-V codegen (IREE 3.13) fails to
        # legalise a stride-2 load out of a wider row (k_pe at 512.. of the 576-wide kv_a output)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.stack((r1, r2), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
