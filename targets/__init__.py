"""kimi_iree.targets: one module per IREE target — its compile flags, the architectures it accepts and
the runtime driver its modules need. `get_target(name)` is the registry."""

from __future__ import annotations

from dataclasses import dataclass, field


class TargetError(Exception):
    """An unknown target or architecture (the CLI prints it as one line, exit code 2)."""


@dataclass(frozen=True)
class TargetFlags:
    target: str                  # cpu, cuda, rocm, vulkan, metal
    arch: str                    # as the user named it (after resolving "host")
    driver: str                  # iree.runtime driver: local-task, cuda, hip, vulkan, metal
    flags: list[str]             # iree-compile flags
    executable_format: str       # what iree-dump-module shows for the executables
    notes: list[str] = field(default_factory=list)   # fallbacks taken, for the manifest


def get_target(name: str):
    from . import cpu
    targets = {"cpu": cpu}
    if name not in targets:
        raise TargetError(f"--target {name!r}: unknown target (known: {', '.join(sorted(targets))})")
    return targets[name]


def list_targets() -> dict[str, list[str]]:
    from . import cpu
    return {"cpu": cpu.ARCHES}
