"""The x86 AVX-512 lowering of the MXFP4 matmul units: a hand-written dispatch (passes/mxfp4.py picks it
for llvm-cpu targets whose CPU has AVX-512F; the others get passes/mxfp4_cpu.py's linalg kernels).

    y[r, o] = sum_k x[r, k] * W[experts[r], o, k]      (every unit is flattened to rows r)
    W[e, o, k] = e2m1(nibble(packed[e, o, k // 2], k % 2)) * 2^(scales[e, o, k // 32] - 127)

Why a hand-written dispatch: FP4 E2M1 has 16 codes, and AVX-512's `vpermd` looks up 16 f32 values
at once from a table held in one register, indexed by the low 4 bits of each 32-bit lane. No linalg
form makes IREE emit it (a `tensor.extract` from a 16-entry table becomes a memory gather), and the
integer decode of passes/mxfp4_cpu.py costs about 16 vector ops per 32 weights. Here a block of 32
weights (16 bytes) costs: one `vpmovzxbd` (bytes -> 32-bit lanes; lane b's low 4 bits are the low
nibble), one `vpsrld` (the high nibble), two `vpermd` (the f32 values), and per row a `vmulps`, a
`vfmadd` with the de-interleaved x (the low nibble of byte b is k = 32g + 2b, the high one k + 1:
x_even and x_odd are two contiguous 16-float runs) and a `vfmadd` with the block scale. The scale
2^(s - 127) is built as f32 bits (max(s, 1) << 23), a broadcast; s == 0 (2^-127, below the normal
range, which local-task's flush-to-zero mode would read as 0) takes a table holding the values / 2
with the factor 2^-126 instead, so every block is exact.

The dispatch is a `stream.executable` (IREE's samples/custom_dispatch form): scf loops and vector ops
on the bindings' memrefs, with the permute as `llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"`;
IREE lowers it with its usual LLVM CPU backend. Workgroups split the output rows o (`o_tile` each);
each walks the rows r in runs of one expert (the frontend sorts prefill's routed pairs by expert): a
run of `rows_per_decode` rows shares one decode of each weight block (4: at 16 rows of one expert, 8
rows per decode measured 4.1 ms against 1.5 ms, prototype timings), a shorter tail takes the rows
one at a time. Rows of different experts in any order are still correct, only slower.
"""

from __future__ import annotations

from .mxfp4_cpu import pow2_divisor

TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _vector(values: list[float]) -> str:
    return "dense<[" + ", ".join(repr(v) for v in values) + "]> : vector<16xf32>"


def _table(scale: float) -> str:
    """The 16 E2M1 values (times `scale`), code c at lane c: bit 3 is the sign."""
    return _vector([v * scale for v in TABLE] + [-v * scale for v in TABLE])


