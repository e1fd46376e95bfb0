"""The differential harness (in the spirit of llama.cpp's test-backend-ops): one fusion unit or one block,
exported exactly as kimi-compile exports the model, rewritten by our passes, compiled for a target and
run there, against the eager reference on the same inputs.

    cases = [...]                                # nn.Modules and their inputs (tests/block_cases.py)
    results = run_on_backend(cases, BACKENDS["vulkan-host"])
    results[0].error                             # max|got - want| / max|want| over every output

A case's module is exported with `torch.export` + IREE's FX importer and its weights become
`#flow.parameter.named` globals fed from a ParameterIndex (as `model.irpa` feeds a real module), so
the compiler sees what it sees in a real build: no weight is a constant it could fold. Fusion units
are emitted as custom ops and rewritten by `run_passes` for the backend, as kimi-compile does.

Backends: `cpu-host` (this CPU), `cpu-avx2` (`--arch x86-64-v3`: AVX2 code, which runs on every
x86-64-v3 host, so an AVX-512 machine tests the AVX2 lowering too), `vulkan-host` (lavapipe here),
and compile-only ones for the GPUs this machine cannot run (cuda sm_80/sm_90, rocm gfx942/gfx1100,
metal). Vulkan cases run in a subprocess per lavapipe vector width (`LP_NATIVE_VECTOR_WIDTH`:
lavapipe JIT-compiles shaders for the host, and the width sets its subgroup size, 128 -> 4 and
256 -> 8), so one host tests several device shapes.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

WORKER = Path(__file__).with_name("backend_worker.py")


@dataclass(frozen=True)
class Backend:
    name: str
    target: str                  # kimi-compile --target
    arch: str                    # kimi-compile --arch
    runs: bool                   # executes on this machine (else compile-only)
    driver: str = "local-task"
    bf16_dot: bool = False       # kimi-compile --bf16-activations (lossy; x86 with AVX512-BF16)

    def flags(self):
        from kimi_iree.targets import get_target
        return get_target(self.target).flags(self.arch)


def _x86_64() -> bool:
    import platform
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def vulkan_device():
    """This machine's Vulkan device (None without one), asked once: vulkaninfo takes a second."""
    from kimi_iree.targets.vulkan import query_host_device
    return query_host_device()


BACKENDS = {
    "cpu-host": Backend("cpu-host", "cpu", "host", True),
    "cpu-avx2": Backend("cpu-avx2", "cpu", "x86-64-v3", _x86_64()),
    "vulkan-host": Backend("vulkan-host", "vulkan", "host", True, driver="vulkan"),
    "cpu-host-bf16": Backend("cpu-host-bf16", "cpu", "host", True, bf16_dot=True),
    "cuda-sm_80": Backend("cuda-sm_80", "cuda", "sm_80", False, driver="cuda"),
    "cuda-sm_90": Backend("cuda-sm_90", "cuda", "sm_90", False, driver="cuda"),
    "rocm-gfx942": Backend("rocm-gfx942", "rocm", "gfx942", False, driver="hip"),
    "rocm-gfx1100": Backend("rocm-gfx1100", "rocm", "gfx1100", False, driver="hip"),
    "metal": Backend("metal", "metal", "apple", False, driver="metal"),
}
RUNNING = ["cpu-host", "cpu-avx2", "vulkan-host"]
COMPILE_ONLY = ["cuda-sm_80", "cuda-sm_90", "rocm-gfx942", "rocm-gfx1100", "metal"]
# lavapipe vector widths the Vulkan cases run at (KIMI_LAVAPIPE_WIDTHS="128,256,512" for more)
LAVAPIPE_WIDTHS = [w for w in os.environ.get("KIMI_LAVAPIPE_WIDTHS", "256,128").split(",") if w]


@dataclass
class Case:
    """A module whose forward takes `inputs` and returns a tensor or a tuple of tensors."""

    name: str
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    tolerance: float              # on max|got - want| / max|want|, per output
    note: str = ""

    def reference(self) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.module(*self.inputs)
        return [t.detach().numpy() for t in (out if isinstance(out, tuple) else (out,))]


@dataclass
class Result:
    backend: str
    errors: list[float] = field(default_factory=list)   # per output (empty for compile-only)
    detail: str = ""

    @property
    def error(self) -> float:
        return max(self.errors, default=0.0)


class _Cases(nn.Module):
    """Several cases side by side, so each one's weights have their own names (case3.packed, ...)."""

    def __init__(self, cases: list[Case]):
        super().__init__()
        for i, case in enumerate(cases):
            # as kimi-compile's skeleton holds them: a weight that requires grad exports differently
            # (a Parameter inside an index list is refused by the FX importer)
            case.module.requires_grad_(False)
            self.add_module(f"case{i}", case.module.eval())


def export(cases: list[Case]) -> tuple[str, dict[str, np.ndarray]]:
    """torch-dialect MLIR with one function per case (`case0`, `case1`, ...), and every weight by its
    global's name."""
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter
    from torch_mlir import fx

    from kimi_iree.frontend.export import _parameter_hooks

    holder = _Cases(cases)
    hooks = _parameter_hooks("holder.")       # global names as in holder.state_dict(): case3.packed, ...
    importer = FxImporter(context=ir.Context(), hooks=hooks)
    hooks.prepare_module(importer.module.operation)
    with torch.no_grad():
        for i, case in enumerate(cases):
            fx.export_and_import(_Entry(holder, i), *case.inputs, fx_importer=importer, func_name=f"case{i}",
                                 experimental_support_mutation=True,  # import_program: parameters via the hooks
                                 decomposition_table={})
    # numpy has no bf16: its bytes go to the parameter index as int16 (the same bytes)
    weights = {n: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().contiguous().numpy()
               for n, t in holder.state_dict().items()}
    return str(importer.module), weights


