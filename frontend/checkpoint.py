"""Reading a Hugging Face checkpoint directory: safetensors shards (memory-mapped, one tensor at a time)
and which of their tensors make each canonical tensor (`plan_checkpoint`, from names and headers alone).
What the model then holds is decided once, by frontend/convert.py `plan_conversion`: the converter
writes that plan and `load_model` loads it.

Never executes code from a checkpoint: only config.json, safetensors and JSON index files are read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointError
from .names import Transform, block_scaled_codes, map_name, normalise
from .safetensors_file import SafetensorsFile, TensorInfo

FP8_DTYPES = ("F8_E4M3",)


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
    transforms: tuple[Transform, ...]
    expert: int | None          # stacking position for routed experts

    def shape(self, reader: CheckpointReader) -> tuple[int, ...]:
        """The part's shape after its transforms, from the header alone."""
        shape = tuple(reader.info(self.source).shape)
        for t in self.transforms:
            shape = tuple(t.shape(shape))
        return shape

    def read(self, reader: CheckpointReader) -> torch.Tensor:
        """The part's tensor, its byte-preserving transforms applied (a reshape or a row slice)."""
        tensor = reader.get(self.source)
        for t in self.transforms:
            tensor = t.tensor(tensor)
        return tensor.contiguous()


@dataclass
class CheckpointPlan:
    """Which checkpoint tensors make each canonical tensor, decided from names and headers alone."""

    parts: dict[str, list[Part]]                              # canonical -> parts (experts in order)
    row_shapes: dict[str, list[Part]] = field(default_factory=dict)   # X.packed -> its `weight_shape` tensors
    dropped: Counter = field(default_factory=Counter)         # group -> tensor count
    dropped_bytes: Counter = field(default_factory=Counter)   # group -> bytes

    def sources(self, canonical: str) -> list[str]:
        return [p.source for p in self.parts[canonical]]


def plan_checkpoint(reader: CheckpointReader, cfg: ModelConfig, keep_layers: int | None = None) -> CheckpointPlan:
    """Map every checkpoint name; drop vision/projector/MTP tensors (and layers >= keep_layers, a
    runnable slice); check that routed experts are complete. Reads no tensor data."""
    parts: dict[str, list[Part]] = defaultdict(list)
    row_shapes: dict[str, list[Part]] = defaultdict(list)
    dropped, dropped_bytes = Counter(), Counter()
    for name in reader.names():
        normalised, group = normalise(name, cfg)
        if normalised is None or (keep_layers is not None and _layer_index(normalised) >= keep_layers):
            group = group or "sliced layers"
            dropped[group] += 1
            dropped_bytes[group] += reader.info(name).nbytes
            continue
        for target in map_name(normalised, cfg):
            if reader.info(name).dtype in FP8_DTYPES and target.name.endswith(".weight"):
                target = block_scaled_codes(target)          # FP8 bytes: held as codes beside their scales
            if target.name.endswith(".weight_shape"):
                row_shapes[target.name[: -len("weight_shape")] + "packed"].append(Part(name, (), target.expert))
                continue
            parts[target.name].append(Part(name, target.transforms, target.expert))
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
    return CheckpointPlan(dict(parts), dict(row_shapes), dropped, dropped_bytes)


def _layer_index(normalised: str) -> int:
    parts = normalised.split(".")
    return int(parts[2]) if normalised.startswith("model.layers.") else -1
