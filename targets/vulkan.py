"""vulkan-spirv: vendor profiles, or `host` built from the local Vulkan device.

A SPIR-V module bakes in a subgroup size; run on a device with another one, reductions silently
give wrong numbers (IREE_NOTES §0.2, §8: lavapipe has subgroup size 8 while IREE's stock profiles
assume 16-64). So every profile records the subgroup size it assumes, `host` picks one matching
the device, and kimi-run refuses a module whose subgroup size the device does not have.
`vp_android_baseline_2022` uses no subgroup operations at all, so it runs on any subgroup size: it
is built in the host target's form from IREE's facts for the profile (the stock profile's 64-thread
reductions race, and its missing 16-bit storage made IREE's emulated bf16 loads compute wrong
numbers: bf16 weights are read as 32-bit words there).
Device facts come from `vulkaninfo` (Debian/Ubuntu package vulkan-tools), read by the runtime's
`kimi_iree.runtime.devices` (kimi-run checks a module's subgroup size against the device too).
Known fallbacks (recorded in the manifest): attention is written as matmul-softmax-matmul, not
`iree_linalg_ext.attention` (which SPIR-V cannot compile); top-k is a radix select, not a sort (the
SPIR-V sort is wrong on lavapipe from 1024 keys); where the device or profile lacks 64-bit integers,
IREE demotes the model's int64 index arithmetic to int32 (`--iree-input-demote-i64-to-i32`; the
module boundary is int32 anyway: token ids, lengths, the position).
"""

from __future__ import annotations

import re
from dataclasses import replace

from kimi_iree.runtime.devices import VulkanDevice, query_host_device

from . import TargetError, CompileTarget

DRIVER = "vulkan"
BASELINE = "vp_android_baseline_2022"
# profile -> subgroup sizes it may use (None: no subgroup operations)
PROFILES: dict[str, tuple[int, ...] | None] = {
    BASELINE: None,
    "rdna3": (32, 64), "rdna2": (32, 64), "rdna1": (32, 64), "cdna3": (64,),
    "ampere": (32,), "turing": (32,), "ada": (32,), "hopper": (32,),
    "valhall": (16,), "adreno": (64,),
}
# profiles whose compute set has no Int64 in IREE 3.13's target table (KnownTargets.cpp)
NO_INT64 = {BASELINE, "valhall", "adreno"}
DEMOTE_I64 = "--iree-input-demote-i64-to-i32"
DEMOTE_NOTE = "int64 index arithmetic demoted to int32 inside the module (no 64-bit integers on the target)"
ARCHES = ["host", *PROFILES]
BASELINE_NOTE = (f"{BASELINE}: IREE's facts for the profile (fp32 and int32 arithmetic, 32-bit storage, 16 KiB "
                 "shared memory, 128 threads) in the host target's form, one thread in reduction kernels: the stock "
                 "profile spreads them over 64 threads, which race where fused ops iterate in different orders")
DEFAULT_ARCH = "host"
VENDOR_PROFILES = {0x1002: "rdna3", 0x10DE: "ampere", 0x13B5: "valhall", 0x5143: "adreno"}


# The baseline profile as a device (IREE's KnownTargets.cpp): what host_target builds its module for.
BASELINE_DEVICE = VulkanDevice(name=BASELINE, vendor_id=0, subgroup_size=1, shared_memory_bytes=16 * 1024,
                               max_invocations=128, float16=False, int8=False, int16=False, int64=False,
                               storage16=False, storage8=False)


def profile_for(device: VulkanDevice) -> str | None:
    """The vendor's profile when it can use the device's subgroup size, else None (build one)."""
    profile = VENDOR_PROFILES.get(device.vendor_id)
    if profile and device.subgroup_size in (PROFILES[profile] or ()):
        return profile
    return None


def host_target(device: VulkanDevice, arch: str = "host", api: str = "vulkan") -> str:
    """A `hal.device.targets` value describing exactly this device, for devices no stock profile fits.

    It is the baseline profile's shape with the device's own facts filled in: its 64/16/8-bit
    arithmetic and storage, its shared memory and workgroup limits. Subgroup operations stay off and
    the workgroup limits stay the baseline's (128 threads).

    The subgroup size given to IREE is 1, not the device's: with subgroup operations off it is only
    the thread count IREE's default SPIR-V configuration (BaseDistribute/BaseVectorize: reductions,
    elementwise ops) spreads a workgroup over. With more than one thread, a dispatch whose fused ops
    iterate in different orders (a reduction fused with a transposed producer or consumer, e.g.
    KDA's l2norm feeding the head-major chunked form, or the gated RMSNorm of its transposed output)
    gets each op distributed over the threads separately, the intermediate in workgroup memory and
    no barrier between them: threads read results other threads have not written yet. lavapipe
    runs the rows of a workgroup one after the other, so this gave NaN logits. One thread per
    workgroup in those kernels has nothing to race with; matmul kernels keep their own workgroup
    shapes (and barriers). Enabling subgroup operations instead (size 8) fixes those reductions but
    miscompiles the KDA decode step (SubgroupReduce pipeline)."""
    compute = ["fp32", *(["fp16"] if device.float16 else []), *(["int64"] if device.int64 else []), "int32",
               *(["int16"] if device.int16 else []), *(["int8"] if device.int8 else [])]
    storage = ["b32", *(["b16"] if device.storage16 else []), *(["b8"] if device.storage8 else [])]
    threads = min(device.max_invocations, 128)
    wgp = (f"compute = {'|'.join(compute)}, storage = {'|'.join(storage)}, subgroup = none, "
           f"subgroup_size_choices = [1], max_workgroup_sizes = [{threads}, {threads}, 64], "
           f"max_thread_count_per_workgroup = {threads}, max_workgroup_memory_bytes = {device.shared_memory_bytes}, "
           f"max_workgroup_counts = [65535, 65535, 65535]")
    backend, fmt = {"vulkan": ("vulkan-spirv", "vulkan-spirv-fb"), "metal": ("metal-spirv", "metal-msl-fb")}[api]
    target = (f'#hal.executable.target<"{backend}", "{fmt}", {{iree_codegen.target_info = '
              f'#iree_gpu.target<arch = "{arch}", features = "spirv:v1.3,cap:Shader", wgp = <{wgp}>>}}>')
    return f'[#hal.device.target<"{api}", [{target}]> : !hal.device]'


