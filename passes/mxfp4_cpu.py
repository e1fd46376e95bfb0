"""The llvm-cpu lowering of the MXFP4 matmul units for CPUs without AVX-512F (passes/mxfp4.py picks
it for them; with AVX-512F the table-lookup dispatch of passes/mxfp4_avx512.py is 1.8x faster):

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
   strided/gathered activation loads and no repacking of the weights. A util.optimization_barrier
   keeps this copy in its own (tiny) dispatch; otherwise IREE fuses it into the consumer and the
   strided loads come back.
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


# Body of the contraction generic, shared by both layouts. Inputs: %xev, %xov (f32), %w8 (i8),
# %s (i32 scale byte), %acc. Defines %lo, %hi (decoded weights * 2^-14) and %f, %gf (block factors).
_DECODE = """
      %sh9 = arith.constant 9 : i16
      %sh12 = arith.constant 12 : i16
      %sh5 = arith.constant 5 : i16
      %sh8 = arith.constant 8 : i16
      %m0e00 = arith.constant 3584 : i16      // 0x0E00: f16 bits 11..9 <- e1 e0 m
      %m8000 = arith.constant -32768 : i16    // 0x8000: f16 sign
      %c23 = arith.constant 23 : i32
      %c1 = arith.constant 1 : i32
      %c126 = arith.constant 126 : i32
      // E2M1 -> f16 bits: value * 2^-14 exactly (e == 0 -> f16 subnormal / zero)
      %w16 = arith.extui %w8 : i8 to i16
      %la = arith.shli %w16, %sh9 : i16       // low nibble: bits 2..0 -> 11..9
      %la2 = arith.andi %la, %m0e00 : i16
      %lb = arith.shli %w16, %sh12 : i16      // low nibble sign: bit 3 -> 15
      %lb2 = arith.andi %lb, %m8000 : i16
      %lh = arith.ori %la2, %lb2 : i16
      %lhf = arith.bitcast %lh : i16 to f16
      %lo = arith.extf %lhf : f16 to f32
      %ha = arith.shli %w16, %sh5 : i16       // high nibble: bits 6..4 -> 11..9
      %ha2 = arith.andi %ha, %m0e00 : i16
      %hb = arith.shli %w16, %sh8 : i16       // high nibble sign: bit 7 -> 15
      %hb2 = arith.andi %hb, %m8000 : i16
      %hh = arith.ori %ha2, %hb2 : i16
      %hhf = arith.bitcast %hh : i16 to f16
      %hi = arith.extf %hhf : f16 to f32
      // block factor 2^(s-127) = g * f with f = 2^(max(s,1)-127), g = (s == 0 ? 1/2 : 1): both normal
      // f32 for every s in 0..254 (2^-127 alone is subnormal and DAZ would read it as 0), built as bits
      %s1 = arith.maxui %s, %c1 : i32
      %fb = arith.shli %s1, %c23 : i32
      %f = arith.bitcast %fb : i32 to f32
      %sl = arith.minui %s, %c1 : i32
      %sg = arith.addi %sl, %c126 : i32
      %gb = arith.shli %sg, %c23 : i32
      %gf = arith.bitcast %gb : i32 to f32
      %fnz = arith.constant -0.0 : f32"""


def _shape(*dims: int) -> str:
    return "x".join(str(d) for d in dims)


def _deinterleave(src: str, lead: list[int], G: int, names: list[str]) -> str:
    """%xe, %xo : tensor<lead x G x 16 x f32> from %src : tensor<lead x (32G) x f32>."""
    L = len(lead)
    xs = _shape(*lead, G, 16)
    xs5 = _shape(*lead, G, 16, 2)
    d = ", ".join(names + ["g", "b"])
    assoc = ", ".join(f"[{i}]" for i in range(L)) + (", " if L else "") + f"[{L}, {L + 1}, {L + 2}]"
    par = ", ".join(['"parallel"'] * (L + 2))
    return f"""
  // de-interleave x: xe[.., g, b] = x[.., 32g + 2b] * 2^14, xo[.., g, b] = x[.., 32g + 2b + 1] * 2^14
  %xr = tensor.expand_shape {src} [{assoc}] output_shape [{xs5.replace("x", ", ")}]
      : tensor<{_shape(*lead, 32 * G)}xf32> into tensor<{xs5}xf32>
  %xe0 = tensor.empty() : tensor<{xs}xf32>
  %xeo:2 = linalg.generic {{indexing_maps = [affine_map<({d}) -> ({d}, 0)>, affine_map<({d}) -> ({d}, 1)>,
                                            affine_map<({d}) -> ({d})>, affine_map<({d}) -> ({d})>],
                           iterator_types = [{par}]}}
      ins(%xr, %xr : tensor<{xs5}xf32>, tensor<{xs5}xf32>) outs(%xe0, %xe0 : tensor<{xs}xf32>, tensor<{xs}xf32>) {{
    ^bb0(%a: f32, %b: f32, %o1: f32, %o2: f32):
      // x * 2^14 (exact): cancels the 2^-14 of the f16 weight decode, so x * w is at its true scale
      %c2p14 = arith.constant 16384.0 : f32
      %as = arith.mulf %a, %c2p14 : f32
      %bs = arith.mulf %b, %c2p14 : f32
      linalg.yield %as, %bs : f32, f32
  }} -> (tensor<{xs}xf32>, tensor<{xs}xf32>)
  // keep the de-interleave in its own dispatch (fused, it would bring back strided x loads)
  %xe, %xo = util.optimization_barrier %xeo#0, %xeo#1 : tensor<{xs}xf32>, tensor<{xs}xf32>"""


