"""kimi_iree.passes: our MLIR -> MLIR rewrites, run by kimi-compile between export and iree-compile.

Each pass finds the fusion units the frontend emitted as custom ops (frontend/units.py) and replaces
them with an implementation in linalg on builtin tensors:
  weights.py           kimi::weight_expert_matmul / weight_batched_matmul -> a contraction reading the
                       block-scaled codes (MXFP4: mxfp4.py and its CPU kernels; FP8, INT4: block_scaled.py)
  sparse_attention.py  kimi::sparse_mla_attention -> indexer + top-k + attention over the selected rows
  kda.py               kimi::kda_decode -> KDA's recurrence step as an x86 dispatch
Passes know MLIR (IREE's Python bindings), not torch modules; each is testable on IR text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rewrite import PassError, unit_names


@dataclass(frozen=True)
class PassOptions:
    weight_matmul: bool = True
    sparse_attention: bool = True
    backend: str = "llvm-cpu"          # the IREE codegen backend: llvm-cpu, spirv, cuda, rocm
    avx512: bool = False               # llvm-cpu: the target CPU has AVX-512F (passes/mxfp4_avx512.py)
    avx2: bool = False                 # llvm-cpu: the target CPU has AVX2 (the same dispatch, 8 wide)
    bf16_dot: bool = False             # llvm-cpu with AVX512-BF16: bf16 matmul rows rounded to bf16 (lossy, asked for)


@dataclass
class PassReport:
    mlir: str
    rewritten: dict[str, int] = field(default_factory=dict)    # unit -> how many were rewritten
    notes: list[str] = field(default_factory=list)             # lowerings that are a target's fallback


def run_passes(mlir: str, options: PassOptions = PassOptions()) -> PassReport:
    """Run the enabled passes over torch-dialect MLIR text. A unit left with no lowering is an error."""
    from iree.compiler import ir

    from .kda import rewrite_kda_decode
    from .weights import rewrite_dense_matmul, rewrite_per_head_matmul, rewrite_weight_matmul
    from .sparse_attention import rewrite_sparse_attention

    with ir.Context() as context:
        context.allow_unregistered_dialects = False
        module = ir.Module.parse(mlir)
        report = PassReport("")
        if options.weight_matmul:
            report.rewritten["weight_matmul"], notes = rewrite_weight_matmul(module, options.backend, options.avx512,
                                                                                options.avx2)
            report.notes.extend(notes)
            # the bf16 dense units: linear layers, float experts, MLA's per-head projections
            dense, bf16_dots = rewrite_dense_matmul(module, options.backend, options.avx512, options.avx2, options.bf16_dot)
            report.rewritten["dense_matmul"] = dense + rewrite_per_head_matmul(module, options.backend, options.avx512)
            report.rewritten["dense_matmul_bf16_dot"] = bf16_dots      # of those, rows rounded to bf16 (lossy)
        if options.sparse_attention:
            report.rewritten["sparse_mla_attention"] = rewrite_sparse_attention(module, options.backend, options.avx512,
                                                                                  options.avx2)
        # emitted only where its dispatch applies (driver/build.py): no option of its own
        report.rewritten["kda_decode"] = rewrite_kda_decode(module, options.backend, options.avx512, options.avx2)
        report.rewritten = {unit: n for unit, n in report.rewritten.items() if n}
        left = unit_names(module)
        if left:
            raise PassError(f"unit {left[0]} has no lowering with these pass options")
        if not module.operation.verify():
            raise PassError("the module does not verify after the passes")
        report.mlir = str(module)
    return report


__all__ = ["PassError", "PassOptions", "PassReport", "run_passes"]
