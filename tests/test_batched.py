"""Batched modules (`kimi-compile --max-batch N`): every sequence slot computes what the batch-1 module
computes, at its own position, whatever the other slots are doing, and kimi-run still runs them.
The batched modules also carry context windows (`--context-windows`, conftest.WINDOWS) and the batch-1
ones none: each call there takes the smallest window holding its rows' tokens, so every comparison
with the batch-1 module holds the windowed entries to the whole-cache ones too."""

import contextlib
import io
import json
import os

import numpy as np
import pytest

from conftest import BATCH, WINDOWS, relative_error
from kimi_iree.runtime import Session
from kimi_iree.runtime.cli import main as kimi_run

TOL = 1e-5                  # of max|logit|, the bound for a slot against the batch-1 module
DECODE_STEPS = 6


def prompts(vocab: int, lengths: tuple[int, ...] = (5, 37, 20)) -> list[list[int]]:
    """Ragged prompts: within one block, across three blocks (16-token blocks), across two."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab - 3, n).tolist() for n in lengths]


def batch1_run(out, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """Every prompt position's logits, then DECODE_STEPS greedy steps, on the batch-1 module."""
    session = Session(out)
    rows = [session.prefill(prompt, all_logits=True)]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(np.argmax(rows[-1][-1])))
        rows.append(session.decode(tokens[-1])[None])
    return np.concatenate(rows), tokens


def staggered_run(session: Session, prompts: list[list[int]], joins: list[int]) -> list[tuple[np.ndarray, list[int]]]:
    """The prompts run together on a batched session as a server runs them: sequence i joins at step
    joins[i]; each step is one prefill call for the sequences still reading their prompt (a block each)
    and one decode call for those generating."""
    sequences = [None] * len(prompts)
    rows, tokens, fed = [[] for _ in prompts], [[] for _ in prompts], [0] * len(prompts)
    P = session.prefill_block
    step = 0
    while any(len(t) < DECODE_STEPS for t in tokens):
        for i, at in enumerate(joins):
            if at == step:
                sequences[i] = session.new_sequence()
        live = [i for i in range(len(prompts)) if sequences[i] is not None]
        reading = [i for i in live if fed[i] < len(prompts[i])]
        generating = [i for i in live if fed[i] == len(prompts[i]) and len(tokens[i]) < DECODE_STEPS]
        if reading:
            blocks = [prompts[i][fed[i]: fed[i] + P] for i in reading]
            for i, block, logits in zip(reading, blocks, session.prefill_rows(
                    [(sequences[i], b) for i, b in zip(reading, blocks)], all_logits=True)):
                fed[i] += len(block)
                rows[i].append(logits)
        if generating:
            for i in generating:
                tokens[i].append(int(np.argmax(rows[i][-1][-1])))
            for i, logits in zip(generating, session.decode_rows([(sequences[i], tokens[i][-1]) for i in generating])):
                rows[i].append(logits[None])
        step += 1
    return [(np.concatenate(r), t) for r, t in zip(rows, tokens)]


def test_the_manifest_records_the_batch(batched):
    _, out = batched()
    module = json.loads((out / "model.json").read_text())["module"]
    assert module["max_batch"] == BATCH
    assert module["entry_points"]["prefill"]["inputs"][:3] == [["tokens", [BATCH, 16], "int32"],
                                                              ["positions", [BATCH], "int32"],
                                                              ["lengths", [BATCH], "int32"]]
    assert all(slot["shape"][0] == BATCH for slot in module["state"])
    assert "position" not in {slot["name"] for slot in module["state"]}     # the runtime passes positions
    assert module["context_windows"] == list(WINDOWS)
    for w in WINDOWS:
        assert module["entry_points"][f"decode_w{w}"] == module["entry_points"]["decode"]


def test_calls_take_the_smallest_window_that_holds_their_tokens(batched):
    """A sequence alone: its calls walk through the windows as it grows (8: dense attention over the
    window, 32: selection over it, then the whole cache), with the numbers of whole-cache calls only."""
    _, out = batched()
    session = Session(out)
    used = []
    for table in (session._prefill, session._decode):
        for w, function in list(table.items()):
            table[w] = lambda *a, w=w, f=function: (used.append(w), f(*a))[1]
    ps = prompts(session.vocab_size, (6, 37))
    windowed = [staggered_run(session, [p], joins=[0])[0] for p in ps]
    assert set(used) == {*WINDOWS, None}
    whole = Session(out)
    whole.windows = []
    for p, (logits, tokens) in zip(ps, windowed):
        want_logits, want_tokens = staggered_run(whole, [p], joins=[0])[0]
        assert tokens == want_tokens and relative_error(logits, want_logits) <= 1e-6