def batched_function(name: str, M: int, E: int, K: int, O: int, nt: int = 8, ot: int = 2) -> str:
    """@name(x [M, E, K], packed, scales) -> [M, E, O], y[m, e] = x[m, e] @ W[e]^T (needs M > 1).
    nt, ot: rows of m / o per vector tile (the decoded block is shared by the nt rows)."""
    if K % 32 or M < 2:
        raise ValueError(f"batched_function needs K % 32 == 0 and M > 1, got K={K}, M={M}")
    return _iota_func(name, M, E, K, O, E, "i64", None, nt, ot)


def gathered_function(name: str, N: int, J: int, K: int, O: int, E: int, dist_o: int | None = None) -> str:
    """@name(x [N, J, K], packed, scales, experts [N, J] i64) -> [N, J, O], y[n, j] = x[n, j] @ W[experts[n, j]]^T.
    dist_o: rows of O per workgroup (default: 8, or the largest power of two dividing O below 8)."""
    if K % 32:
        raise ValueError(f"K must be a multiple of 32, got {K}")
    G, K2, M, it = K // 32, K // 2, N * J, "i64"
    dist_o = dist_o or pow2_divisor(O, 8)
    sig = (f"util.func private @{name}(%x: tensor<{N}x{J}x{K}xf32>, %packed: tensor<{E}x{O}x{K2}xi8>,\n"
           f"    %scales: tensor<{E}x{O}x{G}xi8>, %experts: tensor<{N}x{J}x{it}>) -> tensor<{N}x{J}x{O}xf32>")
    pk = f"""
  %pk = tensor.expand_shape %packed [[0], [1], [2, 3]] output_shape [{E}, {O}, {G}, 16]
      : tensor<{E}x{O}x{K2}xi8> into tensor<{E}x{O}x{G}x16xi8>"""
    if M == 1:
        # single row: no m dim at all (a unit dim would make IREE rebuild the op and drop the config)
        lead, mdim, rowsh = [], [], ""
        pre = f"""
  %c0 = arith.constant 0 : index
  %xm = tensor.collapse_shape %x [[0, 1, 2]] : tensor<{N}x{J}x{K}xf32> into tensor<{K}xf32>
  %ei0 = tensor.extract %experts[%c0, %c0] : tensor<{N}x{J}x{it}>
  %e0 = arith.index_cast %ei0 : {it} to index"""
        sel = f"""
  // the one selected expert: a dynamic-offset slice (only its bytes are read)
  %wsel = tensor.extract_slice %pk[%e0, 0, 0, 0] [1, {O}, {G}, 16] [1, 1, 1, 1]
      : tensor<{E}x{O}x{G}x16xi8> to tensor<{O}x{G}x16xi8>"""
        eread = f"""      %ei = tensor.extract %experts[%c0, %c0] : tensor<{N}x{J}x{it}>"""
        odim = 0
    else:
        lead, mdim, rowsh = [M], ["m"], f"{M}x"
        pre = f"""
  %xm = tensor.collapse_shape %x [[0, 1], [2]] : tensor<{N}x{J}x{K}xf32> into tensor<{M}x{K}xf32>
  %em = tensor.collapse_shape %experts [[0, 1]] : tensor<{N}x{J}x{it}> into tensor<{M}x{it}>"""
        sel = f"""
  // packed[experts[m]] -> [M, O, G, 16]; fused into the consumer dispatch, one 16-byte load per block
  %wsel0 = tensor.empty() : tensor<{M}x{O}x{G}x16xi8>
  %wsel = iree_linalg_ext.gather dimension_map = [0] ins(%pk, %em : tensor<{E}x{O}x{G}x16xi8>, tensor<{M}x{it}>)
      outs(%wsel0 : tensor<{M}x{O}x{G}x16xi8>) -> tensor<{M}x{O}x{G}x16xi8>"""
        eread = f"""      %mi = linalg.index 0 : index
      %ei = tensor.extract %em[%mi] : tensor<{M}x{it}>"""
        odim = 1
    d = ", ".join(mdim + ["o", "b", "g"])
    md = "".join(v + ", " for v in mdim)
    info = _compilation_info([1] * len(mdim) + [dist_o, 16, 0], [1] * len(mdim) + [1, 16, 0],
                             [0] * len(mdim) + [0, 0, 1])
    xs, ps, ys = f"{rowsh}{G}x16", f"{rowsh}{O}x16", f"{rowsh}{O}"
    yexpand = (f"[[0, 1, 2]] output_shape [{N}, {J}, {O}] : tensor<{O}xf32>" if M == 1 else
               f"[[0, 1], [2]] output_shape [{N}, {J}, {O}] : tensor<{M}x{O}xf32>")
    return f"""
{sig} {{
  %c0f = arith.constant 0.0 : f32{pre}{_deinterleave("%xm", lead, G, mdim)}{pk}{sel}
  %p0 = tensor.empty() : tensor<{ps}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{ps}xf32>) -> tensor<{ps}xf32>
  // stage 1: part[m, o, b] = sum_g blockfactor(s[e,o,g]) * (xe[m,g,b]*lo(w[m,o,g,b]) + xo[m,g,b]*hi(w[m,o,g,b]))
  // b is a parallel 16-lane vector, g the (scalar-loop) reduction
  %part = linalg.generic {{indexing_maps = [affine_map<({d}) -> ({md}g, b)>, affine_map<({d}) -> ({md}g, b)>,
                                          affine_map<({d}) -> ({md}o, g, b)>, affine_map<({d}) -> ({md}o, b)>],
                          iterator_types = [{", ".join(['"parallel"'] * (len(mdim) + 2))}, "reduction"],
                          {info}}}
      ins(%xe, %xo, %wsel : tensor<{xs}xf32>, tensor<{xs}xf32>, tensor<{rowsh}{O}x{G}x16xi8>)
      outs(%pz : tensor<{ps}xf32>) {{
    ^bb0(%xev: f32, %xov: f32, %w8: i8, %acc: f32):
{eread}
      %e = arith.index_cast %ei : {it} to index
      %o = linalg.index {odim} : index
      %g = linalg.index {odim + 2} : index
      %s8 = tensor.extract %scales[%e, %o, %g] : tensor<{E}x{O}x{G}xi8>
      %s = arith.extui %s8 : i8 to i32
{_DECODE}
      %p1 = arith.mulf %xev, %lo : f32
      %p2 = math.fma %xov, %hi, %p1 : f32
      %p2g = arith.mulf %p2, %gf : f32
      // == p2g * f; written as an fma so that the vectoriser does not build a vector.contract
      %p3 = math.fma %p2g, %f, %fnz : f32
      %r = arith.addf %p3, %acc : f32
      linalg.yield %r : f32
  }} -> tensor<{ps}xf32>
  // stage 2: y[m, o] = sum_b part[m, o, b]
  %y0 = tensor.empty() : tensor<{ys}xf32>
  %yz = linalg.fill ins(%c0f : f32) outs(%y0 : tensor<{ys}xf32>) -> tensor<{ys}xf32>
  %ym = linalg.generic {{indexing_maps = [affine_map<({md}o, b) -> ({md}o, b)>, affine_map<({md}o, b) -> ({md}o)>],
                       iterator_types = [{", ".join(['"parallel"'] * (len(mdim) + 1))}, "reduction"]}}
      ins(%part : tensor<{ps}xf32>) outs(%yz : tensor<{ys}xf32>) {{
    ^bb0(%a: f32, %acc: f32):
      %r = arith.addf %a, %acc : f32
      linalg.yield %r : f32
  }} -> tensor<{ys}xf32>
  %y = tensor.expand_shape %ym {yexpand} into tensor<{N}x{J}x{O}xf32>
  util.return %y : tensor<{N}x{J}x{O}xf32>
}}
"""


