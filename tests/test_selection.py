"""Radix selection (frontend/selection.py) against a stable descending sort, ties to the earliest index."""

import pytest
import torch

from kimi_iree.frontend.selection import kth_largest, member_slots, order_key, stable_order, topk_members


def test_order_key_keeps_float_order_and_folds_negative_zero():
    x = torch.tensor([float("-inf"), -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38])
    key = order_key(x)
    assert (key.diff() > 0).sum() == len(x) - 2      # strictly increasing except -0.0 == +0.0
    assert key[4] == key[5]


@pytest.mark.parametrize("seed", range(6))
def test_topk_members_match_a_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(30):
        n = int(torch.randint(1, 400, (), generator=g))
        k = int(torch.randint(1, n + 1, (), generator=g))
        x = torch.randn(4, n, generator=g) * 10.0 ** int(torch.randint(-6, 6, (), generator=g))
        if seed % 2:
            x = x.round()                              # many ties
        ref = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(kth_largest(x, k)[:, 0], ref.values[:, k - 1])
        expect = torch.zeros_like(x, dtype=torch.bool).scatter(1, ref.indices[:, :k], True)
        members = topk_members(x, k)
        assert torch.equal(members, expect)
        slots = member_slots(members, k)
        assert torch.equal((slots * torch.arange(n)).sum(-1).long(), expect.nonzero()[:, 1].view(4, k))


def test_topk_members_with_fewer_valid_entries_than_k_keeps_only_valid_ones():
    x = torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0]])
    valid = torch.tensor([[True, False, True, False, False]])
    assert topk_members(x, 3, valid).tolist() == [[True, False, True, False, False]]


def test_kth_largest_rejects_k_out_of_range():
    with pytest.raises(ValueError, match="k=6"):
        kth_largest(torch.zeros(5), 6)


@pytest.mark.parametrize("n,values", [(1, 1), (7, 3), (128, 64), (256, 8)])
def test_stable_order_matches_a_stable_sort(n, values):
    g = torch.Generator().manual_seed(n)
    keys = torch.randint(0, values, (n,), generator=g)
    order, rank = stable_order(keys)
    assert torch.equal(order, torch.sort(keys, stable=True).indices)
    assert torch.equal(order[rank], torch.arange(n))


@pytest.mark.parametrize("seed", range(4))
def test_pairwise_ranks_keep_what_the_radix_select_keeps(seed, monkeypatch):
    """Routers' few entries take pairwise ranks (one [n, n] reduction), longer rows the radix select: the
    same members and the same k-th value, with ties, -inf values and invalid entries."""
    from kimi_iree.frontend import selection
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        n = int(torch.randint(1, 80, (), generator=g))
        k = int(torch.randint(1, n + 1, (), generator=g))
        x = (torch.randn(3, n, generator=g) * 4).round()               # many ties
        x[torch.rand(3, n, generator=g) < 0.1] = float("-inf")
        valid = torch.rand(3, n, generator=g) < 0.7
        forms = []
        for pairwise_max in (0, 1 << 20):
            monkeypatch.setattr(selection, "PAIRWISE_MAX", pairwise_max)
            forms.append((topk_members(x, k), topk_members(x, k, valid), kth_largest(x, k)))
        for radix, pairwise in zip(*forms):
            assert torch.equal(radix, pairwise)
