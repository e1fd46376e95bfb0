"""cuda: NVIDIA GPUs through LLVM NVPTX (`--iree-cuda-target`), run on the `cuda` driver.
Accepts SM versions and the code or product names IREE knows (ampere, hopper, a100, h100, ...)."""

from __future__ import annotations

from . import TargetError, TargetFlags

DRIVER = "cuda"
ARCHES = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "ampere", "ada", "hopper", "blackwell",
          "a100", "a10", "l4", "l40s", "h100", "h200", "rtx3090", "rtx4090"]
DEFAULT_ARCH = "sm_80"


def flags(arch: str = DEFAULT_ARCH) -> TargetFlags:
    if arch not in ARCHES:
        raise TargetError(f"--arch {arch!r} is not a cuda architecture (known: {', '.join(ARCHES)})")
    return TargetFlags("cuda", arch, DRIVER, ["--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}"], "cuda-nvptx-fb")
