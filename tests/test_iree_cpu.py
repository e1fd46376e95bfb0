"""The compiled IREE llvm-cpu module against the eager model (and transformers where it exists)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend import load_model
from kimi_iree.runtime import Session
from kimi_iree.runtime.errors import RuntimeUsageError
from kimi_iree.runtime.cli import main as kimi_run

from conftest import COMPILE_ARGS, module_logits, relative_error

FAMILIES = ["k3.1", "kimi_linear_mxfp4", "deepseek_v32"]
LOGIT_TOL = 1e-3          # relative to max|logit|: IREE reassociates f32 sums (O3 fast-math reductions)
PPL_TOL = 2e-3
TEXT = ("Kimi Delta Attention keeps a matrix-valued memory per head; DeepSeek sparse attention "
        "scores every earlier token and keeps only the best ones.")


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_iree_logits_match_eager(compiled, family):
    out, checkpoint = compiled(family)
    model = load_model(checkpoint)
    session = Session(out)
    ids = _ids(40)                                    # three prefill blocks of 16
    got = session.prefill(ids, all_logits=True)
    got_next = session.decode(7)
    session.reset()
    got_last = session.prefill(ids)                   # prefill's own row: the last real token of a padded block
    with torch.no_grad():
        state = model.init_state(1, 64)
        want, state = model.prefill(torch.tensor([ids]), state)   # one chunk
        want_next, _ = model.decode(torch.tensor([7]), state)
    want, want_next = want[0].numpy(), want_next[0].numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    err_next = np.abs(got_next - want_next).max() / np.abs(want_next).max()
    err_last = np.abs(got_last - want[-1]).max() / np.abs(want[-1]).max()
    print(f"{family}: prefill {err:.1e}, last {err_last:.1e}, decode {err_next:.1e} (relative to max|logit|)")
    assert err < LOGIT_TOL and err_last < LOGIT_TOL and err_next < LOGIT_TOL


def test_bf16_activations_are_asked_for_recorded_and_close(any_checkpoint, tmp_path):
    """--bf16-activations (lossy): the manifest says so, the logits move by bf16's rounding of the rows (not
    0, not more), and without the flag the module stays exact."""
    from kimi_iree.targets.cpu import host_has
    if not (host_has("avx512f") and host_has("avx512_bf16")):
        pytest.skip("this CPU has no AVX512-BF16")
    checkpoint = any_checkpoint("deepseek_v32")
    # bf16 linear layers (the tiny checkpoint is f32): the block dispatch on each 16-row prefill block; every
    # earlier token selected (index_topk 64), as a long prompt's first 2048 are: with 8 of 40, near-tied
    # indexer scores flip under any perturbation (a third of the positions here), which is not this test's
    for name, extra in (("exact", []), ("bf16", ["--bf16-activations"])):
        assert kimi_compile([str(checkpoint), "-o", str(tmp_path / name), *COMPILE_ARGS, "--dtype", "bf16",
                             "--index-topk", "64", *extra]) == 0
    assert json.loads((tmp_path / "bf16" / "model.json").read_text())["module"]["activations"] == "bf16"
    assert json.loads((tmp_path / "exact" / "model.json").read_text())["module"]["activations"] == "f32"
    ids = _ids(40)
    want, got = (Session(tmp_path / name).prefill(ids, all_logits=True) for name in ("exact", "bf16"))
    # per position: a token whose experts are near a tie may route differently (its logits then move far),
    # as in any lossy mode; the rest move by the rounding
    err = np.abs(got - want).max(-1) / np.abs(want).max()
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    print(f"bf16 activations against f32, relative to max|logit|: median {np.median(err):.1e}, max {err.max():.1e}, "
          f"{(err < 2e-2).mean():.3f} of positions under 2e-2; top-1 agreement {agree:.3f}")
    assert err.max() > 1e-5 and np.median(err) < 2e-2 and (err < 2e-2).mean() >= 0.9 and agree >= 0.9


@pytest.mark.parametrize("family", FAMILIES)
def test_32_greedy_tokens_identical_to_eager(compiled, family, capsys):
    out, checkpoint = compiled(family)
    model = load_model(checkpoint)
    prompt = _ids(5, seed=1)
    assert kimi_run([str(out / "model.vmfb"), "--prompt-ids", ",".join(map(str, prompt)), "-n", "32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    want = []
    with torch.no_grad():
        logits, state = model.prefill(torch.tensor([prompt]), model.init_state(1, 64))
        token = int(logits[0, -1].argmax())
        for _ in range(32):
            want.append(token)
            logits, state = model.decode(torch.tensor([token]), state)
            token = int(logits[0].argmax())
    assert got == want


@pytest.mark.parametrize("family", ["kimi_linear_mxfp4", "deepseek_v32"])
def test_perplexity_matches_transformers(compiled, hf_checkpoint, family, tmp_path, capsys):
    out, _ = compiled(family)
    _, oracle = hf_checkpoint(family)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert kimi_run([str(out / "model.vmfb"), "--perplexity", str(text), "--ctx", "48", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = list(TEXT.encode())[:48]
    with torch.no_grad():
        loss = oracle(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    print(f"{family}: perplexity IREE {got['perplexity']:.4f}, transformers {np.exp(loss):.4f}")
    assert got["tokens"] == 48
    assert abs(got["perplexity"] - np.exp(loss)) / np.exp(loss) < PPL_TOL


def test_streamed_text_equals_the_decoded_tokens(compiled, capsys):
    """Streaming prints each new piece of the decoded continuation once, whole characters only."""
    out, _ = compiled("k3.1")
    args = [str(out / "model.vmfb"), "--prompt", "Hello", "-n", "12"]
    assert kimi_run(args) == 0
    streamed = capsys.readouterr().out
    assert kimi_run(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert streamed == result["text"] + "\n" and len(result["tokens"]) >= 1


def test_runtime_needs_no_torch(compiled, tmp_path):
    """A deploy machine has iree-base-runtime and numpy only: importing torch must not be needed."""
    out, _ = compiled("k3.1")
    blocker = tmp_path / "no_torch"
    for name in ("torch", "iree/compiler"):
        (blocker / name).mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    code = ("import kimi_iree.runtime, sys\n"
            "from kimi_iree.runtime.cli import main\n"
            f"code = main([{str(out / 'model.vmfb')!r}, '--prompt', 'Hi', '-n', '3', '--json'])\n"
            "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
            "sys.exit(code)\n")
    # iree.compiler is hidden too: a namespace folder without the real package's modules
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"]


# ------------------------------------------------------------------------------ errors
def _copy(out, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(out, dst, ignore=shutil.ignore_patterns("synthetic-*"))
    return dst


def _run_error(args, capsys):
    code = kimi_run([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_abi_mismatch_is_refused(compiled, tmp_path, capsys):
    out = _copy(compiled("k3.1")[0], tmp_path)
    manifest = json.loads((out / "model.json").read_text())
    manifest["module"]["abi_version"] = 99
    (out / "model.json").write_text(json.dumps(manifest))
    assert "recompile" in _run_error([out / "model.vmfb", "--prompt-ids", "1"], capsys)


def test_missing_archive_is_named(compiled, tmp_path, capsys):
    out = _copy(compiled("k3.1")[0], tmp_path)
    (out / "model.irpa").unlink()
    assert "model.irpa: missing" in _run_error([out / "model.vmfb", "--prompt-ids", "1"], capsys)


def test_missing_module_is_named(tmp_path, capsys):
    missing = tmp_path / "nonexistent.vmfb"
    assert f"{missing}: no such file" in _run_error([missing, "--prompt-ids", "1"], capsys)


def test_saved_logits_and_kl_divergence(compiled, tmp_path, capsys):
    """--save-logits writes every scored position's logits; --kl-divergence compares a run with them."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    k31 = str(compiled("k3.1")[0] / "model.vmfb")
    base = tmp_path / "base.npy"
    assert kimi_run([k31, "--perplexity", str(text), "--ctx", "48", "--save-logits", str(base), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    saved = np.load(base)
    assert saved.dtype == np.float32 and saved.shape == (47, json.loads(
        (compiled("k3.1")[0] / "model.json").read_text())["config"]["vocab_size"])
    assert not list(tmp_path.glob(".base.npy*"))                  # written through a renamed temp file
    assert kimi_run([k31, "--perplexity", str(text), "--ctx", "48", "--kl-divergence", str(base), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["kl_max"] < 1e-9 and again["top1_agreement"] == 1.0 and again["perplexity"] == first["perplexity"]
    # one line naming the file, exit 2: other positions, another vocabulary, no --perplexity
    assert "scored positions" in _run_error([k31, "--perplexity", text, "--ctx", "40", "--kl-divergence", base],
                                            capsys)
    np.save(tmp_path / "other_vocab.npy", saved[:, :100])
    assert "vocabulary 100" in _run_error([k31, "--perplexity", text, "--ctx", "48", "--kl-divergence",
                                           tmp_path / "other_vocab.npy"], capsys)
    assert "--perplexity" in _run_error([k31, "--prompt-ids", "1", "--kl-divergence", base], capsys)
    assert "no such file" in _run_error([k31, "--perplexity", text, "--kl-divergence", tmp_path / "none.npy"], capsys)


def test_kl_divergence_measures_what_it_names():
    from kimi_iree.runtime.logits import kl_divergence
    base = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], dtype=np.float32))
    other = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.1, 0.8]], dtype=np.float32))
    result = kl_divergence(base, other)
    expected = 0.5 * np.log(2) + 0.25 * np.log(0.5)               # row 0; row 1 is identical
    assert abs(result["kl_max"] - expected) < 1e-6 and abs(result["kl_mean"] - expected / 2) < 1e-6
    assert result["top1_agreement"] == 0.5


