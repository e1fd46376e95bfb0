"""The llvm-cpu lowering of the MXFP4 matmul units for CPUs with neither AVX-512F nor AVX2 (aarch64, older
x86; passes/mxfp4.py picks it for them; the table-lookup dispatch of passes/mxfp4_avx512.py is 1.8x
faster with AVX-512F, 2.6x with AVX2 on 128 grouped pairs):

    y[n, j, o] = sum_k x[n, j, k] * W[e(n, j), o, k]
    W[e, o, k] = e2m1(nibble(packed[e, o, k // 2], k % 2)) * 2^(scales[e, o, k // 32] - 127)

`gathered_function` (decode: e = experts[n, j]) and `batched_function` (prefill: e = j, x [M, E, K])
return one `util.func private @name(...)` on builtin tensors (x f32, packed/scales i8, experts i64).
Measured on a 2-vCPU AVX-512 machine (bench/mxfp4_matmul.py, README "Figures"): at M = 1 the fused
matvec is 28-42x faster than the unfused dequantise-then-matmul pattern, and 1.9-2.3x faster than an
f32 matvec of the same shape reading its weights from DRAM (1.5-1.8x when the f32 weights sit in L3).
It is compute-bound (about 4-5 GB/s of packed bytes); at 16 rows the decode costs more than the
bytes it saves, and an f32 matmul is 2-5x faster.

Formulation (why each piece is there; measurements in the report / bench.py):

1. x is de-interleaved once: xe[m, g, b] = x[m, 32g + 2b], xo[m, g, b] = x[m, 32g + 2b + 1].
   Byte b of 32-block g holds k = 32g+2b (low nibble) and k = 32g+2b+1 (high nibble), so with the
   de-interleaved x both nibbles of a 16-byte block meet two *contiguous* 16-float runs of x: no
   strided/gathered activation loads and no repacking of the weights. An explicit
   `flow.dispatch.region` keeps this copy in its own (tiny) dispatch; otherwise IREE fuses it into
   the consumer and the strided loads come back. (It was a `util.optimization_barrier`, which held
   the dispatch apart too but, left between dispatches on the host side, ended the queue submission
   there: a K3 decode call became 22 submissions with their own transient allocations, and 35% of
   the call was the host waiting between them; README "Findings".)
2. The selected experts' bytes are read inside the contraction dispatch:
   - M = N*J > 1: `iree_linalg_ext.gather` of packed[experts[m]] -> [M, O, G, 16] i8. IREE fuses it into
     the consumer dispatch (no materialised copy) and vectorises it to one 16-byte load per block.
     (A `tensor.extract %packed[e, o, g, b]` inside the generic does *not* work: IREE's
     TransposeGenericOps makes the reduction dim g innermost, the tile's vector shape becomes
     1x16x1, and the MLIR vectoriser's contiguous-load test (trailing vector dim != 1) fails, so it
     emits a 16-element vector.gather = 16 vpinsrb per block.)
   - M == 1: a dynamic-offset tensor.extract_slice of packed at the one expert.
   The scale byte is a tensor.extract inside the body with indices that are invariant per vector
   (expert from tensor.extract %experts[m], o, g) -> a scalar load + broadcast.
3. Decode (integer-only, exact, DAZ-safe): the E2M1 code (s e1 e0 m) is placed as an f16,
   sign -> bit 15 and (e1 e0 m) -> bits 11..9, and converted with arith.extf (vcvtph2ps). That gives
   exactly v * 2^-14 for every code, the two e == 0 codes (0.5, and 0) landing on f16 subnormals /
   zero, which vcvtph2ps converts exactly (the local-task DAZ/FTZ mode applies to f32 inputs, not to
   the f16 source of a conversion). Code 8 -> -0.0. The bit building is done on i16 lanes (16 lanes
   = one ymm): about 9 ymm ops + 2 vcvtph2ps per 32 weights, versus ~16 zmm ops for the f32
   exponent-add decode of the notes.
4. Block scale: x is multiplied by 2^14 in the de-interleave pass (exact for |x| < 2^113), which
   cancels the 2^-14 of the decode, so every product x*v is at its true scale and the block partial
   P = xe.lo + xo.hi is multiplied by 2^(s-127) ("scale the block partial sum"): no exponent tricks
   whose range depends on s, no intermediate that under/overflows unless the true term does.
   2^(s-127) for s = 0..254 needs 255 exponents, one more than the normal f32 range (2^-127 is
   subnormal, and local-task's DAZ reads a subnormal multiplier as 0), so it is applied as g * f with
   f = 2^(max(s,1)-127) and g = (s == 0 ? 1/2 : 1), both built from the scale byte with integer
   shifts (no exp2).
   The last multiply is written `math.fma(P, f, -0.0)` (== P*f exactly) and then `arith.addf acc`:
   a plain mulf+addf would be turned into a vector.contract whose reduction dim is the unit g dim,
   which LLVM then scalarises into 16 vfmadd213ss per block.
5. b (the 16 bytes of a block) is a *parallel* vector lane: part[m, o, b] accumulates 16 lanes over g
   (one zmm accumulator, no horizontal reduction in the loop); a second small generic sums the 16
   lanes. The explicit lowering_config (distribution [.., dist_o, 16, 0], vector [.., 1, 16, 0],
   reduction [.., 0, 0, 1]) is what makes it fast (IREE's own choice is slower); it is only kept if
   the generic has no unit dims (FoldUnitExtentDims rebuilds the op and drops the attribute), hence
   the M == 1 specialisation without an m dim.

`batched_function` (prefill: row (m, e) goes through expert e) reads W[e] through an indexing map
and decodes each block once for `nt` rows of m (the decode is shared, the per-row work is 4 vector
ops per 32 weights).
"""

