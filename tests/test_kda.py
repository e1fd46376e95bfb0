"""KDA: the chunked prefill form equals the token recurrence."""

import pytest
import torch

from kimi_iree.frontend.kda import kda_chunked, kda_recurrent, l2norm


def _inputs(T, B=2, H=3, dk=16, dv=16, seed=0, lower_bound=None):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(B, T, H, dk, generator=g))
    v = torch.randn(B, T, H, dv, generator=g)
    f = torch.randn(B, T, H, dk, generator=g)
    gate = (lower_bound * torch.sigmoid(f)) if lower_bound else -torch.nn.functional.softplus(f)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    state = torch.randn(B, H, dk, dv, generator=g) * 0.1
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("T,chunk", [(1, 16), (16, 16), (45, 16), (70, 32), (33, 64)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunked_equals_recurrent(T, chunk, lower_bound):
    q, k, v, g, beta, state = _inputs(T, lower_bound=lower_bound)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    # fp32 on both sides; the chunked form reassociates sums over up to `chunk` tokens.
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


def test_chunked_state_carries_across_calls():
    q, k, v, g, beta, state = _inputs(50)
    o_all, s_all = kda_chunked(q, k, v, g, beta, state)
    o1, s1 = kda_chunked(q[:, :21], k[:, :21], v[:, :21], g[:, :21], beta[:, :21], state)
    o2, s2 = kda_chunked(q[:, 21:], k[:, 21:], v[:, 21:], g[:, 21:], beta[:, 21:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-5)
