import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from hf_checkpoints import PUBLISHED, REAL_DIMS, write_hf_checkpoint, write_kimi_linear_mxfp4, write_published_checkpoint  # noqa: E402
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint  # noqa: E402

HF_FAMILIES = ["kimi_linear", "kimi_linear_odd", "kimi_linear_mxfp4", "deepseek_v3", "deepseek_v32",
               "deepseek_v32_issue16", "kimi_k25"]
# published quantised layouts (issue 19): FP8 block-scaled DeepSeek-V3.2 and Kimi-K2, INT4 K2.5 experts
PUBLISHED_FAMILIES = list(PUBLISHED)
SYNTHETIC_FAMILIES = ["k3.1", "k3"]
ALL_FAMILIES = HF_FAMILIES + PUBLISHED_FAMILIES + SYNTHETIC_FAMILIES


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(family) -> (directory, transformers model); built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            if family == "kimi_linear_mxfp4":
                model = write_kimi_linear_mxfp4(directory)
            elif family in PUBLISHED or family in REAL_DIMS:
                model = write_published_checkpoint(family, directory)
            else:
                model = write_hf_checkpoint(family, directory)
            cache[family] = (directory, model)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def any_checkpoint(hf_checkpoint, tmp_path_factory):
    """any_checkpoint(family) -> checkpoint directory, for transformers-written and synthetic ones."""
    synthetic = {}

    def get(family: str):
        if family in SYNTHETIC_FAMILIES:
            if family not in synthetic:
                synthetic[family] = write_synthetic_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", variant=family)
            return synthetic[family]
        return hf_checkpoint(family)[0]
    return get


COMPILE_ARGS = ["--target", "cpu", "--max-context", "64", "--prefill-block", "16", "--quiet"]
# issue 16's checkpoint is compiled at the default prefill block (32): its bug showed from position 16
# of a 32-token block, with index_topk 24 between the two
EXTRA_COMPILE_ARGS = {"deepseek_v32_issue16": ["--prefill-block", "32"]}


@pytest.fixture(scope="session")
def compiled(any_checkpoint, tmp_path_factory):
    """compiled(family) -> (OUT directory, checkpoint): an IREE cpu module, built once per session.
    The synthetic K3.1 goes through `kimi-compile --demo`, the path `make demo` takes."""
    from kimi_iree.driver.kimi_compile import main as kimi_compile
    cache = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"iree-{family}")
            if family == "k3.1":
                assert kimi_compile(["--demo", "-o", str(out), *COMPILE_ARGS]) == 0
                checkpoint = out / "synthetic-k3.1"
            else:
                checkpoint = any_checkpoint(family)
                args = [str(checkpoint), "-o", str(out), *COMPILE_ARGS, *EXTRA_COMPILE_ARGS.get(family, [])]
                assert kimi_compile(args) == 0
            cache[family] = (out, checkpoint)
        return cache[family]

    return get


VULKAN_ARGS = ["--target", "vulkan", "--arch", "host", "--max-context", "64", "--prefill-block", "16", "--quiet"]


@pytest.fixture(scope="session")
def vulkan_compiled(compiled, tmp_path_factory):
    """vulkan_compiled(family, *extra_flags) -> OUT of the family's checkpoint compiled for the host Vulkan
    device (lavapipe here), built once per session. Skips where there is no Vulkan device."""
    from kimi_iree.driver.kimi_compile import main as kimi_compile
    from kimi_iree.targets.vulkan import query_host_device
    cache = {}

    def get(family, *extra):
        if query_host_device() is None:
            pytest.skip("no Vulkan device here (CI installs mesa-vulkan-drivers, libvulkan1 and vulkan-tools)")
        if (family, extra) not in cache:
            _, checkpoint = compiled(family)
            out = tmp_path_factory.mktemp(f"vulkan-{family}")
            assert kimi_compile([str(checkpoint), "-o", str(out), *VULKAN_ARGS, *EXTRA_COMPILE_ARGS.get(family, []),
                                 *extra]) == 0
            cache[(family, extra)] = out
        return cache[(family, extra)]
    return get


BATCH = 3          # the sequence slots of the batched test modules
# their context windows: at the synthetic K3.1's index_topk (8: attention over the window is dense there)
# and above it (selection over the window); a call past 32 takes the whole cache
WINDOWS = (8, 32)


@pytest.fixture(scope="session")
def batched(compiled, vulkan_compiled, tmp_path_factory):
    """batched(target) -> (the synthetic K3.1's batch-1 module for target ("cpu" or "vulkan"), the same
    compiled with --max-batch BATCH): a slot is held to the batch-1 module of its own target."""
    from kimi_iree.driver.kimi_compile import main as kimi_compile
    cache = {}

    def get(target: str = "cpu"):
        if target not in cache:
            single, checkpoint = compiled("k3.1")
            if target == "vulkan":
                single = vulkan_compiled("k3.1")       # skips where there is no Vulkan device
            out = tmp_path_factory.mktemp(f"batched-{target}")
            args = COMPILE_ARGS if target == "cpu" else VULKAN_ARGS
            assert kimi_compile([str(checkpoint), "-o", str(out), *args, "--max-batch", str(BATCH),
                                 "--context-windows", ",".join(map(str, WINDOWS))]) == 0
            cache[target] = (single, out)
        return cache[target]
    return get


def module_logits(out, ids: list[int]) -> np.ndarray:
    """A compiled module's logits for every prompt token, then two decode steps: [len(ids) + 2, vocab]."""
    from kimi_iree.runtime import Session
    session = Session(out)
    prefill = session.prefill(ids, all_logits=True)
    return np.concatenate([prefill, [session.decode(11)], [session.decode(12)]])


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want| / max|want|: logits compared relative to their largest magnitude."""
    return float(np.abs(got - want).max() / np.abs(want).max())


# Markers (pyproject.toml): `compile` for tests that build a whole module or a table of kernels with
# iree-compile (minutes), `vulkan` for those that run on the Vulkan device. `pytest -m "not compile"`
# runs the rest in well under a minute; `make test` runs everything.
COMPILE_FIXTURES = {"compiled", "batched", "vulkan_compiled", "vulkan", "fused_and_unfused", "table_results", "small_k31"}
COMPILE_MODULES = {"test_backend_ops", "test_model_logits", "test_cross_targets", "test_vulkan"}


def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = item.module.__name__.rsplit(".", 1)[-1]
        if fixtures & COMPILE_FIXTURES or module in COMPILE_MODULES:
            item.add_marker(pytest.mark.compile)
        if "vulkan" in item.nodeid or module == "test_vulkan":
            item.add_marker(pytest.mark.vulkan)
