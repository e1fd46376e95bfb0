"""model.json, the contract between kimi-compile and the runtime, as dataclasses.

The compile side builds a `Manifest` (frontend/convert.py the conversion part, the driver the
`Module`) and writes it with `to_json`; the runtime reads it with `Manifest.load`, which checks the
format, the ABI versions and the files it names, and then reads attributes, never string keys.

    OUT/model.json
      format, abi_version, kimi_iree_version
      source          checkpoint path, model_type
      conversion      options, source fingerprint, layers kept / in the source, dropped groups, sizes
      config          the ModelConfig (frontend/config.py `to_dict`)
      parameters      model.irpa, its scope, every tensor's dtype, shape and source
      tokenizer       files copied from the checkpoint, add_bos_token
      experts         how routed experts are held (a block-scaled format or a float dtype), and what made them so
      weights         how the other linear layers are held (FP8 as published, widened, float)
      indexer         the lightning indexer's facts (DSA models)
      module          the compiled module (absent after --convert-only): target, driver, flags, the
                      fallbacks taken, the fused units, entry points and the state layout
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import RuntimeUsageError, read_json

FORMAT = "kimi-iree-model"
ABI_VERSION = 1               # the manifest's layout
MODULE_ABI_VERSION = 4        # the module's interface: [batch] rows, positions and lengths as inputs (no position state); prefill returns the last logits + hidden, head


def package_version(distribution: str) -> str:
    """The installed version of `distribution` (kimi-iree, iree-base-compiler), for the manifest."""
    try:
        from importlib.metadata import version
        return version(distribution)
    except Exception:
        return "unknown"


@dataclass(frozen=True)
class StateSlot:
    """One state tensor the entry points take and return, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: str                # numpy spelling

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def cache_slots(max_context: int, prefill_block: int) -> int:
    """Slots of a KV cache (dim 1 of its state tensor [B, slots, ...]): a prefill block's padding tokens
    write past the real ones, where no real query looks."""
    return max_context + prefill_block


def windowed(name: str, window: int | None) -> str:
    """The entry point of `name` ("prefill", "decode") whose attention reads the first `window` cache slots
    (None: the whole cache)."""
    return name if window is None else f"{name}_w{window}"


@dataclass(frozen=True)
class EntryPoint:
    """An exported function's arguments and results: [name, shape, dtype] rows; "*state" stands for the
    state slots in order."""

    inputs: list
    outputs: list


@dataclass(frozen=True)
class Module:
    file: str
    abi_version: int
    iree_compiler_version: str
    target: str
    arch: str
    driver: str
    executable_format: str
    flags: list[str]
    fallbacks: list[str]                  # every place the module is not what was asked for, and why
    fused_units: dict[str, int]
    vulkan_profile: str | None
    subgroup_sizes: list[int] | None      # SPIR-V: the subgroup sizes the module may use (None: any)
    max_context: int
    prefill_block: int
    max_batch: int                        # sequence slots a call runs
    index_topk: int | None
    entry_points: dict[str, EntryPoint]
    state: list[StateSlot]
    # prefill_wW / decode_wW read only the first W cache slots (ascending; none in a module built before them)
    context_windows: list[int] = field(default_factory=list)
    # prefill_short[_wW] run a block of this many tokens (None: no such entries)
    short_prefill_block: int | None = None
    # "f32": exact; "bf16": the x86 bf16 matmuls round their rows to bf16 (kimi-compile --bf16-activations)
    activations: str = "f32"

    @classmethod
    def from_json(cls, d: dict) -> "Module":
        d = dict(d)
        d.setdefault("context_windows", [])
        d.setdefault("activations", "f32")
        d["entry_points"] = {k: EntryPoint(**v) for k, v in d["entry_points"].items()}
        d["state"] = [StateSlot(s["name"], tuple(s["shape"]), s["dtype"]) for s in d["state"]]
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["entry_points"] = {k: asdict(v) for k, v in self.entry_points.items()}
        out["state"] = [s.to_json() for s in self.state]
        return out