def test_unavailable_driver_lists_the_available_ones(compiled, capsys):
    err = _run_error([compiled("k3.1")[0] / "model.vmfb", "--device", "metal", "--prompt-ids", "1"], capsys)
    assert "'metal' is not available" in err and "local-task" in err


def test_a_failed_cpu_load_is_not_retried(compiled, monkeypatch):
    """Only a GPU driver's load gets a second try (runtime/session.py); a CPU failure is reported at once."""
    calls = []

    def failing_load(self, rt):
        calls.append(self.device_uri)
        raise RuntimeError("DATA_LOSS; while invoking native function hal.fence.await")
    monkeypatch.setattr(Session, "_load_module", failing_load)
    with pytest.raises(RuntimeUsageError, match=r"model\.vmfb: cannot load \(DATA_LOSS"):
        Session(compiled("k3.1")[0])
    assert calls == ["local-task"]


def test_prompt_beyond_max_context(compiled, capsys):
    ids = ",".join(["1"] * 70)
    assert "max context 64" in _run_error([compiled("k3.1")[0] / "model.vmfb", "--prompt-ids", ids, "-n", "1"], capsys)


def test_depth_beyond_max_context(compiled, capsys):
    assert "max context" in _run_error([compiled("k3.1")[0] / "model.vmfb", "--bench", "--depth", "60"], capsys)


