"""Reading a Hugging Face checkpoint directory: config, safetensors shards (memory-mapped, one tensor
at a time), the name table, and `load_model` for eager use.

Never executes code from a checkpoint: only config.json, safetensors and JSON index files are read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import mxfp4
from .config import ModelConfig, load_config
from .errors import CheckpointError
from .model import KimiModel
from .names import map_name, normalise
from .safetensors_file import SafetensorsFile, TensorInfo


class CheckpointReader:
    """The tensors of a checkpoint directory: `model.safetensors.index.json` or every `*.safetensors`.

    Headers are validated when the reader is made (missing shards, truncation, lying offsets);
    tensor bytes are read only when asked for.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a checkpoint directory")
        self.files: dict[Path, SafetensorsFile] = {}
        self.file_of: dict[str, Path] = {}
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                items = list(weight_map.items())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            for name, file in items:
                path = self.directory / file
                if path not in self.files:
                    if not path.exists():
                        raise CheckpointError(f"{path}: shard named in {index.name} is missing (tensor {name})")
                    self.files[path] = SafetensorsFile(path)
                if name not in self.files[path].tensors:
                    raise CheckpointError(f"{path}: tensor {name} named in {index.name} is not in the shard")
                self.file_of[name] = path
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.directory}: no *.safetensors files")
            for path in shards:
                self.files[path] = SafetensorsFile(path)
                for name in self.files[path].tensors:
                    if name in self.file_of:
                        raise CheckpointError(f"{path}: tensor {name} also in {self.file_of[name].name}")
                    self.file_of[name] = path

    def names(self) -> list[str]:
        return list(self.file_of)

    def info(self, name: str) -> TensorInfo:
        return self.files[self.file_of[name]].tensors[name]

    def get(self, name: str) -> torch.Tensor:
        return self.files[self.file_of[name]].tensor(name)

    def chunks(self, name: str):
        return self.files[self.file_of[name]].chunks(name)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor (or a row-slice of it) feeding a canonical tensor."""

    source: str
    transform: str | None
    expert: int | None          # stacking position for routed experts


@dataclass
class CheckpointPlan:
    """Which checkpoint tensors make each canonical tensor, decided from names and headers alone."""

    parts: dict[str, list[Part]]                              # canonical -> parts (experts in order)
    dropped: Counter = field(default_factory=Counter)         # group -> tensor count
    dropped_bytes: Counter = field(default_factory=Counter)   # group -> bytes

    def sources(self, canonical: str) -> list[str]:
        return [p.source for p in self.parts[canonical]]


def plan_checkpoint(reader: CheckpointReader, cfg: ModelConfig, keep_layers: int | None = None) -> CheckpointPlan:
    """Map every checkpoint name; drop vision/projector/MTP tensors (and layers >= keep_layers, a
    runnable slice); check that routed experts are complete. Reads no tensor data."""
    parts: dict[str, list[Part]] = defaultdict(list)
    dropped, dropped_bytes = Counter(), Counter()
    for name in reader.names():
        normalised, group = normalise(name, cfg)
        if normalised is None or (keep_layers is not None and _layer_index(normalised) >= keep_layers):
            group = group or "sliced layers"
            dropped[group] += 1
            dropped_bytes[group] += reader.info(name).nbytes
            continue
        for target in map_name(normalised, cfg):
            parts[target.name].append(Part(name, target.transform, target.expert))
    for canonical, plist in parts.items():
        experts = [p.expert for p in plist]
        if experts[0] is None:
            if len(plist) > 1:
                raise CheckpointError(f"tensor {plist[1].source}: {canonical} already given by {plist[0].source}")
            continue
        if len(set(experts)) != len(experts):
            dup = next(e for e in experts if experts.count(e) > 1)
            raise CheckpointError(f"{canonical}: expert {dup} given twice")
        missing = sorted(set(range(cfg.num_experts)) - set(experts))
        if missing:
            raise CheckpointError(f"{canonical}: expert {missing[0]} missing (have {len(experts)} of {cfg.num_experts})")
        extra = sorted(set(experts) - set(range(cfg.num_experts)))
        if extra:
            raise CheckpointError(f"{canonical}: expert {extra[0]} beyond num_experts={cfg.num_experts}")
        plist.sort(key=lambda p: p.expert)
    return CheckpointPlan(dict(parts), dropped, dropped_bytes)


def _layer_index(normalised: str) -> int:
    parts = normalised.split(".")
    return int(parts[2]) if normalised.startswith("model.layers.") else -1


def read_part(reader: CheckpointReader, part: Part) -> torch.Tensor:
    """A part's tensor with its byte-preserving transform applied (a reshape or a row slice)."""
    tensor = reader.get(part.source)
    for step in filter(None, (part.transform or "").split("+")):
        if step == "blocks":
            tensor = mxfp4.gpt_oss_blocks_to_packed(tensor)
        elif step == "even_rows":
            tensor = tensor[..., 0::2, :]
        elif step == "odd_rows":
            tensor = tensor[..., 1::2, :]
    return tensor.contiguous()


