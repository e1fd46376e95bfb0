"""Our eager model against transformers 5.23 on tiny random checkpoints of each family."""

import pytest
import torch

from hf_checkpoints import VOCAB
from selection_ties import ids_without_ties
from kimi_iree.frontend import load_model

# f32 on both sides; the only differences are summation order and the absorbed MLA form.
REL_TOL = 1e-4


def _logits_close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_linear_mxfp4", "deepseek_v3", "deepseek_v32", "kimi_k25"])
def test_logits_match_transformers(hf_checkpoint, family):
    directory, ref = hf_checkpoint(family)
    ours = load_model(directory)
    if ours.cfg.has_indexer:
        ids = ids_without_ties(ours, 2, 19, VOCAB, seed=7)   # see selection_ties.py
    else:
        ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits.float()
        got = ours(ids)
    err = _logits_close(got, expected)
    print(f"{family}: max |ours - transformers| / max|logit| = {err:.2e}")
    assert err < REL_TOL


def test_deepseek_v32_selection_is_active(hf_checkpoint):
    """index_topk (4) is below the 19 tokens, so the indexer really drops keys here."""
    directory, ref = hf_checkpoint("deepseek_v32")
    sparse, dense = load_model(directory), load_model(directory, index_topk=10_000)
    ids = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (sparse(ids) - dense(ids)).abs().max() > 1e-3


def test_kimi_k25_drops_vision_tensors(hf_checkpoint):
    from kimi_iree.frontend.checkpoint import CheckpointReader, map_checkpoint
    directory, _ = hf_checkpoint("kimi_k25")
    model = load_model(directory)
    mapped = map_checkpoint(CheckpointReader(directory), model.cfg)
    assert mapped.dropped["vision"] > 0 and mapped.dropped["mm_projector"] > 0
    assert not any("vision" in n or "projector" in n for n in mapped.tensors)
