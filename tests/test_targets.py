"""targets/: flags per target and architecture, and the Vulkan profile choice from device facts."""

import pytest

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.targets import TargetError, get_target
from kimi_iree.targets.vulkan import BASELINE, VulkanDevice, host_target, profile_for


@pytest.mark.parametrize("target,arch,flag,driver", [
    ("cpu", "host", "--iree-llvmcpu-target-cpu=host", "local-task"),
    ("cpu", "aarch64-linux-android", "--iree-llvmcpu-target-triple=aarch64-none-linux-android34", "local-task"),
    ("cpu", "x86_64-pc-windows-msvc", "--iree-llvmcpu-target-cpu=x86-64-v3", "local-task"),
    ("cuda", "sm_86", "--iree-cuda-target=sm_86", "cuda"),
    ("cuda", "sm_90", "--iree-cuda-target=sm_89", "cuda"),      # IREE 3.13 has no sm_90: PTX fallback
    ("rocm", "gfx950", "--iree-rocm-target=gfx950", "hip"),
    ("vulkan", "valhall", "--iree-vulkan-target=valhall", "vulkan"),
    ("metal", "apple", "--iree-hal-target-device=metal", "metal"),
])
def test_target_flags_and_driver(target, arch, flag, driver):
    t = get_target(target).flags(arch)
    assert flag in t.flags and t.driver == driver


def test_cuda_fallback_is_recorded():
    assert "JIT-compiled" in get_target("cuda").flags("h200").notes[0]


def test_unknown_target_and_arch_are_named():
    with pytest.raises(TargetError, match="'tpu'"):
        get_target("tpu")
    with pytest.raises(TargetError, match="'sm_20'"):
        get_target("cuda").flags("sm_20")


def test_bf16_activations_need_avx512_bf16(capsys):
    from kimi_iree.driver.build import CompileOptions, resolve_target
    from kimi_iree.frontend.errors import FrontendError
    assert get_target("cpu").flags("znver4").avx512_bf16 and not get_target("cpu").flags("x86-64-v4").avx512_bf16
    with pytest.raises(FrontendError, match="--bf16-activations: the cpu target \\(x86-64-v3\\) has no AVX512-BF16"):
        resolve_target(CompileOptions(arch="x86-64-v3", bf16_activations=True))
    with pytest.raises(FrontendError, match="--bf16-activations"):
        resolve_target(CompileOptions(target="cuda", arch="sm_80", bf16_activations=True))
    assert resolve_target(CompileOptions(arch="znver4", bf16_activations=True)).avx512_bf16


def _device(vendor, subgroup):
    return VulkanDevice("gpu", vendor, subgroup, 65536, 1024, float16=True, int8=True, int16=True, int64=True,
                        storage16=True, storage8=False)


def test_vulkan_host_profile_matches_the_device_subgroup_size():
    assert profile_for(_device(0x10005, 8)) is None              # lavapipe: no stock profile uses 8
    assert profile_for(_device(0x1002, 64)) == "rdna3"
    assert profile_for(_device(0x10DE, 32)) == "ampere"
    assert profile_for(_device(0x13B5, 8)) is None               # a Mali reporting 8, not valhall's 16
    target = host_target(_device(0x10005, 8))                    # then a target built from the device
    assert "subgroup = none" in target and "int64" in target and "b8" not in target
    assert "subgroup_size_choices = [1]" in target      # one thread per workgroup outside matmuls (see host_target)
    assert get_target("vulkan").flags("valhall").subgroup_sizes == (16,)
    assert get_target("vulkan").flags(BASELINE).subgroup_sizes is None


def test_list_targets_names_every_target(capsys):
    assert kimi_compile(["--list-targets"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "cuda", "rocm", "vulkan", "metal"):
        assert out.count(f"{name} ") >= 1


def test_vulkan_targets_without_int64_demote_index_arithmetic():
    from kimi_iree.targets.vulkan import DEMOTE_I64
    assert DEMOTE_I64 in get_target("vulkan").flags("valhall").flags
    assert DEMOTE_I64 not in get_target("vulkan").flags("rdna3").flags


# ------------------------------------------------------------------ which unit a failed compile blames
FAILED_MODULE = """module {
  func.func @decode(%arg0: !torch.vtensor<[1],si32>) -> !torch.vtensor<[1],f32> {
    %0 = torch.aten.neg %arg0 : !torch.vtensor<[1],si32> -> !torch.vtensor<[1],f32>
  }
  util.func private @kimi_fp8_e4m3_b128_gathered_N1_J8_K384_O192_E4(%x: tensor<1x8x384xf32>) -> tensor<1x8x192xf32> {
    %y = linalg.generic
  }
  util.func private @kimi_sparse_mla_attention_B1_T1_H3_index_keys(%q: tensor<1xf32>) -> tensor<1xf32> {
    %k = linalg.generic
  }
}"""


@pytest.mark.parametrize("line, function, unit", [(3, "decode", None),
                                                  (6, "kimi_fp8_e4m3_b128_gathered_N1_J8_K384_O192_E4", "weight_matmul"),
                                                  (9, "kimi_sparse_mla_attention_B1_T1_H3_index_keys", "sparse_attention")])
def test_a_failed_compile_names_its_function_and_unit(line, function, unit):
    from kimi_iree.driver.build import failing_function, unit_of_kernel
    got = failing_function(FAILED_MODULE, f"<stdin>:{line}:10: error: 'func.func' op failed to distribute")
    assert got == function and unit_of_kernel(got) == unit
    assert failing_function(FAILED_MODULE, "<unknown>:0: error: failed to legalize") is None


def test_the_unit_whose_kernel_failed_takes_its_reference_form_first():
    """A failure inside the block-scaled weight kernel turns that unit off, not the sparse-attention unit
    (the first in order when the error names no unit)."""
    from kimi_iree.driver.build import Attempt, CompileError, next_attempt
    from kimi_iree.frontend.units import FusedUnits
    cuda = get_target("cuda").flags("sm_80")
    attempt = Attempt(cuda, 32, FusedUnits(weight_matmul=True, sparse_attention=True))
    error = CompileError("<stdin>:6:10: error: 'func.func' op failed to distribute",
                         "kimi_fp8_e4m3_b128_gathered_N1_J8_K384_O192_E4")
    first = next_attempt(attempt, error, block_given=False)
    assert first.fused == FusedUnits(weight_matmul=False, sparse_attention=True)
    assert first.notes[-1].startswith("weight_matmul unit in its reference form (as --no-weight-fusion)")
    second = next_attempt(first, error, block_given=False)
    assert second.fused == FusedUnits() and next_attempt(second, error, block_given=False) is None
    unnamed = next_attempt(attempt, CompileError("<unknown>:0: error: failed"), block_given=False)
    assert unnamed.fused == FusedUnits(weight_matmul=True, sparse_attention=False)
