"""K3.1 = K3 + the lightning indexer on every attention layer, in the published K3 layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_iree.frontend import CheckpointError, load_model
from kimi_iree.frontend.checkpoint import CheckpointReader, plan_checkpoint
from kimi_iree.frontend.synthetic import write_synthetic_checkpoint

T, CACHE = 12, 32


@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("k31") / "ckpt", variant="k3.1")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("k3") / "ckpt", variant="k3")


def _ids():
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(11))


def test_k31_loads_in_the_published_layout(k31):
    model = load_model(k31)
    cfg = model.cfg
    assert cfg.model_type == "kimi_k3" and cfg.has_indexer and cfg.expert_format == "mxfp4"
    assert cfg.layer_kinds == ("kda", "kda", "kda", "mla", "kda", "mla")
    assert plan_checkpoint(CheckpointReader(k31), cfg).dropped == {"vision": 4, "mm_projector": 3, "mtp": 3}
    assert model.state_dict()["layers.1.ffn.experts.w1.packed"].dtype == torch.uint8


def test_k31_with_topk_covering_the_context_equals_k3_exactly(k31, k3):
    dsa, dense = load_model(k31, index_topk=T), load_model(k3)
    with torch.no_grad():
        a, _ = dsa.prefill(_ids(), dsa.init_state(2, CACHE))     # the selection runs and keeps every key
        b, _ = dense.prefill(_ids(), dense.init_state(2, CACHE))
    assert torch.equal(a, b)


def test_k31_with_topk_forced_below_the_context_differs(k31, k3):
    dsa, dense = load_model(k31, index_topk=4), load_model(k3)
    with torch.no_grad():
        diff = (dsa(_ids()) - dense(_ids())).abs()
    assert diff[:, :4].max() == 0 and diff[:, 4:].max() > 1e-3


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    import shutil
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    if edit_tensors:
        for file in sorted(set(index["weight_map"].values())):
            tensors = load_file(str(dst / file))
            edit_tensors(tensors)
            save_file(tensors, str(dst / file))
        index["weight_map"] = {n: f for f in sorted(set(index["weight_map"].values()))
                               for n in load_file(str(dst / f))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_k31_config_whose_layers_lack_indexer_tensors_fails_naming_layer_and_tensor(k3, tmp_path):
    def add_index_keys(cfg):
        cfg["text_config"].update(index_n_heads=8, index_head_dim=16, index_topk=8)
    broken = _rewrite(k3, tmp_path / "broken", edit_config=add_index_keys)
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.3\.mixer\.indexer\..* \(layer 3\)"):
        load_model(broken)


def test_k31_indexer_shape_contradicting_config_fails_naming_layer_and_tensor(k31, tmp_path):
    def wrong_heads(cfg):
        cfg["text_config"]["index_n_heads"] = 4
    broken = _rewrite(k31, tmp_path / "broken", edit_config=wrong_heads)
    with pytest.raises(CheckpointError, match=r"layers\.3\.self_attn\.indexer\.(wq_b|weights_proj)\.weight: shape .* \(layer 3\)"):
        load_model(broken)


def test_unknown_tensor_is_named(k31, tmp_path):
    def add(tensors):
        if "language_model.model.norm.weight" in tensors:
            tensors["language_model.model.layers.2.self_attn.mystery.weight"] = torch.zeros(3)
    broken = _rewrite(k31, tmp_path / "broken", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.2\.self_attn\.mystery\.weight'"):
        load_model(broken)
