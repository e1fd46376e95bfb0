"""kimi_iree.targets: one module per IREE target — its compile flags, the architectures it accepts and
the runtime driver its modules need. `get_target(name)` is the registry."""

from __future__ import annotations

from dataclasses import dataclass


class TargetError(Exception):
    """An unknown target or architecture (the CLI prints it as one line, exit code 2)."""


@dataclass(frozen=True)
class CompileTarget:
    """Everything kimi-compile needs to build for one target and the runtime needs to run it. Immutable:
    a fallback is a new CompileTarget (`fallback`), its notes say why."""

    target: str                  # cpu, cuda, rocm, vulkan, metal
    arch: str                    # as the user named it (after resolving "host")
    driver: str                  # iree.runtime driver: local-task, cuda, hip, vulkan, metal
    flags: list[str]             # iree-compile flags
    executable_format: str       # what iree-dump-module shows for the executables
    notes: tuple[str, ...] = ()  # how the target differs from what was asked, for the manifest
    subgroup_sizes: tuple[int, ...] | None = None    # SPIR-V: the subgroup sizes the module may use
    profile: str | None = None
    device_targets: str | None = None   # a `hal.device.targets` module attribute replacing the target flags
    storage16: bool = True       # 16-bit loads and stores in kernels (else bf16 weights are read as 32-bit words)
    avx512: bool = False         # cpu: the target CPU has AVX-512F (the MXFP4 pass's table-lookup dispatch)
    avx2: bool = False           # cpu: the target CPU has AVX2 (the same dispatch's 8-wide form)
    avx512_bf16: bool = False    # cpu: the target CPU has AVX512-BF16 (kimi-compile --bf16-activations)
    portable: bool = False       # SPIR-V: already in the portable form (no subgroup operations)

    def __post_init__(self):
        object.__setattr__(self, "notes", tuple(self.notes))

    def fallback(self, error: str) -> "CompileTarget | None":
        """The same target in a form more likely to compile, after IREE failed with `error`: a stock
        SPIR-V profile (Vulkan vendor profile, Metal) rebuilt without subgroup operations; None when
        there is none."""
        if self.backend != "spirv" or self.portable:
            return None
        from .vulkan import portable_form
        return portable_form(self, error)

    @property
    def backend(self) -> str:
        """IREE's codegen backend for the target: what the passes lower their units for."""
        return {"cpu": "llvm-cpu", "vulkan": "spirv", "metal": "spirv"}.get(self.target, self.target)


def _targets() -> dict:
    from . import cpu, cuda, metal, rocm, vulkan
    return {"cpu": cpu, "cuda": cuda, "rocm": rocm, "vulkan": vulkan, "metal": metal}


def get_target(name: str):
    targets = _targets()
    if name not in targets:
        raise TargetError(f"--target {name!r}: unknown target (known: {', '.join(sorted(targets))})")
    return targets[name]


def list_targets() -> dict[str, tuple[str, list[str]]]:
    """target -> (runtime driver, accepted architectures)."""
    return {name: (m.DRIVER, m.ARCHES) for name, m in _targets().items()}
