"""FP8 and INT4 weight matmuls reading the published codes inside the contraction (frontend/formats.py
has the formats and the reference these must equal):

  y[n, j, o] = sum_k w(e, o, k) x[n, j, k],   e = experts[n, j] (gathered) or j (batched)
  fp8_e4m3_b128   w = e4m3(packed[e, o, k]) * scales[e, o / 128, k / 128]
  int4_g32        w = bf16_round((nibble(packed[e, o, k / 8], k % 8) - 8) * scales[e, o, k / 32])

Both decode with integer ops to the f32 bit pattern, so every target runs them (SPIR-V has no FP8 or
bf16 type; IREE's CPU backend vectorises the integer decode). The per-element scale and, for INT4,
the bf16 rounding keep the numbers exactly the reference's (no reassociation beyond the f32 sum).
bf16 scales arrive as bf16, or on SPIR-V as their bits: i16, or i32 words of two (exporter's
`bf16_as`); the scale read follows the operand type.
"""

from __future__ import annotations

from .kernels import render
from .linalg_text import Generic, indent, tensor_type
from .mxfp4_cpu import _compilation_info, pow2_divisor

# llvm-cpu: K in steps of `lanes` contiguous elements (a vector of the part generic): 16 FP8 bytes, or
# the 8 nibbles of one INT4 word
CPU_LANES = {"fp8_e4m3_b128": 16, "int4_g32": 8, "bf16": 16}
CPU_SCALES = {"fp8_e4m3_b128": "f32", "int4_g32": "bf16", "bf16": None}   # bf16: a plain weight, no scales
CODE_ELEMENT = {"fp8_e4m3_b128": "i8", "int4_g32": "i32", "bf16": "bf16"}

CONSTANTS = ["%c3 = arith.constant 3 : i32", "%c4 = arith.constant 4 : i32", "%c7 = arith.constant 7 : i32",
             "%c8 = arith.constant 8 : i32", "%c15 = arith.constant 15 : i32", "%c16 = arith.constant 16 : i32",
             "%c20 = arith.constant 20 : i32", "%c23 = arith.constant 23 : i32", "%c120 = arith.constant 120 : i32",
             "%c128 = arith.constant 128 : i32", "%c0x7fff = arith.constant 32767 : i32",
             "%c_high = arith.constant -65536 : i32", "%c1 = arith.constant 1 : i32",
             "%c_subnormal = arith.constant 0.001953125 : f32", "%c_nan = arith.constant 0x7FC00000 : f32",
             "%c_zero = arith.constant 0 : i32", "%c2_index = arith.constant 2 : index",
             "%c32_index = arith.constant 32 : index", "%c128_index = arith.constant 128 : index"]


def e4m3_lines(code: str, out: str) -> list[str]:
    """f32 %out of the E4M3FN code in the i32 %code (0..255): bias 7, subnormals m * 2^-9, S.1111.111 NaN."""
    return [f"{out}_e = arith.shrui {code}, %c3 : i32", f"{out}_e4 = arith.andi {out}_e, %c15 : i32",
            f"{out}_m = arith.andi {code}, %c7 : i32",
            f"{out}_exp = arith.addi {out}_e4, %c120 : i32", f"{out}_exp_bits = arith.shli {out}_exp, %c23 : i32",
            f"{out}_man_bits = arith.shli {out}_m, %c20 : i32",
            f"{out}_normal_bits = arith.ori {out}_exp_bits, {out}_man_bits : i32",
            f"{out}_normal = arith.bitcast {out}_normal_bits : i32 to f32",
            f"{out}_m_f = arith.sitofp {out}_m : i32 to f32",
            f"{out}_subnormal = arith.mulf {out}_m_f, %c_subnormal : f32",
            f"{out}_is_sub = arith.cmpi eq, {out}_e4, %c_zero : i32",
            f"{out}_mag0 = arith.select {out}_is_sub, {out}_subnormal, {out}_normal : f32",
            f"{out}_code7f = arith.andi {code}, %c127 : i32", f"{out}_is_nan = arith.cmpi eq, {out}_code7f, %c127 : i32",
            f"{out}_mag = arith.select {out}_is_nan, %c_nan, {out}_mag0 : f32",
            f"{out}_neg = arith.negf {out}_mag : f32", f"{out}_sign = arith.andi {code}, %c128 : i32",
            f"{out}_is_neg = arith.cmpi ne, {out}_sign, %c_zero : i32",
            f"{out} = arith.select {out}_is_neg, {out}_neg, {out}_mag : f32"]


