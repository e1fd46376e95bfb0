import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from hf_checkpoints import write_hf_checkpoint, write_kimi_linear_mxfp4  # noqa: E402
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint  # noqa: E402

HF_FAMILIES = ["kimi_linear", "kimi_linear_mxfp4", "deepseek_v3", "deepseek_v32", "kimi_k25"]
SYNTHETIC_FAMILIES = ["k3.1", "k3"]
ALL_FAMILIES = HF_FAMILIES + SYNTHETIC_FAMILIES


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(family) -> (directory, transformers model); built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            if family == "kimi_linear_mxfp4":
                model = write_kimi_linear_mxfp4(directory)
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
