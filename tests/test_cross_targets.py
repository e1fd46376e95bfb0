"""The same definition compiles for GPU targets and CPU cross triples this machine cannot run:
each module holds an executable of the expected format (checked with iree-dump-module)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
from kimi_iree.passes.kda import kda_decode_applies
from kimi_iree.targets import cpu

# A 2-layer K3.1 (KDA + DSA + MXFP4 MoE, both passes on) keeps each compile near 25 s. Whole models
# for one target of each codegen here (Metal: the portable-form test below); every unit and block is
# compiled for cuda, rocm and metal by tests/test_backend_ops.py. KIMI_ALL_TARGETS=1 compiles the rest.
TARGETS = [("cuda", "sm_90"), ("cpu", "aarch64-linux-gnu"),
           # Vulkan profiles without Int64 (adreno also without 8-bit storage), at the default prefill
           # block: each hit an IREE 3.13 SPIR-V codegen failure the model or the MXFP4 pass now avoids
           # (valhall compiles in CI through the fallback tests below and test_vulkan's refusal test)
           ("vulkan", "adreno")]
if os.environ.get("KIMI_ALL_TARGETS"):
    TARGETS += [("vulkan", "valhall"), ("metal", "apple"), ("rocm", "gfx942"), ("cuda", "sm_80"), ("rocm", "gfx950"), ("rocm", "gfx1100"),
                ("cpu", "x86_64-linux-gnu"), ("cpu", "aarch64-linux-android"), ("cpu", "arm64-apple-darwin"),
                ("cpu", "x86_64-pc-windows-msvc")]
DRIVERS = {"cuda": "cuda", "rocm": "hip", "metal": "metal", "cpu": "local-task", "vulkan": "vulkan"}


@pytest.fixture(scope="module")
def small_k31(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("k31-2") / "ckpt", variant="k3.1", num_layers=2)


@pytest.mark.parametrize("target,arch", TARGETS)
def test_compiles_with_the_expected_executable_format(small_k31, tmp_path, target, arch):
    out = tmp_path / "out"
    block = [] if target == "vulkan" else ["--prefill-block", "16"]
    assert kimi_compile([str(small_k31), "--target", target, "--arch", arch, "-o", str(out), "--max-context", "64",
                         *block, "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    dump_tool = shutil.which("iree-dump-module") or str(Path(__import__("sys").executable).parent / "iree-dump-module")
    dump = subprocess.run([dump_tool, str(out / "model.vmfb")], capture_output=True, text=True, check=True).stdout
    assert module["executable_format"] in dump
    assert module["driver"] == DRIVERS[target]
    # bf16 linears take our dense kernel on every llvm-cpu triple (its linalg form has no ISA of its own)
    dense = {"dense_matmul"} if target == "cpu" else set()
    # KDA's decode dispatch on the x86 triples (AVX2 at least), at a head dim in whole vectors
    isa = cpu.flags(arch) if target == "cpu" else None
    head_dim = json.loads((out / "model.json").read_text())["config"]["kda_head_dim"]
    kda = ({"kda_decode"} if isa is not None and (isa.avx512 or isa.avx2) and kda_decode_applies(head_dim, isa.avx512)
           else set())
    assert set(module["fused_units"]) == {"weight_matmul", "sparse_mla_attention"} | dense | kda
    if target == "cpu":          # the x86 triples' baseline (x86-64-v3) has AVX2 for the MXFP4 dispatch, arm neither
        assert any("no AVX-512F or AVX2" in note for note in module["fallbacks"]) != arch.startswith("x86_64")


@pytest.mark.parametrize("target,arch", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_real_head_dims_compile_fused_for_cuda_and_rocm(hf_checkpoint, tmp_path, target, arch):
    """DeepSeek-V3.2 in the published FP8 layout at its real head dims (kv_lora 512, rope 64, dn = dv = 128,
    index head 128) compiles for CUDA and ROCm with both units fused and no fallback: the FP8 kernel's
    reduction over K >= 128 and the reference selection failed IREE's reduction distribution there while
    every tiny family compiled."""
    checkpoint, _ = hf_checkpoint("deepseek_v32_fp8_real_dims")
    out = tmp_path / "out"
    assert kimi_compile([str(checkpoint), "--target", target, "--arch", arch, "-o", str(out), "--max-context", "64",
                         "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    assert set(module["fused_units"]) == {"weight_matmul", "sparse_mla_attention"}
    assert not [note for note in module["fallbacks"] if "reference form" in note]
    if target != "cuda":                     # ROCm compiles the reference selection's rows in test_backend_ops
        return
    # the selection's reference form, as --no-sparse-attention-fusion builds it: the pairwise rank over a
    # 64-slot window and the radix select over the 300-slot cache
    out = tmp_path / "reference"
    assert kimi_compile([str(checkpoint), "--target", target, "--arch", arch, "-o", str(out), "--max-context", "300",
                         "--context-windows", "64", "--no-sparse-attention-fusion", "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    assert set(module["fused_units"]) == {"weight_matmul"}


def test_vulkan_host_without_int64_or_8bit_storage_compiles(small_k31, tmp_path, monkeypatch):
    """`--arch host` on a device lacking shaderInt64 and 8-bit storage (a target built from the device's
    facts, no stock profile): the int32 demotion and the word-read MXFP4 scales make it compile."""
    from kimi_iree.targets import vulkan
    device = vulkan.VulkanDevice(name="no-int64 test device", vendor_id=0x10005, subgroup_size=8,
                                 shared_memory_bytes=32768, max_invocations=256, float16=False, int8=True,
                                 int16=True, int64=False, storage16=True, storage8=False)
    monkeypatch.setattr(vulkan, "query_host_device", lambda: device)
    out = tmp_path / "out"
    assert kimi_compile([str(small_k31), "--target", "vulkan", "--arch", "host", "-o", str(out),
                         "--max-context", "64", "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    assert module["subgroup_sizes"] == [8] and any("int32" in note for note in module["fallbacks"])


def _fail_at_block_32(monkeypatch):
    """compile_module failing as IREE 3.13 did for the stock vp_android_baseline_2022 profile at
    prefill block 32 (an attention-residual dispatch over the profile's 16 KiB of shared memory)."""
    from kimi_iree.driver import build as driver
    blocks = []

    def compile_module(mlir, *_):
        tokens = re.search(r"@prefill\(%arg0: !torch\.vtensor<\[1,(\d+)\],si32>", mlir)
        blocks.append(int(tokens[1]) if tokens else None)
        if blocks[-1] == 32:
            raise driver.CompileError("<stdin>:1:1: error: function 'd' uses 16640 bytes of shared memory; exceeded "
                                      "the limit of 16384 bytes")
        return b"vmfb"
    monkeypatch.setattr(driver, "compile_module", compile_module)
    return blocks


def test_shared_memory_overflow_halves_the_default_prefill_block(small_k31, tmp_path, monkeypatch):
    blocks = _fail_at_block_32(monkeypatch)
    out = tmp_path / "out"
    assert kimi_compile([str(small_k31), "--target", "vulkan", "--arch", "valhall", "-o", str(out),
                         "--max-context", "64", "--quiet"]) == 0
    assert blocks == [32, 16]
    module = json.loads((out / "model.json").read_text())["module"]
    assert module["prefill_block"] == 16 and module["entry_points"]["prefill"]["inputs"][0][1] == [1, 16]
    assert any(note.startswith("prefill block 16, not 32") and "16384 B" in note for note in module["fallbacks"])


def test_an_explicit_prefill_block_is_not_changed(small_k31, tmp_path, monkeypatch, capsys):
    """A --prefill-block the user gave is kept: the other fallbacks are tried at that block (the portable
    form, the units' reference forms), and when all fail the error names the block."""
    blocks = _fail_at_block_32(monkeypatch)
    out = tmp_path / "out"
    assert kimi_compile([str(small_k31), "--target", "vulkan", "--arch", "valhall", "-o", str(out),
                         "--max-context", "64", "--prefill-block", "32", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert set(blocks) == {32} and len(blocks) == 4          # stock, portable, then each unit's reference form
    assert err[-1].startswith("error: ") and "16640 bytes" in err[-1]
    assert "--prefill-block 32: try a smaller block" in err[-1]
    assert not (out / "model.json").exists()


def test_a_stock_profile_that_cannot_compile_falls_back_to_the_portable_form(small_k31, tmp_path, monkeypatch):
    """IREE 3.13's stock SPIR-V configurations fail some shapes (Metal and subgroup-32 Vulkan profiles: an
    unsplit vector<32xi32> in a 32-row reduction over 16 candidates); kimi-compile then builds the
    target without subgroup operations (the form lavapipe tests) and says so in the manifest."""
    from kimi_iree.driver import build as driver
    real, seen = driver.compile_module, []

    def compile_module(mlir, flags, *rest):
        seen.append("hal.device.targets" in mlir)
        if not seen[-1]:
            raise driver.CompileError("<unknown>:0: error: failed to legalize operation 'arith.constant': "
                                      "dense<0> : vector<32xi32>")
        return real(mlir, flags, *rest)
    monkeypatch.setattr(driver, "compile_module", compile_module)
    out = tmp_path / "out"
    assert kimi_compile([str(small_k31), "--target", "metal", "-o", str(out), "--max-context", "64",
                         "--prefill-block", "16", "--quiet"]) == 0
    assert seen == [False, True]
    module = json.loads((out / "model.json").read_text())["module"]
    assert module["vulkan_profile"] == "apple (portable)"
    assert any(n.startswith("compiled in the portable form") and "vector<32xi32>" in n for n in module["fallbacks"])
    assert set(module["fused_units"]) == {"weight_matmul", "sparse_mla_attention"}
