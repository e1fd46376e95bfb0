"""The fused lightning indexer + sparse attention pass: `kimi::sparse_mla_attention` -> attention over the
selected rows only.

The unit's reference (frontend/dsa.py) scores every cache slot, selects the top `topk` by the
indexer and applies the selection as a -inf mask over the whole cache: its attention costs O(S) per
query whatever topk is. This pass rewrites each unit into a linalg implementation that touches the
selected rows only, for a tile of Tq queries at a time:

  1. indexer      dots[t, h, s] = iq[t, h] . ik[s];  I[t, s] = sum_h w[t, h] ReLU(dots * index_scale)
  2. order keys   key[t, s] = the int32 whose order is I's float order; invisible slots (s > pos[b, t])
                  get INT32_MIN, below every score
  3. radix select the k-th largest key, one hex digit per round (8 rounds; each counts the keys at
                  or above 16 candidates, as frontend/selection.py), then keep = key > kth plus the
                  earliest ties (a scan)
  4. compaction   slot = running count of kept keys (a scan); a scatter writes each kept slot's
                  index s into idx[t, slot] (k slots; the rest go to a spare slot k)
  5. gather       rows[t, j] = latent[idx[t, j]], k_pe[idx[t, j]]          [Tq, k, r + dr]
  6. attention    scores over the k rows, -inf past the number kept (fewer than k keys visible),
                  softmax, o_latent[t, h] = sum_j p[t, h, j] rows[t, j]
The selection is exactly the reference's (same keys, same tie rule), so results agree to f32
rounding. Attention costs O(k) per query; the indexer stays O(S) (it must see every key).

Prefill: query tiles of Tq rows run in an scf.for (the host loop IREE keeps around the dispatches),
Tq chosen so that the per-tile buffers ([Tq, HI, S] indexer dots, [Tq, k, r] rows) stay within
TILE_BUDGET_BYTES: no [tokens x context] f32 buffer is ever live. Decode is one tile of one query.
Gathering costs k rows per query with no reuse between queries, while the cache rows of a masked
attention are shared by the whole tile; so a prefill tile gathers only once the cache holds
PREFILL_GATHER_RATIO x k slots, and below that steps 4-5 are skipped and step 6 attends over the
cache with the selection as a mask (measured: a 4k-token prefill at topk 2048, 16 heads, took
38.8 s gathering against 11.4 s for the reference mask form).
When topk covers every cache slot there is nothing to select: the unit becomes attention over every
visible slot, with no indexer and no top-k (the frontend already emits the dense layer then).

Lowering: on llvm-cpu every step is a linalg.generic (contractions, elementwise, reductions) plus
two iree_linalg_ext.scan and one iree_linalg_ext.scatter, all of which IREE vectorises or runs as
loops; the gather is a tensor.extract with a contiguous trailing index (vector loads). On SPIR-V
the same ops lower (scan and scatter included); the selection is integer counting only, no sort,
so it avoids IREE's bubble sort (CPU) and the sort that is wrong on lavapipe (IREE_NOTES §3).

x86 decode (llvm-cpu with AVX-512F or AVX2, one query a tile): steps 1-2, 3-4 and 5-6 (or 5 alone) are
hand-written dispatches where the shapes are whole vectors (`index_keys_width`, `select_topk_width`,
`attend_rows_width`, `gather_rows_width`; elsewhere the linalg forms run). IREE's contraction ran the indexer at ~50 GFLOP/s
over every slot of the window; the dispatch (kernels/index_keys_x86.mlir) sums each tile's NT x HG dot
products with one shuffle tree and skips the tiles past the query's position, ~145 GFLOP/s. The linalg
selection is 14 small dispatches a layer (radix rounds, scans, a scatter), mostly IREE's cost per
dispatch; the one dispatch of kernels/select_topk_x86.mlir took 0.32 -> 0.14 ms of a bench-size step at
depth 8192 (4 layers). IREE's gather of 512 rows of 512 + 64 took 0.23 ms a layer, the dispatch
(kernels/gather_rows_x86.mlir) 0.05. Bench-size DeepSeek-V3.2 decode at depth 8192: 11.0 -> 8.6 ms of
dispatches a step with the indexer and gather dispatches (bench/dispatch_profile.py, README). The attention
over the gathered rows was then four IREE dispatches a layer (two contractions, a softmax, the rope part)
reading a 1.2 MB buffer the gather wrote; kernels/attend_rows_x86.mlir reads each selected row where it
lies in the caches, once a workgroup of heads: 1.25 -> 0.6 ms of a depth-8192 step (4 layers).
"""

from __future__ import annotations

import struct

from iree.compiler import ir

from .kernels import kernel_name, render
from .linalg_text import Generic, filled, indent, tensor_type
from .rewrite import FunctionTable, PassError, TensorArg, find_units, replace_with_call, scalar_value, tensor_arg

UNIT = "sparse_mla_attention"
TILE_BUDGET_BYTES = 128 << 20
# A prefill tile gathers each query's k rows only when the cache holds at least this many times k
# slots; below, a mask over the shared cache rows is cheaper (bench/sparse_attention.py, README).
PREFILL_GATHER_RATIO = 4
# IREE-WORKAROUND(transient leak): a prefill tile's gathered latent rows of 32 MiB were never freed on
# llvm-cpu (131 MiB lost per prefill call of a bench-size DeepSeek-V3.2, iree-benchmark-module too); tiles
# whose rows stay within this size did not leak.
GATHER_TILE_BYTES = 2 << 20
INT32_MIN = -(2 ** 31)
DIGIT_BITS = 4
CANDIDATES = 2 ** DIGIT_BITS


