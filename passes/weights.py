"""The weight-matmul pass: every `kimi::weight_expert_matmul` / `kimi::weight_batched_matmul` unit
(frontend/units.py) -> a contraction that reads its block-scaled codes and scales as published, never a
dequantised weight tensor. The unit's last operand names the format (frontend/formats.py):

  mxfp4           passes/mxfp4.py `choose_lowering`: the AVX-512 dispatch, the CPU linalg kernels or
                  the portable generic, by target
  fp8_e4m3_b128   passes/block_scaled.py: integer E4M3 decode, the block scale per element
  int4_g32        passes/block_scaled.py: nibble unpack, the group scale, bf16 rounding
                  (both on x86, the rows of a decode step, a prefill's pairs and per-head blocks:
                  passes/kernels/block_scaled_x86_rows.mlir, `x86_rows_function`)

`kimi::dense_batched_matmul` / `kimi::dense_expert_matmul` (bf16 linear layers, lm_head and float
experts, emitted for llvm-cpu only: IREE's own matvec of a widened bf16 weight ran at half the speed of
an f32 one, and a prefill block materialised the whole widened weight) take the same CPU kernels with
the bf16 bits as their codes.

`kimi::per_head_matmul` (MLA's absorbed projections on a block of tokens, llvm-cpu only) becomes IREE's
packed matmul form written out (passes/kernels/per_head_mmt4d.mlir): left to IREE, the [T, H, O, K]
contraction of an f32 copy of the weight ran at ~25 GFLOP/s; packed, the batch_mmt4d runs at the f32 peak.

A unit whose operands do not have the format's shapes and types is an error naming it (the driver
then compiles the unit's reference form instead: a wrong number is never the fallback).
"""

from __future__ import annotations

from iree.compiler import ir

from . import block_scaled, mxfp4
from .kernels import kernel_name, render
from .mxfp4_avx512 import ROWS_PER_DECODE
from .mxfp4_cpu import pow2_divisor
from .rewrite import FunctionTable, PassError, find_units, replace_with_call, string_value, tensor_arg

UNITS = (("weight_expert_matmul", True), ("weight_batched_matmul", False))
# the scale element types each format's kernels read (bf16 may arrive as its bits on SPIR-V)
SCALE_TYPES = {"mxfp4": ("ui8",), "fp8_e4m3_b128": ("f32",), "int4_g32": ("bf16", "si16", "si32")}
CODE_TYPES = {"mxfp4": "ui8", "fp8_e4m3_b128": "ui8", "int4_g32": "si32"}