def _iota_func(name, N, J, K, O, E, it, dist_o, nt, ot) -> str:
    """Expert j for row (n, j): W[j] through indexing maps, decode shared by nt rows of n, ot rows of o
    per tile. The function takes no experts operand."""
    G, K2 = K // 32, K // 2
    nt, ot = min(nt, N), pow2_divisor(O, ot)
    dist_o = dist_o or max(ot, pow2_divisor(O, 8))
    hj, hn = J > 1, N > 1

    def keep(v):
        return (v != "j" or hj) and (v != "n" or hn)

    size = {"n": N, "j": J, "o": O, "g": G, "b": 16, "h": 2}

    def sh(*names):
        return "x".join(str(size[v]) for v in names if keep(v))

    def ix(*names):
        return "(" + ", ".join(v for v in names if keep(v)) + ")"

    dims = [v for v in ["j", "o", "n", "b", "g"] if keep(v)]
    D = "(" + ", ".join(dims) + ")"
    tile = {"j": (1, 1), "o": (dist_o, ot), "n": (nt, nt), "b": (16, 16), "g": (0, 0)}
    info = _compilation_info([tile[v][0] for v in dims], [tile[v][1] for v in dims],
                             [1 if v == "g" else 0 for v in dims])
    lead = [size[v] for v in ("n", "j") if keep(v)]
    xnames = [v for v in ("n", "j") if keep(v)]
    xs, ws, ss, ps, ys = sh("n", "j", "g", "b"), sh("j", "o", "g", "b"), sh("j", "o", "g"), sh("j", "o", "n", "b"), sh("n", "j", "o")
    nx = [v for v in ("n", "j") if keep(v)]
    yd = "(" + ", ".join(nx + ["o", "b"]) + ")"
    yo = "(" + ", ".join(nx + ["o"]) + ")"

    def flat(t, src, typ, full, part):
        """%t = src reshaped from `full` to `part` (both 'AxBxC' strings) through one flat dim."""
        n_part, n_full = len(part.split("x")), len(full.split("x"))
        total = math.prod(int(d) for d in full.split("x"))
        return (f"  %{t}0 = tensor.collapse_shape {src} [[{', '.join(str(i) for i in range(n_full))}]] "
                f": tensor<{full}x{typ}> into tensor<{total}x{typ}>\n"
                f"  %{t} = tensor.expand_shape %{t}0 [[{', '.join(str(i) for i in range(n_part))}]] "
                f"output_shape [{part.replace('x', ', ')}] : tensor<{total}x{typ}> into tensor<{part}x{typ}>\n")

    xlead = sh("n", "j") + "x" if lead else ""
    return f"""
util.func private @{name}(%x: tensor<{N}x{J}x{K}xf32>, %packed: tensor<{E}x{O}x{K2}xi8>,
    %scales: tensor<{E}x{O}x{G}xi8>) -> tensor<{N}x{J}x{O}xf32> {{
  %c0f = arith.constant 0.0 : f32
{flat("xm", "%x", "f32", f"{N}x{J}x{K}", f"{xlead}{K}")}{_deinterleave("%xm", lead, G, xnames)}
{flat("pk", "%packed", "i8", f"{E}x{O}x{K2}", ws)}{flat("sc", "%scales", "i8", f"{E}x{O}x{G}", ss)}
  %p0 = tensor.empty() : tensor<{ps}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{ps}xf32>) -> tensor<{ps}xf32>
  %part = linalg.generic {{indexing_maps = [affine_map<{D} -> {ix("n", "j", "g", "b")}>, affine_map<{D} -> {ix("n", "j", "g", "b")}>,
                                          affine_map<{D} -> {ix("j", "o", "g", "b")}>, affine_map<{D} -> {ix("j", "o", "g")}>,
                                          affine_map<{D} -> {ix("j", "o", "n", "b")}>],
                          iterator_types = [{", ".join(['"parallel"'] * (len(dims) - 1))}, "reduction"],
                          {info}}}
      ins(%xe, %xo, %pk, %sc : tensor<{xs}xf32>, tensor<{xs}xf32>, tensor<{ws}xi8>, tensor<{ss}xi8>)
      outs(%pz : tensor<{ps}xf32>) {{
    ^bb0(%xev: f32, %xov: f32, %w8: i8, %s8: i8, %acc: f32):
      %s = arith.extui %s8 : i8 to i32
{_DECODE}
      // g (1/2 or 1, exact) folded into the decoded weights once per block (shared by the nt rows);
      // f applied to each row's block partial
      %log = arith.mulf %lo, %gf : f32
      %hig = arith.mulf %hi, %gf : f32
      %p1 = arith.mulf %xev, %log : f32
      %p2 = math.fma %xov, %hig, %p1 : f32
      %p3 = math.fma %p2, %f, %fnz : f32
      %r = arith.addf %p3, %acc : f32
      linalg.yield %r : f32
  }} -> tensor<{ps}xf32>
  %ye = tensor.empty() : tensor<{ys}xf32>
  %yz = linalg.fill ins(%c0f : f32) outs(%ye : tensor<{ys}xf32>) -> tensor<{ys}xf32>
  %ym = linalg.generic {{indexing_maps = [affine_map<{yd} -> {ix("j", "o", "n", "b")}>, affine_map<{yd} -> {yo}>],
                       iterator_types = [{", ".join(['"parallel"'] * (len(nx) + 1))}, "reduction"]}}
      ins(%part : tensor<{ps}xf32>) outs(%yz : tensor<{ys}xf32>) {{
    ^bb0(%a: f32, %acc: f32):
      %r = arith.addf %a, %acc : f32
      linalg.yield %r : f32
  }} -> tensor<{ys}xf32>
{flat("y", "%ym", "f32", ys, f"{N}x{J}x{O}")}  util.return %y : tensor<{N}x{J}x{O}xf32>
}}
"""
