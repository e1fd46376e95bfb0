"""The KDA decode pass: every `kimi::kda_decode` unit (frontend/units.py, one token of Kimi Delta Attention's
recurrence for every head) -> a hand-written x86 dispatch (passes/kernels/kda_decode_x86.mlir).

Left to IREE, the step (decay, S^T k, the rank-1 update, S^T q over a [B, H, dk, dv] f32 state) ran at
0.13 ms a layer of the bench-size K3 (8 heads of 128 x 128) built for AVX-512 and 0.24 ms for AVX2, where
reading and writing its 0.5 MB of state takes ~0.04 ms at this host's bandwidth; the dispatch runs 0.05
and 0.07 ms (bench/dispatch_profile.py, README "KDA decode step"). It keeps a chunk of each head's
columns in registers: one pass over the rows sums S1^T k, a second writes the updated rows and sums
S'^T q while the chunk is still in L2. The driver emits the unit only where the dispatch applies (llvm-cpu
with AVX2 or AVX-512F, `kda_decode_applies`; elsewhere, and with `--no-kda-fusion`, the step is the
reference's plain torch ops); a unit it cannot take is an error naming it, never a wrong number.
"""

from __future__ import annotations

from iree.compiler import ir

from .kernels import kernel_name, render
from .rewrite import FunctionTable, PassError, find_units, replace_with_call, tensor_arg

# vectors of state columns a pass keeps in registers, at most: C sums (+ C deltas in the second pass)
# within AVX-512's 32 registers of 16 floats, AVX2's 16 of 8
MAX_CHUNK = {True: 8, False: 4}


def chunk_vectors(dv: int, avx512: bool) -> int:
    """The most vectors (up to MAX_CHUNK) whose columns divide dv; 0: dv is not whole vectors."""
    width = 16 if avx512 else 8
    return next((c for c in (8, 4, 2, 1) if c <= MAX_CHUNK[avx512] and dv % (c * width) == 0), 0)


def kda_decode_applies(dv: int, avx512: bool) -> bool:
    """Whether the dispatch takes a head of dv state columns (whole vectors)."""
    return chunk_vectors(dv, avx512) > 0


def kda_decode_function(name: str, B: int, H: int, dk: int, dv: int, avx512: bool) -> str:
    return render("kda_decode_x86.mlir", name=name, B=B, H=H, dk=dk, dv=dv, C=chunk_vectors(dv, avx512),
                  width=16 if avx512 else 8)


def rewrite_kda_decode(module: ir.Module, backend: str = "llvm-cpu", avx512: bool = False, avx2: bool = False) -> int:
    """Rewrite every `kimi::kda_decode` unit; returns how many."""
    table = FunctionTable(module)
    count = 0
    for op in find_units(module, "kda_decode"):
        args = [tensor_arg(v.type) for v in op.operands]
        results = [tensor_arg(r.type) for r in op.results]
        if len(args) != 6 or None in args or len(results) != 2 or None in results:
            raise PassError(f"kda_decode: expected six static tensor operands and two results ({op.location})")
        q, k, v, decay, beta, state = args
        B, H, dk = q.shape
        dv = v.shape[-1]
        if (any(a.dtype != "f32" for a in args) or k.shape != q.shape or decay.shape != q.shape
                or v.shape != (B, H, dv) or beta.shape != (B, H) or state.shape != (B, H, dk, dv)):
            raise PassError(f"kda_decode: unexpected operands {[a.builtin for a in args]}")
        if backend != "llvm-cpu" or not (avx512 or avx2) or not kda_decode_applies(dv, avx512):
            raise PassError(f"kda_decode: no dispatch for dv={dv} on {backend} (avx512={avx512}, avx2={avx2}): "
                            "compile with --no-kda-fusion")
        name = kernel_name("kda_decode_x86" + ("" if avx512 else "_avx2"), B=B, H=H, dk=dk, dv=dv)
        symbol = table.get(("kda_decode", B, H, dk, dv, avx512), name,
                           lambda n: kda_decode_function(n, B, H, dk, dv, avx512))
        replace_with_call(op, list(op.operands), symbol, results)
        count += 1
    return count
