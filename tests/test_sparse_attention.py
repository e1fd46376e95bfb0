"""The fused indexer + sparse attention pass (passes/sparse_attention.py): the rewrite on IR text, the
fused implementation against the reference (frontend/dsa.py), and whole modules fused vs unfused."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend import dsa
from kimi_iree.passes import PassError, PassOptions, run_passes
from kimi_iree.passes import sparse_attention
from kimi_iree.runtime.cli import main as kimi_run

from conftest import COMPILE_ARGS, EXTRA_COMPILE_ARGS, module_logits, relative_error

# ---------------------------------------------------------------------------------- IR text
def unit_ir(op_name: str = "torch.kimi.sparse_mla_attention", topk: int = 3, T: int = 1, S: int = 6,
            R: int = 8, P: int = 4, HI: int = 2, DI: int = 4) -> str:
    B, H = 1, 2
    types = [f"[{B},{T},{H},{R}],f32", f"[{B},{T},{H},{P}],f32", f"[{B},{S},{R}],f32", f"[{B},{S},{P}],f32",
             f"[{B},{T},{HI},{DI}],f32", f"[{B},{T},{HI}],f32", f"[{B},{S},{DI}],f32", f"[{B},{T}],si64"]
    vt = [f"!torch.vtensor<{t}>" for t in types]
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(vt))
    return f"""
func.func @main({args}) -> {vt[0]} {{
  %scale = torch.constant.float 1.250000e-01
  %iscale = torch.constant.float 5.000000e-01
  %k = torch.constant.int {topk}
  %r = torch.operator "{op_name}"({", ".join(f"%a{i}" for i in range(8))}, %scale, %iscale, %k) : ({", ".join(vt)}, !torch.float, !torch.float, !torch.int) -> {vt[0]}
  return %r : {vt[0]}
}}"""


def test_pass_rewrites_the_unit_into_a_call_of_the_sparse_implementation():
    report = run_passes(unit_ir())                           # decode: one query
    assert report.rewritten == {"sparse_mla_attention": 1}
    assert "torch.operator" not in report.mlir
    assert "util.call @kimi_sparse_mla_attention_B1_T1_H2_R8_P4_HI2_DI4_S6_K3" in report.mlir   # its specialisation
    assert "iree_linalg_ext.scatter" in report.mlir          # compaction of the selected slots
    assert report.mlir.count("tensor.extract %") == 2       # the gathers of the selected rows


def test_prefill_gathers_only_when_the_cache_is_several_times_topk():
    near = run_passes(unit_ir(T=2, S=6, topk=3)).mlir        # 6 < 4 * 3 slots: the selection as a mask
    assert "iree_linalg_ext.scatter" not in near and "tensor.extract %" not in near
    far = run_passes(unit_ir(T=2, S=12, topk=3)).mlir        # 12 slots: gather each query's 3 rows
    assert "iree_linalg_ext.scatter" in far and far.count("tensor.extract %") == 2


def test_pass_leaves_a_look_alike_op_alone():
    text = unit_ir(op_name="torch.other.sparse_mla_attention")
    assert 'torch.operator "torch.other.sparse_mla_attention"' in run_passes(text).mlir


def test_unit_left_unlowered_when_the_pass_is_off_is_an_error():
    with pytest.raises(PassError, match="sparse_mla_attention has no lowering"):
        run_passes(unit_ir(), PassOptions(sparse_attention=False))


def test_topk_covering_the_cache_lowers_to_dense_attention():
    mlir = run_passes(unit_ir(topk=6)).mlir        # 6 >= the 6 cache slots: nothing to select
    assert "iree_linalg_ext.scan" not in mlir and "iree_linalg_ext.scatter" not in mlir


# ------------------------------------------------------------------- the implementation
X86_CPU = {None: "host", "avx512": "host", "avx2": "x86-64-v3"}


def run_unit(B, T, H, R, P, HI, DI, S, K, first_position, index_w_scale=1.0, seed=0, stagger=0, x86=None,
             distinct_keys=0):
    """Compile the pass's implementation for these shapes alone (llvm-cpu) and run it beside the reference.
    Row b of the batch starts at first_position + b * stagger (ragged sequences). x86: the decode
    indexer dispatch's form ("avx512", "avx2"; built for the host or x86-64-v3), None for the linalg form.
    distinct_keys: the indexer's key rows repeat every that many slots (ties at the k-th score)."""
    import iree.compiler as ic
    import iree.runtime as rt

    def tt(*shape, e="f32"):
        return f"tensor<{'x'.join(map(str, shape))}x{e}>"

    types = [tt(B, T, H, R), tt(B, T, H, P), tt(B, S, R), tt(B, S, P), tt(B, T, HI, DI), tt(B, T, HI), tt(B, S, DI),
             tt(B, T, e="i64")]
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(types))
    text = sparse_attention.unit_function("impl", B, T, H, R, P, HI, DI, S, K, 0.1, 0.25, x86) + f"""
util.func public @main({args}) -> {types[0]} {{
  %r = util.call @impl({", ".join(f"%a{i}" for i in range(8))}) : ({", ".join(types)}) -> {types[0]}
  util.return %r : {types[0]}
}}"""
    vmfb = ic.compile_str(text, target_backends=["llvm-cpu"],
                          extra_args=[f"--iree-llvmcpu-target-cpu={X86_CPU[x86]}", "--iree-opt-level=O3"])
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(B, T, H, R, generator=g), torch.randn(B, T, H, P, generator=g),
              torch.randn(B, S, R, generator=g), torch.randn(B, S, P, generator=g),
              torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, HI, generator=g) * index_w_scale,
              torch.randn(B, S, DI, generator=g), torch.arange(first_position, first_position + T) + stagger * torch.arange(B)[:, None]]
    if distinct_keys:
        inputs[6] = inputs[6][:, torch.arange(S) % distinct_keys]
    want = dsa.sparse_mla_attention(*inputs, 0.1, 0.25, K).numpy()
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    got = context.modules.module.main(*[x.numpy() for x in inputs]).to_host()
    return got, want