def radix_rounds() -> list[tuple[int, int]]:
    """The selection's radix rounds, most significant digit first: (shift, offset), the top digit signed
    (its candidates run from -CANDIDATES / 2), as frontend/selection.py `kth_largest_key`."""
    top = 32 - DIGIT_BITS
    return [(shift, CANDIDATES // 2 if shift == top else 0) for shift in range(top, -1, -DIGIT_BITS)]

# The x86 decode dispatches: the indexer's keys a tile and a workgroup (kernels/index_keys_x86.mlir; the last
# workgroup clamped to S: a divisor of S made a bench-size 8352-slot cache 261 workgroups of 32 keys, 0.68 ->
# 0.56 ms of a step at 256), the gather's rows a workgroup at most (kernels/gather_rows_x86.mlir)
INDEX_KEYS_TILE = 4
INDEX_KEYS_CHUNK = 256
GATHER_ROWS_CHUNK = 64
ATTEND_HEADS = 8          # the most heads a workgroup of the x86 attention over the selected rows takes
X86_WIDTH = {"avx512": 16, "avx2": 8}


def f32_literal(x: float) -> str:
    """An f32 constant as its exact bit pattern (MLIR accepts hex float literals)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


def gathers_rows(T: int, S: int, K: int) -> bool:
    """Whether the unit's queries gather their k rows (decode; prefill at contexts of PREFILL_GATHER_RATIO
    * k and beyond) or attend over the shared cache rows with the selection as a mask."""
    return K < S and (T == 1 or S >= PREFILL_GATHER_RATIO * K)


def query_tile(T: int, S: int, HI: int, K: int, H: int, R: int, P: int) -> int:
    """The largest power-of-two divisor of T whose per-tile buffers fit TILE_BUDGET_BYTES (and whose
    gathered latent rows fit GATHER_TILE_BYTES)."""
    gather = gathers_rows(T, S, K)
    per_query = 4 * (max(HI * S + 3 * S, K * (R + P) + 2 * H * K) if gather else HI * S + 3 * S + 3 * H * S)
    tile = T & -T
    while tile > 1 and (tile * per_query > TILE_BUDGET_BYTES or gather and tile * 4 * K * R > GATHER_TILE_BYTES):
        tile //= 2
    return tile


def index_keys_width(HI: int, DI: int, S: int, x86: str | None) -> int:
    """The vector width of the x86 indexer dispatch for a decode query (0: it does not apply, the linalg
    form runs): AVX-512 or AVX2 on llvm-cpu, DI whole vectors, HI whole head groups, S whole key tiles."""
    width = X86_WIDTH.get(x86 or "", 0)
    if not width:
        return 0
    group = width // INDEX_KEYS_TILE
    return width if DI % width == 0 and HI % group == 0 and S % INDEX_KEYS_TILE == 0 else 0


def shuffle_tree(width: int) -> list[tuple[list[int], list[int]]]:
    """Shuffle masks that sum `width` vectors' lanes into one vector (lane i: the sum of vector i): each
    stage pairs the vectors, taking the first and second half of every lane group of both into lo and hi,
    whose sum has twice the groups at half the size."""
    stages, groups = [], 1
    while groups < width:
        size = width // groups
        lo = [base + g * size + i for base in (0, width) for g in range(groups) for i in range(size // 2)]
        stages.append((lo, [i + size // 2 for i in lo]))
        groups *= 2
    return stages


def index_keys_function(name: str, B: int, S: int, HI: int, DI: int, width: int, index_scale: float) -> str:
    folds = [width >> i for i in range(1, 8) if width >> i >= INDEX_KEYS_TILE]
    return render("index_keys_x86.mlir", name=name, B=B, S=S, HI=HI, DI=DI, width=width, NT=INDEX_KEYS_TILE,
                  HG=width // INDEX_KEYS_TILE, CH=INDEX_KEYS_CHUNK, scale=f32_literal(index_scale), tree=shuffle_tree(width),
                  folds=folds)


def select_topk_width(S: int, x86: str | None) -> int:
    """The vector width of the x86 selection of a decode query (0: the linalg steps 3-4 run)."""
    width = X86_WIDTH.get(x86 or "", 0)
    return width if width and S % width == 0 else 0


def select_topk_function(name: str, B: int, S: int, K: int, width: int) -> str:
    return render("select_topk_x86.mlir", name=name, B=B, S=S, K=K, width=width, rounds=radix_rounds(),
                  candidates=CANDIDATES)


def gather_rows_width(R: int, P: int, x86: str | None) -> int:
    """The vector width of the x86 gather of a decode query's rows (0: the linalg gather runs)."""
    width = X86_WIDTH.get(x86 or "", 0)
    return width if width and R % width == 0 and P % width == 0 else 0


def attend_rows_width(H: int, R: int, P: int, K: int, x86: str | None) -> int:
    """The vector width of the x86 attention over a decode query's selected rows (0: the gather and the
    linalg attention run): R, P and K whole vectors, H whole groups of the score tile's heads."""
    width = X86_WIDTH.get(x86 or "", 0)
    if not width:
        return 0
    heads = width // INDEX_KEYS_TILE
    return width if R % width == 0 and P % width == 0 and K % width == 0 and H % heads == 0 else 0


def attend_rows_function(name: str, B: int, S: int, K: int, H: int, R: int, P: int, width: int,
                         softmax_scale: float) -> str:
    """Workgroups of HW heads, whole score tiles of HG, at most ATTEND_HEADS a workgroup and at least two
    workgroups where the heads allow: each workgroup reads every selected row once, so fewer, wider ones
    read less, while a real checkpoint's 96 or 128 heads still spread over many cores (12 or 16
    workgroups; the bench models' 16 heads: two). The output pass holds `width` accumulators (AVX-512 has
    32 registers, AVX2 16): HB heads by CW vectors."""
    HG = width // INDEX_KEYS_TILE
    sizes = [d for d in range(HG, min(H, ATTEND_HEADS) + 1, HG) if H % d == 0]
    HW = max([d for d in sizes if H // d >= 2] or sizes)
    HB = max(d for d in range(1, min(HW, width) + 1) if HW % d == 0)
    CW = next(c for c in (4, 2, 1) if HB * c <= width and R % (c * width) == 0)
    return render("attend_rows_x86.mlir", name=name, B=B, S=S, K=K, H=H, R=R, P=P, width=width, NT=INDEX_KEYS_TILE,
                  HG=HG, HW=HW, HB=HB, CW=CW, scale=f32_literal(softmax_scale), tree=shuffle_tree(width))


def gather_rows_function(name: str, B: int, S: int, K: int, R: int, P: int, width: int) -> str:
    chunk = next(c for c in (GATHER_ROWS_CHUNK >> i for i in range(7)) if K % c == 0)
    return render("gather_rows_x86.mlir", name=name, B=B, S=S, K=K, R=R, P=P, width=width, CH=chunk)


def f32t(*shape: int) -> str:
    return tensor_type(shape, "f32")


def i32t(*shape: int) -> str:
    return tensor_type(shape, "i32")


def tile_function(name: str, B: int, T: int, H: int, R: int, P: int, HI: int, DI: int, S: int, K: int,
                  softmax_scale: float, index_scale: float, gather: bool = True, x86: str | None = None) -> str:
    """util.func private @name: one tile of T queries (see the module docstring for the steps).
    With K >= S nothing can be dropped: attention over every visible slot, no indexer, no top-k.
    x86 ("avx512", "avx2" or None): a decode query's steps 1-2 (indexer keys) and 5 (gather) run as the x86
    dispatches where their shapes allow."""
    helpers = ""
    ql_t, qp_t, lat_t, kpe_t = f32t(B, T, H, R), f32t(B, T, H, P), f32t(B, S, R), f32t(B, S, P)
    iq_t, iw_t, ik_t, pos_t = f32t(B, T, HI, DI), f32t(B, T, HI), f32t(B, S, DI), tensor_type((B, T), "i64")
    if K >= S:
        L = attention_lines(B, T, H, R, P, S, ("%latent", "b j c", lat_t), ("%k_pe", "b j c", kpe_t),
                            ("%pos", "b t", pos_t, "i64", "sle"), softmax_scale)
    else:
        keys_width = index_keys_width(HI, DI, S, x86) if T == 1 else 0
        attend_width = attend_rows_width(H, R, P, K, x86) if T == 1 and gather else 0
        rows_width = gather_rows_width(R, P, x86) if T == 1 and gather and not attend_width else 0
        select_width = select_topk_width(S, x86) if T == 1 and gather else 0
        keys, rows = f"{name}_index_keys" if keys_width else None, f"{name}_gather" if rows_width else None
        select, attend = f"{name}_select" if select_width else None, f"{name}_attend" if attend_width else None
        if keys:
            helpers += index_keys_function(keys, B, S, HI, DI, keys_width, index_scale)
        if select:
            helpers += select_topk_function(select, B, S, K, select_width)
        if rows:
            helpers += gather_rows_function(rows, B, S, K, R, P, rows_width)
        if attend:
            helpers += attend_rows_function(attend, B, S, K, H, R, P, attend_width, softmax_scale)
        L = selection_lines(B, T, H, R, P, HI, DI, S, K, index_scale, softmax_scale, gather, keys, rows, select,
                            attend)
    L += [f"util.return %out : {ql_t}"]
    args = (f"%ql: {ql_t}, %qp: {qp_t}, %latent: {lat_t}, %k_pe: {kpe_t}, %iq: {iq_t}, %iw: {iw_t}, "
            f"%ik: {ik_t}, %pos: {pos_t}")
    return helpers + f"util.func private @{name}({args}) -> {ql_t} {{\n{indent(L)}\n}}\n"


def selection_lines(B: int, T: int, H: int, R: int, P: int, HI: int, DI: int, S: int, K: int,
                    index_scale: float, softmax_scale: float, gather: bool, index_keys: str | None = None,
                    gather_rows: str | None = None, select_topk: str | None = None,
                    attend_rows: str | None = None) -> list[str]:
    """Steps 1-6 for K < S: the indexer, the selection, the gather and attention over the k rows
    (gather), or attention over the cache with the selection as a mask (not gather). index_keys,
    gather_rows, select_topk, attend_rows: x86 dispatch functions for steps 1-2 (the order keys), step 5,
    steps 3-4 (a decode query's selection) and steps 5-6 (its attention over the rows in the caches)
    instead of linalg."""
    ql_t, lat_t, kpe_t = f32t(B, T, H, R), f32t(B, S, R), f32t(B, S, P)
    iq_t, iw_t, ik_t, pos_t = f32t(B, T, HI, DI), f32t(B, T, HI), f32t(B, S, DI), tensor_type((B, T), "i64")
    key_t, bt_t = i32t(B, T, S), i32t(B, T)
    L: list[str] = []

    L += [f"%int_min = arith.constant {INT32_MIN} : i32", "%c0_i32 = arith.constant 0 : i32",
          "%c1_i32 = arith.constant 1 : i32", f"%k_i32 = arith.constant {K} : i32"]
    if index_keys:
        L += [f"%key = util.call @{index_keys}(%iq, %iw, %ik, %pos) : ({iq_t}, {iw_t}, {ik_t}, {pos_t}) -> {key_t}"]
    else:
        L += index_key_lines(B, T, HI, DI, S, index_scale)
    if select_topk:
        L += [f"%idx, %kept_count = util.call @{select_topk}(%key, %pos) : ({key_t}, {pos_t}) -> "
              f"({i32t(B, T, K)}, {bt_t})"]
        return L + gathered_attention_lines(B, T, H, R, P, S, K, softmax_scale, gather_rows, attend_rows)

    # 3. radix select: the k-th largest key, a hex digit a round, exactly as frontend/selection.py
    # `kth_largest_key` (16 candidates, digit 0 counted too): one definition in two forms, held to each
    # other by tests/test_sparse_attention.py (this implementation against the reference, ties included)
    L += filled("%thr_r0", bt_t, "0", "i32")
    rounds = radix_rounds()
    for r, (shift, offset) in enumerate(rounds):
        step = 1 << shift
        cnt_t = i32t(B, T, CANDIDATES)
        L += filled(f"%cnt0_r{r}", cnt_t, "0", "i32")
        L += [f"%step_r{r} = arith.constant {step} : i32", f"%first_r{r} = arith.constant {-offset} : i32"]
        L += (Generic("b t c s".split(), {"s"})
              .input("%key", "b t s", key_t).input(f"%thr_r{r}", "b t", bt_t).output(f"%cnt0_r{r}", "b t c", cnt_t)
              .emit(f"%cnt_r{r}", ["%k: i32", "%thr: i32", "%acc: i32"],
                    ["%c_idx = linalg.index 2 : index", "%c = arith.index_cast %c_idx : index to i32",
                     f"%digit = arith.addi %c, %first_r{r} : i32",
                     f"%delta = arith.muli %digit, %step_r{r} : i32",
                     "%cand = arith.addi %thr, %delta : i32",
                     "%ge = arith.cmpi sge, %k, %cand : i32", "%one = arith.extui %ge : i1 to i32",
                     "%a = arith.addi %acc, %one : i32"], ["%a"]))
        # threshold += (digit - offset) * step, digit = the candidates still holding k keys, less one
        # (digit 0 always holds). Each reduction starts from a fresh zero tensor: reducing into the live
        # threshold tensor fails to bufferize on the CUDA pipeline.
        L += filled(f"%digit0_r{r}", bt_t, "0", "i32")
        L += (Generic("b t c".split(), {"c"}).input(f"%cnt_r{r}", "b t c", cnt_t).output(f"%digit0_r{r}", "b t", bt_t)
              .emit(f"%digit_r{r}", ["%n: i32", "%acc: i32"],
                    ["%holds = arith.cmpi sge, %n, %k_i32 : i32", "%one = arith.extui %holds : i1 to i32",
                     "%a = arith.addi %acc, %one : i32"], ["%a"]))
        L += [f"%offset_r{r} = arith.constant {offset + 1} : i32", f"%thr_next0_r{r} = tensor.empty() : {bt_t}"]
        L += (Generic("b t".split()).input(f"%thr_r{r}", "b t", bt_t).input(f"%digit_r{r}", "b t", bt_t)
              .output(f"%thr_next0_r{r}", "b t", bt_t)
              .emit(f"%thr_r{r + 1}", ["%thr: i32", "%d: i32", "%o: i32"],
                    [f"%signed = arith.subi %d, %offset_r{r} : i32", f"%delta = arith.muli %signed, %step_r{r} : i32",
                     "%next = arith.addi %thr, %delta : i32"], ["%next"]))
    kth = f"%thr_r{len(rounds)}"

    # keep = key > kth, plus the earliest visible ties until k are kept
    L += filled("%above0", bt_t, "0", "i32")
    L += (Generic("b t s".split(), {"s"}).input("%key", "b t s", key_t).input(kth, "b t", bt_t)
          .output("%above0", "b t", bt_t)
          .emit("%above", ["%k: i32", "%kth: i32", "%acc: i32"],
                ["%gt = arith.cmpi sgt, %k, %kth : i32", "%one = arith.extui %gt : i1 to i32",
                 "%a = arith.addi %acc, %one : i32"], ["%a"]))
    L += ["%tied0 = tensor.empty() : " + key_t]
    L += (Generic("b t s".split()).input("%key", "b t s", key_t).input(kth, "b t", bt_t).input("%pos", "b t", pos_t)
          .output("%tied0", "b t s", key_t)
          .emit("%tied", ["%k: i32", "%kth: i32", "%p: i64", "%o: i32"],
                [*visible("%vis", "%p"), "%eq = arith.cmpi eq, %k, %kth : i32",
                 "%t = arith.andi %eq, %vis : i1", "%one = arith.extui %t : i1 to i32"], ["%one"]))
    L += _inclusive_scan("%tie_rank", "%tied", B, T, S)
    L += ["%keep0 = tensor.empty() : " + key_t]
    L += (Generic("b t s".split()).input("%key", "b t s", key_t).input(kth, "b t", bt_t)
          .input("%tied", "b t s", key_t).input("%tie_rank", "b t s", key_t).input("%above", "b t", bt_t)
          .output("%keep0", "b t s", key_t)
          .emit("%keep", ["%k: i32", "%kth: i32", "%tie: i32", "%rank: i32", "%n_above: i32", "%o: i32"],
                ["%gt = arith.cmpi sgt, %k, %kth : i32", "%room = arith.subi %k_i32, %n_above : i32",
                 "%in_room = arith.cmpi sle, %rank, %room : i32", "%is_tie = arith.cmpi ne, %tie, %c0_i32 : i32",
                 "%tie_kept = arith.andi %is_tie, %in_room : i1", "%kept = arith.ori %gt, %tie_kept : i1",
                 "%one = arith.extui %kept : i1 to i32"], ["%one"]))

    if not gather:
        # A prefill tile at a context within a few topk: the kept slots as a mask over the whole cache,
        # whose rows every query of the tile shares (gathering per query costs more there).
        return L + attention_lines(B, T, H, R, P, S, ("%latent", "b j c", lat_t), ("%k_pe", "b j c", kpe_t),
                                   ("%keep", "b t j", key_t, "i32", "mask"), softmax_scale)

    # 4. compaction: kept slot s goes to idx[t, running count - 1]; the rest to the spare slot K
    L += _inclusive_scan("%keep_rank", "%keep", B, T, S, total="%kept_count")
    upd_t, ind_t, W = i32t(B, T, S), i32t(B, T, S, 1), K + 1
    n = B * T * S
    # One flat index a slot, (b T + t)(k + 1) + place, into the [B, T, k + 1] list seen as one dim. The
    # index computation gets a dispatch of its own: fused into the scatter's, llvm-cpu stack-allocates
    # a tile of it and fails past 32 KiB (S = 4096 already). An explicit region, not a
    # util.optimization_barrier: a barrier makes the host wait for the queue (README "Findings").
    L += [f"%indices = flow.dispatch.region -> ({i32t(n, 1)}) {{",
          f"%k_spare = arith.constant {K} : i32", f"%row_width = arith.constant {W} : i32",
          f"%t_count = arith.constant {T} : i32", "%scatter_index0 = tensor.empty() : " + ind_t]
    L += (Generic("b t s c".split()).input("%keep", "b t s", key_t).input("%keep_rank", "b t s", key_t)
          .output("%scatter_index0", "b t s c", ind_t)
          .emit("%scatter_index", ["%kept: i32", "%rank: i32", "%o: i32"],
                ["%b_idx = linalg.index 0 : index", "%t_idx = linalg.index 1 : index",
                 "%b = arith.index_cast %b_idx : index to i32", "%t = arith.index_cast %t_idx : index to i32",
                 "%slot0 = arith.subi %rank, %c1_i32 : i32", "%is_kept = arith.cmpi ne, %kept, %c0_i32 : i32",
                 "%slot = arith.select %is_kept, %slot0, %k_spare : i32",
                 "%bT = arith.muli %b, %t_count : i32", "%bt = arith.addi %bT, %t : i32",
                 "%row = arith.muli %bt, %row_width : i32", "%v = arith.addi %row, %slot : i32"], ["%v"]))
    L += [f"%indices0 = tensor.collapse_shape %scatter_index [[0, 1, 2], [3]] : {ind_t} into {i32t(n, 1)}",
          f"flow.return %indices0 : {i32t(n, 1)}", "}"]
    # the values (each slot's own s) too: fused into the scatter, they were a stack tile of 8 B a slot
    L += [f"%updates = flow.dispatch.region -> ({i32t(n)}) {{", "%scatter_value0 = tensor.empty() : " + upd_t]
    L += (Generic("b t s".split()).output("%scatter_value0", "b t s", upd_t)
          .emit("%scatter_value", ["%o: i32"],
                ["%s_idx = linalg.index 2 : index", "%s = arith.index_cast %s_idx : index to i32"], ["%s"]))
    L += [f"%updates0 = tensor.collapse_shape %scatter_value [[0, 1, 2]] : {upd_t} into {i32t(n)}",
          f"flow.return %updates0 : {i32t(n)}", "}"]
    L += filled("%slots0", i32t(B * T * W), "0", "i32")
    # Indices are unique except for each row's spare place K, which is never read: any write order is fine.
    L += [f"%slots_flat = iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) "
          f"ins(%updates, %indices : {i32t(n)}, {i32t(n, 1)}) outs(%slots0 : {i32t(B * T * W)}) {{",
          "^bb0(%new: i32, %old: i32):", "  iree_linalg_ext.yield %new : i32", f"}} -> {i32t(B * T * W)}",
          f"%slots = tensor.expand_shape %slots_flat [[0, 1, 2]] output_shape [{B}, {T}, {W}] : {i32t(B * T * W)} into {i32t(B, T, W)}",
          f"%idx = tensor.extract_slice %slots[0, 0, 0] [{B}, {T}, {K}] [1, 1, 1] : {i32t(B, T, W)} to {i32t(B, T, K)}"]
    return L + gathered_attention_lines(B, T, H, R, P, S, K, softmax_scale, gather_rows, attend_rows)


def gathered_attention_lines(B: int, T: int, H: int, R: int, P: int, S: int, K: int, softmax_scale: float,
                             gather_rows: str | None, attend_rows: str | None = None) -> list[str]:
    """Steps 5-6 from %idx (the kept slots) and %kept_count: gather the rows, attend over them; or, with
    attend_rows (the x86 dispatch of a decode query), attend over the rows where they lie in the caches."""
    lat_t, kpe_t, bt_t = f32t(B, S, R), f32t(B, S, P), i32t(B, T)
    if attend_rows:
        return [f"%out = util.call @{attend_rows}(%ql, %qp, %idx, %kept_count, %latent, %k_pe) : ({f32t(B, T, H, R)}, "
                f"{f32t(B, T, H, P)}, {i32t(B, T, K)}, {bt_t}, {lat_t}, {kpe_t}) -> {f32t(B, T, H, R)}"]
    L: list[str] = []
    # 5. gather the selected rows
    idx_t = i32t(B, T, K)
    if gather_rows:
        L += [f"%rows, %rows_pe = util.call @{gather_rows}(%idx, %latent, %k_pe) : ({idx_t}, {lat_t}, {kpe_t}) -> "
              f"({f32t(B, T, K, R)}, {f32t(B, T, K, P)})"]
    else:
        for value, source, width, src_t in (("%rows", "%latent", R, lat_t), ("%rows_pe", "%k_pe", P, kpe_t)):
            rows_t = f32t(B, T, K, width)
            # Materialise the rows (k x width, a few MiB) in a dispatch of their own: fused into the
            # contractions below, the gather turns them into scalar loops.
            L += [f"{value} = flow.dispatch.region -> ({rows_t}) {{", f"{value}0 = tensor.empty() : {rows_t}"]
            L += (Generic("b t j c".split()).input("%idx", "b t j", idx_t).output(f"{value}0", "b t j c", rows_t)
                  .emit(f"{value}_gathered", ["%i: i32", "%o: f32"],
                        ["%b = linalg.index 0 : index", "%c = linalg.index 3 : index",
                         "%s = arith.index_cast %i : i32 to index",
                         f"%v = tensor.extract {source}[%b, %s, %c] : {src_t}"], ["%v"]))
            L += [f"flow.return {value}_gathered : {rows_t}", "}"]

    # 6. attention over the k rows, -inf past the number kept
    L += attention_lines(B, T, H, R, P, K, ("%rows", "b t j c", f32t(B, T, K, R)),
                         ("%rows_pe", "b t j c", f32t(B, T, K, P)), ("%kept_count", "b t", bt_t, "i32", "slt"),
                         softmax_scale)
    return L


def visible(slot: str, pos: str) -> list[str]:
    """Region lines of a [b, t, s] generic: `slot` = whether slot s is visible at position `pos`."""
    return ["%s_idx = linalg.index 2 : index", "%s64 = arith.index_cast %s_idx : index to i64",
            f"{slot} = arith.cmpi sle, %s64, {pos} : i64"]


def index_key_lines(B: int, T: int, HI: int, DI: int, S: int, index_scale: float) -> list[str]:
    """Steps 1-2 in linalg: the indexer's scores %iscore and their order keys %key (INT32_MIN when invisible)."""
    iq_t, iw_t, ik_t, pos_t = f32t(B, T, HI, DI), f32t(B, T, HI), f32t(B, S, DI), tensor_type((B, T), "i64")
    key_t = i32t(B, T, S)
    L: list[str] = []
    # 1. indexer scores
    L += filled("%dots0", f32t(B, T, HI, S), "0.0", "f32")
    L += (Generic("b t h s d".split(), {"d"})
          .input("%iq", "b t h d", iq_t).input("%ik", "b s d", ik_t).output("%dots0", "b t h s", f32t(B, T, HI, S))
          .emit("%dots", ["%q: f32", "%k: f32", "%acc: f32"],
                ["%m = arith.mulf %q, %k : f32", "%a = arith.addf %acc, %m : f32"], ["%a"]))
    L += filled("%iscore0", f32t(B, T, S), "0.0", "f32")
    L += [f"%index_scale = arith.constant {f32_literal(index_scale)} : f32", "%zero = arith.constant 0.0 : f32"]
    L += (Generic("b t s h".split(), {"h"})
          .input("%dots", "b t h s", f32t(B, T, HI, S)).input("%iw", "b t h", iw_t)
          .output("%iscore0", "b t s", f32t(B, T, S))
          .emit("%iscore", ["%d: f32", "%w: f32", "%acc: f32"],
                ["%x = arith.mulf %d, %index_scale : f32", "%relu = arith.maximumf %x, %zero : f32",
                 "%m = arith.mulf %w, %relu : f32", "%a = arith.addf %acc, %m : f32"], ["%a"]))

    # 2. order keys; invisible slots below everything
    L += ["%magnitude = arith.constant 2147483647 : i32", "%key0 = tensor.empty() : " + key_t]
    L += (Generic("b t s".split()).input("%iscore", "b t s", f32t(B, T, S)).input("%pos", "b t", pos_t)
          .output("%key0", "b t s", key_t)
          .emit("%key", ["%x: f32", "%p: i64", "%o: i32"],
                [*visible("%vis", "%p"),
                 "%bits = arith.bitcast %x : f32 to i32",
                 "%neg = arith.cmpi slt, %bits, %c0_i32 : i32",
                 "%flip = arith.xori %bits, %magnitude : i32",          # -1 - magnitude for negatives
                 "%ordered = arith.select %neg, %flip, %bits : i32",
                 "%negzero = arith.cmpi eq, %bits, %int_min : i32",     # -0.0 ties with +0.0
                 "%k0 = arith.select %negzero, %c0_i32, %ordered : i32",
                 "%k = arith.select %vis, %k0, %int_min : i32"], ["%k"]))
    return L


def attention_lines(B: int, T: int, H: int, R: int, P: int, J: int, rows: tuple[str, str, str],
                    rows_pe: tuple[str, str, str], limit: tuple[str, str, str, str, str],
                    softmax_scale: float) -> list[str]:
    """%out [B, T, H, R] = softmax over the J rows of (ql . rows + qp . rows_pe) * scale, where row j
    counts for query t iff `j <pred> limit[t]` (limit: value, index dims, type, element, cmpi predicate),
    or, with pred "mask", iff limit[t, j] != 0."""
    ql_t, qp_t, sc_t = f32t(B, T, H, R), f32t(B, T, H, P), f32t(B, T, H, J)
    limit_value, limit_index, limit_t, limit_e, pred = limit
    L = filled("%sc0", sc_t, "0.0", "f32")
    L += (Generic("b t h j c".split(), {"c"}).input("%ql", "b t h c", ql_t).input(*rows)
          .output("%sc0", "b t h j", sc_t)
          .emit("%sc_latent", ["%q: f32", "%k: f32", "%acc: f32"],
                ["%m = arith.mulf %q, %k : f32", "%a = arith.addf %acc, %m : f32"], ["%a"]))
    L += filled("%scp0", sc_t, "0.0", "f32")
    L += (Generic("b t h j c".split(), {"c"}).input("%qp", "b t h c", qp_t).input(*rows_pe)
          .output("%scp0", "b t h j", sc_t)
          .emit("%sc_pe", ["%q: f32", "%k: f32", "%acc: f32"],
                ["%m = arith.mulf %q, %k : f32", "%a = arith.addf %acc, %m : f32"], ["%a"]))
    L += [f"%softmax_scale = arith.constant {f32_literal(softmax_scale)} : f32",
          "%neg_inf = arith.constant 0xFF800000 : f32", "%scores0 = tensor.empty() : " + sc_t]
    L += (Generic("b t h j".split()).input("%sc_latent", "b t h j", sc_t).input("%sc_pe", "b t h j", sc_t)
          .input(limit_value, limit_index, limit_t).output("%scores0", "b t h j", sc_t)
          .emit("%scores", ["%a: f32", "%p: f32", f"%n: {limit_e}", "%o: f32"],
                ["%j_idx = linalg.index 3 : index", f"%j = arith.index_cast %j_idx : index to {limit_e}",
                 f"%zero_{limit_e} = arith.constant 0 : {limit_e}",
                 f"%valid = arith.cmpi ne, %n, %zero_{limit_e} : {limit_e}" if pred == "mask" else
                 f"%valid = arith.cmpi {pred}, %j, %n : {limit_e}", "%sum = arith.addf %a, %p : f32",
                 "%scaled = arith.mulf %sum, %softmax_scale : f32",
                 "%v = arith.select %valid, %scaled, %neg_inf : f32"], ["%v"]))
    # linalg.softmax, not max/exp/sum/div generics: IREE fused those four into one dispatch whose SPIR-V
    # reduction kept two [J] rows in workgroup memory (33,024 B at 4,104 slots: over lavapipe's 32 KiB),
    # while it lowers linalg.softmax (what torch-mlir makes of the reference's softmax) in bounded memory.
    L += [f"%probs0 = tensor.empty() : {sc_t}",
          f"%probs = linalg.softmax dimension(3) ins(%scores : {sc_t}) outs(%probs0 : {sc_t}) -> {sc_t}"]
    L += filled("%out0", ql_t, "0.0", "f32")
    L += (Generic("b t h c j".split(), {"j"}).input("%probs", "b t h j", sc_t).input(*rows)
          .output("%out0", "b t h c", ql_t)
          .emit("%out", ["%p: f32", "%v: f32", "%acc: f32"],
                ["%m = arith.mulf %p, %v : f32", "%a = arith.addf %acc, %m : f32"], ["%a"]))
    return L


def _inclusive_scan(result: str, source: str, B: int, T: int, S: int, total: str | None = None) -> list[str]:
    """result = running sum of source along the slot dim (and `total`, the row sums, when named)."""
    t3, t2 = tensor_type((B, T, S), "i32"), tensor_type((B, T), "i32")
    lines = filled(f"{result}_init", t3, "0", "i32") + filled(f"{result}_acc", t2, "0", "i32")
    names = f"{result}, {total}" if total else f"{result}, {result}_total"
    lines += [f"{names} = iree_linalg_ext.scan dimension(2) inclusive(true) ins({source} : {t3}) "
              f"outs({result}_init, {result}_acc : {t3}, {t2}) {{",
              "^bb0(%x: i32, %acc: i32):", "  %s = arith.addi %x, %acc : i32", "  iree_linalg_ext.yield %s : i32",
              f"}} -> {t3}, {t2}"]
    return lines


def unit_function(name: str, B: int, T: int, H: int, R: int, P: int, HI: int, DI: int, S: int, K: int,
                  softmax_scale: float, index_scale: float, x86: str | None = None) -> str:
    """@name for T queries: the tile function itself, or a loop over query tiles calling it."""
    Tq, gather = query_tile(T, S, HI, K, H, R, P), gathers_rows(T, S, K)
    if Tq == T:
        return tile_function(name, B, T, H, R, P, HI, DI, S, K, softmax_scale, index_scale, gather, x86)
    # the per-query operands are sliced to the tile; the caches are read whole by every tile
    full = {"ql": (B, T, H, R), "qp": (B, T, H, P), "iq": (B, T, HI, DI), "iw": (B, T, HI)}
    tile = {v: (B, Tq, *shape[2:]) for v, shape in full.items()}
    pos_t, pos_tile_t = tensor_type((B, T), "i64"), tensor_type((B, Tq), "i64")
    lat_t, kpe_t, ik_t = f32t(B, S, R), f32t(B, S, P), f32t(B, S, DI)
    loop = ["%c0 = arith.constant 0 : index", f"%cT = arith.constant {T} : index",
            f"%cTq = arith.constant {Tq} : index", f"%out0 = tensor.empty() : {f32t(*full['ql'])}",
            f"%out = scf.for %t0 = %c0 to %cT step %cTq iter_args(%acc = %out0) -> ({f32t(*full['ql'])}) {{"]
    for v, shape in full.items():
        offsets = ", ".join(["0", "%t0", *["0"] * (len(shape) - 2)])
        loop.append(f"  %{v}_tile = tensor.extract_slice %{v}[{offsets}] [{', '.join(map(str, tile[v]))}] "
                    f"[{', '.join(['1'] * len(shape))}] : {f32t(*shape)} to {f32t(*tile[v])}")
    loop += [
        f"  %pos_tile = tensor.extract_slice %pos[0, %t0] [{B}, {Tq}] [1, 1] : {pos_t} to {pos_tile_t}",
        f"  %o = util.call @{name}_tile(%ql_tile, %qp_tile, %latent, %k_pe, %iq_tile, %iw_tile, %ik, %pos_tile) : "
        f"({f32t(*tile['ql'])}, {f32t(*tile['qp'])}, {lat_t}, {kpe_t}, {f32t(*tile['iq'])}, {f32t(*tile['iw'])}, "
        f"{ik_t}, {pos_tile_t}) -> {f32t(*tile['ql'])}",
        f"  %next = tensor.insert_slice %o into %acc[0, %t0, 0, 0] [{B}, {Tq}, {H}, {R}] [1, 1, 1, 1] : "
        f"{f32t(*tile['ql'])} into {f32t(*full['ql'])}",
        f"  scf.yield %next : {f32t(*full['ql'])}", "}", f"util.return %out : {f32t(*full['ql'])}"]
    args = (f"%ql: {f32t(*full['ql'])}, %qp: {f32t(*full['qp'])}, %latent: {lat_t}, %k_pe: {kpe_t}, "
            f"%iq: {f32t(*full['iq'])}, %iw: {f32t(*full['iw'])}, %ik: {ik_t}, %pos: {pos_t}")
    return (tile_function(f"{name}_tile", B, Tq, H, R, P, HI, DI, S, K, softmax_scale, index_scale, gather)
            + f"util.func private @{name}({args}) -> {f32t(*full['ql'])} {{\n{indent(loop)}\n}}\n")


def rewrite_sparse_attention(module: ir.Module, backend: str = "llvm-cpu", avx512: bool = False,
                             avx2: bool = False) -> int:
    """Rewrite every `kimi::sparse_mla_attention` unit in `module`; returns how many. On llvm-cpu with
    AVX-512F or AVX2 a decode query's indexer runs as the x86 dispatch where its shapes allow."""
    x86 = None if backend != "llvm-cpu" else "avx512" if avx512 else "avx2" if avx2 else None
    table = FunctionTable(module)
    units = find_units(module, UNIT)
    for op in units:
        operands = list(op.operands)
        if len(operands) != 11:
            raise PassError(f"{UNIT}: expected 11 operands, got {len(operands)}")
        tensors = [tensor_arg(v.type) for v in operands[:8]]
        scalars = [scalar_value(v) for v in operands[8:]]
        result = tensor_arg(op.results[0].type)
        if any(t is None for t in tensors) or result is None or any(s is None for s in scalars):
            raise PassError(f"{UNIT}: operands must be static tensors and constant scalars ({op.location})")
        ql, qp, lat, kpe, iq, iw, ik, pos = tensors
        B, T, H, R = ql.shape
        P, (S, HI, DI) = qp.shape[-1], (lat.shape[1], iq.shape[2], iq.shape[3])
        softmax_scale, index_scale, K = float(scalars[0]), float(scalars[1]), int(scalars[2])
        expected = [(B, T, H, R), (B, T, H, P), (B, S, R), (B, S, P), (B, T, HI, DI), (B, T, HI), (B, S, DI), (B, T)]
        if [t.shape for t in tensors] != expected or [t.dtype for t in tensors] != ["f32"] * 7 + ["si64"]:
            raise PassError(f"{UNIT}: unexpected operand types {[t.builtin for t in tensors]}")
        if K < 1:
            raise PassError(f"{UNIT}: topk {K} must be at least 1")
        key = (B, T, H, R, P, HI, DI, S, K, softmax_scale, index_scale, x86)
        name = kernel_name("sparse_mla_attention", B=B, T=T, H=H, R=R, P=P, HI=HI, DI=DI, S=S, K=K)
        symbol = table.get(key, name, lambda n: unit_function(n, *key))
        replace_with_call(op, operands[:8], symbol, result)
    return len(units)
