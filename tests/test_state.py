"""The functional state: prefill of N tokens equals N single-token decode steps, and a prompt split
across several prefill calls equals one call."""

import pytest
import torch

from conftest import ALL_FAMILIES
from kimi_iree.frontend import load_model

# The chunked KDA form and the recurrence differ by fp32 reassociation only (about 1e-6 per layer,
# growing through the layers of a random model; in float64 the same comparison agrees to 1e-13).
# Logits are compared against the logit scale, like the oracle tests.
SCALE_TOL = 1e-4


def _assert_close_to_scale(got, want, what="logits"):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < SCALE_TOL, f"{what}: max |a - b| / max|b| = {err:.2e}"


MAX_CONTEXT = 32


def _ids(n, seed=3):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))   # every vocabulary has 256


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prefill_equals_decode_steps(any_checkpoint, family):
    model = load_model(any_checkpoint(family))
    ids = _ids(12)
    with torch.no_grad():
        logits, state = model.prefill(ids, model.init_state(2, MAX_CONTEXT))
        step_state = model.init_state(2, MAX_CONTEXT)
        steps = []
        for t in range(ids.shape[1]):
            out, step_state = model.decode(ids[:, t], step_state)
            steps.append(out)
    _assert_close_to_scale(torch.stack(steps, 1), logits)
    assert state.keys() == step_state.keys()
    for name in state:
        if state[name].is_floating_point():
            _assert_close_to_scale(step_state[name], state[name], name)
        else:
            assert torch.equal(step_state[name], state[name]), name


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prompt_split_across_prefill_calls(any_checkpoint, family):
    model = load_model(any_checkpoint(family))
    ids = _ids(20)
    with torch.no_grad():
        whole, _ = model.prefill(ids, model.init_state(2, MAX_CONTEXT))
        state = model.init_state(2, MAX_CONTEXT)
        parts = []
        for lo, hi in [(0, 7), (7, 8), (8, 20)]:
            out, state = model.prefill(ids[:, lo:hi], state)
            parts.append(out)
    _assert_close_to_scale(torch.cat(parts, 1), whole)
    assert state["position"].item() == 20


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_full_forward_equals_prefill_into_a_larger_cache(any_checkpoint, family):
    """A cache longer than the prompt (the exported shape) changes nothing."""
    model = load_model(any_checkpoint(family))
    ids = _ids(9)
    with torch.no_grad():
        _assert_close_to_scale(model.prefill(ids, model.init_state(2, MAX_CONTEXT))[0], model(ids))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_padded_prefill_block_equals_the_real_tokens(any_checkpoint, family):
    """The exported prefill takes a fixed-size block and a length: padding changes nothing."""
    model = load_model(any_checkpoint(family))
    ids = _ids(13)
    block = torch.cat([ids, torch.full((2, 3), 5)], dim=1)           # 16 = 13 real + 3 padding
    with torch.no_grad():
        want, want_state = model.prefill(ids, model.init_state(2, MAX_CONTEXT))
        got, got_state = model.prefill(block, model.init_state(2, MAX_CONTEXT), length=torch.tensor(13))
        # and decoding on from either state agrees
        nxt = ids[:, :1]
        want_next, _ = model.decode(nxt, want_state)
        got_next, _ = model.decode(nxt, got_state)
    _assert_close_to_scale(got[:, :13], want)
    _assert_close_to_scale(got_next, want_next)
    assert got_state["position"].item() == 13
    for name in want_state:
        if name.endswith(("latent", "k_pe", "index_keys")):
            _assert_close_to_scale(got_state[name][:, :13], want_state[name][:, :13], name)
        elif want_state[name].is_floating_point():
            _assert_close_to_scale(got_state[name], want_state[name], name)
