"""Published quantised checkpoints as they ship (issue 19): DeepSeek-V3.2 and Kimi-K2 FP8 block-scaled
weights, K2.5 INT4 pack-quantized experts. Kept packed in model.irpa with the source bytes, widened only
on request, refused with one line when malformed. Logits against transformers are in test_oracle.py
(eager) and test_model_logits.py (compiled, cpu and vulkan)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PUBLISHED_FAMILIES, module_logits, relative_error
from hf_checkpoints import fp8_block_dequantize
from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend.checkpoint import CheckpointReader, plan_checkpoint
from kimi_iree.frontend.config import load_config

from test_convert import archive, run, source_bytes


def _convert(checkpoint, out, capsys, *flags):
    code, err = run([checkpoint, "--convert-only", "-o", out, "--quiet", *flags], capsys)
    assert code == 0, err
    return json.loads((out / "model.json").read_text()), err


@pytest.mark.parametrize("family", PUBLISHED_FAMILIES)
def test_codes_and_scales_pass_through_bit_exact(hf_checkpoint, family, tmp_path, capsys):
    checkpoint, _ = hf_checkpoint(family)
    manifest, _ = _convert(checkpoint, tmp_path / "out", capsys)
    tensors = archive(tmp_path / "out")
    plan = plan_checkpoint(CheckpointReader(checkpoint), load_config(checkpoint))
    assert set(tensors) == set(plan.parts)
    for name, parts in plan.parts.items():
        assert tensors[name].tobytes() == source_bytes(checkpoint, parts), name
    packed = [n for n in tensors if n.endswith(".packed")]
    dtypes = {manifest["parameters"]["tensors"][n]["dtype"] for n in packed}
    if family == "kimi_k25_int4":
        # only the routed experts are INT4; attention and shared experts stay bf16
        assert dtypes == {"I32"} and all(".experts." in n for n in packed)
        assert manifest["experts"]["format"] == "int4_g32" and manifest["weights"] == {"bf16": manifest["weights"]["bf16"]}
    else:
        assert dtypes == {"F8_E4M3"} and manifest["experts"]["format"] == "fp8_e4m3_b128"
        # bf16 as shipped: embeddings, lm_head, the router and the indexer's weights_proj
        assert set(manifest["weights"]) == {"fp8_e4m3_b128", "bf16"}
        assert not any(re.search(r"(embed|lm_head|\.gate\.|weights_proj|norm)", n) for n in packed)
    if family == "deepseek_v32_fp8":
        assert {"layers.1.mixer.indexer.wq_b.packed", "layers.1.mixer.indexer.wk.packed"} <= set(packed)


def test_widening_on_request_never_touches_the_indexer(hf_checkpoint, tmp_path, capsys):
    checkpoint, _ = hf_checkpoint("deepseek_v32_fp8")
    manifest, err = _convert(checkpoint, tmp_path / "out", capsys, "--dtype", "bf16")
    tensors = manifest["parameters"]["tensors"]
    # non-expert FP8 linears become bf16 weights; the ue8m0 scales make the bf16 values exact
    assert "layers.1.mixer.q_a_proj.packed" not in tensors and tensors["layers.1.mixer.q_a_proj.weight"]["dtype"] == "BF16"
    source = load_file(checkpoint / "model.safetensors")
    want = fp8_block_dequantize(source["model.layers.1.self_attn.q_a_proj.weight"],
                                source["model.layers.1.self_attn.q_a_proj.weight_scale_inv"])
    got = torch.from_numpy(archive(tmp_path / "out")["layers.1.mixer.q_a_proj.weight"].view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got.reshape(want.shape).float(), want)
    # the indexer's projections keep their FP8 codes, with a notice; routed experts stay packed
    for layer in (0, 1):
        for proj in ("wq_b", "wk"):
            assert tensors[f"layers.{layer}.mixer.indexer.{proj}.packed"]["dtype"] == "F8_E4M3"
            assert f"notice: layers.{layer}.mixer.indexer.{proj}.weight keeps its source dtype F8_E4M3" in err
    assert tensors["layers.1.ffn.experts.w1.packed"]["dtype"] == "F8_E4M3"
    assert manifest["weights"]["fp8_e4m3_b128"] == 4                       # the four indexer projections
    # --override widens one weight only
    manifest, _ = _convert(checkpoint, tmp_path / "one", capsys, "--override", r"layers\.1\.mixer\.o_proj=f32")
    tensors = manifest["parameters"]["tensors"]
    assert tensors["layers.1.mixer.o_proj.weight"]["dtype"] == "F32" and "layers.1.mixer.q_a_proj.packed" in tensors


@pytest.mark.parametrize("family", ["deepseek_v32_fp8", "kimi_k25_int4"])
def test_quantising_packed_experts_again_is_refused(hf_checkpoint, family, tmp_path, capsys):
    checkpoint, _ = hf_checkpoint(family)
    code, err = run([checkpoint, "--convert-only", "-o", tmp_path / "q", "--quantize-experts", "mxfp4", "--quiet"],
                    capsys)
    assert code == 2 and err.count("\n") == 1 and "--quantize-experts mxfp4" in err and "already" in err
    assert not (tmp_path / "q" / "model.irpa").exists()


# ------------------------------------------------------------------------------- bad input
FP8_Q_A = "model.layers.1.self_attn.q_a_proj.weight"
INT4_W1 = "language_model.model.blocks.1.mlp.experts.3.gate_proj.weight"


def _edit(checkpoint, edit):
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _missing_scale_inv(t):
    del t[f"{FP8_Q_A}_scale_inv"]


def _short_scale_grid(t):
    t[f"{FP8_Q_A}_scale_inv"] = t[f"{FP8_Q_A}_scale_inv"][:, :1].contiguous()       # [1, 1] for a [48, 144] weight


def _f16_scale_inv(t):
    t[f"{FP8_Q_A}_scale_inv"] = t[f"{FP8_Q_A}_scale_inv"].half()


def _fp8_as_int8(t):
    t[FP8_Q_A] = t[FP8_Q_A].view(torch.int8)


def _odd_weight_shape(t):
    t[f"{INT4_W1}_shape"] = torch.tensor([32, 64, 1])


def _wrong_weight_shape(t):
    t[f"{INT4_W1}_shape"] = torch.tensor([32, 56], dtype=torch.int32)


def _missing_weight_scale(t):
    del t[f"{INT4_W1}_scale"]


def _f32_weight_scale(t):
    t[f"{INT4_W1}_scale"] = t[f"{INT4_W1}_scale"].float()


BAD_INPUTS = {
    "missing weight_scale_inv": ("deepseek_v32_fp8", _missing_scale_inv, rf"{FP8_Q_A}: F8_E4M3 codes without their "
                                 rf"weight_scale_inv"),
    "scale grid short": ("deepseek_v32_fp8", _short_scale_grid, rf"{FP8_Q_A}_scale_inv: scale grid \[1, 1\] does not "
                         r"cover the \[48, 144\] weight in 128x128 blocks \(expected \[1, 2\]\)"),
    "f16 scale_inv": ("deepseek_v32_fp8", _f16_scale_inv, rf"{FP8_Q_A}_scale_inv: dtype F16, fp8_e4m3_b128 scales "
                      r"must be F32"),
    "int8 codes": ("deepseek_v32_fp8", _fp8_as_int8, rf"{FP8_Q_A}: dtype I8, expected a float tensor"),
    "odd weight_shape": ("kimi_k25_int4", _odd_weight_shape, rf"{INT4_W1}_shape: I64 \[3\], expected 2 integers"),
    "wrong weight_shape": ("kimi_k25_int4", _wrong_weight_shape, rf"{INT4_W1}_shape: weight_shape \[32, 56\], "
                           r"config implies \[32, 64\]"),
    "missing weight_scale": ("kimi_k25_int4", _missing_weight_scale, r"layers.1.ffn.experts.w1.scales: expert 3 missing"),
    "f32 weight_scale": ("kimi_k25_int4", _f32_weight_scale, rf"{INT4_W1}_scale: dtype F32, \S+ has BF16"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_exit_2_and_no_archive(hf_checkpoint, tmp_path, capsys, case):
    family, damage, expected = BAD_INPUTS[case]
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint(family)[0], checkpoint)
    capsys.readouterr()                             # (building the checkpoint printed progress)
    _edit(checkpoint, damage)
    out = tmp_path / "out"
    code, err = run([checkpoint, "--convert-only", "-o", out, "--quiet"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(expected, lines[0]), lines[0]
    assert not (out / "model.irpa").exists()


# ------------------------------------------------------------------------------- the unit's reference
@pytest.mark.compile
def test_no_weight_fusion_keeps_the_reference_and_agrees(compiled, hf_checkpoint, tmp_path):
    """--no-weight-fusion: the module computes the eager dequantise-then-multiply; same logits as fused."""
    fused_out, checkpoint = compiled("kimi_k25_int4")
    out = tmp_path / "unfused"
    assert kimi_compile([str(checkpoint), "-o", str(out), "--target", "cpu", "--max-context", "64",
                         "--prefill-block", "16", "--quiet", "--no-weight-fusion"]) == 0
    fused = json.loads((fused_out / "model.json").read_text())["module"]["fused_units"]
    unfused = json.loads((out / "model.json").read_text())["module"]["fused_units"]
    assert fused.get("weight_matmul", 0) > 0 and unfused.get("weight_matmul", 0) == 0
    ids = np.random.default_rng(5).integers(0, 256, 20).tolist()
    assert relative_error(module_logits(out, ids), module_logits(fused_out, ids)) < 1e-4