@pytest.mark.parametrize("case", [
    dict(T=1, first_position=30),               # decode deep in the cache
    dict(T=1, first_position=2),                # decode with fewer visible keys than topk
    dict(T=4, first_position=0),                # a prefill tile from position 0
    dict(T=4, first_position=20, B=2),          # two sequences
    dict(T=1, first_position=2, B=3, stagger=15),   # ragged decode: three sequences at their own places
    dict(T=4, first_position=0, B=2, stagger=30),   # ragged prefill: one sequence early, one deep
    dict(T=2, first_position=25, index_w_scale=0.0),   # every score 0: all ties, earliest slots win
    dict(T=4, first_position=20, K=16),         # a prefill tile near topk: the selection as a mask
    dict(T=2, first_position=20, K=40),         # topk covers the cache: dense
], ids=["decode", "decode-early", "prefill-early", "batch-2", "ragged-decode", "ragged-prefill", "all-ties", "prefill-mask", "dense"])
def test_fused_implementation_matches_the_reference(case):
    case = {"B": 1, "H": 4, "R": 32, "P": 8, "HI": 8, "DI": 16, "S": 40, "K": 6, **case}
    got, want = run_unit(**case)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < 1e-5, err


@pytest.mark.parametrize("x86", ["avx512", "avx2"])
@pytest.mark.parametrize("case", [
    dict(first_position=1001),                  # deep: the tile holding pos is partly visible
    dict(first_position=5),                     # fewer visible keys than topk: every tile past pos skipped
    dict(first_position=700, B=3, stagger=-300),   # ragged decode, each row its own visible tiles
    dict(first_position=900, index_w_scale=0.0),   # every score 0: all ties, earliest slots win
    dict(first_position=1001, K=200, distinct_keys=7),   # 7 scores, ~143 slots each: the 2nd score kept in part
    dict(first_position=60, HI=12, DI=32, S=68, R=24, P=8),   # 3 head groups (AVX-512), rows of 24 + 8 (AVX2 only)
    dict(first_position=70, S=72, K=64),           # the tail past the last vector holding pos is empty
], ids=["deep", "early", "ragged", "all-ties", "tied-kth", "odd-groups", "full"])
def test_x86_decode_dispatches_match_the_reference(case, x86):
    """The decode query's indexer keys (kernels/index_keys_x86.mlir), selection (select_topk_x86.mlir) and
    row gather (gather_rows_x86.mlir) as the x86 dispatches, AVX-512 and AVX2 (built for x86-64-v3): the
    reference's numbers."""
    case = {"B": 1, "T": 1, "H": 5, "R": 64, "P": 16, "HI": 16, "DI": 128, "S": 1056, "K": 64, **case}
    text = sparse_attention.unit_function("impl", *(case[k] for k in "B T H R P HI DI S K".split()), 0.1, 0.25, x86)
    width = sparse_attention.X86_WIDTH[x86]
    assert "impl_index_keys_keys" in text
    assert ("impl_gather_rows" in text) == (case["R"] % width == 0 and case["P"] % width == 0)
    assert ("impl_select_select" in text) == (case["S"] % width == 0)
    got, want = run_unit(**case, x86=x86)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < 1e-5, err


