"""MXFP4 (OCP microscaling FP4): FP4 E2M1 values, one E8M0 scale per 32 along K (MODEL_SPEC 4).

Layout we hold (the HF-side bytes, never repacked here):
  packed [..., N, K/2] uint8   element 2j in the low nibble of byte j, element 2j+1 in the high nibble
  scales [..., N, K/32] uint8  block value 2^(e - 127)
compressed-tensors' `weight_packed`/`weight_scale` are exactly this; gpt-oss' `*_blocks`
[..., N, K/32, 16] is the same bytes with K/2 split into (K/32, 16).

`dequantize` is the reference the exported module computes inside its forward; the weights are
never stored wider than these bytes.
"""

from __future__ import annotations

import torch

BLOCK = 32


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 code (int, 0..15) -> f32 value, from the bits (no table: nothing to embed in a module).

    exponent 0 is subnormal (0 or 0.5); otherwise (1 + m/2) * 2^(e-1); bit 3 is the sign (8 = -0.0)."""
    e, m = ((code >> 1) & 3).to(torch.float32), (code & 1).to(torch.float32)
    magnitude = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K/2] uint8 codes + [..., N, K/32] uint8 E8M0 scales -> [..., N, K] values."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scales.dtype}")
    *lead, n, half_k = packed.shape
    if tuple(scales.shape) != (*lead, n, half_k * 2 // BLOCK):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    codes = packed.to(torch.int32)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(*lead, n, half_k * 2)  # low nibble = even
    values = e2m1_value(nibbles)
    # 2^(e-127) is exact in f32 for every e in 0..254 (e = 0 gives a denormal scale).
    exponent = scales.to(torch.float32) - 127.0
    scale = torch.exp2(exponent).repeat_interleave(BLOCK, dim=-1)
    out = values * scale
    return out if dtype == torch.float32 else out.to(dtype)


def expert_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """x [N, J, K] through expert experts[n, j] of packed [E, O, K/2] / scales [E, O, K/32] -> [N, J, O].

    The reference of the `kimi::mxfp4_expert_matmul` unit: gathers the selected experts' bytes, then
    dequantises them (what the unfused module computes)."""
    return torch.einsum("njk,njok->njo", x, dequantize(packed[experts], scales[experts]))


def batched_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, E, K], column e through expert e of packed [E, O, K/2] / scales [E, O, K/32] -> [M, E, O]."""
    return torch.einsum("mek,eok->meo", x, dequantize(packed, scales))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (packed [..., N, K/2], scales [..., N, K/32]), OCP MX v1.0 rounding.

    Per 32-block: e = floor(log2(max|x|)) - 2 + 127 (2 = E2M1's largest exponent), then each
    x / 2^(e-127) rounds to the nearest E2M1 value, ties to the even code, saturating at 6.
    """
    *lead, n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs K divisible by {BLOCK}, got {k}")
    w = weight.to(torch.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2 + 127, torch.zeros_like(amax))
    e = e.clamp(0, 254)
    m = (w / torch.exp2(e - 127)).abs()
    # Round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6}: count the boundaries passed;
    # '>=' at a midpoint rounds up to an even code, '>' keeps the lower (even) one.
    magnitude_code = ((m > 0.25).int() + (m >= 0.75).int() + (m > 1.25).int() + (m >= 1.75).int()
                      + (m > 2.5).int() + (m >= 3.5).int() + (m > 5.0).int())
    codes = magnitude_code + 8 * (w < 0).int()
    codes = codes.reshape(*lead, n, k // 2, 2).to(torch.uint8)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), e.squeeze(-1).to(torch.uint8).contiguous()


def gpt_oss_blocks_to_packed(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss `*_blocks` [..., N, K/32, 16] -> [..., N, K/2]: the same bytes, one reshape."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