# The Vulkan form (a second batched module, 35 s of compile on lavapipe: 0 difference from the Vulkan
# batch-1 module when last run) is in the full run, KIMI_ALL_TARGETS=1, to keep CI within its budget.
TARGETS = ["cpu", "vulkan"] if os.environ.get("KIMI_ALL_TARGETS") else ["cpu"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_slot_equals_the_batch1_module(batched, target):
    single, out = batched(target)
    session = Session(out)
    ps = prompts(session.vocab_size, (5, 37, 20) if target == "cpu" else (5, 20, 9))   # lavapipe is slow
    want = [batch1_run(single, p) for p in ps]
    # the second and third sequences join while the first decodes and the second still prefills
    for i, (got, tokens) in enumerate(staggered_run(session, ps, joins=[0, 1, 3])):
        assert tokens == want[i][1], f"sequence {i}: greedy tokens differ"
        err = relative_error(got, want[i][0])
        assert err <= TOL, f"sequence {i}: {err:.2e} of max|logit| off the batch-1 module"


def test_other_slots_change_no_slot_numbers(batched):
    """A sequence alone in the module and the same sequence beside two busy ones: the same numbers."""
    _, out = batched()
    session = Session(out)
    ps = prompts(session.vocab_size)
    alone = staggered_run(session, ps[1:2], joins=[0])[0]
    session = Session(out)
    crowded = staggered_run(session, [ps[1], ps[0], ps[2]], joins=[0, 0, 2])[0]
    assert crowded[1] == alone[1]
    assert relative_error(crowded[0], alone[0]) <= 1e-6


def test_a_released_slot_starts_afresh(batched):
    """A row reused by a new sequence holds the previous one's KDA state and caches: the module must
    start it from nothing (position 0), with no reset call."""
    single, out = batched()
    session = Session(out)
    ps = prompts(session.vocab_size)
    old = session.new_sequence()
    session.prefill(ps[1], sequence=old)
    session.decode(7, old)
    session.release(old)
    new = session.new_sequence()
    assert new.row == old.row
    got = session.prefill(ps[2], all_logits=True, sequence=new)
    want = Session(single).prefill(ps[2], all_logits=True)
    assert relative_error(got, want) <= TOL


def test_rows_are_held_until_released(batched):
    from kimi_iree.runtime.errors import RuntimeUsageError
    _, out = batched()
    session = Session(out)
    held = [session.new_sequence() for _ in range(BATCH)]
    assert sorted(s.row for s in held) == list(range(BATCH)) and session.free_rows() == 0
    with pytest.raises(RuntimeUsageError, match=f"all {BATCH} sequence slots"):
        session.new_sequence()
    session.release(held[1])
    assert session.new_sequence().row == held[1].row


def _kimi_run(*args: str) -> dict:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert kimi_run([*map(str, args), "--json"]) == 0
    return json.loads(stdout.getvalue())


def test_kimi_run_runs_a_batched_module(batched, tmp_path):
    single, out = batched()
    assert _kimi_run(out, "--prompt", "Hello there", "-n", "12")["tokens"] == \
        _kimi_run(single, "--prompt", "Hello there", "-n", "12")["tokens"]
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, then naps in the sun.")
    for module, name in ((single, "single"), (out, "batched")):
        _kimi_run(module, "--perplexity", text, "--save-logits", tmp_path / f"{name}.npy")
    assert relative_error(np.load(tmp_path / "batched.npy"), np.load(tmp_path / "single.npy")) <= TOL
    bench = _kimi_run(out, "--bench", "--depth", "8", "--prompt-tokens", "20", "--gen-tokens", "4")
    assert bench["batch"] == BATCH and bench["batch_prefill_tokens_per_s"] > 0 and bench["batch_decode_tokens_per_s"] > 0
    assert bench["decode_tokens_per_s"] > 0                  # one sequence, as on a batch-1 module