def bf16_round_lines(value: str, out: str) -> list[str]:
    """f32 %out = %value rounded to the nearest bf16 (ties to even), integer ops."""
    return [f"{out}_bits = arith.bitcast {value} : f32 to i32", f"{out}_lsb0 = arith.shrui {out}_bits, %c16 : i32",
            f"{out}_lsb = arith.andi {out}_lsb0, %c1 : i32", f"{out}_bias = arith.addi {out}_lsb, %c0x7fff : i32",
            f"{out}_sum = arith.addi {out}_bits, {out}_bias : i32",
            f"{out}_rounded = arith.andi {out}_sum, %c_high : i32",
            f"{out} = arith.bitcast {out}_rounded : i32 to f32"]


def scale_lines(scales: str, scales_t: str, element: str, index: list[str], out: str) -> list[str]:
    """f32 %out = scales[index] for a scale tensor of `element` f32 | bf16 | i16 (bf16 bits) | i32 (two
    bf16 bits a word along the last dim)."""
    where = ", ".join(index)
    if element == "f32":
        return [f"{out} = tensor.extract {scales}[{where}] : {scales_t}"]
    if element == "bf16":
        return [f"{out}_b = tensor.extract {scales}[{where}] : {scales_t}", f"{out} = arith.extf {out}_b : bf16 to f32"]
    if element == "i16":
        return [f"{out}_h = tensor.extract {scales}[{where}] : {scales_t}",
                f"{out}_w = arith.extui {out}_h : i16 to i32", f"{out}_bits = arith.shli {out}_w, %c16 : i32",
                f"{out} = arith.bitcast {out}_bits : i32 to f32"]
    *lead, last = index
    return [f"{out}_word_index = arith.divui {last}, %c2_index : index",
            f"{out}_odd_index = arith.remui {last}, %c2_index : index",
            f"{out}_word = tensor.extract {scales}[{', '.join([*lead, f'{out}_word_index'])}] : {scales_t}",
            f"{out}_low = arith.shli {out}_word, %c16 : i32", f"{out}_high = arith.andi {out}_word, %c_high : i32",
            f"{out}_odd = arith.cmpi ne, {out}_odd_index, %c0_index : index",
            f"{out}_bits = arith.select {out}_odd, {out}_high, {out}_low : i32",
            f"{out} = arith.bitcast {out}_bits : i32 to f32"]


def chunk_lanes(fmt: str, K: int) -> int:
    """Elements of k one partial sum of `matmul_function` takes: an INT4 word's 8 nibbles, else up to 16
    FP8 / bf16 codes (K's largest power-of-two divisor up to 16)."""
    return 8 if fmt == "int4_g32" else pow2_divisor(K, 16)