@pytest.mark.parametrize("x86", ["avx512", "avx2"])
@pytest.mark.parametrize("case", [
    dict(first_position=1001),                  # deep: two workgroups of 8 heads
    dict(first_position=5, H=8),                # 6 rows kept of 64: the rest -inf, never read
    dict(first_position=700, H=8, B=3, stagger=-300),   # ragged decode, each row its own rows kept
    dict(first_position=900, H=4, index_w_scale=0.0),   # every score 0: the earliest 64 slots kept; 1 workgroup
    dict(first_position=600, H=12, R=48, K=48),    # 3 workgroups of 4 heads (AVX2: 2 of 6)
    dict(first_position=300, H=32, S=320, K=32),   # a wide model's heads: 4 workgroups of 8
], ids=["deep", "early", "ragged", "one-workgroup-all-ties", "three-workgroups", "four-workgroups"])
def test_x86_decode_attention_over_the_selected_rows_matches_the_reference(case, x86):
    """The decode query's attention over its selected rows as one x86 dispatch (kernels/attend_rows_x86.mlir:
    read where they lie in the caches, no gather): the reference's numbers."""
    case = {"B": 1, "T": 1, "H": 16, "R": 64, "P": 16, "HI": 16, "DI": 128, "S": 1056, "K": 64, **case}
    text = sparse_attention.unit_function("impl", *(case[k] for k in "B T H R P HI DI S K".split()), 0.1, 0.25, x86)
    assert "impl_attend_attend" in text and "impl_gather" not in text
    got, want = run_unit(**case, x86=x86)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < 1e-5, err


def test_x86_decode_dispatches_apply_only_where_their_shapes_are_whole_vectors():
    """Outside whole vectors (DI, R, P, S for the selection), whole head groups (HI) and whole key tiles
    (S), off x86 and for prefill tiles the linalg forms run."""
    def parts(T=1, HI=16, DI=128, S=1056, R=64, P=16, x86="avx512", H=5, K=64):
        text = sparse_attention.unit_function("impl", 1, T, H, R, P, HI, DI, S, K, 0.1, 0.25, x86)
        return "impl_index_keys" in text, "impl_select" in text, "impl_gather" in text
    assert parts() == (True, True, True)
    assert parts(x86=None) == parts(T=4, S=4096) == (False, False, False)
    assert parts(DI=40) == (False, True, True) and parts(HI=6) == (False, True, True)
    assert parts(S=1058) == (False, False, True) and parts(S=1060) == (True, False, True)
    assert parts(S=1060, x86="avx2") == (True, False, True) and parts(S=1064, x86="avx2") == (True, True, True)
    assert parts(P=8) == (True, True, False) and parts(P=8, x86="avx2") == (True, True, True)
    assert parts(HI=6, x86="avx2") == (True, True, True) and parts(HI=3, x86="avx2") == (False, True, True)
    # the attention over the selected rows (which then gathers nothing): whole score tiles of heads (4 on
    # AVX-512, 2 on AVX2), R, P and K whole vectors
    def attends(**shape):
        text = sparse_attention.unit_function("impl", 1, 1, shape.pop("H"), shape.pop("R", 64), shape.pop("P", 16),
                                              16, 128, 1056, shape.pop("K", 64), 0.1, 0.25, shape.pop("x86", "avx512"))
        return "impl_attend" in text
    assert attends(H=8) and attends(H=6, x86="avx2") and attends(H=8, K=72, x86="avx2")
    assert not (attends(H=6) or attends(H=8, K=72) or attends(H=8, P=8) or attends(H=8, R=68, x86="avx2"))
    assert parts(H=8)[2] is False and parts(H=6)[2] is True
    whole = unit_ir(S=8, R=16, P=16, HI=4, DI=16)
    assert run_passes(whole, PassOptions(avx512=True)).mlir.count("flow.dispatch @") == 2
    assert run_passes(whole, PassOptions(avx2=True)).mlir.count("flow.dispatch @") == 3
    assert "flow.dispatch @" not in run_passes(whole, PassOptions(backend="spirv", avx512=True)).mlir
    assert "flow.dispatch @" not in run_passes(whole).mlir


def test_prefill_runs_in_query_tiles_when_a_tile_would_exceed_the_budget(monkeypatch):
    monkeypatch.setattr(sparse_attention, "TILE_BUDGET_BYTES", 4096)     # 1-2 queries a tile
    text = sparse_attention.unit_function("impl", 1, 8, 4, 32, 8, 8, 16, 40, 6, 0.1, 0.25)
    assert "scf.for" in text and "@impl_tile" in text
    got, want = run_unit(1, 8, 4, 32, 8, 8, 16, 40, 6, first_position=10)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_gathering_prefill_tiles_keep_their_rows_within_the_gather_bound(monkeypatch):
    """A gathering prefill (S >= 4 k) splits its queries so each tile's latent rows fit GATHER_TILE_BYTES
    (the IREE transient leak), and the tiles still give the reference's numbers."""
    assert sparse_attention.query_tile(32, 4224, 16, 512, 16, 512, 64) == 2      # 32 x 512 x 512 f32 = 32 MiB whole
    monkeypatch.setattr(sparse_attention, "GATHER_TILE_BYTES", 4 * 6 * 32 * 2)  # 2 queries of 6 rows x 32
    text = sparse_attention.unit_function("impl", 1, 8, 4, 32, 8, 8, 16, 40, 6, 0.1, 0.25)
    assert "scf.for" in text and "@impl_tile" in text
    got, want = run_unit(1, 8, 4, 32, 8, 8, 16, 40, 6, first_position=10)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