def _rows_body(n: int, K: int, O: int, E: int, R: int) -> str:
    """One run of `n` rows (%r .. %r + n - 1) through expert %e for the workgroup's output rows: each
    weight block is decoded once for the n rows. (Two output rows per step, sharing the x loads,
    measured no faster at 16 rows.)"""
    G, K2 = K // 32, K // 2
    accs = ", ".join(f"%a{i} = %zero" for i in range(n))
    acc_types = ", ".join(["vector<16xf32>"] * n)
    rows = "".join(f"""
              %row{i} = arith.addi %r, %c{i} : index
              %xe{i} = vector.load %xe[%row{i}, %g, %c0] : memref<{R}x{G}x16xf32>, vector<16xf32>
              %xo{i} = vector.load %xo[%row{i}, %g, %c0] : memref<{R}x{G}x16xf32>, vector<16xf32>
              %p{i} = arith.mulf %lo, %xe{i} : vector<16xf32>
              %q{i} = math.fma %hi, %xo{i}, %p{i} : vector<16xf32>
              %b{i} = math.fma %q{i}, %f, %a{i} : vector<16xf32>""" for i in range(n))
    stores = "".join(f"""
          %sum{i} = vector.reduction <add>, %acc#{i} : vector<16xf32> into f32
          %ro{i} = arith.addi %r, %c{i} : index
          memref.store %sum{i}, %y[%ro{i}, %o] : memref<{R}x{O}xf32>""" for i in range(n))
    yields = ", ".join(f"%b{i}" for i in range(n))
    return f"""
        scf.for %oi = %c0 to %c_otile step %c1 {{
          %o = arith.addi %o_base, %oi : index
          %acc:{n} = scf.for %g = %c0 to %c_g step %c1 iter_args({accs}) -> ({acc_types}) {{
              // block g of row o: 16 bytes -> 32-bit lanes (low nibble in bits 0..3), high nibble
              %g16 = arith.muli %g, %c16 : index
              %w = vector.load %pk[%e, %o, %g16] : memref<{E}x{O}x{K2}xi8>, vector<16xi8>
              %code_lo = arith.extui %w : vector<16xi8> to vector<16xi32>
              %code_hi = arith.shrui %code_lo, %four : vector<16xi32>
              // scale 2^(s-127) = f32 bits max(s,1) << 23, times the table's 1/2 when s == 0
              %s8 = memref.load %sc[%e, %o, %g] : memref<{E}x{O}x{G}xi8>
              %s = arith.extui %s8 : i8 to i32
              %s_zero = arith.cmpi eq, %s, %c0_i32 : i32
              %tab = arith.select %s_zero, %table_half, %table : vector<16xi32>
              %s1 = arith.maxui %s, %c1_i32 : i32
              %fbits = arith.shli %s1, %c23_i32 : i32
              %fs = arith.bitcast %fbits : i32 to f32
              %f = vector.broadcast %fs : f32 to vector<16xf32>
              // vpermd: lane b <- table[code_b & 15]
              %lo_bits = llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"(%tab, %code_lo) : (vector<16xi32>, vector<16xi32>) -> vector<16xi32>
              %hi_bits = llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"(%tab, %code_hi) : (vector<16xi32>, vector<16xi32>) -> vector<16xi32>
              %lo = arith.bitcast %lo_bits : vector<16xi32> to vector<16xf32>
              %hi = arith.bitcast %hi_bits : vector<16xi32> to vector<16xf32>{rows}
              scf.yield {yields} : {acc_types}
          }}{stores}
        }}"""