def _expected_shapes(fmt: str, E: int, O: int, K: int, scales_words: bool) -> tuple[tuple, tuple]:
    ceil = lambda a, b: -(-a // b)
    if fmt == "mxfp4":
        return (E, O, K // 2), (E, O, K // mxfp4.BLOCK)
    if fmt == "fp8_e4m3_b128":
        return (E, O, K), (E, ceil(O, 128), ceil(K, 128))
    groups = ceil(K, 32)
    return (E, O, ceil(K, 8)), (E, O, groups // 2 if scales_words else groups)


def rewrite_weight_matmul(module: ir.Module, backend: str = "llvm-cpu", avx512: bool = False,
                          avx2: bool = False) -> tuple[int, list[str]]:
    """Rewrite every weight-matmul unit in `module` for `backend` (`avx512`, `avx2`: an llvm-cpu target
    with AVX-512F, AVX2); returns how many, and the manifest notes of the lowerings used."""
    table = FunctionTable(module)
    count, notes = 0, []
    for unit, gathered in UNITS:
        for op in find_units(module, unit):
            operands = list(op.operands)
            fmt = string_value(operands[-1]) if operands else None
            tensors = operands[:-1]
            args = [tensor_arg(v.type) for v in tensors]
            result = tensor_arg(op.results[0].type)
            if fmt not in SCALE_TYPES or len(args) != (4 if gathered else 3) or None in args or result is None:
                raise PassError(f"{unit}: expected static tensor operands and a format of "
                                f"{', '.join(SCALE_TYPES)} ({op.location})")
            x, packed, scales = args[:3]
            N, J, K = x.shape
            E, O = packed.shape[:2]
            words = fmt == "int4_g32" and scales.dtype == "si32"
            want_packed, want_scales = _expected_shapes(fmt, E, O, K, words)
            if (x.dtype != "f32" or packed.dtype != CODE_TYPES[fmt] or scales.dtype not in SCALE_TYPES[fmt]
                    or packed.shape != want_packed or scales.shape != want_scales
                    or (fmt == "mxfp4" and K % mxfp4.BLOCK) or (gathered and args[3].shape != (N, J))
                    or (not gathered and J != E)):
                raise PassError(f"{unit} ({fmt}): unexpected operand types {[a.builtin for a in args]}")
            form = "gathered" if gathered else "batched"
            if fmt == "mxfp4":
                lowering = mxfp4.choose_lowering(backend, avx512, gathered, N, E, O, K, avx2=avx2)
                if lowering.note and lowering.note not in notes:
                    notes.append(lowering.note)
                name = kernel_name(f"mxfp4_{lowering.kind.replace('-', '_')}_{form}", N=N, J=J, K=K, O=O, E=E)
                build = lambda n, lw=lowering: mxfp4.implementation(n, N, J, K, O, E, gathered, lw)
                key = ("mxfp4", N, J, K, O, E, gathered, lowering)
            else:
                element = {"f32": "f32", "bf16": "bf16", "si16": "i16", "si32": "i32"}[scales.dtype]
                if backend == "llvm-cpu" and x86_rows_applies(fmt, N, J, K, E, gathered, element, avx512, avx2):
                    kind = {"fp8_e4m3_b128": "fp8", "int4_g32": "int4"}[fmt]
                    name = kernel_name(f"{kind}_x86_rows" + ("" if avx512 else "_avx2"), R=N * J, K=K, O=O, E=E)
                    build = lambda n, f=fmt: x86_rows_function(n, f, N, J, K, O, E, gathered, avx512)
                elif backend == "llvm-cpu" and block_scaled.cpu_kernel_applies(fmt, N, J, K, E, gathered, element):
                    name = kernel_name(f"{fmt}_cpu_{form}", N=N, J=J, K=K, O=O, E=E)
                    build = lambda n, f=fmt, ps=packed.shape, ss=scales.shape: block_scaled.cpu_function(
                        n, f, N, J, K, O, E, gathered, ps, ss)
                else:
                    name = kernel_name(f"{fmt}_{form}", N=N, J=J, K=K, O=O, E=E)
                    build = lambda n, f=fmt, el=element, ps=packed.shape, ss=scales.shape: block_scaled.matmul_function(
                        n, f, N, J, K, O, E, gathered, ps, ss, el)
                key = (fmt, N, J, K, O, E, gathered, scales.dtype, name)
            symbol = table.get(key, name, build)
            replace_with_call(op, tensors, symbol, result)
            count += 1
    return count, notes


# rows x outputs of the dense block dispatch's register tile: nt*ot sums + ot weight + nt row vectors
# within AVX-512's 32 registers, AVX2's 16
DENSE_BLOCK_TILES = {True: (4, 4), False: (2, 4)}
# a decode row's sums over alternate vectors of K: AVX2's 8 lanes need two for the stream to keep up (the
# 32768 x 1024 head 1.56 against the linalg kernel's 1.76 ms; one sum 2.47 against 2.35), AVX-512's one
# (two measured the same)
DECODE_CHAINS = {True: 1, False: 2}


def x86_width(avx512: bool) -> int:
    """f32 lanes a vector register: AVX-512's 16, AVX2's 8."""
    return 16 if avx512 else 8


def dense_block_tile(N: int, avx512: bool) -> tuple[int, int]:
    """The block dispatch's rows x outputs tile. A decode row (N = 1) streams its weight once, one output
    row at a time, as the linalg kernel's loop does (a 1 x 4 tile's four interleaved rows read slower:
    the 32768 x 1024 head 2.10 against 1.83 ms); its lanes are summed in the dispatch (the template's
    `decode_row`, DECODE_CHAINS sums), where the linalg kernel wrote them out for a second dispatch (some
    100 of a K3 decode step's ~500)."""
    return (1, 1) if N == 1 else DENSE_BLOCK_TILES[avx512]


def dense_rows_applies(N: int, J: int, K: int, E: int, gathered: bool, avx512: bool, avx2: bool) -> bool:
    """Whether a bf16 expert unit takes the x86 routed-pairs dispatch: more rows than experts (a
    prefill's pairs, grouped by expert, have runs to share; a decode step's k pairs and the per-head
    projections, one row an expert, take `dense_pairs_applies`' decode rows)."""
    return gathered and (avx512 or avx2) and N * J > E and K % 16 == 0


def dense_pairs_applies(N: int, J: int, K: int, O: int, E: int, gathered: bool, avx512: bool, avx2: bool) -> bool:
    """Whether a bf16 expert unit takes the x86 decode-pairs dispatch: one token's rows, no two sharing an
    expert to be worth a run (a decode step's k routed pairs, MLA's per-head projections of one token),
    each streamed as a decode row through its own expert's weight (`dense_pairs_function`)."""
    return (gathered and N == 1 and (avx512 or avx2) and not dense_rows_applies(N, J, K, E, gathered, avx512, avx2)
            and K % x86_width(avx512) == 0)


def dense_dot(K: int, avx512: bool, bf16_dot: bool) -> str:
    """How an x86 bf16 dispatch multiplies: "f32" (the weights widened, exact), or "bf16" where asked
    (kimi-compile --bf16-activations: the rows rounded to bf16, AVX512-BF16 dot products, bf16_tile.mlir)
    and K holds whole pairs of vectors."""
    return "bf16" if bf16_dot and avx512 and K % 32 == 0 else "f32"


def dense_rows_function(name: str, N: int, J: int, K: int, O: int, E: int, avx512: bool, dot: str = "f32") -> str:
    """@name(x [N, J, K], weight [E, O, K] bf16, experts [N, J]) -> [N, J, O]: the N*J rows through their
    experts by passes/kernels/dense_bf16_x86.mlir. The linalg kernel gathers a weight row for every
    (token, expert) pair; here a run of 4 (else 2) pairs with one expert loads and widens each weight vector
    once, and each row vector serves several outputs: a run x outputs tile within the block dispatch's
    register budget (DENSE_BLOCK_TILES: 4 x 4 sums on AVX-512, 4 x 2 on AVX2)."""
    R = N * J
    n = max(1, min(ROWS_PER_DECODE, R))
    o_tile = pow2_divisor(O, 32)
    block_rows, block_outputs = DENSE_BLOCK_TILES[avx512]
    ot = pow2_divisor(o_tile, min(block_outputs, block_rows * block_outputs // n))
    return render("dense_bf16_x86.mlir", name=name, N=N, J=J, R=R, K=K, O=O, E=E, o_tile=o_tile, n=n, ot=ot,
                  width=x86_width(avx512), dot=dot)


def dense_block_applies(N: int, J: int, K: int, O: int, E: int, gathered: bool, avx512: bool, avx2: bool) -> bool:
    """Whether a bf16 unit takes the x86 dense block dispatch: a linear layer (one weight) on a block of
    rows or a decode row (`dense_block_tile`), K in whole vectors, O in whole tiles of outputs."""
    _, ot = dense_block_tile(N, avx512)
    return (not gathered and J == 1 and E == 1 and (avx512 or avx2)
            and K % x86_width(avx512) == 0 and O % ot == 0)


def dense_block_function(name: str, N: int, K: int, O: int, avx512: bool, dot: str = "f32") -> str:
    """@name(x [N, 1, K] f32, weight [1, O, K] bf16) -> [N, 1, O]: a linear layer on a block of rows by
    passes/kernels/dense_bf16_x86_block.mlir. The linalg kernel kept 16 partial sums an output in memory
    for a second dispatch to add (on a 32-row block ~10% of a DeepSeek-V3.2 prefill); here they stay in
    registers across K."""
    nt, ot = dense_block_tile(N, avx512)
    assert N > 1 or dot == "f32", "a decode row is never rounded (rewrite_dense_matmul)"
    width = x86_width(avx512)
    # a decode row: workgroups of block_scaled.stream_rows, each a long run of the weight
    o_tile = block_scaled.stream_rows(1, O) if N == 1 else max(ot, pow2_divisor(O, 32))
    chains = DECODE_CHAINS[avx512] if N == 1 and K % (DECODE_CHAINS[avx512] * width) == 0 else 1
    return render("dense_bf16_x86_block.mlir", name=name, N=N, K=K, O=O, nt=nt, ot=ot,
                  o_tile=o_tile, width=width, dot=dot, chains=chains, E=0, R=0)


def dense_pairs_function(name: str, R: int, K: int, O: int, E: int, avx512: bool) -> str:
    """@name(x [1, R, K] f32, weight [E, O, K] bf16, experts [1, R]) -> [1, R, O]: each row a decode row
    (dense_bf16_x86_block.mlir `decode_row`) through weight[experts[r]], in workgroups of stream_rows(R, O)
    outputs of one row. The linalg kernel's gather of the selected experts' rows read them at ~80% of the
    dense decode rows' rate (DeepSeek-V3.2 bench decode profile: 39-40 against 49-50 GB/s)."""
    width = x86_width(avx512)
    chains = DECODE_CHAINS[avx512] if K % (DECODE_CHAINS[avx512] * width) == 0 else 1
    return render("dense_bf16_x86_block.mlir", name=name, N=1, K=K, O=O, nt=1, ot=1,
                  o_tile=block_scaled.stream_rows(R, O), width=width, dot="f32", chains=chains, E=E, R=R)


# an FP8 / INT4 row's codes a vector and sums over alternate vectors: 32 codes a step on both ISAs (an
# INT4 group). FP8's integer decode runs on i16 lanes, so codes twice a register of floats halve its work
# (AVX-512 gate/up 0.51 -> 0.44 ms a decode step, bench FP8 DeepSeek-V3.2); AVX2 keeps two sums (0.90 ->
# 0.86), AVX-512 one (two: 0.45 -> 0.49, the down projections 0.23 -> 0.35)
X86_ROWS_VECTORS = {True: (32, 1), False: (16, 2)}
# more rows than experts (a prefill's pairs, per-head or linear rows of a block): runs of rows with one
# expert share each decoded vector, run x chains x width / lanes sums in registers: AVX-512 8 x 2 of 16,
# AVX2 4 x 2 of 8. Runs of 8 against 4 on AVX-512 (bench FP8 DeepSeek-V3.2 64-token prefill): per-head
# W_UK^T 5.0 -> 3.9 ms, gate/up 10.7 -> 10.0; AVX2's runs of 2 (two sums of 16) left its linear layers no
# faster than the linalg kernel, runs of 4 took the prefill 142-160 -> 105 ms
X86_ROWS_RUNS = {True: [8, 4, 2, 1], False: [4, 2, 1]}
X86_ROWS_RUNS_VECTORS = {True: (32, 1), False: (16, 1)}


def x86_rows_applies(fmt: str, N: int, J: int, K: int, E: int, gathered: bool, scales: str, avx512: bool,
                     avx2: bool) -> bool:
    """Whether an FP8 or INT4 unit takes the x86 rows dispatch: every form (a decode step's or a prefill's
    pairs, MLA's per-head projections, a linear layer's decode row or block) where K is in whole vectors
    (FP8) or groups of 32 (INT4, bf16 scales as published). Bench FP8 DeepSeek-V3.2 64-token prefill, the
    linear layers' blocks against the linalg kernel: q_b_proj 7.8 -> 5.4 ms, the call 65-67 -> 53-60 ms
    (AVX-512); AVX2 as above."""
    if fmt == "fp8_e4m3_b128":
        fits = K % x86_width(avx512) == 0
    else:
        fits = fmt == "int4_g32" and K % 32 == 0 and scales == "bf16"
    return fits and (avx512 or avx2)


def x86_rows_function(name: str, fmt: str, N: int, J: int, K: int, O: int, E: int, gathered: bool,
                      avx512: bool) -> str:
    """@name(x [N, J, K] f32, codes, scales[, experts [N, J] i64]) -> [N, J, O] (R = N x J rows) for FP8
    (codes [E, O, K] ui8, scales [E, O/128, K/128] f32) or INT4 (codes [E, O, K/8] si32, scales
    [E, O, K/32] bf16) by passes/kernels/block_scaled_x86_rows.mlir. The linalg kernel read the selected
    experts' codes through `iree_linalg_ext.gather`, a whole expert for every pair, at ~14 GB/s (bench FP8
    DeepSeek-V3.2 decode profile: 0.84 ms for the 6 x 2 MB of gate/up codes a step, against ~38 GB/s for
    the bf16 head), and wrote each output's lanes out for a second dispatch to sum. Up to one row an
    expert (a decode step's pairs, per-head rows, a linear layer's row), each row streams its expert's
    codes in workgroups of stream_rows(R, O) outputs; more rows than experts (a prefill's pairs, per-head
    or linear rows of a block) share each decoded vector in runs of rows (MLA's W_UK^T on a 64-token
    block: the linalg kernel's 16-lane split of K = 128 and the second dispatch summing them ran at ~31
    GFLOP/s)."""
    R = N * J
    batched = not gathered and (E > 1 or N > 1)
    runs = batched or (gathered and R > E)
    width, chains = X86_ROWS_RUNS_VECTORS[avx512] if runs else X86_ROWS_VECTORS[avx512]
    if (K % 128) % (chains * width):           # the vectors must tile 128 codes and K's partial last block
        width, chains = x86_width(avx512), 1
    # INT4: each group's 16 weights rounded once and looked up, a group a step: AVX-512 16 lanes at a time
    # from one table, AVX2 8 lanes from two (decode rows 4 sums, runs 2 a row: 8 sums in registers for 4 rows)
    lookup = None
    if fmt == "int4_g32":
        lookup = "avx512" if avx512 else "avx2"
        width, chains = (16, 2) if avx512 else (8, 2 if runs else 4)
    o_tile = pow2_divisor(O, 32) if runs else block_scaled.stream_rows(R, O)
    return render("block_scaled_x86_rows.mlir", name=name, fmt=fmt, N=N, J=J, R=R, K=K, O=O, E=E,
                  gathered=gathered, batched=batched, o_tile=o_tile, width=width, chains=chains,
                  run_sizes=X86_ROWS_RUNS[avx512] if runs else [], lookup=lookup)


# f32 tiles of IREE's CPU mmt4d (rows x outputs, K step 1): a 16 x 16 tile of AVX-512 registers, 8 x 8
# for AVX2 and NEON
MMT4D_TILES = {True: (16, 16), False: (8, 8)}


def per_head_function(name: str, N: int, H: int, K: int, O: int, avx512: bool) -> str:
    """@name(x [N, H, K] f32, weight [H, O, K] bf16) -> [N, H, O]: the per-head batched matmul, packed."""
    M0, N0 = MMT4D_TILES[avx512]
    return render("per_head_mmt4d.mlir", name=name, N=N, H=H, K=K, O=O, M0=M0, N0=N0,
                  N1=-(-N // M0), O1=-(-O // N0))


def rewrite_per_head_matmul(module: ir.Module, backend: str = "llvm-cpu", avx512: bool = False) -> int:
    """Rewrite every `kimi::per_head_matmul` (x [N, H, K] f32, weight [H, O, K] bf16); returns how many."""
    table = FunctionTable(module)
    count = 0
    for op in find_units(module, "per_head_matmul"):
        args = [tensor_arg(v.type) for v in op.operands]
        result = tensor_arg(op.results[0].type)
        if len(args) != 2 or None in args or result is None:
            raise PassError(f"per_head_matmul: expected static tensor operands ({op.location})")
        x, weight = args
        if (backend != "llvm-cpu" or x.dtype != "f32" or weight.dtype != "bf16" or len(x.shape) != 3
                or len(weight.shape) != 3 or weight.shape[0] != x.shape[1] or weight.shape[2] != x.shape[2]):
            raise PassError(f"per_head_matmul: an llvm-cpu unit of f32 rows and a bf16 weight, got "
                            f"{[a.builtin for a in args]} on {backend}")
        (N, H, K), O = x.shape, weight.shape[1]
        name = kernel_name("per_head_mmt4d", N=N, H=H, K=K, O=O)
        symbol = table.get(("per_head", N, H, K, O, avx512), name,
                           lambda n: per_head_function(n, N, H, K, O, avx512))
        replace_with_call(op, list(op.operands), symbol, result)
        count += 1
    return count


def rewrite_dense_matmul(module: ir.Module, backend: str = "llvm-cpu", avx512: bool = False,
                         avx2: bool = False, bf16_dot: bool = False) -> tuple[int, int]:
    """Rewrite every `kimi::dense_expert_matmul` (x [N, J, K] f32, weight [E, O, K] bf16, experts [N, J]) and
    `kimi::dense_batched_matmul` (x [M, E, K], weight [E, O, K]); returns how many, and how many of them
    round their rows to bf16 (`bf16_dot`: the x86 block and routed-pairs dispatches, `dense_dot`; lossy,
    asked for)."""
    table = FunctionTable(module)
    count = dots = 0
    # dense_exact_matmul: a linear layer whose rows are never rounded (the lightning indexer's)
    for unit, gathered, may_round in (("dense_expert_matmul", True, True), ("dense_batched_matmul", False, True),
                                      ("dense_exact_matmul", False, False)):
        for op in find_units(module, unit):
            args = [tensor_arg(v.type) for v in op.operands]
            result = tensor_arg(op.results[0].type)
            if len(args) != (3 if gathered else 2) or None in args or result is None:
                raise PassError(f"{unit}: expected static tensor operands ({op.location})")
            x, weight = args[:2]
            N, J, K = x.shape
            E, O = weight.shape[:2]
            if (x.dtype != "f32" or weight.dtype != "bf16" or weight.shape != (E, O, K)
                    or (gathered and args[2].shape != (N, J)) or (not gathered and J != E)):
                raise PassError(f"{unit}: unexpected operand types {[a.builtin for a in args]}")
            form = "gathered" if gathered else "batched"
            # a single row (a decode step's linear layer) stays exact: its matvec is memory-bound, rounding
            # would buy nothing; a prefill's routed pairs are one row of N * J pairs
            dot = dense_dot(K, avx512, bf16_dot and may_round and N * J > 1)
            arch = "" if avx512 else "_avx2"
            isa = arch + ("_bf16dot" if dot == "bf16" else "")
            if backend == "llvm-cpu" and dense_rows_applies(N, J, K, E, gathered, avx512, avx2):
                name = kernel_name("bf16_x86_rows" + isa, N=N, J=J, K=K, O=O, E=E)
                build = lambda n, d=dot: dense_rows_function(n, N, J, K, O, E, avx512, d)
                dots += dot == "bf16"
            elif backend == "llvm-cpu" and dense_pairs_applies(N, J, K, O, E, gathered, avx512, avx2):
                # exact under --bf16-activations too, as a decode row is: memory-bound, rounding buys nothing
                name = kernel_name("bf16_x86_pairs" + arch, R=J, K=K, O=O, E=E)
                build = lambda n: dense_pairs_function(n, J, K, O, E, avx512)
            elif backend == "llvm-cpu" and dense_block_applies(N, J, K, O, E, gathered, avx512, avx2):
                name = kernel_name("bf16_x86_block" + isa, N=N, K=K, O=O)
                build = lambda n, d=dot: dense_block_function(n, N, K, O, avx512, d)
                dots += dot == "bf16"
            elif backend == "llvm-cpu" and block_scaled.cpu_kernel_applies("bf16", N, J, K, E, gathered, "bf16"):
                name = kernel_name(f"bf16_cpu_{form}", N=N, J=J, K=K, O=O, E=E)
                build = lambda n, ws=weight.shape, g=gathered: block_scaled.cpu_function(
                    n, "bf16", N, J, K, O, E, g, ws, (), avx512=avx512)
            else:
                name = kernel_name(f"bf16_{form}", N=N, J=J, K=K, O=O, E=E)
                build = lambda n, ws=weight.shape, g=gathered: block_scaled.matmul_function(
                    n, "bf16", N, J, K, O, E, g, ws, (), "bf16")
            symbol = table.get(("bf16", N, J, K, O, E, gathered, avx512, name), name, build)
            replace_with_call(op, list(op.operands), symbol, result)
            count += 1
    return count, dots