# ------------------------------------------------------------------------- whole modules


@pytest.fixture(scope="module")
def fused_and_unfused(compiled, tmp_path_factory):
    """family -> (fused OUT, unfused OUT): the session's module (index_topk 4 or 8, below the 80-slot
    cache, so the unit is used) and the same compile with --no-sparse-attention-fusion."""
    cache = {}

    def get(family):
        if family not in cache:
            fused, checkpoint = compiled(family)
            unfused = tmp_path_factory.mktemp(f"unfused-{family}")
            assert kimi_compile([str(checkpoint), "-o", str(unfused), *COMPILE_ARGS, *EXTRA_COMPILE_ARGS.get(family, []),
                                 "--no-sparse-attention-fusion"]) == 0
            cache[family] = (fused, unfused)
        return cache[family]
    return get


@pytest.mark.parametrize("family", ["deepseek_v32"])      # each unit shape: tests/test_backend_ops.py
def test_fused_and_unfused_modules_agree(fused_and_unfused, family):
    fused, unfused = fused_and_unfused(family)
    assert json.loads((fused / "model.json").read_text())["module"]["fused_units"]["sparse_mla_attention"] >= 1
    assert "sparse_mla_attention" not in json.loads((unfused / "model.json").read_text())["module"]["fused_units"]
    ids = np.random.default_rng(3).integers(0, 256, 40).tolist()
    err = relative_error(module_logits(fused, ids), module_logits(unfused, ids))
    print(f"{family}: fused vs unfused {err:.1e} (relative to max|logit|)")
    assert err < 1e-5


@pytest.mark.skipif(not os.environ.get("KIMI_ALL_TARGETS"),
                    reason="full run only (KIMI_ALL_TARGETS=1; two more compiles): CI covers the same rule "
                           "eagerly (tests/test_dsa.py) and in the table's topk-at/above-cache rows")
def test_perplexity_equals_dense_when_topk_covers_the_context(any_checkpoint, fused_and_unfused, tmp_path, capsys):
    """The seed's experiment: index_topk above the context gives the dense model's perplexity (the same
    checkpoint without its indexer); index_topk forced below the context changes it."""
    checkpoint = any_checkpoint("deepseek_v32")
    dense_checkpoint = tmp_path / "dense"
    without_indexer(checkpoint, dense_checkpoint)
    text = tmp_path / "text.txt"
    text.write_text("Sparse attention keeps the best keys; dense attention keeps them all. " * 2)
    results = {}
    for name, source, extra in (("dense", dense_checkpoint, []), ("topk-covers", checkpoint, ["--index-topk", "512"])):
        out = tmp_path / name
        assert kimi_compile([str(source), "-o", str(out), *COMPILE_ARGS, *EXTRA_COMPILE_ARGS.get("deepseek_v32", []),
                             *extra]) == 0
        results[name] = out
    results["topk-4"] = fused_and_unfused("deepseek_v32")[0]     # the checkpoint's own index_topk: 4
    ppl = {}
    for name, out in results.items():
        assert kimi_run([str(out / "model.vmfb"), "--perplexity", str(text), "--ctx", "60", "--json"]) == 0
        ppl[name] = json.loads(capsys.readouterr().out)["perplexity"]
    with capsys.disabled():
        print(f"\nperplexity: dense {ppl['dense']:.6f}, index_topk 512 {ppl['topk-covers']:.6f}, "
              f"index_topk 4 {ppl['topk-4']:.6f}")
    assert abs(ppl["topk-covers"] - ppl["dense"]) / ppl["dense"] < 1e-6
    assert abs(ppl["topk-4"] - ppl["dense"]) / ppl["dense"] > 1e-4


def without_indexer(checkpoint, out):
    """A copy of a deepseek_v32 checkpoint with the lightning indexer removed: a deepseek_v3 checkpoint."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "deepseek_v3"
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    for key in [k for k in config if k.startswith("index_")]:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    for f in checkpoint.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(f).items() if ".indexer." not in k}
            save_file(tensors, out / f.name, metadata={"format": "pt"})
        elif f.name != "config.json" and f.is_file() and f.suffix != ".json" or f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
