"""The block-scaled weight formats' dequantisers (frontend/formats.py) on hand-made values, against
independent decoders: torch's own float8_e4m3fn and bfloat16 conversions and compressed-tensors'
`unpack_from_int32`. Every FP8 code (subnormals and both NaN encodings), every int4 code at every
nibble position, partial edge blocks, extreme scales."""

import math

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

import block_cases as bc
from hf_checkpoints import fp8_block_dequantize, int4_group_dequantize
from kimi_iree.frontend.formats import FORMATS, batched_matmul, e4m3_value, expert_matmul, int4_codes, round_to_bf16

ALL_CODES = torch.arange(256, dtype=torch.int32)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit on values, NaN where NaN (any payload), signed zeros told apart."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_every_fp8_code_decodes_as_torch_float8_e4m3fn():
    want = ALL_CODES.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    assert _same(e4m3_value(ALL_CODES), want)


def test_fp8_landmarks():
    v = e4m3_value(torch.tensor([0x00, 0x80, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x7F, 0xFF]))
    assert v[0].item() == 0.0 and math.copysign(1, v[1].item()) == -1          # +0, -0
    assert v[2].item() == 2.0 ** -9 and v[3].item() == 7 * 2.0 ** -9            # smallest and largest subnormal
    assert v[4].item() == 2.0 ** -6                                              # smallest normal
    assert v[5].item() == 1.0 and v[6].item() == 448.0 and v[7].item() == -448.0  # 1.0, largest finite
    assert torch.isnan(v[8:]).all()                                              # S.1111.111: E4M3FN's only NaN


def test_round_to_bf16_matches_torch_on_every_kind_of_float():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[~torch.isnan(x)]
    # exact ties both ways, subnormals, the overflow edge, zeros
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x7F7FFFFF, 0x7F7F7FFF, 0, -2 ** 31],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([float("inf"), -float("inf"), 1e-45, -3.0e38])])
    assert _same(round_to_bf16(x), x.to(torch.bfloat16).to(torch.float32))


@pytest.mark.parametrize("K", [8, 37, 64])
def test_every_int4_code_at_every_nibble_unpacks_as_compressed_tensors(K):
    # row r holds q = (r + j) mod 16 - 8 at column j: every code lands on every nibble position
    q = ((torch.arange(16)[:, None] + torch.arange(K)[None, :]) % 16 - 8).to(torch.int8)
    packed = pack_to_int32(q, 4)
    assert packed.shape == (16, math.ceil(K / 8)) and packed.dtype == torch.int32
    assert torch.equal(int4_codes(packed, K) - 8, unpack_from_int32(packed, 4, torch.Size([16, K])).to(torch.int32))


def _fp8_case(O: int, K: int, scale_exponents: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (O, K), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[codes & 127 == 127] = 0x3C                                      # NaN codes checked above
    lo, hi = scale_exponents
    grid = (math.ceil(O / 128), math.ceil(K / 128))
    scales = torch.exp2(torch.randint(lo, hi + 1, grid, generator=g).float()) * (1 + torch.rand(grid, generator=g))
    return codes, scales


@pytest.mark.parametrize("O,K,exponents", [(128, 256, (-8, 4)),       # whole blocks
                                           (200, 300, (-8, 4)),       # partial edge blocks both ways
                                           (576, 130, (-8, 4)),       # kv_a_proj_with_mqa's 576 rows: 5 row blocks
                                           (1, 1, (-8, 4)),           # one element, one partial block
                                           (130, 129, (-130, -120)),  # scales near the f32 subnormal range
                                           (130, 129, (110, 118))])   # products past e4m3's range, still finite
def test_fp8_block_dequantisation_crops_edge_blocks(O, K, exponents):
    codes, scales = _fp8_case(O, K, exponents)
    got = FORMATS["fp8_e4m3_b128"].dequantize(codes, scales, K)
    assert got.shape == (O, K)
    assert _same(got, fp8_block_dequantize(codes.view(torch.float8_e4m3fn), scales))


@pytest.mark.parametrize("O,K,scale", [(16, 64, None), (5, 37, None), (4, 96, 3.0e38), (4, 96, 1e-38)])
def test_int4_group_dequantisation_matches_compressed_tensors(O, K, scale):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (O, K), generator=g, dtype=torch.int8)
    groups = math.ceil(K / 32)
    scales = (torch.rand(O, groups, generator=g) * 4 if scale is None else torch.full((O, groups), scale)).to(torch.bfloat16)
    packed = pack_to_int32(q, 4)
    # bf16 products: 3e38 * 8 overflows to inf in both, 1e-38 * q lands in bf16's subnormals
    assert _same(FORMATS["int4_g32"].dequantize(packed, scales, K), int4_group_dequantize(packed, scales, (O, K)))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_storage_shapes_and_the_reference_matmuls(fmt):
    f = FORMATS[fmt]
    E, O, K = 3, 40, 64
    g = torch.Generator().manual_seed(2)
    pshape, sshape = f.packed_shape(O, K), f.scales_shape(O, K)
    if f.packed_dtype == torch.int32:
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, *pshape), generator=g, dtype=torch.int64).to(torch.int32)
    else:
        packed = torch.randint(0, 256, (E, *pshape), generator=g, dtype=torch.int32).to(torch.uint8)
        if fmt == "fp8_e4m3_b128":
            packed[packed & 127 == 127] = 0
    if fmt == "mxfp4":
        scales = torch.randint(120, 130, (E, *sshape), generator=g, dtype=torch.int32).to(torch.uint8)
    else:
        scales = torch.rand(E, *sshape, generator=g).to(f.scales_dtype)
    w = f.dequantize(packed, scales, K)
    assert w.shape == (E, O, K) and torch.isfinite(w).all()
    x = torch.randn(2, E, K, generator=g)
    torch.testing.assert_close(batched_matmul(x, packed, scales, fmt), torch.einsum("mek,eok->meo", x, w))
    experts = torch.tensor([[2, 0], [1, 1]])
    torch.testing.assert_close(expert_matmul(x[:, :2], packed, scales, experts, fmt),
                               torch.einsum("njk,njok->njo", x[:, :2], w[experts]))


@pytest.mark.parametrize("T", [1, 5], ids=["decode", "block"])
def test_fp8_kv_b_per_head_reads_the_codes_of_the_dequantised_weight(T):
    """An FP8 kv_b_proj's absorbed projections from its rearranged codes and scales (frontend/mla.py
    `fp8_absorbed_weights`: W_UK^T transposed by 128 x 128 blocks) equal the dequantised weight's; a wrong
    block's scale or a transposed code would move them by far more than the f32 sums' order."""
    case = bc.mla(T=T, S=16, position=4, heads=3, nope=128, v_dim=128, kv_lora=144, fp8_kv_b=True)
    mixer = case.module.mixer
    assert mixer.fused_per_head and mixer.kv_b_proj.fused
    with torch.no_grad():
        got = case.module(*case.inputs)[0]
        mixer.fused_per_head = False            # the einsum of the dequantised weight
        want = case.module(*case.inputs)[0]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