@dataclass
class Mapped:
    """The checkpoint as canonical tensors (routed experts stacked over [E, ...])."""

    tensors: dict[str, torch.Tensor]
    plan: CheckpointPlan

    @property
    def dropped(self) -> Counter:
        return self.plan.dropped


def map_checkpoint(reader: CheckpointReader, cfg: ModelConfig) -> Mapped:
    plan = plan_checkpoint(reader, cfg)
    tensors = {}
    for canonical, plist in plan.parts.items():
        loaded = [read_part(reader, p) for p in plist]
        if plist[0].expert is not None:
            shapes = {tuple(t.shape) for t in loaded}
            if len(shapes) > 1:
                raise CheckpointError(f"{canonical}: experts disagree on shape {sorted(shapes)}")
            tensors[canonical] = torch.stack(loaded)
        else:
            tensors[canonical] = loaded[0]
    return Mapped(tensors, plan)


def _fit_experts(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bring the routed experts to the form the model holds: quantise float experts to MXFP4, or
    dequantise MXFP4 for a float model (an explicit request, e.g. to compare with an oracle)."""
    for name in expected:
        if ".experts.w" not in name:
            continue
        base, kind = name.rsplit(".", 1)                      # layers.{i}.ffn.experts.w1, packed|weight
        if kind == "packed" and f"{base}.weight" in tensors:
            tensors[f"{base}.packed"], tensors[f"{base}.scales"] = mxfp4.quantize(tensors.pop(f"{base}.weight"))
        elif kind == "weight" and f"{base}.packed" in tensors:
            if f"{base}.scales" not in tensors:
                raise CheckpointError(f"{base}.scales: MXFP4 scales missing for {base}.packed")
            tensors[name] = mxfp4.dequantize(tensors.pop(f"{base}.packed"), tensors.pop(f"{base}.scales"))


def _layer_of(name: str) -> str:
    parts = name.split(".")
    return f" (layer {parts[1]})" if parts[0] == "layers" else ""


def load_state(model: KimiModel, mapped: Mapped, keep_dtypes: bool = False) -> None:
    """Check names, shapes and dtypes against the model, then load. Errors name the tensor.

    keep_dtypes: hold float weights in their stored dtype (what export needs, so the module reads
    model.irpa's bytes); otherwise they are widened to the model's f32."""
    tensors = dict(mapped.tensors)
    for name, t in tensors.items():
        if name.endswith(".mixer.A_log"):
            # Kept as stored (K3: [head_dim], more entries than heads); the gate reads the first H.
            kda = model.get_submodule(name[: -len(".A_log")])
            if t.numel() < kda.num_heads:
                raise CheckpointError(f"{mapped.plan.sources(name)[0]}: {t.numel()} entries for {kda.num_heads} KDA heads")
            kda.A_log = torch.nn.Parameter(torch.zeros(t.numel()))
    expected = model.state_dict()
    _fit_experts(tensors, expected)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}{_layer_of(missing[0])}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        src = mapped.plan.sources(unexpected[0])[0]
        raise CheckpointError(f"tensor {src} is not used by this config{_layer_of(unexpected[0])} "
                              f"(would be {unexpected[0]})")
    ready = {}
    for name, want in expected.items():
        t = tensors[name]
        src = mapped.plan.sources(name)[0] if name in mapped.plan.parts else name
        if tuple(t.shape) != tuple(want.shape):
            if t.numel() == want.numel() and t.dim() != want.dim():
                t = t.reshape(want.shape)   # 2-D conv weights, [1,1,H,1] A_log: same elements
            else:
                raise CheckpointError(f"tensor {src}: shape {list(t.shape)}, config implies {list(want.shape)}"
                                      f"{_layer_of(name)}")
        if want.dtype == torch.uint8:
            if t.dtype != torch.uint8:
                raise CheckpointError(f"tensor {src}: dtype {t.dtype}, MXFP4 bytes must be uint8")
        elif not t.is_floating_point():
            raise CheckpointError(f"tensor {src}: dtype {t.dtype}, expected a float tensor")
        ready[name] = t if keep_dtypes or want.dtype == torch.uint8 else t.to(want.dtype)
    model.load_state_dict(ready, strict=True, assign=keep_dtypes)


def load_model(checkpoint_dir: str | Path, *, index_topk: int | None = None,
               quantized_experts: bool | None = None, keep_dtypes: bool = False) -> KimiModel:
    """An eager KimiModel from a checkpoint directory.

    index_topk: override the config's (the forced-selection experiment); quantized_experts: hold
    routed experts as MXFP4 (default: as the checkpoint stores them); keep_dtypes: see load_state.
    """
    cfg = load_config(checkpoint_dir)
    if index_topk is not None:
        if not cfg.has_indexer:
            raise CheckpointError(f"{checkpoint_dir}: --index-topk given but the model has no indexer")
        cfg = cfg.with_overrides(index_topk=index_topk)
    reader = CheckpointReader(checkpoint_dir)
    mapped = map_checkpoint(reader, cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in mapped.tensors:
        cfg = cfg.with_overrides(tie_word_embeddings=False)   # an explicit head in the checkpoint wins
    model = KimiModel(cfg, quantized_experts)
    load_state(model, mapped, keep_dtypes)
    return model.eval()
