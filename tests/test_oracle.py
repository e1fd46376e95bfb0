"""Our eager model against transformers 5.23 on tiny random checkpoints of each family."""

import pytest
import torch

from hf_checkpoints import VOCAB, oracle_logits
from kimi_iree.frontend import load_model

# f32 on both sides; the only differences are summation order and the absorbed MLA form.
REL_TOL = 1e-4


def _logits_close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_linear_odd", "kimi_linear_mxfp4", "deepseek_v3",
                                    "deepseek_v32", "deepseek_v32_issue16", "kimi_k25",
                                    # published layouts, the oracle on the dequantised weights (issue 19)
                                    "deepseek_v32_fp8", "kimi_k2_fp8", "kimi_k25_int4"])
def test_logits_match_transformers(hf_checkpoint, family):
    directory, ref = hf_checkpoint(family)
    ours = load_model(directory)
    ids = torch.randint(0, min(VOCAB, ours.cfg.vocab_size), (2, 19), generator=torch.Generator().manual_seed(7))
    expected = oracle_logits(ref, ids)        # exact top-k ties broken as ours are (hf_checkpoints.stable_topk)
    with torch.no_grad():
        got = ours(ids)
    err = _logits_close(got, expected)
    print(f"{family}: max |ours - transformers| / max|logit| = {err:.2e}")
    assert err < REL_TOL


def test_deepseek_v32_selection_is_active(hf_checkpoint):
    """index_topk (4) is below the 19 tokens, so the indexer really drops keys here."""
    directory, ref = hf_checkpoint("deepseek_v32")
    sparse, dense = load_model(directory), load_model(directory, index_topk=10_000)
    ids = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (sparse(ids) - dense(ids)).abs().max() > 1e-3


def test_kimi_k25_drops_vision_tensors(hf_checkpoint):
    from kimi_iree.frontend.checkpoint import CheckpointReader, plan_checkpoint
    directory, _ = hf_checkpoint("kimi_k25")
    model = load_model(directory)
    planned = plan_checkpoint(CheckpointReader(directory), model.cfg)
    assert planned.dropped["vision"] > 0 and planned.dropped["mm_projector"] > 0
    assert not any("vision" in n or "projector" in n for n in planned.parts)


def test_gpt_oss_fused_mxfp4_packing_loads_like_compressed_tensors(hf_checkpoint, tmp_path):
    """The same MXFP4 bytes in gpt-oss' fused layout (`gate_up_proj_blocks` [E, 2I, K/32, 16] with
    gate/up rows interleaved, `*_scales`) give exactly the compressed-tensors model's logits."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    directory, _ = hf_checkpoint("kimi_linear_mxfp4")
    fused = tmp_path / "gpt_oss"
    shutil.copytree(directory, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    layers = sorted({n.split(".")[2] for n in tensors if ".experts." in n})
    for i in layers:
        p = f"model.layers.{i}.block_sparse_moe.experts"
        E = len({n.split(".")[5] for n in tensors if n.startswith(p + ".")})
        def stack(w, kind):
            return torch.stack([tensors[f"{p}.{e}.{w}.{kind}"] for e in range(E)])
        gate_up = torch.stack([stack("w1", "weight_packed"), stack("w3", "weight_packed")], dim=2)   # interleave rows
        gate_up = gate_up.reshape(E, -1, gate_up.shape[-1])
        gate_up_scales = torch.stack([stack("w1", "weight_scale"), stack("w3", "weight_scale")], dim=2).reshape(E, gate_up.shape[1], -1)
        down = stack("w2", "weight_packed")
        out[f"model.layers.{i}.mlp.experts.gate_up_proj_blocks"] = gate_up.reshape(E, gate_up.shape[1], -1, 16)
        out[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"] = gate_up_scales
        out[f"model.layers.{i}.mlp.experts.down_proj_blocks"] = down.reshape(E, down.shape[1], -1, 16)
        out[f"model.layers.{i}.mlp.experts.down_proj_scales"] = stack("w2", "weight_scale")
    save_file(out, str(fused / "model.safetensors"))
    config = json.loads((fused / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", "self_attn"]}
    (fused / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(load_model(fused)(ids), load_model(directory)(ids))