@dataclass(frozen=True)
class Conversion:
    options: dict
    source_fingerprint: str
    layers: int
    source_layers: int
    dropped: dict[str, dict]
    tensors_kept: int
    bytes_kept: int


@dataclass(frozen=True)
class Parameters:
    file: str
    scope: str
    tensors: dict[str, dict]              # name -> {"dtype", "shape", "sources"}


@dataclass(frozen=True)
class Tokenizer:
    files: list[str]
    add_bos_token: bool = False


@dataclass
class Manifest:
    kimi_iree_version: str
    source: dict
    conversion: Conversion
    config: dict                          # frontend.config.ModelConfig.to_dict()
    parameters: Parameters
    tokenizer: Tokenizer
    experts: dict | None = None
    weights: dict | None = None           # non-expert linears: {format or dtype: count}
    indexer: dict | None = None
    module: Module | None = None
    format: str = FORMAT
    abi_version: int = ABI_VERSION
    directory: Path | None = field(default=None, compare=False)   # where it was read from

    # ------------------------------------------------------------------ facts the runtime uses
    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.get("eos_token_ids") or [])

    # ------------------------------------------------------------------------------- json
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format, "abi_version": self.abi_version,
                               "kimi_iree_version": self.kimi_iree_version, "source": self.source,
                               "conversion": asdict(self.conversion), "config": self.config,
                               "parameters": asdict(self.parameters), "tokenizer": asdict(self.tokenizer)}
        for optional in ("experts", "weights", "indexer"):
            if getattr(self, optional) is not None:
                out[optional] = getattr(self, optional)
        if self.module is not None:
            out["module"] = self.module.to_json()
        return out

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, d: dict, where: str = "model.json") -> "Manifest":
        """A manifest from its JSON form; a format or ABI this runtime cannot read is a one-line error."""
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("abi_version") != ABI_VERSION:
            got = d if not isinstance(d, dict) else (d.get("format"), d.get("abi_version"))
            raise RuntimeUsageError(f"{where}: format/ABI {got!r}, this runtime reads {FORMAT} ABI {ABI_VERSION}: "
                                    "recompile with kimi-compile")
        module = d.get("module")
        if module is not None and module.get("abi_version") != MODULE_ABI_VERSION:
            raise RuntimeUsageError(f"{where}: module ABI {module.get('abi_version')!r}, this runtime runs "
                                    f"{MODULE_ABI_VERSION}: recompile with kimi-compile")
        try:
            return cls(kimi_iree_version=d["kimi_iree_version"], source=d["source"],
                       conversion=Conversion(**d["conversion"]), config=d["config"],
                       parameters=Parameters(**d["parameters"]), tokenizer=Tokenizer(**d["tokenizer"]),
                       experts=d.get("experts"), weights=d.get("weights"), indexer=d.get("indexer"),
                       module=None if module is None else Module.from_json(module))
        except (KeyError, TypeError) as e:
            raise RuntimeUsageError(f"{where}: not a kimi-compile manifest ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str | Path, need_module: bool = True) -> "Manifest":
        """OUT/model.json for OUT, OUT/model.vmfb or OUT/model.json; checks the files it names."""
        path = Path(path)
        if not path.exists():
            raise RuntimeUsageError(f"{path}: no such file or directory (give OUT/model.vmfb or the OUT directory "
                                    "of kimi-compile)")
        directory = path if path.is_dir() else path.parent
        manifest_file = directory / "model.json"
        raw = read_json(manifest_file, RuntimeUsageError, f"missing (is {directory} a kimi-compile output?)")
        manifest = cls.from_json(raw, str(manifest_file))
        manifest.directory = directory
        if need_module:
            if manifest.module is None:
                raise RuntimeUsageError(f"{manifest_file}: no compiled module (converted only): run kimi-compile "
                                        "without --convert-only")
            for f in (manifest.module.file, manifest.parameters.file):
                if not (directory / f).exists():
                    raise RuntimeUsageError(f"{directory / f}: missing (the manifest names it)")
        return manifest