def iree_target_facts(flags: list[str], name: str) -> VulkanDevice:
    """What IREE's own target table says of the SPIR-V target `flags` select (a Vulkan profile, Metal):
    its arithmetic and storage types, shared memory and thread limits, read from the
    `#iree_gpu.target` IREE attaches to a trivial module. Subgroup facts are left out on purpose."""
    import iree.compiler as ic

    text = ic.compile_str("func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> { return %a : tensor<4xf32> }",
                          input_type="auto", extra_args=[*flags, "--compile-to=preprocessing"]).decode()
    wgp = re.search(r"wgp = <(.*?)>>", text)
    if wgp is None:
        raise TargetError(f"{name}: IREE reported no GPU target facts")
    fields = dict(re.findall(r"(\w+) = (\[[^\]]*\]|[^,]+)", wgp.group(1)))
    compute, storage = fields["compute"].split("|"), fields["storage"].split("|")
    return VulkanDevice(name=name, vendor_id=0, subgroup_size=1,
                        shared_memory_bytes=int(fields["max_workgroup_memory_bytes"]),
                        max_invocations=int(fields["max_thread_count_per_workgroup"]),
                        float16="fp16" in compute, int8="int8" in compute, int16="int16" in compute,
                        int64="int64" in compute, storage16="b16" in storage, storage8="b8" in storage)


PORTABLE_NOTE = ("compiled in the portable form: {name}'s facts (types, storage, shared memory) with no subgroup "
                 "operations and one thread in reduction kernels, the form tested on lavapipe, because IREE's stock "
                 "configuration failed: {error}")


def portable_form(target: CompileTarget, error: str) -> CompileTarget:
    """`target` (a stock Vulkan profile or Metal) rebuilt in the host target's form from IREE's facts for it,
    for shapes where IREE 3.13's stock SPIR-V configuration cannot compile a dispatch (e.g. a 32-row
    reduction over 16 candidates: an unsplit vector<32xi32> on subgroup-32 targets)."""
    selecting = ("--iree-hal-target-device=", "--iree-vulkan-target=")
    facts = iree_target_facts(target.flags, target.profile or target.arch)
    api = "metal" if target.target == "metal" else "vulkan"
    notes = [*target.notes, PORTABLE_NOTE.format(name=target.profile or target.arch, error=error)]
    return replace(target, flags=[f for f in target.flags if not f.startswith(selecting)], notes=notes,
                   subgroup_sizes=None, profile=f"{target.profile or target.arch} (portable)",
                   device_targets=host_target(facts, arch=target.arch, api=api), storage16=facts.storage16,
                   portable=True)




def flags(arch: str = DEFAULT_ARCH) -> CompileTarget:
    notes = ["attention lowered as matmul-softmax-matmul (SPIR-V has no iree_linalg_ext.attention)"]
    if arch == "host":
        device = query_host_device()
        if device is None:
            raise TargetError("--target vulkan --arch host: no Vulkan device found (is vulkaninfo from vulkan-tools "
                              "installed, and a driver such as mesa-vulkan-drivers?); name a profile with --arch")
        profile = profile_for(device)
        if profile is None:
            notes.append(f"host device {device.name!r}: subgroup size {device.subgroup_size}, "
                         f"{device.shared_memory_bytes} B shared memory, int64 {device.int64}, fp16 {device.float16}"
                         " -> a target built from the device (no stock profile matches its subgroup size)")
            demote = [] if device.int64 else [DEMOTE_I64]
            notes += [] if device.int64 else [DEMOTE_NOTE]
            return CompileTarget("vulkan", arch, DRIVER, demote, "vulkan-spirv-fb", notes,
                               subgroup_sizes=(device.subgroup_size,), profile="host",
                               device_targets=host_target(device), storage16=device.storage16, portable=True)
        notes.append(f"host device {device.name!r}: subgroup size {device.subgroup_size} -> profile {profile}")
    elif arch == BASELINE:
        notes += [BASELINE_NOTE, DEMOTE_NOTE]
        return CompileTarget("vulkan", arch, DRIVER, [DEMOTE_I64], "vulkan-spirv-fb", notes, subgroup_sizes=None,
                           profile=BASELINE, device_targets=host_target(BASELINE_DEVICE, arch=BASELINE), portable=True,
                           storage16=False)
    elif arch in PROFILES:
        profile = arch
    else:
        raise TargetError(f"--arch {arch!r} is not a vulkan profile (known: {', '.join(ARCHES)})")
    demote = profile in NO_INT64
    return CompileTarget("vulkan", arch, DRIVER, ["--iree-hal-target-device=vulkan", f"--iree-vulkan-target={profile}",
                                                *([DEMOTE_I64] if demote else [])],
                       "vulkan-spirv-fb", notes + ([DEMOTE_NOTE] if demote else []), subgroup_sizes=PROFILES[profile],
                       profile=profile)
