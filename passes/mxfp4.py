"""The MXFP4 lowerings of the weight-matmul units (passes/weights.py): `kimi::weight_expert_matmul` /
`kimi::weight_batched_matmul` with fmt "mxfp4" -> one contraction that reads the packed FP4 codes and
E8M0 scales directly, never a dequantised weight tensor.

The units' reference (frontend/mxfp4.py) dequantises the weights to f32 and then multiplies: IREE
materialises the wide matrix (IREE_NOTES §4, §9: 7 ms against 1 ms for an f32 matvec). Here the
weight bytes stay in the checkpoint's layout (code 2i in the low nibble of byte i, one scale per
32) and the activations are de-interleaved instead, x_even[g, b] = x[32g + 2b] and
x_odd[g, b] = x[32g + 2b + 1], so each byte b of block g meets two contiguous runs of x:

  y[n, j, o] = sum_g 2^(s[e, o, g] - 127) * sum_b (fp4(lo(w[e, o, g, b])) x_even[g, b] + fp4(hi(...)) x_odd[g, b])
  with e = experts[n, j] (decode: the selected experts only) or e = the row's group (batched)

FP4 E2M1 decodes with integer ops to the f32 bit pattern (no table to gather from): magnitude code
m = c & 7 is 0.5 * m for m < 2 and (1 + (m & 1) / 2) * 2^((m >> 1) - 1) otherwise, which is
f32 bits (252 + m) << 22, and (252 * m) << 22 for m < 2; the sign is bit 3. The block scale
multiplies the block's partial sum once (2^(s - 127) is f32 bits s << 23; s = 0 is the denormal
2^-127, which IREE's CPU runtime flushes to zero like every denormal: such a block contributes
below 1e-37). Summing a block before scaling reorders the f32 sums, as any compiler may.

Lowerings:
  llvm-cpu with   passes/mxfp4_avx512.py: a hand-written dispatch whose decode is a 16-entry register
  AVX-512F        table lookup (vpermd); runs of rows with one expert share each block's decode.
  llvm-cpu with   the same dispatch 8 wide: an 8-entry vpermps on the magnitude, the sign xor-ed in
  AVX2            (2.6x the linalg kernel on 128 grouped pairs, x86-64-v3, prototype timing).
  llvm-cpu        passes/mxfp4_cpu.py: the same math tuned for the CPU vectoriser (an f16-conversion
                  decode, the 16 bytes of a block as one vector lane with a two-stage reduction, an
                  explicit lowering_config, the selected experts read through iree_linalg_ext.gather).
  SPIR-V, CUDA,   the portable linalg.generic below: integer decode to f32 bits, f32 math, one
  ROCm            contraction over (block, byte) reading the packed bytes with tensor.extract; on
                  SPIR-V the i8 loads are emulated with 32-bit loads where the device lacks 8-bit
                  storage, and the scale bytes are read as 32-bit words (flow.tensor.bitcast, then
                  shift and mask): adreno failed to emulate the 4-byte vector load of scales.
                  (gfx950's scaled MFMA needs both operands in MX form: not used.)
"""

from __future__ import annotations

from dataclasses import dataclass

from iree.compiler import ir

from . import mxfp4_avx512, mxfp4_cpu
from .linalg_text import Generic, indent, tensor_type

BLOCK = 32
HALF = BLOCK // 2


def decode_lines(code: str, out: str) -> list[str]:
    """f32 value %out of the FP4 E2M1 code in the i32 %code (0..15), integer ops + one bitcast."""
    return [f"{out}_m = arith.andi {code}, %c7 : i32",
            f"{out}_small = arith.cmpi ult, {out}_m, %c2 : i32",
            f"{out}_subnormal = arith.muli {out}_m, %c252 : i32",
            f"{out}_normal = arith.addi {out}_m, %c252 : i32",
            f"{out}_field = arith.select {out}_small, {out}_subnormal, {out}_normal : i32",
            f"{out}_abs = arith.shli {out}_field, %c22 : i32",
            f"{out}_sign = arith.andi {code}, %c8 : i32",
            f"{out}_sign_bit = arith.shli {out}_sign, %c28 : i32",
            f"{out}_bits = arith.ori {out}_abs, {out}_sign_bit : i32",
            f"{out} = arith.bitcast {out}_bits : i32 to f32"]


def scale_lines(scale: str, out: str) -> list[str]:
    """f32 2^(s - 127) of the E8M0 byte value %scale (i32, 0..255)."""
    return [f"{out}_zero = arith.cmpi eq, {scale}, %c0 : i32",
            f"{out}_normal = arith.shli {scale}, %c23 : i32",
            f"{out}_bits = arith.select {out}_zero, %c_denormal, {out}_normal : i32",
            f"{out} = arith.bitcast {out}_bits : i32 to f32"]