class _Entry(nn.Module):
    """Case i of a `_Cases`, exported with the holder's parameter names."""

    def __init__(self, holder: _Cases, i: int):
        super().__init__()
        self.holder, self.i = holder, i

    def forward(self, *inputs):
        return getattr(self.holder, f"case{self.i}")(*inputs)


def compile_cases(mlir: str, backend: Backend) -> tuple[bytes, str]:
    """The passes for the backend's codegen, then iree-compile with kimi-compile's flags for it, falling
    back as kimi-compile does to the target's portable form; returns the module and the fallback taken."""
    from kimi_iree.driver.build import CompileError, compile_for_target
    from kimi_iree.passes import PassOptions, run_passes

    target = backend.flags()
    passes = run_passes(mlir, PassOptions(backend=target.backend, avx512=target.avx512, avx2=target.avx2,
                                          bf16_dot=backend.bf16_dot))
    try:
        return compile_for_target(passes.mlir, target), ""
    except CompileError as e:
        portable = target.fallback(e.first_error)
        if portable is None:
            raise
        return compile_for_target(passes.mlir, portable), f"portable form ({str(e)[:160]})"


def run_on_backend(cases: list[Case], backend: Backend, widths: list[str] | None = None) -> list[Result]:
    """Compile the cases (one module) for `backend` and, where it runs here, compare every output of
    each case with its reference. A compile failure is reported against each case in turn (each is
    compiled alone), so one bad shape does not hide the others."""
    mlir, weights = export(cases)
    try:
        vmfb, fallback = compile_cases(mlir, backend)
    except Exception:
        if len(cases) == 1:
            raise
        return [r for case in cases for r in _alone(case, backend, widths)]
    results = [Result(backend.name, detail=fallback) for _ in cases]
    if not backend.runs:
        return results
    inputs = [[t.numpy() for t in case.inputs] for case in cases]
    if backend.driver == "vulkan":
        runs = {f"width {w}": run_in_subprocess(vmfb, weights, inputs, "vulkan", {"LP_NATIVE_VECTOR_WIDTH": w})
                for w in (widths or LAVAPIPE_WIDTHS)}
    else:
        runs = {"": run_module(vmfb, weights, inputs, backend.driver)}
    for i, case in enumerate(cases):
        want = case.reference()
        details = []
        for label, got in runs.items():
            err = max(relative_error(g, w) for g, w in zip(got[i], want))
            results[i].errors.append(err)
            details.append(f"{label} {err:.1e}".strip())
        results[i].detail = ", ".join(filter(None, [fallback, *details]))
    return results


def _alone(case: Case, backend: Backend, widths: list[str] | None) -> list[Result]:
    try:
        return run_on_backend([case], backend, widths)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Result(backend.name, [float("inf")], f"compile failed: {first}")]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want| / max|want| (inf when got has a NaN or the shapes differ)."""
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    scale = np.abs(want).max()
    return float(np.abs(got.astype(np.float64) - want).max() / (scale if scale else 1.0))


def run_module(vmfb: bytes, weights: dict[str, np.ndarray], inputs: list[list[np.ndarray]],
               driver: str) -> list[list[np.ndarray]]:
    """Load `vmfb` with `weights` as the "model" parameter scope on `driver`; call function case{i} on
    inputs[i]; return every function's results read back to the host."""
    import iree.runtime as rt

    from kimi_iree.runtime.session import read_staged

    device = rt.get_device(driver, cache=False)
    config = rt.Config(device=device)
    index = rt.ParameterIndex()
    for name, array in weights.items():
        index.add_buffer(name, np.ascontiguousarray(array).view(np.uint8).reshape(-1))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model"))
    context = rt.SystemContext(vm_modules=[params, rt.VmModule.copy_buffer(config.vm_instance, vmfb)], config=config)
    results = []
    for i, args in enumerate(inputs):
        out = getattr(context.modules.module, f"case{i}")(*args)
        outs = out if isinstance(out, (tuple, list)) else [out]
        read = []
        for array in outs:
            try:
                read.append(array.to_host().copy())
            except ValueError:                # lavapipe cannot import host memory: read through staging
                read.append(read_staged(device, array))
        results.append(read)
    return results


def run_in_subprocess(vmfb: bytes, weights: dict[str, np.ndarray], inputs: list[list[np.ndarray]], driver: str,
                      env: dict[str, str]) -> list[list[np.ndarray]]:
    """run_module in a fresh process with `env` added (lavapipe reads its settings once per process)."""
    with tempfile.TemporaryDirectory(prefix="kimi-backend-") as tmp:
        tmp = Path(tmp)
        (tmp / "module.vmfb").write_bytes(vmfb)
        np.savez(tmp / "weights.npz", **weights)
        np.savez(tmp / "inputs.npz", **{f"{i}_{j}": a for i, args in enumerate(inputs) for j, a in enumerate(args)})
        proc = subprocess.run([sys.executable, str(WORKER), str(tmp), driver, str(len(inputs))], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{driver} worker ({env}) failed: {proc.stderr.strip().splitlines()[-1:]}")
        outputs = np.load(tmp / "outputs.npz")
        return [[outputs[f"{i}_{j}"] for j in range(sum(k.startswith(f"{i}_") for k in outputs.files))]
                for i in range(len(inputs))]


def describe(case: Case, result: Result) -> str:
    return f"{case.name} on {result.backend}: {result.error:.1e}" + (f" ({result.detail})" if result.detail else "")
