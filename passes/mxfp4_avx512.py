"""The x86 lowerings of the MXFP4 matmul units: a hand-written dispatch (passes/mxfp4.py picks it for
llvm-cpu targets whose CPU has AVX-512F, and its 8-wide form for AVX2; the others get
passes/mxfp4_cpu.py's linalg kernels). The AVX-512 form is described here; the AVX2 form looks up the 8
magnitudes with `vpermps` (llvm.x86.avx2.permps, the low 3 bits of each lane) and xors the lane with
code << 28, which sets bit 3 of the code as the sign (`_table` holds the other bits' xor), a block's 16
bytes as two halves of 8.

    y[r, o] = sum_k x[r, k] * W[experts[r], o, k]      (every unit is flattened to rows r)
    W[e, o, k] = e2m1(nibble(packed[e, o, k // 2], k % 2)) * 2^(scales[e, o, k // 32] - 127)

Why a hand-written dispatch: FP4 E2M1 has 16 codes, and AVX-512's `vpermd` looks up 16 f32 values
at once from a table held in one register, indexed by the low 4 bits of each 32-bit lane. No linalg
form makes IREE emit it (a `tensor.extract` from a 16-entry table becomes a memory gather), and the
integer decode of passes/mxfp4_cpu.py costs about 16 vector ops per 32 weights. Here a block of 32
weights (16 bytes) costs: one `vpmovzxbd` (bytes -> 32-bit lanes; lane b's low 4 bits are the low
nibble), one `vpsrld` (the high nibble), two `vpermd` (the f32 values), and per row a `vmulps`, a
`vfmadd` with the de-interleaved x (the low nibble of byte b is k = 32g + 2b, the high one k + 1:
x_even and x_odd are two contiguous 16-float runs) and a `vfmadd` with the block scale. Where a row's
K/32 scales are whole vectors (K a multiple of 512 for AVX-512, 256 for AVX2), the row's scales 2^(s - 127)
are built before its loop as f32 bits s << 23, a vector at a time, and each block broadcasts its own
(the per-block scalar decode was ~7 of a block's ~17 ops). s == 0 (2^-127, below the normal range, which
local-task's flush-to-zero mode would read as 0) sends its row to the per-block form, which builds
max(s, 1) << 23 and takes a table holding the values / 2 for that block, so every block is exact.

Each output row also prefetches the weights and scales of the row `PREFETCH` ahead in the workgroup's
walk (past the tile's end, the first rows of the next run's expert): a tile reads 32 rows of 256 bytes
from each of 4 experts, streams too short for the hardware prefetcher. In the bench K3 decode step
(`bench/dispatch_profile.py OUT --entry decode_w64`, alternating modules) the two together took the
MXFP4 dispatch from 1.0 to 0.7 ms (AVX-512) and from 1.5-1.9 to 1.0-1.2 ms (AVX2) a step.

The dispatch is a `stream.executable` (IREE's samples/custom_dispatch form, the template
passes/kernels/mxfp4_avx512.mlir): scf loops and vector ops
on the bindings' memrefs, with the permute as `llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"`;
IREE lowers it with its usual LLVM CPU backend. Workgroups split the output rows o (`o_tile` each);
each walks the rows r in runs of one expert (the frontend sorts prefill's routed pairs by expert;
passes/kernels/row_runs.mlir, shared with the bf16 dispatch): a run of `ROWS_PER_DECODE` rows shares one
decode of each weight block (4: at 16 rows of one expert, 8 rows per decode measured 4.1 ms against
1.5 ms, prototype timings), else a run of 2, else one row. Rows of different experts in any order are
still correct, only slower.
"""

from __future__ import annotations

import struct

from .kernels import render
from .mxfp4_cpu import pow2_divisor

TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
ROWS_PER_DECODE = 4
PREFETCH = 8          # rows ahead (8 x 256 bytes at the bench model's K = 512; 3 measured no better)
WIDTH = {"avx512": 16, "avx2": 8}      # floats a vector register


def _table(scale: float, width: int) -> str:
    """The E2M1 values (times `scale`) as f32 bits, code c at lane c: for vpermd the 16 signed values (bit
    3 is the sign); for vpermps the 8 magnitudes, each xor-ed with (c << 28). The AVX2 form xors a lane's
    looked-up bits with (code << 28), the nibble in bits 28..31: that undoes the table's bits 28..30 and
    leaves bit 31 = bit 3 of the code, the sign (one op fewer than isolating bit 3 first)."""
    if width == 16:
        bits = [_f32_bits(v * scale) for v in TABLE] + [_f32_bits(-v * scale) for v in TABLE]
    else:
        bits = [_f32_bits(v * scale) ^ (c << 28) for c, v in enumerate(TABLE)]
    return "dense<[" + ", ".join(map(str, bits)) + f"]> : vector<{width}xi32>"


def _f32_bits(value: float) -> int:
    """The f32 bits of `value` as a signed int32 (an MLIR i32 literal)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _render(name: str, form: str, R: int, K: int, O: int, E: int, isa: str, **wrapper: int) -> str:
    if K % 32:
        raise ValueError(f"K must be a multiple of 32, got {K}")
    width = WIDTH[isa]
    return render("mxfp4_avx512.mlir", name=name, form=form, R=R, K=K, O=O, E=E, o_tile=pow2_divisor(O, 32),
                  n=max(1, min(ROWS_PER_DECODE, R)), width=width, table=_table(1.0, width),
                  table_half=_table(0.5, width), row_scales=(K // 32) % width == 0, prefetch=PREFETCH,
                  **{"N": 0, "J": 0, "M": 0, **wrapper})


def gathered_function(name: str, N: int, J: int, K: int, O: int, E: int, isa: str = "avx512") -> str:
    """@name(x [N, J, K], packed [E, O, K/2] i8, scales [E, O, K/32] i8, experts [N, J] i64) -> [N, J, O]:
    row (n, j) through expert experts[n, j] (the unit kimi::mxfp4_expert_matmul), as N*J rows. The
    dispatch is `stream.executable @{name}_rows_dispatch` (its function also @{name}_rows: IREE links the
    CPU executables of a module into one, where public names must be unique)."""
    return _render(name, "gathered", N * J, K, O, E, isa, N=N, J=J)


def batched_function(name: str, M: int, E: int, K: int, O: int, isa: str = "avx512") -> str:
    """@name(x [M, E, K], packed, scales) -> [M, E, O]: column e through expert e (the unit
    kimi::mxfp4_batched_matmul), as E runs of M rows (expert-major), each run sharing its decodes."""
    return _render(name, "batched", M * E, K, O, E, isa, M=M)
