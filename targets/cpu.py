"""llvm-cpu: the host, a named CPU, or a cross-compilation triple for the platforms llama.cpp ships
binaries for, each with a sensible CPU feature baseline. Runs on the `local-task` driver."""

from __future__ import annotations

import platform
from pathlib import Path

from . import TargetError, CompileTarget

DRIVER = "local-task"
# triple -> (LLVM target triple, baseline CPU, extra CPU features)
CROSS = {
    "x86_64-linux-gnu": ("x86_64-unknown-linux-gnu", "x86-64-v3", ""),          # AVX2 + FMA
    "aarch64-linux-gnu": ("aarch64-unknown-linux-gnu", "generic", "+neon,+dotprod"),
    "aarch64-linux-android": ("aarch64-none-linux-android34", "generic", "+neon,+dotprod"),
    "arm64-apple-darwin": ("arm64-apple-darwin", "apple-m1", ""),
    "x86_64-pc-windows-msvc": ("x86_64-pc-windows-msvc", "x86-64-v3", ""),
}
# named CPUs for the host's architecture (passed to --iree-llvmcpu-target-cpu)
NAMED = ["x86-64-v2", "x86-64-v3", "x86-64-v4", "haswell", "skylake-avx512", "icelake-server",
         "sapphirerapids", "znver3", "znver4", "apple-m1", "neoverse-v1", "neoverse-n2"]
AVX512 = {"x86-64-v4", "skylake-avx512", "icelake-server", "sapphirerapids", "znver4"}
AVX2 = AVX512 | {"x86-64-v3", "haswell", "znver3"}
AVX512_BF16 = {"sapphirerapids", "znver4"}
ARCHES = ["host", *CROSS, *NAMED]
DEFAULT_ARCH = "host"


def flags(arch: str = DEFAULT_ARCH) -> CompileTarget:
    base = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu"]
    if arch == "host":
        return CompileTarget("cpu", arch, DRIVER, base + ["--iree-llvmcpu-target-cpu=host"], "embedded-elf-x86_64",
                           avx512=host_has("avx512f"), avx2=host_has("avx2"),
                           avx512_bf16=host_has("avx512f") and host_has("avx512_bf16"))
    if arch in CROSS:
        triple, cpu, features = CROSS[arch]
        extra = [f"--iree-llvmcpu-target-cpu-features={features}"] if features else []
        fmt = "embedded-elf-" + ("arm_64" if triple.startswith(("aarch64", "arm64")) else "x86_64")
        return CompileTarget("cpu", arch, DRIVER, base + [f"--iree-llvmcpu-target-triple={triple}",
                                                         f"--iree-llvmcpu-target-cpu={cpu}", *extra], fmt,
                             avx2=cpu in AVX2)
    if arch in NAMED:
        return CompileTarget("cpu", arch, DRIVER, base + [f"--iree-llvmcpu-target-cpu={arch}"], "embedded-elf",
                           avx512=arch in AVX512, avx2=arch in AVX2, avx512_bf16=arch in AVX512_BF16)
    raise TargetError(f"--arch {arch!r} is not a cpu architecture (known: {', '.join(ARCHES)})")


def host_has_avx512() -> bool:
    """Whether this machine's CPU (what `--iree-llvmcpu-target-cpu=host` compiles for) has AVX-512F."""
    return host_has("avx512f")


def host_has(flag: str) -> bool:
    """Whether this machine's CPU is x86-64 with the /proc/cpuinfo feature `flag` (avx512f, avx2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in cpuinfo.splitlines())
