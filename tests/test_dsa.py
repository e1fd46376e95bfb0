"""DSA: with index_topk covering every key the layer is exactly dense attention; below it, it is not."""

import copy

import pytest
import torch

from hf_checkpoints import VOCAB
from kimi_iree.frontend import KimiModel, load_model
from kimi_iree.frontend.dsa import visible_slots
from kimi_iree.frontend.selection import topk_members

DSA_FAMILIES = ["deepseek_v32", "k3.1"]


def without_indexer(model: KimiModel) -> KimiModel:
    """The same model with each attention layer's indexer removed: plain MLA attention."""
    dense = copy.deepcopy(model)
    for block in dense.layers:
        if block.kind == "mla":
            block.mixer.indexer = None
    return dense


@pytest.fixture(params=DSA_FAMILIES)
def dsa_checkpoint(request, any_checkpoint):
    return any_checkpoint(request.param)


def test_dsa_equals_dense_attention_when_topk_covers_context(dsa_checkpoint):
    T, cache = 12, 32
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    model = load_model(dsa_checkpoint, index_topk=T)      # selection runs (T < cache) and keeps everything
    dense = without_indexer(model)
    with torch.no_grad():
        sparse_logits, _ = model.prefill(ids, model.init_state(2, cache))
        dense_logits, _ = dense.prefill(ids, dense.init_state(2, cache))
    assert torch.equal(sparse_logits, dense_logits)


def test_dsa_differs_from_dense_when_topk_below_context(dsa_checkpoint):
    T = 12
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    model = load_model(dsa_checkpoint, index_topk=3)
    dense = without_indexer(model)
    with torch.no_grad():
        diff = (model(ids) - dense(ids)).abs()
    assert diff[:, :3].max() == 0          # the first 3 queries see at most 3 keys: nothing dropped
    assert diff[:, 3:].max() > 1e-3


def test_selection_keeps_every_visible_key_when_fewer_than_k():
    scores = torch.randn(1, 4, 6)
    visible = visible_slots(torch.arange(4)[None], 6)
    keep = topk_members(scores, 5, visible)
    assert torch.equal(keep, visible.expand(1, 4, 6))   # no garbage (invisible) rows kept


def test_selection_breaks_ties_towards_the_earliest_key():
    keep = topk_members(torch.zeros(1, 1, 6), 2, torch.ones(1, 1, 6, dtype=torch.bool))
    assert keep[0, 0].tolist() == [True, True, False, False, False, False]
