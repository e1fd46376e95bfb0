"""cuda: NVIDIA GPUs through LLVM NVPTX (`--iree-cuda-target`), run on the `cuda` driver.

IREE 3.13's known-target table stops at Ada: sm_90 / sm_100 (Hopper, Blackwell) fail with
"missing GPU target". For those we compile PTX for sm_89, which the CUDA driver JIT-compiles on
the newer GPU (correct, but without Hopper-only instructions such as wgmma); the manifest says so.
"""

from __future__ import annotations

from . import TargetError, CompileTarget

DRIVER = "cuda"
NATIVE = ["sm_80", "sm_86", "sm_89", "ampere", "ada", "a100", "rtx3090", "rtx4090"]
# arch -> the target IREE can build that runs there
PTX_FALLBACK = {"sm_90": "sm_89", "sm_90a": "sm_89", "sm_100": "sm_89", "hopper": "sm_89", "h100": "sm_89",
                "h200": "sm_89", "blackwell": "sm_89", "b200": "sm_89"}
ARCHES = [*NATIVE, *PTX_FALLBACK]
DEFAULT_ARCH = "sm_80"


def flags(arch: str = DEFAULT_ARCH) -> CompileTarget:
    if arch in NATIVE:
        return CompileTarget("cuda", arch, DRIVER, ["--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}"],
                           "cuda-nvptx-fb")
    if arch in PTX_FALLBACK:
        built = PTX_FALLBACK[arch]
        return CompileTarget("cuda", arch, DRIVER, ["--iree-hal-target-device=cuda", f"--iree-cuda-target={built}"],
                           "cuda-nvptx-fb", [f"{arch}: IREE 3.13 has no such CUDA target; PTX for {built} is "
                                             "JIT-compiled by the driver (no Hopper-only instructions)"])
    raise TargetError(f"--arch {arch!r} is not a cuda architecture (known: {', '.join(ARCHES)})")
