"""Block-scaled weight formats: a weight held as the published checkpoint ships it, narrow codes plus
scales beside them, and its dequantisation (the reference every module computes when the
weight-matmul pass is off, and the eager model always).

  format          packed [.., O, *]            scales [.., *, *]                       w[o, k]
  mxfp4           u8  [O, K/2]  two E2M1/byte  u8 E8M0 [O, K/32]                       e2m1 * 2^(s-127)
  fp8_e4m3_b128   u8  [O, K]    E4M3FN bytes   f32 [ceil(O/128), ceil(K/128)]          e4m3 * s[o//128, k//128]
  int4_g32        i32 [O, ceil(K/8)]           bf16 [O, ceil(K/32)]                    bf16((u - 8) * s[o, k//32])

- mxfp4: OCP MX (gpt-oss, compressed-tensors mxfp4-pack-quantized, K3): frontend/mxfp4.py.
- fp8_e4m3_b128: DeepSeek-V3/V3.2 and Kimi-K2's `quant_method: fp8`, `weight_block_size [128, 128]`
  (`*.weight` float8_e4m3fn + `*.weight_scale_inv`). An edge block is partial and uses its own scale
  (cropped: a 576-row weight has 5 row blocks). The product is f32 (DeepSeek's own dequantiser
  multiplies in f32; V3.2's `ue8m0` scales are powers of two, so there it is exact). The bytes are held
  as u8 (the same bytes): every target then decodes E4M3 with integer ops, as SPIR-V must.
- int4_g32: compressed-tensors `pack-quantized` (Kimi-K2-Thinking, K2.5 routed experts): symmetric
  int4 stored offset-binary u = q + 8, element k of a row in word k // 8 at bits 4 (k % 8).., low nibble
  first, rows padded to whole words (trimmed by the row length K); no zero point. compressed-tensors
  multiplies in bf16, so the reference rounds each product to bf16 (exact in f32 before rounding:
  a 4-bit integer times an 8-bit mantissa).

Decoders are integer ops and one bitcast: they export to plain arith on every target (no fp8 or bf16
type is needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import mxfp4

FP8_BLOCK = 128
INT4_GROUP = 32
INT4_PER_WORD = 8


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3FN code (int, 0..255) -> f32 value, from the bits.

    bias 7; exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN (E4M3FN has no infinity, so 448 is
    the largest finite value); bit 7 is the sign."""
    code = code.to(torch.int32)
    e, m = (code >> 3) & 15, code & 7
    normal = (((e + 120) << 23) | (m << 20)).view(torch.float32)       # 2^(e-7) * (1 + m/8), exact
    magnitude = torch.where(e == 0, m.to(torch.float32) * 2.0 ** -9, normal)
    # (code & 127) == 127, not (e == 15) & (m == 7): a boolean `&` has no lowering in torch-mlir
    magnitude = torch.where((code & 127) == 127, torch.full_like(magnitude, float("nan")), magnitude)
    return torch.where((code & 128) != 0, -magnitude, magnitude)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """f32 rounded to the nearest bf16 value (ties to even), still f32: integer ops, no bf16 type."""
    bits = x.view(torch.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.view(torch.float32)


def int4_codes(packed: torch.Tensor, K: int) -> torch.Tensor:
    """int32 words [.., O, W] -> the offset-binary codes u (0..15) [.., O, K], int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # bitwise_right_shift, not `>>`: a tensor-by-tensor `>>` (aten.__rshift__.Tensor) has no torch-mlir lowering
    nibbles = torch.bitwise_right_shift(packed.to(torch.int32).unsqueeze(-1), shifts) & 15      # [.., O, W, 8]
    return nibbles.flatten(-2)[..., :K]


def _expand_blocks(scales: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """[.., R, C] per-block scales -> [.., rows, cols] (each scale over its block; edge blocks cropped)."""
    if block_rows > 1:
        scales = scales.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return scales.repeat_interleave(block_cols, dim=-1)[..., :cols]


def widen(t: torch.Tensor) -> torch.Tensor:
    from .layers import widen_to_f32       # (layers imports this module)
    return widen_to_f32(t)


@dataclass(frozen=True)
class WeightFormat:
    """One block-scaled format: its storage dtypes and shapes for an [O, K] weight, and its dequantiser."""

    name: str
    packed_dtype: torch.dtype
    scales_dtype: torch.dtype
    block_rows: int                  # rows one scale covers
    block_cols: int                  # columns (K) one scale covers
    codes_per_element: tuple[int, int]   # (codes, storage elements): 2 per u8, 1 per u8, 8 per i32

    def packed_shape(self, O: int, K: int) -> tuple[int, int]:
        per, _ = self.codes_per_element
        return O, math.ceil(K / per)

    def scales_shape(self, O: int, K: int) -> tuple[int, int]:
        return math.ceil(O / self.block_rows), math.ceil(K / self.block_cols)

    def dequantize(self, packed: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
        """packed [.., O, *] + scales [.., *, *] -> f32 [.., O, K]."""
        O = packed.shape[-2]
        if self.name == "mxfp4":
            return mxfp4.dequantize(packed, scales)
        scale = _expand_blocks(widen(scales), O, K, self.block_rows, self.block_cols)
        if self.name == "fp8_e4m3_b128":
            return e4m3_value(packed) * scale
        return round_to_bf16((int4_codes(packed, K) - 8).to(torch.float32) * scale)


MXFP4 = WeightFormat("mxfp4", torch.uint8, torch.uint8, 1, mxfp4.BLOCK, (2, 1))
FP8_E4M3_B128 = WeightFormat("fp8_e4m3_b128", torch.uint8, torch.float32, FP8_BLOCK, FP8_BLOCK, (1, 1))
INT4_G32 = WeightFormat("int4_g32", torch.int32, torch.bfloat16, 1, INT4_GROUP, (INT4_PER_WORD, 1))
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (MXFP4, FP8_E4M3_B128, INT4_G32)}


def expert_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
                  fmt: str) -> torch.Tensor:
    """x [N, J, K] through expert experts[n, j] of packed [E, O, *] / scales [E, *, *] -> [N, J, O].

    The reference of the `kimi::weight_expert_matmul` unit: gathers the selected experts' codes and
    scales, then dequantises them (what the unfused module computes)."""
    w = FORMATS[fmt].dequantize(packed[experts], scales[experts], x.shape[-1])
    return torch.einsum("njk,njok->njo", x, w)


def batched_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [M, E, K], column e through expert e of packed [E, O, *] / scales [E, *, *] -> [M, E, O]."""
    return torch.einsum("mek,eok->meo", x, FORMATS[fmt].dequantize(packed, scales, x.shape[-1]))
