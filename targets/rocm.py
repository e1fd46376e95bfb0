"""rocm: AMD GPUs through LLVM AMDGPU, run on the `hip` driver. IREE 3.13 spells the flag
`--iree-rocm-target` (`--iree-hip-target` no longer exists). gfx950 has scaled-MFMA MXFP4 matmuls."""

from __future__ import annotations

from . import TargetError, CompileTarget

DRIVER = "hip"
ARCHES = ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201", "mi300x", "rx7900xtx"]
DEFAULT_ARCH = "gfx942"


def flags(arch: str = DEFAULT_ARCH) -> CompileTarget:
    if arch not in ARCHES:
        raise TargetError(f"--arch {arch!r} is not a rocm architecture (known: {', '.join(ARCHES)})")
    return CompileTarget("rocm", arch, DRIVER, ["--iree-hal-target-device=hip", f"--iree-rocm-target={arch}"], "rocm-hsaco-fb")
