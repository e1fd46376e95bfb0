"""MXFP4 dequantisation against transformers' reference, and our quantiser's rounding."""

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kimi_iree.frontend import mxfp4


def _random_codes(E=3, N=8, K=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return packed, scales


def test_dequantize_is_bit_exact_against_transformers():
    packed, scales = _random_codes()
    # the extreme scales: denormal-range and near-overflow exponents, and negative zero codes
    scales[0, 0, 0], scales[0, 1, 0], scales[0, 2, 0], scales[0, 3, 0] = 0, 1, 2, 254
    packed[1, 0, :] = 0x88   # -0.0 in both nibbles
    ours = mxfp4.dequantize(packed, scales)
    E, N, half_k = packed.shape
    blocks = packed.reshape(E, N, half_k * 2 // 32, 16)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours.view(torch.int32), ref.contiguous().view(torch.int32))  # bit for bit, sign of zero too


def test_quantize_round_trips_representable_values():
    packed, scales = _random_codes(seed=1)
    scales = scales.clamp(100, 150)
    values = mxfp4.dequantize(packed, scales)
    p2, s2 = mxfp4.quantize(values)
    assert torch.equal(mxfp4.dequantize(p2, s2), values)


def test_quantize_rounds_to_nearest_even_and_saturates():
    # one block with max 4.0 -> scale 2^0; midpoints go to the even code
    x = torch.zeros(1, 32)
    x[0, :9] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3])
    packed, scales = mxfp4.quantize(x)
    assert scales.item() == 127
    got = mxfp4.dequantize(packed, scales)[0, :9]
    assert got.tolist() == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5]
    # a block max of 7.9 still picks e = floor(log2 7.9) - 2 = 0 and saturates at 6
    y = torch.zeros(1, 32)
    y[0, 0] = 7.9
    assert mxfp4.dequantize(*mxfp4.quantize(y))[0, 0].item() == 6.0
