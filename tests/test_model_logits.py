"""Whole models, compiled for cpu and vulkan, against the oracle: transformers for the families it
implements (DeepSeek-V3.2 with its selection active: index_topk below the tokens), our eager model for
the synthetic K3.1 (no public implementation). Logits, not perplexity: on random weights perplexity is
nearly flat (a module 0.3 of max|logit| off transformers scored within 2e-3 of its perplexity).

Each module scores 40 prompt tokens (several prefill blocks, the last one padded) and then decodes two
tokens; the oracle sees the same 42 tokens in one causal forward.
"""

import os

import numpy as np
import pytest
import torch

from hf_checkpoints import oracle_logits
from kimi_iree.frontend import load_model

from conftest import module_logits, relative_error

ORACLE_FAMILIES = ["kimi_linear", "kimi_linear_odd", "kimi_linear_mxfp4", "deepseek_v32", "deepseek_v32_issue16",
                   "kimi_k25", "deepseek_v32_fp8", "kimi_k2_fp8", "kimi_k25_int4"]
# relative to max|logit|: IREE reassociates f32 sums (O3), and the random models amplify rounding
COMPILED_TOL = 1e-3
DECODED = [11, 12]


def _ids(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, 40).tolist()


def _oracle(hf_checkpoint, family: str, ids: list[int]) -> np.ndarray:
    _, model = hf_checkpoint(family)
    return oracle_logits(model, torch.tensor([ids + DECODED]))[0].numpy()


@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_cpu_module_matches_transformers(compiled, hf_checkpoint, family):
    ids = _ids()
    err = relative_error(module_logits(compiled(family)[0], ids), _oracle(hf_checkpoint, family, ids))
    print(f"{family}: cpu module vs transformers {err:.1e}")
    assert err < COMPILED_TOL


# on lavapipe: one Kimi-Linear (the odd shapes), both DeepSeek-V3.2 configurations, K2.5, and the two
# published quantised layouts issue 19 names (FP8 DeepSeek-V3.2, INT4 K2.5); the MXFP4 path on Vulkan is
# the synthetic K3.1's (test_k31_module_matches_eager)
# (the plain deepseek_v32, a subset of what issue 16's configuration exercises, and kimi_k25, whose
# architecture kimi_k25_int4 runs, only in the full run: KIMI_ALL_TARGETS=1, for CI's time budget)
VULKAN_FAMILIES = ["kimi_linear_odd", "deepseek_v32_issue16", "deepseek_v32_fp8", "kimi_k25_int4",
                   *(["deepseek_v32", "kimi_k25"] if os.environ.get("KIMI_ALL_TARGETS") else [])]


@pytest.mark.parametrize("family", VULKAN_FAMILIES)
def test_vulkan_module_matches_transformers(vulkan_compiled, hf_checkpoint, family):
    ids = _ids()
    err = relative_error(module_logits(vulkan_compiled(family), ids), _oracle(hf_checkpoint, family, ids))
    print(f"{family}: vulkan module vs transformers {err:.1e}")
    assert err < COMPILED_TOL


def test_deepseek_v32_issue16_selection_is_active(hf_checkpoint):
    """index_topk 24 is below the 42 tokens: the indexer drops keys (the oracle with every key differs)."""
    directory, model = hf_checkpoint("deepseek_v32_issue16")
    ids = torch.tensor([_ids() + DECODED])
    sparse = oracle_logits(model, ids)
    model.config.index_topk = 10_000
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 10_000
    try:
        dense = oracle_logits(model, ids)
    finally:
        model.config.index_topk = 24
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 24
    assert relative_error(sparse.numpy(), dense.numpy()) > 1e-2


@pytest.mark.parametrize("target", ["cpu", "vulkan"])
def test_k31_module_matches_eager(compiled, vulkan_compiled, target):
    out, checkpoint = compiled("k3.1")
    if target == "vulkan":
        out = vulkan_compiled("k3.1")
    ids = _ids()
    model = load_model(checkpoint)
    with torch.no_grad():
        want = model(torch.tensor([ids + DECODED]))[0].numpy()
    err = relative_error(module_logits(out, ids), want)
    print(f"k3.1: {target} module vs eager {err:.1e}")
    assert err < COMPILED_TOL