def test_token_outside_vocabulary(compiled, capsys):
    err = _run_error([compiled("k3.1")[0] / "model.vmfb", "--prompt-ids", "1,99999", "-n", "1"], capsys)
    assert "token id 99999" in err


def test_no_tokenizer_and_no_prompt_ids(compiled, tmp_path, capsys):
    out = _copy(compiled("k3.1")[0], tmp_path)
    (out / "tokenizer.json").unlink()
    assert "--prompt-ids" in _run_error([out / "model.vmfb", "--prompt", "hello"], capsys)


def test_bench_reports_throughput(compiled, capsys):
    assert kimi_run([str(compiled("k3.1")[0] / "model.vmfb"), "--bench", "--prompt-tokens", "16",
                     "--gen-tokens", "4", "--depth", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["depth"] == 8 and result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0


def test_returned_logits_stay_valid_after_later_calls(compiled):
    """local-task's to_host() maps the result buffer, which later calls reuse: the session must copy."""
    session = Session(compiled("k3.1")[0])
    session.prefill(_ids(5))
    first = session.decode(3)
    kept = first.copy()
    for token in (4, 5, 6, 7):
        session.decode(token)
    assert np.array_equal(first, kept)


def test_module_boundary_has_no_64_bit_integers(compiled, tmp_path):
    """Targets without Int64 (valhall, adreno, the Vulkan baseline, devices lacking shaderInt64) compile
    with IREE's i64 -> i32 demotion, which must not change the module's interface: token ids, positions,
    lengths and the state are int32 or float, so the same runtime drives both and the numbers agree."""
    out, checkpoint = compiled("k3.1")
    manifest = json.loads((out / "model.json").read_text())["module"]
    dtypes = [s["dtype"] for s in manifest["state"]] + [
        spec[2] for entry in manifest["entry_points"].values() for spec in [*entry["inputs"], *entry["outputs"]]
        if spec != "*state"]
    assert not [d for d in dtypes if "64" in d and "float" not in d]
    from kimi_iree.targets.vulkan import query_host_device
    if query_host_device() is not None:
        return      # test_vulkan runs the baseline profile's module, built demoted, against this one
    demoted = tmp_path / "demoted"
    assert kimi_compile([str(checkpoint), "-o", str(demoted), *COMPILE_ARGS,
                         "--iree-flag=--iree-input-demote-i64-to-i32"]) == 0
    ids = _ids(20)
    assert relative_error(module_logits(demoted, ids), module_logits(out, ids)) < 1e-5


def test_a_context_window_must_be_below_the_max_context(any_checkpoint, tmp_path, capsys):
    code = kimi_compile([str(any_checkpoint("k3.1")), "-o", str(tmp_path / "out"), *COMPILE_ARGS,
                         "--context-windows", "16,64"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--context-windows 64" in err and "max context 64" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())    # refused before converting


def test_default_context_windows_start_at_64_and_grow_4x_to_half_the_max_context():
    from types import SimpleNamespace
    from kimi_iree.driver.build import CompileOptions, context_windows
    mla, kda = SimpleNamespace(layer_kinds=["kda", "mla"]), SimpleNamespace(layer_kinds=["kda"])
    assert context_windows(mla, CompileOptions(max_context=4192)) == (64, 256, 1024)
    assert context_windows(mla, CompileOptions(max_context=8288)) == (64, 256, 1024, 4096)
    assert context_windows(mla, CompileOptions(max_context=96)) == ()
    assert context_windows(kda, CompileOptions(max_context=4192)) == ()          # no cache to window
    assert context_windows(mla, CompileOptions(max_context=4192, context_windows=(512, 128))) == (128, 512)


@pytest.mark.parametrize("short", ["16", "-1"])
def test_a_short_prefill_block_must_be_shorter_than_the_block(any_checkpoint, tmp_path, capsys, short):
    code = kimi_compile([str(any_checkpoint("k3.1")), "-o", str(tmp_path / "out"), *COMPILE_ARGS,
                         "--short-prefill-block", short])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--short-prefill-block {short}" in err and "(16)" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_released_sequences_buffers_serve_the_next_one_cleared(compiled):
    """A batch-1 sequence's state buffers go to the next new sequence (no new allocation: its page
    faults cost more than the call at long contexts), cleared: the same logits as a fresh session's."""
    out = compiled("k3.1")[0]
    want = Session(out).prefill(_ids(20), all_logits=True)
    session = Session(out)
    used = session.new_sequence()
    # state far from zero: the second 16-token block's padding writes cache slots 30 and 31, and the
    # third decode step (position 32) the first slot past the prefill's blocks
    session.prefill(_ids(30, seed=2), sequence=used)
    assert used.written == 32
    for token in (3, 5, 7):
        session.decode(token, sequence=used)
    assert used.written == 33
    buffers = used.state
    session.release(used)
    again = session.new_sequence()
    assert again.state is buffers
    # only the slots `used` wrote were cleared, and that is every nonzero one
    assert all(not session._read(array).any() for array in again.state)
    assert np.array_equal(session.prefill(_ids(20), all_logits=True, sequence=again), want)
    with pytest.raises(RuntimeUsageError, match="released"):
        session.decode(1, sequence=used)
    session.reset()                                           # kimi-run's default sequence the same way
    assert np.array_equal(session.prefill(_ids(20), all_logits=True), want)


def test_bench_warms_up_first_unless_told_not_to(compiled, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(Session, "prefill", lambda self, ids, *a, **k: calls.append(len(ids)) or np.zeros(self.vocab_size))
    monkeypatch.setattr(Session, "decode", lambda self, token, *a, **k: np.zeros(self.vocab_size))
    args = [str(compiled("k3.1")[0] / "model.vmfb"), "--bench", "--prompt-tokens", "12", "--gen-tokens", "2", "--json"]
    assert kimi_run(args) == 0 and calls == [12, 12]          # llama-bench's warm-up prompt, then the timed one
    calls.clear()
    assert kimi_run([*args, "--no-warmup"]) == 0 and calls == [12]
    capsys.readouterr()


def test_short_prefill_block_entries_give_the_full_blocks_numbers(compiled, tmp_path):
    """A module with a short prefill block (8 beside 32) runs a short prompt and a long prompt's tail there;
    logits match the eager model's, every position's too (the full block). (The windowed twins are the
    same lookup by window; no windows here to keep the compile short.)"""
    _, checkpoint = compiled("k3.1")
    out = tmp_path / "short"
    assert kimi_compile([str(checkpoint), "-o", str(out), "--target", "cpu", "--max-context", "96",
                         "--prefill-block", "32", "--short-prefill-block", "8", "--context-windows", "none",
                         "--quiet"]) == 0
    module = json.loads((out / "model.json").read_text())["module"]
    assert module["short_prefill_block"] == 8
    assert module["entry_points"]["prefill_short"]["inputs"][0][1] == [1, 8]
    model = load_model(checkpoint)
    session = Session(out)
    calls = []
    for window, function in list(session._prefill_short.items()):
        session._prefill_short[window] = lambda *a, f=function, w=window: calls.append(w) or f(*a)
    # 5 alone; 37 = 32 + 5 and 69 = 2 x 32 + 5: the tail
    for n, want_calls in ((5, [None]), (37, [None]), (69, [None])):
        ids = _ids(n, seed=n)
        session.reset()
        calls.clear()
        got = session.prefill(ids)
        got_next = session.decode(3)
        assert calls == want_calls
        with torch.no_grad():
            want, state = model.prefill(torch.tensor([ids]), model.init_state(1, 96))
            want_next, _ = model.decode(torch.tensor([3]), state)
        assert relative_error(got, want[0, -1].numpy()) < LOGIT_TOL
        assert relative_error(got_next, want_next[0].numpy()) < LOGIT_TOL
    session.reset()
    calls.clear()
    every = session.prefill(_ids(5, seed=5), all_logits=True)        # the head reads a full block's rows
    assert calls == [] and every.shape[0] == 5
    with torch.no_grad():
        want, _ = model.prefill(torch.tensor([_ids(5, seed=5)]), model.init_state(1, 96))
    assert relative_error(every, want[0].numpy()) < LOGIT_TOL