from __future__ import annotations

import math

from .kernels import render


def pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _compilation_info(dist, vec, red) -> str:
    return ("compilation_info = #iree_codegen.compilation_info<lowering_config = "
            f"#iree_cpu.lowering_config<distribution = {list(dist)}, vector_common_parallel = {list(vec)}, "
            f"vector_reduction = {list(red)}>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")


def _shape(*dims: int) -> str:
    return "x".join(str(d) for d in dims)


def _deinterleave(src: str, lead: list[int], G: int, names: list[str]) -> dict:
    """The arguments of the template macro `deinterleave`: %xe, %xo [lead, G, 16] from src [lead, 32G]."""
    L = len(lead)
    return dict(src=src, x_t=f"tensor<{_shape(*lead, 32 * G)}xf32>", xs=_shape(*lead, G, 16),
                xs5=_shape(*lead, G, 16, 2), d=", ".join(names + ["g", "b"]),
                assoc=", ".join(f"[{i}]" for i in range(L)) + (", " if L else "") + f"[{L}, {L + 1}, {L + 2}]",
                out_shape=", ".join(map(str, (*lead, G, 16, 2))), par=", ".join(['"parallel"'] * (L + 2)))


def _reflat(y: str, src: str, element: str, full: str, part: str) -> dict:
    """The arguments of the template macro `reflat`: %y = src from `full` to `part` through one flat dim."""
    return dict(y=y, src=src, element=element, full=full, part=part,
                total=math.prod(int(d) for d in full.split("x")))


