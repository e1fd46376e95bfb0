"""What the runtime knows of a device before it runs a module on it: a Vulkan device's facts from
`vulkaninfo` (Debian/Ubuntu package vulkan-tools). kimi-run checks a SPIR-V module's subgroup size
against them; kimi-compile (targets/vulkan.py) builds `--arch host` modules from them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class VulkanDevice:
    name: str
    vendor_id: int
    subgroup_size: int
    shared_memory_bytes: int
    max_invocations: int
    float16: bool
    int8: bool
    int16: bool
    int64: bool
    storage16: bool
    storage8: bool


def parse_vulkaninfo(text: str) -> VulkanDevice | None:
    """The first device in `vulkaninfo` text output (None when it lists none)."""
    def first(key: str) -> str | None:
        m = re.search(rf"^\s*{key}\s*=\s*(.+?)\s*$", text, re.M)
        return m.group(1) if m else None

    def flag(key: str) -> bool:
        return first(key) == "true"

    name, vendor, subgroup = first("deviceName"), first("vendorID"), first("subgroupSize")
    if name is None or subgroup is None:
        return None
    return VulkanDevice(name=name, vendor_id=int(vendor, 0) if vendor else 0, subgroup_size=int(subgroup),
                        shared_memory_bytes=int(first("maxComputeSharedMemorySize") or 16384),
                        max_invocations=int(first("maxComputeWorkGroupInvocations") or 128),
                        float16=flag("shaderFloat16"), int8=flag("shaderInt8"), int16=flag("shaderInt16"),
                        int64=flag("shaderInt64"), storage16=flag("storageBuffer16BitAccess"),
                        storage8=flag("storageBuffer8BitAccess"))


def query_host_device() -> VulkanDevice | None:
    """The first Vulkan device vulkaninfo reports, or None when there is none (or no vulkaninfo)."""
    tool = shutil.which("vulkaninfo")
    if tool is None:
        return None
    try:
        text = subprocess.run([tool], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_vulkaninfo(text)
