"""The same definition compiles for GPU targets and CPU cross triples this machine cannot run:
each module holds an executable of the expected format (checked with iree-dump-module)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint

# A 2-layer K3.1 (KDA + DSA + MXFP4 MoE, both passes on) keeps each compile near 25 s.
TARGETS = [("cuda", "sm_80"), ("cuda", "sm_90"), ("rocm", "gfx942"), ("rocm", "gfx950"), ("rocm", "gfx1100"),
           ("metal", "apple"), ("cpu", "x86_64-linux-gnu"), ("cpu", "aarch64-linux-gnu"),
           ("cpu", "aarch64-linux-android"), ("cpu", "arm64-apple-darwin"), ("cpu", "x86_64-pc-windows-msvc")]
DRIVERS = {"cuda": "cuda", "rocm": "hip", "metal": "metal", "cpu": "local-task"}


@pytest.fixture(scope="module")
def small_k31(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("k31-2") / "ckpt", variant="k3.1", num_layers=2)


@pytest.mark.parametrize("target,arch", TARGETS)
def test_compiles_with_the_expected_executable_format(small_k31, tmp_path, target, arch):
    out = tmp_path / "out"
    assert kimi_compile([str(small_k31), "--target", target, "--arch", arch, "-o", str(out), "--max-context", "64",
                         "--prefill-block", "16", "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    dump_tool = shutil.which("iree-dump-module") or str(Path(__import__("sys").executable).parent / "iree-dump-module")
    dump = subprocess.run([dump_tool, str(out / "model.vmfb")], capture_output=True, text=True, check=True).stdout
    assert module["executable_format"] in dump
    assert module["driver"] == DRIVERS[target]
    assert set(module["fused_units"]) == {"mxfp4_matmul", "sparse_mla_attention"}
