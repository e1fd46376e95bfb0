"""vulkan-spirv: vendor profiles, or `host` built from the local Vulkan device.

A SPIR-V module bakes in a subgroup size; run on a device with another one, reductions silently
give wrong numbers (IREE_NOTES §0.2, §8: lavapipe has subgroup size 8 while IREE's stock profiles
assume 16-64). So every profile records the subgroup size it assumes, `host` picks one matching
the device, and kimi-run refuses a module whose subgroup size the device does not have.
`vp_android_baseline_2022` uses no subgroup operations at all, so it runs anywhere (the choice
for lavapipe and for devices matching no profile).
Device facts come from `vulkaninfo` (Debian/Ubuntu package vulkan-tools).
Known fallbacks (recorded in the manifest): attention is written as matmul-softmax-matmul, not
`iree_linalg_ext.attention` (which SPIR-V cannot compile); sort-based top-k is wrong on lavapipe
from 1024 keys, which DSA models reach once max context + prefill block >= 1024.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from . import TargetError, TargetFlags

DRIVER = "vulkan"
BASELINE = "vp_android_baseline_2022"
# profile -> subgroup sizes it may use (None: no subgroup operations)
PROFILES: dict[str, tuple[int, ...] | None] = {
    BASELINE: None,
    "rdna3": (32, 64), "rdna2": (32, 64), "rdna1": (32, 64), "cdna3": (64,),
    "ampere": (32,), "turing": (32,), "ada": (32,), "hopper": (32,),
    "valhall": (16,), "adreno": (64,),
}
ARCHES = ["host", *PROFILES]
DEFAULT_ARCH = "host"
VENDOR_PROFILES = {0x1002: "rdna3", 0x10DE: "ampere", 0x13B5: "valhall", 0x5143: "adreno"}


@dataclass(frozen=True)
class VulkanDevice:
    name: str
    vendor_id: int
    subgroup_size: int
    shared_memory_bytes: int
    float16: bool
    int8: bool


def query_host_device() -> VulkanDevice | None:
    """The first Vulkan device vulkaninfo reports, or None when there is none (or no vulkaninfo)."""
    tool = shutil.which("vulkaninfo")
    if tool is None:
        return None
    try:
        text = subprocess.run([tool], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None

    def first(key: str) -> str | None:
        m = re.search(rf"^\s*{key}\s*=\s*(.+?)\s*$", text, re.M)
        return m.group(1) if m else None

    name, vendor, subgroup = first("deviceName"), first("vendorID"), first("subgroupSize")
    if name is None or subgroup is None:
        return None
    return VulkanDevice(name=name, vendor_id=int(vendor, 0) if vendor else 0, subgroup_size=int(subgroup),
                        shared_memory_bytes=int(first("maxComputeSharedMemorySize") or 16384),
                        float16=first("shaderFloat16") == "true", int8=first("shaderInt8") == "true")


def profile_for(device: VulkanDevice) -> str:
    """The vendor's profile when it can use the device's subgroup size, else the baseline."""
    profile = VENDOR_PROFILES.get(device.vendor_id)
    if profile and device.subgroup_size in (PROFILES[profile] or ()):
        return profile
    return BASELINE


def flags(arch: str = DEFAULT_ARCH) -> TargetFlags:
    notes = ["attention lowered as matmul-softmax-matmul (SPIR-V has no iree_linalg_ext.attention)"]
    if arch == "host":
        device = query_host_device()
        if device is None:
            raise TargetError("--target vulkan --arch host: no Vulkan device found (is vulkaninfo from vulkan-tools "
                              "installed, and a driver such as mesa-vulkan-drivers?); name a profile with --arch")
        profile = profile_for(device)
        notes.append(f"host device {device.name!r}: subgroup size {device.subgroup_size}, "
                     f"{device.shared_memory_bytes} B shared memory -> profile {profile}")
    elif arch in PROFILES:
        profile = arch
    else:
        raise TargetError(f"--arch {arch!r} is not a vulkan profile (known: {', '.join(ARCHES)})")
    return TargetFlags("vulkan", arch, DRIVER, ["--iree-hal-target-device=vulkan", f"--iree-vulkan-target={profile}"],
                       "vulkan-spirv-fb", notes, subgroup_sizes=PROFILES[profile], profile=profile)