def rows_function(name: str, R: int, K: int, O: int, E: int, rows_per_decode: int = 4,
                  o_tile: int | None = None) -> str:
    """MLIR text: `stream.executable @{name}_dispatch` (its function also @{name}: IREE links the CPU
    executables of a module into one, where public names must be unique) and
    `util.func private @{name}(x [R, K] f32, packed [E, O, K/2] i8, scales [E, O, K/32] i8, experts [R] i64)
    -> [R, O] f32`, y[r] = x[r] @ W[experts[r]]^T."""
    if K % 32:
        raise ValueError(f"K must be a multiple of 32, got {K}")
    G, K2 = K // 32, K // 2
    o_tile = o_tile or pow2_divisor(O, 32)
    n = max(1, min(rows_per_decode, R))
    same = "\n".join(f"""          %rr{i} = arith.addi %r, %c{i} : index
          %id{i} = memref.load %ex[%rr{i}] : memref<{R}xi32>
          %eq{i} = arith.cmpi eq, %id{i}, %id0 : i32
          %all{i} = arith.andi %all{i - 1}, %eq{i} : i1""" for i in range(1, n))
    consts = "\n".join(f"        %c{i} = arith.constant {i} : index" for i in range(2, n))
    xt, pt, st, et, yt = (f"tensor<{R}x{K}xf32>", f"tensor<{E}x{O}x{K2}xi8>", f"tensor<{E}x{O}x{G}xi8>",
                          f"tensor<{R}xi64>", f"tensor<{R}x{O}xf32>")
    half_t, ids_t = f"tensor<{R}x{G}x16xf32>", f"tensor<{R}xi32>"
    return f"""
stream.executable private @{name}_dispatch {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %x = arith.constant {O // o_tile} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xe_b: !stream.binding, %xo_b: !stream.binding, %pk_b: !stream.binding, %sc_b: !stream.binding,
                    %ex_b: !stream.binding, %y_b: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{consts}
        %c16 = arith.constant 16 : index
        %c_n = arith.constant {n} : index
        %c_rows = arith.constant {R} : index
        %c_last = arith.constant {R - n} : index
        %c_otile = arith.constant {o_tile} : index
        %c_g = arith.constant {G} : index
        %c_last_expert = arith.constant {E - 1} : index
        %c0_i32 = arith.constant 0 : i32
        %c1_i32 = arith.constant 1 : i32
        %c23_i32 = arith.constant 23 : i32
        %four = arith.constant dense<4> : vector<16xi32>
        %zero = arith.constant dense<0.0> : vector<16xf32>
        %table_f = arith.constant {_table(1.0)}
        %table_half_f = arith.constant {_table(0.5)}
        %table = arith.bitcast %table_f : vector<16xf32> to vector<16xi32>
        %table_half = arith.bitcast %table_half_f : vector<16xf32> to vector<16xi32>
        %xe = stream.binding.subspan %xe_b[%c0] : !stream.binding -> memref<{R}x{G}x16xf32>
        %xo = stream.binding.subspan %xo_b[%c0] : !stream.binding -> memref<{R}x{G}x16xf32>
        %pk = stream.binding.subspan %pk_b[%c0] : !stream.binding -> memref<{E}x{O}x{K2}xi8>
        %sc = stream.binding.subspan %sc_b[%c0] : !stream.binding -> memref<{E}x{O}x{G}xi8>
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{R}xi32>
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{R}x{O}xf32>
        %wg = stream.dispatch.workgroup.id[0] : index
        %o_base = arith.muli %wg, %c_otile : index
        %end = scf.while (%r = %c0) : (index) -> index {{
          %more = arith.cmpi ult, %r, %c_rows : index
          scf.condition(%more) %r : index
        }} do {{
        ^bb0(%r: index):
          %id0 = memref.load %ex[%r] : memref<{R}xi32>
          // an id outside 0..E-1 (never from the router) reads the last expert, not out of bounds
          %id_index = arith.index_castui %id0 : i32 to index
          %fits = arith.cmpi ule, %r, %c_last : index
          %run = scf.if %fits -> (i1) {{
            %all0 = arith.constant true
{same}
            scf.yield %all{n - 1} : i1
          }} else {{
            %no = arith.constant false
            scf.yield %no : i1
          }}
          %next = scf.if %run -> (index) {{
            %e = arith.minui %id_index, %c_last_expert : index{_rows_body(n, K, O, E, R)}
            %rn = arith.addi %r, %c_n : index
            scf.yield %rn : index
          }} else {{
            %e = arith.minui %id_index, %c_last_expert : index{_rows_body(1, K, O, E, R)}
            %r1 = arith.addi %r, %c1 : index
            scf.yield %r1 : index
          }}
          scf.yield %next : index
        }}
        return
    }}
  }}
}}

util.func private @{name}(%x: {xt}, %packed: {pt}, %scales: {st}, %experts: {et}) -> {yt} {{
  // de-interleave x: x_even[r, g, b] = x[r, 32g + 2b], x_odd[r, g, b] = x[r, 32g + 2b + 1]
  %pairs = tensor.expand_shape %x [[0], [1, 2, 3]] output_shape [{R}, {G}, 16, 2] : {xt} into tensor<{R}x{G}x16x2xf32>
  %h0 = tensor.empty() : {half_t}
  %halves:2 = linalg.generic {{indexing_maps = [affine_map<(r, g, b) -> (r, g, b, 0)>, affine_map<(r, g, b) -> (r, g, b, 1)>,
                                              affine_map<(r, g, b) -> (r, g, b)>, affine_map<(r, g, b) -> (r, g, b)>],
                              iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%pairs, %pairs : tensor<{R}x{G}x16x2xf32>, tensor<{R}x{G}x16x2xf32>) outs(%h0, %h0 : {half_t}, {half_t}) {{
    ^bb0(%a: f32, %b: f32, %o1: f32, %o2: f32):
      linalg.yield %a, %b : f32, f32
  }} -> ({half_t}, {half_t})
  // the ids as i32 (the dispatch's interface must not change under --iree-input-demote-i64-to-i32)
  %ids0 = tensor.empty() : {ids_t}
  %ids = linalg.generic {{indexing_maps = [affine_map<(r) -> (r)>, affine_map<(r) -> (r)>], iterator_types = ["parallel"]}}
      ins(%experts : {et}) outs(%ids0 : {ids_t}) {{
    ^bb0(%e64: i64, %o: i32):
      %e32 = arith.trunci %e64 : i64 to i32
      linalg.yield %e32 : i32
  }} -> {ids_t}
  %y = flow.dispatch @{name}_dispatch::@{name}(%halves#0, %halves#1, %packed, %scales, %ids)
      : ({half_t}, {half_t}, {pt}, {st}, {ids_t}) -> {yt}
  util.return %y : {yt}
}}
"""