def batched_function(name: str, M: int, E: int, K: int, O: int, nt: int = 8, ot: int = 2) -> str:
    """@name(x [M, E, K], packed, scales) -> [M, E, O], y[m, e] = x[m, e] @ W[e]^T (needs M > 1).
    nt, ot: rows of m / o per vector tile (the decoded block is shared by the nt rows)."""
    if K % 32 or M < 2:
        raise ValueError(f"batched_function needs K % 32 == 0 and M > 1, got K={K}, M={M}")
    N, J = M, E
    G, K2 = K // 32, K // 2
    nt, ot = min(nt, N), pow2_divisor(O, ot)
    dist_o = max(ot, pow2_divisor(O, 8))
    size = {"n": N, "j": J, "o": O, "g": G, "b": 16}

    def keep(v: str) -> bool:                  # unit dims are left out (IREE would drop the config)
        return (v != "j" or J > 1) and (v != "n" or N > 1)

    def sh(*names: str) -> str:
        return "x".join(str(size[v]) for v in names if keep(v))

    def ix(*names: str) -> str:
        return "(" + ", ".join(v for v in names if keep(v)) + ")"

    dims = [v for v in ["j", "o", "n", "b", "g"] if keep(v)]
    tile = {"j": (1, 1), "o": (dist_o, ot), "n": (nt, nt), "b": (16, 16), "g": (0, 0)}
    xnames = [v for v in ("n", "j") if keep(v)]
    lead = [size[v] for v in xnames]
    xlead = sh("n", "j") + "x" if lead else ""
    ys = sh("n", "j", "o")
    return render("mxfp4_cpu_batched.mlir", name=name, N=N, J=J, K=K, O=O, E=E, G=G, K2=K2,
                  D="(" + ", ".join(dims) + ")",
                  maps={"x": ix("n", "j", "g", "b"), "w": ix("j", "o", "g", "b"), "s": ix("j", "o", "g"),
                        "part": ix("j", "o", "n", "b")},
                  iterators=", ".join(['"parallel"'] * (len(dims) - 1) + ['"reduction"']),
                  info=_compilation_info([tile[v][0] for v in dims], [tile[v][1] for v in dims],
                                         [1 if v == "g" else 0 for v in dims]),
                  xs=sh("n", "j", "g", "b"), ws=sh("j", "o", "g", "b"), ss=sh("j", "o", "g"),
                  ps=sh("j", "o", "n", "b"), ys=ys, y_dims="(" + ", ".join(xnames + ["o", "b"]) + ")",
                  y_out="(" + ", ".join(xnames + ["o"]) + ")",
                  y_iterators=", ".join(['"parallel"'] * (len(xnames) + 1) + ['"reduction"']),
                  deinterleave=_deinterleave("%xm", lead, G, xnames),
                  reflat={"x": _reflat("xm", "%x", "f32", f"{N}x{J}x{K}", f"{xlead}{K}"),
                          "packed": _reflat("pk", "%packed", "i8", f"{E}x{O}x{K2}", sh("j", "o", "g", "b")),
                          "scales": _reflat("sc", "%scales", "i8", f"{E}x{O}x{G}", sh("j", "o", "g")),
                          "y": _reflat("y", "%ym", "f32", ys, f"{N}x{J}x{O}")})


def gathered_function(name: str, N: int, J: int, K: int, O: int, E: int) -> str:
    """@name(x [N, J, K], packed, scales, experts [N, J] i64) -> [N, J, O], y[n, j] = x[n, j] @ W[experts[n, j]]^T.

    Workgroups of 8 rows of O (or the largest power of two dividing O below 8). Not the bf16/FP8/INT4 decode
    kernels' whole streams (passes/block_scaled.py `stream_rows`): this kernel's integer decode (~16 ops a
    block) is compute-bound, and with them it ran no faster on x86 (alternating, J=4 K=2048 O=2048: 1.79
    -> 2.03 ms median; J=4 K=512 O=512 0.166 -> 0.171; J=1 K=2048 O=8192 1.59 -> 1.54)."""
    if K % 32:
        raise ValueError(f"K must be a multiple of 32, got {K}")
    G, K2, M = K // 32, K // 2, N * J
    dist_o = pow2_divisor(O, 8)
    single = M == 1
    mdim = [] if single else ["m"]
    info = _compilation_info([1] * len(mdim) + [dist_o, 16, 0], [1] * len(mdim) + [1, 16, 0],
                             [0] * len(mdim) + [0, 0, 1])
    return render("mxfp4_cpu_gathered.mlir", name=name, N=N, J=J, K=K, O=O, E=E, G=G, K2=K2, M=M, single=single,
                  info=info, deinterleave=_deinterleave("%xm", [] if single else [M], G, mdim))