def matmul_function(name: str, fmt: str, N: int, J: int, K: int, O: int, E: int, gathered: bool,
                    packed_shape: tuple[int, ...], scales_shape: tuple[int, ...], scales_element: str) -> str:
    """util.func private @name(x [N, J, K], packed, scales[, experts [N, J] i64]) -> [N, J, O] for `fmt`
    (fp8_e4m3_b128, int4_g32 or bf16), in two generics as the MXFP4 form (passes/mxfp4.py):
    part[n, j, o, c] sums the `chunk_lanes` products of k = c * lanes + l, read and decoded from the codes;
    y sums the parts. One generic reducing all of K with the codes read in its body failed CUDA's and
    ROCm's reduction distribution from K = 128 ("failed to distribute"); a short inner reduction is what
    their pipelines distribute, and the outer sum is a plain reduction of operands."""
    lanes = chunk_lanes(fmt, K)
    Kp = -(-K // lanes) * lanes                     # INT4 rows are whole words: K padded to them
    C = Kp // lanes
    x_t, y_t, experts_t = tensor_type((N, J, K), "f32"), tensor_type((N, J, O), "f32"), tensor_type((N, J), "i64")
    xp_t, xc_t = tensor_type((N, J, Kp), "f32"), tensor_type((N, J, C, lanes), "f32")
    part_t = tensor_type((N, J, O, C), "f32")
    packed_t = tensor_type(packed_shape, CODE_ELEMENT[fmt])
    scales_t = tensor_type(scales_shape, scales_element) if fmt != "bf16" else None
    L = [*CONSTANTS, "%c2 = arith.constant 2 : i32", "%c127 = arith.constant 127 : i32",
         "%c0_index = arith.constant 0 : index", f"%c_lanes = arith.constant {lanes} : index",
         "%zero = arith.constant 0.0 : f32"]
    x = "%x"
    if Kp != K:                                     # zeros past K: the padded nibbles' products vanish
        L += [f"%x_padded = tensor.pad %x low[0, 0, 0] high[0, 0, {Kp - K}] {{",
              "^bb0(%i0: index, %i1: index, %i2: index):", "  tensor.yield %zero : f32", f"}} : {x_t} to {xp_t}"]
        x = "%x_padded"
    L += [f"%x_chunks = tensor.expand_shape {x} [[0], [1], [2, 3]] output_shape [{N}, {J}, {C}, {lanes}] : "
          f"{xp_t} into {xc_t}"]
    g = Generic("n j o c l".split(), {"l"}).input("%x_chunks", "n j c l", xc_t)
    args = ["%xv: f32"]
    if gathered:
        g.input("%experts", "n j", experts_t)
        args.append("%e_in: i64")
    expert = ["%e = arith.index_cast %e_in : i64 to index"] if gathered else ["%e = linalg.index 1 : index"]
    body = [*expert, "%o = linalg.index 2 : index", "%c = linalg.index 3 : index", "%l = linalg.index 4 : index",
            "%c_k = arith.muli %c, %c_lanes : index", "%k = arith.addi %c_k, %l : index"]
    if fmt == "fp8_e4m3_b128":
        body += ["%byte = tensor.extract %packed[%e, %o, %k] : " + packed_t,
                 "%code = arith.extui %byte : i8 to i32", *e4m3_lines("%code", "%value"),
                 "%o_block = arith.divui %o, %c128_index : index", "%k_block = arith.divui %k, %c128_index : index",
                 *scale_lines("%scales", scales_t, scales_element, ["%e", "%o_block", "%k_block"], "%scale"),
                 "%w = arith.mulf %value, %scale : f32"]
    elif fmt == "int4_g32":
        body += [f"%word = tensor.extract %packed[%e, %o, %c] : {packed_t}",
                 "%nibble32 = arith.index_cast %l : index to i32",
                 "%shift = arith.shli %nibble32, %c2 : i32", "%shifted = arith.shrui %word, %shift : i32",
                 "%u = arith.andi %shifted, %c15 : i32", "%q = arith.subi %u, %c8 : i32",
                 "%q_f = arith.sitofp %q : i32 to f32", "%group = arith.divui %k, %c32_index : index",
                 *scale_lines("%scales", scales_t, scales_element, ["%e", "%o", "%group"], "%scale"),
                 "%product = arith.mulf %q_f, %scale : f32", *bf16_round_lines("%product", "%w")]
    elif fmt == "bf16":
        body += [f"%code = tensor.extract %packed[%e, %o, %k] : {packed_t}", "%w = arith.extf %code : bf16 to f32"]
    else:
        raise ValueError(f"no FP8/INT4 kernel for format {fmt!r}")
    body += ["%p = arith.mulf %w, %xv : f32", "%a = arith.addf %acc, %p : f32"]
    L += [f"%part_empty = tensor.empty() : {part_t}",
          f"%part0 = linalg.fill ins(%zero : f32) outs(%part_empty : {part_t}) -> {part_t}"]
    L += g.output("%part0", "n j o c", part_t).emit("%part", [*args, "%acc: f32"], body, ["%a"])
    L += [f"%y_empty = tensor.empty() : {y_t}", f"%y0 = linalg.fill ins(%zero : f32) outs(%y_empty : {y_t}) -> {y_t}"]
    L += (Generic("n j o c".split(), {"c"}).input("%part", "n j o c", part_t).output("%y0", "n j o", y_t)
          .emit("%y", ["%pv: f32", "%acc: f32"], ["%s = arith.addf %acc, %pv : f32"], ["%s"]))
    L += [f"util.return %y : {y_t}"]
    params = (f"%x: {x_t}, %packed: {packed_t}" + (f", %scales: {scales_t}" if scales_t else "")
              + (f", %experts: {experts_t}" if gathered else ""))
    return f"util.func private @{name}({params}) -> {y_t} {{\n{indent(L)}\n}}\n"


def cpu_kernel_applies(fmt: str, N: int, J: int, K: int, E: int, gathered: bool, scales_element: str) -> bool:
    """Whether `cpu_function` has a form for this unit: K in whole lanes and scales in their published
    type (the batched unit's one row through several experts has none). Otherwise the generic
    `matmul_function` (same numbers)."""
    if fmt not in CPU_LANES or K % CPU_LANES[fmt] or (fmt != "bf16" and scales_element != CPU_SCALES[fmt]):
        return False
    return gathered or N > 1 or (J == 1 and E == 1)


# A decode unit (a few rows through a weight) streams its weight once: a memory-bound read whose speed
# depends on how long each worker's run of consecutive bytes is. IREE's local-task hands a worker 8
# consecutive workgroups at a time once a dispatch has 8 a worker, else 1 (iree/task/tuning.h,
# IREE_TASK_DISPATCH_MAX_TILES_PER_SHARD_RESERVATION). With 8-row workgroups two workers took turns
# every 64 rows (128 KB at K = 1024), too short a stream for the hardware prefetcher: a C matvec read
# 17 GB/s in 8-row turns against 24 GB/s in halves (2 cores of an Intel Xeon VM with AVX-512). So a
# workgroup takes up to 256 rows and a dispatch has a multiple of 16 workgroups: 2 workers split the
# reservations evenly (24 workgroups gave one worker 16: the 3072-row projection 1.04 -> 1.40 ms), 16
# workers get one each.
STREAM_WORKGROUPS, STREAM_ROWS = 16, (8, 256)


def stream_rows(M: int, O: int) -> int:
    """Rows of o a decode workgroup takes (the M rows of x are split one a workgroup): the fewest
    workgroups, a multiple of 16, whose rows divide O and number 8 to 256; else O's largest
    power-of-two divisor up to 8 (the earlier rule)."""
    lo, hi = STREAM_ROWS
    for tiles in range(-(-STREAM_WORKGROUPS // M), O // lo + 1):       # workgroups an x row
        if (M * tiles) % STREAM_WORKGROUPS == 0 and O % tiles == 0 and O // tiles <= hi:
            return O // tiles
    return pow2_divisor(O, lo)


def cpu_function(name: str, fmt: str, N: int, J: int, K: int, O: int, E: int, gathered: bool,
                 packed_shape: tuple[int, ...], scales_shape: tuple[int, ...], avx512: bool = False) -> str:
    """@name(x [N, J, K], packed, scales[, experts]) -> [N, J, O] for llvm-cpu (passes/kernels/block_scaled_cpu.mlir).

    The shape of passes/mxfp4_cpu.py's kernel, for the same reasons: the weight codes are an input
    operand (a dynamic-offset slice at one expert, or iree_linalg_ext.gather of the selected experts,
    fused into the dispatch), K runs in steps of `lanes` contiguous elements that are a *parallel* vector
    lane of part[m, o, b] (no horizontal reduction in the loop), a second generic sums the lanes, and an
    explicit lowering_config tiles it. FP8 decodes through f16 (the code's 7 low bits placed in an f16
    are the E4M3 value * 2^-8, vcvtph2ps converts them) and the 2^8 goes into the block scale: each
    weight is v * s rounded once, as the reference computes it, for every scale below 2^120 (a
    scale_inv that large would describe weights beyond bf16's range). INT4 is the reference's integer
    unpack and bf16 rounding, 8 nibbles of a word as the 8 lanes. `avx512`: the target CPU has AVX-512F
    (the bf16 prefill tile depends on its 32 registers of 16 floats)."""
    if not cpu_kernel_applies(fmt, N, J, K, E, gathered, CPU_SCALES[fmt]):
        raise ValueError(f"no llvm-cpu {fmt} kernel for N={N} J={J} K={K} E={E} gathered={gathered}")
    lanes = CPU_LANES[fmt]
    batched = not gathered and N > 1
    if batched and fmt == "bf16" and not avx512:
        lanes = 8                    # one AVX2 / NEON register of floats
    packed_el = CODE_ELEMENT[fmt]
    common = dict(name=name, fmt=fmt, N=N, J=J, K=K, O=O, E=E, G=K // lanes, lanes=lanes,
                  packed_t=tensor_type(packed_shape, packed_el), packed_el=packed_el,
                  scales_t=tensor_type(scales_shape, CPU_SCALES[fmt]) if CPU_SCALES[fmt] else None)
    if batched:
        # dims [j,] o, n, b, g: a vector tile of ot rows of o x nt rows of n x the lanes shares each decode
        nt, ot = min(8, N), pow2_divisor(O, 2)
        dist_o = max(ot, pow2_divisor(O, 8))
        if fmt == "bf16":
            # Measured on 32-row blocks (1024 x 1024, 3072 x 768, 512 x 1024, alternating): with AVX-512
            # 4 x 4 rows matched or beat 2 x 8 (92-102 against 46-97 GFLOP/s); on AVX2's 16 registers
            # the 2 x 8 x 16 tile spilled (19-55 GFLOP/s), 1 x 4 rows of 8 lanes ran 48-95.
            nt = min(4, N)
            ot = pow2_divisor(O, 4) if avx512 else 1
            dist_o = max(ot, pow2_divisor(O, 8 if avx512 else 16))
        j = [1] if J > 1 else []
        info = _compilation_info([*j, dist_o, nt, lanes, 0], [*j, ot, nt, lanes, 0], [*[0] * len(j), 0, 0, 0, 1])
        return render("block_scaled_cpu_batched.mlir", info=info, **common)
    M = N * J
    m = [] if M == 1 else [1]
    info = _compilation_info([*m, stream_rows(M, O), lanes, 0], [*m, 1, lanes, 0], [*[0] * len(m), 0, 0, 1])
    return render("block_scaled_cpu.mlir", M=M, single=M == 1, expert0=not gathered, info=info, **common)