def gathered_function(name: str, N: int, J: int, K: int, O: int, E: int) -> str:
    """@name(x [N, J, K], packed, scales, experts [N, J] i64) -> [N, J, O]: row (n, j) through expert
    experts[n, j] (the unit kimi::mxfp4_expert_matmul), as N*J rows."""
    R = N * J
    xt, et, yt = f"tensor<{N}x{J}x{K}xf32>", f"tensor<{N}x{J}xi64>", f"tensor<{N}x{J}x{O}xf32>"
    pt, st = f"tensor<{E}x{O}x{K // 2}xi8>", f"tensor<{E}x{O}x{K // 32}xi8>"
    return rows_function(f"{name}_rows", R, K, O, E) + f"""
util.func private @{name}(%x: {xt}, %packed: {pt}, %scales: {st}, %experts: {et}) -> {yt} {{
  %xr = tensor.collapse_shape %x [[0, 1], [2]] : {xt} into tensor<{R}x{K}xf32>
  %er = tensor.collapse_shape %experts [[0, 1]] : {et} into tensor<{R}xi64>
  %yr = util.call @{name}_rows(%xr, %packed, %scales, %er)
      : (tensor<{R}x{K}xf32>, {pt}, {st}, tensor<{R}xi64>) -> tensor<{R}x{O}xf32>
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{N}, {J}, {O}] : tensor<{R}x{O}xf32> into {yt}
  util.return %y : {yt}
}}
"""


def batched_function(name: str, M: int, E: int, K: int, O: int) -> str:
    """@name(x [M, E, K], packed, scales) -> [M, E, O]: column e through expert e (the unit
    kimi::mxfp4_batched_matmul), as E runs of M rows (expert-major), each run sharing its decodes."""
    R = M * E
    xt, yt = f"tensor<{M}x{E}x{K}xf32>", f"tensor<{M}x{E}x{O}xf32>"
    pt, st = f"tensor<{E}x{O}x{K // 2}xi8>", f"tensor<{E}x{O}x{K // 32}xi8>"
    return rows_function(f"{name}_rows", R, K, O, E) + f"""
util.func private @{name}(%x: {xt}, %packed: {pt}, %scales: {st}) -> {yt} {{
  %xt0 = tensor.empty() : tensor<{E}x{M}x{K}xf32>
  %xt = linalg.transpose ins(%x : {xt}) outs(%xt0 : tensor<{E}x{M}x{K}xf32>) permutation = [1, 0, 2]
  %xr = tensor.collapse_shape %xt [[0, 1], [2]] : tensor<{E}x{M}x{K}xf32> into tensor<{R}x{K}xf32>
  %e0 = tensor.empty() : tensor<{R}xi64>
  %er = linalg.generic {{indexing_maps = [affine_map<(r) -> (r)>], iterator_types = ["parallel"]}}
      outs(%e0 : tensor<{R}xi64>) {{
    ^bb0(%out: i64):
      %r = linalg.index 0 : index
      %rows = arith.constant {M} : index
      %e = arith.divui %r, %rows : index
      %e64 = arith.index_cast %e : index to i64
      linalg.yield %e64 : i64
  }} -> tensor<{R}xi64>
  %yr = util.call @{name}_rows(%xr, %packed, %scales, %er)
      : (tensor<{R}x{K}xf32>, {pt}, {st}, tensor<{R}xi64>) -> tensor<{R}x{O}xf32>
  %ye = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{E}, {M}, {O}] : tensor<{R}x{O}xf32> into tensor<{E}x{M}x{O}xf32>
  %y0 = tensor.empty() : {yt}
  %y = linalg.transpose ins(%ye : tensor<{E}x{M}x{O}xf32>) outs(%y0 : {yt}) permutation = [1, 0, 2]
  util.return %y : {yt}
}}
"""
