"""Finding inputs whose DSA selection is unambiguous.

With ReLU scores, two keys can score exactly the same (both 0.0); where such a tie straddles a
query's top-k boundary, which key is kept is arbitrary (torch.topk and our stable selection may
differ), so an oracle comparison needs inputs without boundary ties.
"""

from __future__ import annotations

import torch

from kimi_iree.frontend import dsa


def boundary_ties(model, ids: torch.Tensor) -> int:
    """Number of (layer, batch, query) rows whose top-k boundary falls inside a tie."""
    recorded = []
    original = dsa.index_scores

    def recording(*args, **kwargs):
        s = original(*args, **kwargs)
        recorded.append(s)
        return s

    dsa.index_scores = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        dsa.index_scores = original
    ties = 0
    k = model.cfg.index_topk
    for s in recorded:
        T = s.shape[1]
        for t in range(k, T):          # rows with more visible keys than k
            row = s[:, t, : t + 1].sort(dim=-1, descending=True).values
            ties += int((row[:, k - 1] == row[:, k]).sum())
    return ties


def ids_without_ties(model, batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    for attempt in range(50):
        ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed + attempt))
        if boundary_ties(model, ids) == 0:
            return ids
    raise AssertionError("no tie-free input found in 50 tries: the fixture's indexer is degenerate")