CONSTANTS = ["%c0 = arith.constant 0 : i32", "%c2 = arith.constant 2 : i32", "%c4 = arith.constant 4 : i32",
             "%c7 = arith.constant 7 : i32", "%c8 = arith.constant 8 : i32", "%c15 = arith.constant 15 : i32",
             "%c22 = arith.constant 22 : i32", "%c23 = arith.constant 23 : i32", "%c28 = arith.constant 28 : i32",
             "%c252 = arith.constant 252 : i32", "%c_denormal = arith.constant 2097152 : i32"]


def expert_matmul_function(name: str, N: int, J: int, K: int, O: int, E: int, gathered: bool,
                           scale_words: bool = False) -> str:
    """util.func private @name(x [N, J, K], packed [E, O, K/2] i8, scales [E, O, K/32] i8[, experts [N, J] i64])
    -> [N, J, O]. gathered: row (n, j) uses expert experts[n, j]; else (batched, J == E) expert j.
    scale_words: read the scale bytes out of 32-bit words (see `implementation`)."""
    G = K // BLOCK
    x_t, xs_t = tensor_type((N, J, K), "f32"), tensor_type((N, J, G, HALF, 2), "f32")
    half_t = tensor_type((N, J, G, HALF), "f32")
    packed_t, scales_t = tensor_type((E, O, K // 2), "i8"), tensor_type((E, O, G), "i8")
    experts_t, y_t, part_t = tensor_type((N, J), "i64"), tensor_type((N, J, O), "f32"), tensor_type((N, J, O, G), "f32")
    L = list(CONSTANTS)
    # de-interleave x: the even and odd elements of each 32-block, as [N, J, G, 16] each
    L += [f"%x_pairs = tensor.expand_shape %x [[0], [1], [2, 3, 4]] output_shape [{N}, {J}, {G}, {HALF}, 2] : "
          f"{x_t} into {xs_t}"]
    for half, lane in (("%x_even", "0"), ("%x_odd", "1")):
        L += [f"{half}0 = tensor.empty() : {half_t}"]
        L += (Generic("n j g b".split()).input("%x_pairs", f"n j g b {lane}", xs_t).output(f"{half}0", "n j g b", half_t)
              .emit(half, ["%v: f32", "%o: f32"], [], ["%v"]))
    # part[n, j, o, g] = sum_b of the block's products, read straight from the packed bytes
    expert = (["%e64 = arith.index_cast %e_in : i64 to index"] if gathered else ["%e64 = linalg.index 1 : index"])
    ins_e = ("%experts", "n j", experts_t) if gathered else None
    g = Generic("n j o g b".split(), {"b"}).input("%x_even", "n j g b", half_t).input("%x_odd", "n j g b", half_t)
    args = ["%xe: f32", "%xo: f32"]
    if ins_e:
        g.input(*ins_e)
        args.append("%e_in: i64")
    L += ["%zero = arith.constant 0.0 : f32", f"%part_empty = tensor.empty() : {part_t}",
          f"%part0 = linalg.fill ins(%zero : f32) outs(%part_empty : {part_t}) -> {part_t}"]
    L += (g.output("%part0", "n j o g", part_t)
          .emit("%part", [*args, "%acc: f32"],
                [*expert, "%o = linalg.index 2 : index", "%g = linalg.index 3 : index", "%b = linalg.index 4 : index",
                 "%g16 = arith.muli %g, %c16_index : index", "%byte_index = arith.addi %g16, %b : index",
                 f"%byte = tensor.extract %packed[%e64, %o, %byte_index] : {packed_t}",
                 "%code = arith.extui %byte : i8 to i32",
                 "%lo_code = arith.andi %code, %c15 : i32", "%hi_code = arith.shrui %code, %c4 : i32",
                 *decode_lines("%lo_code", "%lo"), *decode_lines("%hi_code", "%hi"),
                 "%p_lo = arith.mulf %lo, %xe : f32", "%p_hi = arith.mulf %hi, %xo : f32",
                 "%p = arith.addf %p_lo, %p_hi : f32", "%a = arith.addf %acc, %p : f32"], ["%a"]))
    # y = sum_g scale * part
    g = Generic("n j o g".split(), {"g"}).input("%part", "n j o g", part_t)
    args = ["%pg: f32"]
    if ins_e:
        g.input(*ins_e)
        args.append("%e_in: i64")
    L += [f"%y_empty = tensor.empty() : {y_t}", f"%y0 = linalg.fill ins(%zero : f32) outs(%y_empty : {y_t}) -> {y_t}"]
    if scale_words:
        words_t = tensor_type((E * O * G // 4,), "i32")
        L += [f"%scale_words = flow.tensor.bitcast %scales : {scales_t} -> {words_t}"]
        read_scale = ["%eo = arith.muli %e64, %cO_index : index", "%eoo = arith.addi %eo, %o : index",
                      "%eog = arith.muli %eoo, %cG_index : index", "%flat = arith.addi %eog, %g : index",
                      "%word_index = arith.shrui %flat, %c2_index : index",
                      f"%word = tensor.extract %scale_words[%word_index] : {words_t}",
                      "%byte_in_word = arith.andi %flat, %c3_index : index",
                      "%byte_in_word32 = arith.index_cast %byte_in_word : index to i32",
                      "%shift = arith.shli %byte_in_word32, %c3 : i32",
                      "%shifted = arith.shrui %word, %shift : i32", "%sval = arith.andi %shifted, %c255 : i32"]
        L[:0] = [f"%cO_index = arith.constant {O} : index", f"%cG_index = arith.constant {G} : index",
                 "%c2_index = arith.constant 2 : index", "%c3_index = arith.constant 3 : index",
                 "%c3 = arith.constant 3 : i32", "%c255 = arith.constant 255 : i32"]
    else:
        read_scale = [f"%sbyte = tensor.extract %scales[%e64, %o, %g] : {scales_t}",
                      "%sval = arith.extui %sbyte : i8 to i32"]
    L += (g.output("%y0", "n j o", y_t)
          .emit("%y", [*args, "%acc: f32"],
                [*expert, "%o = linalg.index 2 : index", "%g = linalg.index 3 : index",
                 *read_scale, *scale_lines("%sval", "%scale"),
                 "%v = arith.mulf %pg, %scale : f32", "%a = arith.addf %acc, %v : f32"], ["%a"]))
    L += [f"util.return %y : {y_t}"]
    L.insert(0, "%c16_index = arith.constant 16 : index")
    params = f"%x: {x_t}, %packed: {packed_t}, %scales: {scales_t}" + (f", %experts: {experts_t}" if gathered else "")
    return f"util.func private @{name}({params}) -> {y_t} {{\n{indent(L)}\n}}\n"


@dataclass(frozen=True)
class Lowering:
    """How a target computes the MXFP4 units: the one decision both the implementation and the manifest
    read. kind: "avx512" (passes/mxfp4_avx512.py), "llvm-cpu" (passes/mxfp4_cpu.py) or "generic" (the
    portable linalg.generic above); scale_words: read scale bytes out of 32-bit words; note: for the
    manifest when the lowering is a target's fallback."""

    kind: str
    scale_words: bool = False
    note: str | None = None


CPU_NOTE = ("MXFP4 experts through the linalg kernel: the target CPU has no AVX-512F or AVX2 for the table-lookup "
            "dispatch")
SPIRV_NOTE = "MXFP4 experts decoded in-kernel with integer ops to f32 (SPIR-V has no FP4 type)"


def choose_lowering(backend: str, avx512: bool, gathered: bool = True, N: int = 1, E: int = 1, O: int = 1,
                    K: int = BLOCK, avx2: bool = False) -> Lowering:
    """The lowering of one MXFP4 unit ([N, J, K] rows, E experts of [O, K]) for `backend`."""
    if backend == "llvm-cpu" and avx512:
        return Lowering("avx512")
    if backend == "llvm-cpu" and avx2:
        return Lowering("avx2")
    if backend == "llvm-cpu":
        # a one-row batch has no rows to share a decode: the generic form is as good there
        return Lowering("llvm-cpu" if gathered or N > 1 else "generic", note=CPU_NOTE)
    if backend == "spirv":
        # IREE turns the byte read into a vectorised load of 4 x i8, which devices without 8-bit storage
        # (adreno, the baseline profile) cannot lower: read the scale bytes out of 32-bit words
        return Lowering("generic", scale_words=(E * O * (K // BLOCK)) % 4 == 0, note=SPIRV_NOTE)
    return Lowering("generic")              # CUDA, ROCm (gfx950's scaled MFMA needs both operands in MX form)


def implementation(name: str, N: int, J: int, K: int, O: int, E: int, gathered: bool, lowering: Lowering) -> str:
    """The unit's function for `lowering` (choose_lowering)."""
    if lowering.kind in ("avx512", "avx2"):
        return (mxfp4_avx512.gathered_function(name, N, J, K, O, E, lowering.kind) if gathered
                else mxfp4_avx512.batched_function(name, N, E, K, O, lowering.kind))
    if lowering.kind == "llvm-cpu":
        return (mxfp4_cpu.gathered_function(name, N, J, K, O, E) if gathered
                else mxfp4_cpu.batched_function(name, N, E, K, O))
    return expert_matmul_function(name, N, J, K, O, E, gathered, lowering.scale_words)
