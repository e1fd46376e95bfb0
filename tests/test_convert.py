"""kimi-compile --convert-only: HF directory -> model.irpa + model.json, text only, MXFP4 kept."""

import json
import struct

import iree.runtime as rt
import numpy as np
import pytest
import torch

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend.checkpoint import CheckpointReader, plan_checkpoint
from kimi_iree.frontend.config import load_config
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint


def archive(out):
    index = rt.ParameterIndex()
    index.load(str(out / "model.irpa"))
    return {k: np.asarray(rt.parameter_index_entry_as_numpy_flat_ndarray(e)).copy() for k, e in index.items()}


def source_bytes(checkpoint, canonical_parts):
    reader = CheckpointReader(checkpoint)
    return b"".join(p.read(reader).view(torch.uint8).numpy().tobytes() for p in canonical_parts)


@pytest.fixture(scope="module")
def k31_12(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("k31") / "ckpt", variant="k3.1", num_layers=12)


def run(args, capsys):
    code = kimi_compile([str(a) for a in args])
    return code, capsys.readouterr().err


def test_slice_of_k31_is_bit_identical_to_its_source(k31_12, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run([k31_12, "--convert-only", "-o", out, "--layers", "8", "--quiet"], capsys)
    assert code == 0, err
    manifest = json.loads((out / "model.json").read_text())
    tensors = archive(out)
    full_cfg = load_config(k31_12)
    plan = plan_checkpoint(CheckpointReader(k31_12), full_cfg, keep_layers=8)
    assert set(tensors) == set(plan.parts) == set(manifest["parameters"]["tensors"])
    matched = 0
    for name, parts in plan.parts.items():
        assert tensors[name].tobytes() == source_bytes(k31_12, parts), name
        matched += 1
    print(f"{matched} tensors of model.irpa matched their source bytes exactly")
    assert not any(n.startswith(("layers.8.", "layers.9.", "layers.10.", "layers.11.")) for n in tensors)
    conv = manifest["conversion"]
    assert conv["layers"] == 8 and conv["source_layers"] == 12 and conv["dropped"]["sliced layers"]["tensors"] > 0
    cfg = full_cfg
    assert manifest["indexer"] == {"index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
                                   "index_topk": cfg.index_topk, "index_use_rope": True, "layers": [3, 7]}
    assert manifest["parameters"]["tensors"]["layers.1.ffn.experts.w1.packed"]["dtype"] == "U8"


def test_vision_and_projector_are_dropped_and_reported(k31_12, hf_checkpoint, tmp_path, capsys):
    for checkpoint in (k31_12, hf_checkpoint("kimi_k25")[0]):
        out = tmp_path / checkpoint.parent.name
        code, err = run([checkpoint, "--convert-only", "-o", out, "--quiet"], capsys)
        assert code == 0, err
        names = archive(out)
        assert not any("vision" in n or "projector" in n for n in names)
        dropped = json.loads((out / "model.json").read_text())["conversion"]["dropped"]
        assert dropped["vision"]["tensors"] > 0 and dropped["mm_projector"]["tensors"] > 0


def test_override_matching_the_indexer_leaves_it_at_source_precision(k31_12, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run([k31_12, "--convert-only", "-o", out, "--layers", "4", "--override", r"layers\.3\..*=f32",
                     "--quiet"], capsys)
    assert code == 0, err
    meta = json.loads((out / "model.json").read_text())["parameters"]["tensors"]
    for t in ("wq_b", "wk", "weights_proj"):
        assert meta[f"layers.3.mixer.indexer.{t}.weight"]["dtype"] == "BF16"
        assert f"notice: layers.3.mixer.indexer.{t}.weight keeps its source dtype" in err
    assert meta["layers.3.mixer.q_a_proj.weight"]["dtype"] == "F32"      # the rest of the layer did change


def test_dtype_keeps_precision_sensitive_tensors_f32(k31_12, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run([k31_12, "--convert-only", "-o", out, "--layers", "4", "--dtype", "f16", "--quiet"], capsys)
    assert code == 0, err
    meta = json.loads((out / "model.json").read_text())["parameters"]["tensors"]
    assert meta["layers.1.mixer.q_proj.weight"]["dtype"] == "F16"
    for name in ("layers.1.mixer.A_log", "layers.1.mixer.dt_bias", "layers.1.ffn.router.weight",
                 "layers.1.attn_norm.weight", "layers.1.ffn.router.bias"):
        assert meta[name]["dtype"] == "F32", name
    assert meta["layers.1.ffn.experts.w2.scales"]["dtype"] == "U8"


def test_float_experts_keep_their_precision_unless_quantisation_is_asked(hf_checkpoint, tmp_path, capsys):
    """Lossless default: float routed experts are stored as the checkpoint has them; only
    --quantize-experts mxfp4 quantises them (OCP rounding). The manifest says which."""
    from kimi_iree.frontend import mxfp4
    checkpoint, _ = hf_checkpoint("kimi_linear")
    reader = CheckpointReader(checkpoint)
    w = reader.get("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    E = load_config(checkpoint).num_experts
    for flags, name in (([], "default"), (["--keep-expert-precision"], "kept")):
        code, err = run([checkpoint, "--convert-only", "-o", tmp_path / name, "--quiet", *flags], capsys)
        assert code == 0, err
        kept = archive(tmp_path / name)
        assert kept["layers.1.ffn.experts.w2.weight"].reshape(E, -1)[3].tobytes() == w.numpy().tobytes()
        assert json.loads((tmp_path / name / "model.json").read_text())["experts"] == {"format": "f32", "from": "checkpoint"}
    code, err = run([checkpoint, "--convert-only", "-o", tmp_path / "q", "--quantize-experts", "mxfp4", "--quiet"], capsys)
    assert code == 0, err
    q = archive(tmp_path / "q")
    packed, scales = mxfp4.quantize(w)
    assert q["layers.1.ffn.experts.w2.packed"].reshape(E, -1)[3].tobytes() == packed.numpy().tobytes()
    assert q["layers.1.ffn.experts.w2.scales"].reshape(E, -1)[3].tobytes() == scales.numpy().tobytes()
    assert json.loads((tmp_path / "q" / "model.json").read_text())["experts"]["format"] == "mxfp4"


def test_quantising_experts_whose_width_is_not_a_multiple_of_32_names_the_flag(tmp_path, capsys):
    """An expert width of 80 converts losslessly by default; MXFP4 (blocks of 32) cannot hold it."""
    import transformers as tf
    from hf_checkpoints import COMMON, _scaled, write_tokenizer
    torch.manual_seed(0)
    config = tf.DeepseekV3Config(**{**COMMON, "hidden_size": 80, "num_hidden_layers": 2, "q_lora_rank": 24,
                                    "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                    "n_group": 1, "topk_group": 1})
    checkpoint = tmp_path / "hidden80"
    _scaled(tf.DeepseekV3ForCausalLM(config)).save_pretrained(checkpoint)
    write_tokenizer(checkpoint)
    code, err = run([checkpoint, "--convert-only", "-o", tmp_path / "lossless", "--quiet"], capsys)
    assert code == 0, err
    code, err = run([checkpoint, "--convert-only", "-o", tmp_path / "q", "--quantize-experts", "mxfp4", "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--quantize-experts mxfp4" in err and "K=80" in err
    assert not (tmp_path / "q" / "model.irpa").exists()


def test_conversion_is_skipped_when_up_to_date(k31_12, tmp_path, capsys):
    out = tmp_path / "out"
    assert run([k31_12, "--convert-only", "-o", out, "--layers", "2"], capsys)[0] == 0
    code, err = run([k31_12, "--convert-only", "-o", out, "--layers", "2"], capsys)
    assert code == 0 and "up to date" in err
    code, err = run([k31_12, "--convert-only", "-o", out, "--layers", "3"], capsys)
    assert code == 0 and "up to date" not in err


# ------------------------------------------------------------------------------- bad input
@pytest.fixture()
def small(tmp_path):
    return write_synthetic_checkpoint(tmp_path / "ckpt", variant="k3.1", num_layers=2)


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])


def _shard_with(checkpoint, name):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    return checkpoint / index["weight_map"][name]


EMBED = "language_model.model.embed_tokens.weight"


def _missing_shard(c):
    _shard_with(c, EMBED).unlink()


def _truncated(c):
    p = _shard_with(c, EMBED)
    p.write_bytes(p.read_bytes()[:-100])


def _lying_offsets(c):
    def edit(h):
        b, e = h[EMBED]["data_offsets"]
        h[EMBED]["data_offsets"] = [b, e + 64]
    _rewrite_header(_shard_with(c, EMBED), edit)


def _tensor_missing(c):
    name = "language_model.model.layers.1.self_attn.indexer.wk.weight"
    _rewrite_header(_shard_with(c, name), lambda h: h.pop(name))
    index = json.loads((c / "model.safetensors.index.json").read_text())
    index["weight_map"].pop(name)
    (c / "model.safetensors.index.json").write_text(json.dumps(index))


def _wrong_shape(c):
    cfg = json.loads((c / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 128
    (c / "config.json").write_text(json.dumps(cfg))


def _wrong_dtype(c):
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    _rewrite_header(_shard_with(c, name), lambda h: h[name].update(dtype="I8"))


def _unknown_tensor(c):
    shard, extra = _shard_with(c, EMBED), "language_model.model.frobnicator.weight"
    _rewrite_header(shard, lambda h: h.__setitem__(extra, h[EMBED]))
    index = json.loads((c / "model.safetensors.index.json").read_text())
    index["weight_map"][extra] = shard.name
    (c / "model.safetensors.index.json").write_text(json.dumps(index))


def _unsupported_model_type(c):
    cfg = json.loads((c / "config.json").read_text())
    cfg["model_type"] = "llama"
    (c / "config.json").write_text(json.dumps(cfg))


BAD_INPUTS = {
    "missing shard": (_missing_shard, "is missing"),
    "truncated file": (_truncated, "truncated"),
    "header lies about offsets": (_lying_offsets, "header offsets"),
    "tensor missing": (_tensor_missing, r"missing tensor layers.1.mixer.indexer.wk.weight"),
    "shape mismatch": (_wrong_shape, "shape"),
    "dtype mismatch": (_wrong_dtype, "dtype I8"),
    "unknown tensor": (_unknown_tensor, "unknown tensor 'model.frobnicator.weight'"),
    "unsupported model_type": (_unsupported_model_type, "unsupported model_type 'llama'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_exit_2_and_no_archive(small, tmp_path, capsys, case):
    damage, expected = BAD_INPUTS[case]
    damage(small)
    out = tmp_path / "out"
    code, err = run([small, "--convert-only", "-o", out, "--quiet"], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    import re
    assert re.search(expected, lines[0]), lines[0]
    assert not (out / "model.irpa").exists()


def test_unwritable_output_dir_is_named(small, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, err = run([small, "--convert-only", "-o", blocker / "out", "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1 and str(blocker / "out") in err


def test_failed_conversion_leaves_the_earlier_archive_untouched(small, tmp_path, capsys):
    out = tmp_path / "out"
    assert run([small, "--convert-only", "-o", out, "--quiet"], capsys)[0] == 0
    before = (out / "model.irpa").read_bytes()
    _truncated(small)
    assert run([small, "--convert-only", "-o", out, "--quiet"], capsys)[0] == 2
    assert (out / "model.irpa").read_bytes() == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
