"""metal: Apple GPUs (metal-spirv: SPIR-V cross-compiled to MSL), run on the `metal` driver.
Without Xcode's metal tool the module embeds MSL source, compiled by the driver at load."""

from __future__ import annotations

from . import TargetError, CompileTarget

DRIVER = "metal"
ARCHES = ["apple", "macos", "ios"]
DEFAULT_ARCH = "apple"


def flags(arch: str = DEFAULT_ARCH) -> CompileTarget:
    if arch not in ARCHES:
        raise TargetError(f"--arch {arch!r} is not a metal platform (known: {', '.join(ARCHES)})")
    platform = {"apple": "macos", "macos": "macos", "ios": "ios"}[arch]
    return CompileTarget("metal", arch, DRIVER, ["--iree-hal-target-device=metal", "--iree-metal-compile-to-metallib=false",
                                               f"--iree-metal-target-platform={platform}"], "metal-msl-fb",
                       ["attention lowered as matmul-softmax-matmul (SPIR-V path)"])
