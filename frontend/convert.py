"""Checkpoint conversion: a Hugging Face directory -> OUT/model.irpa + OUT/model.json, text only.

  - vision tower, mm_projector, MTP layers (and layers past --layers) are dropped and reported;
  - every kept tensor is stored under its canonical name with the bytes the checkpoint has
    (reshapes are free; derived forms such as -exp(A_log) or a split kv_b_proj are computed in the
    module), routed experts stacked over the expert axis, so the archive can be checked tensor by
    tensor against its source;
  - MXFP4 experts pass through as uint8; float experts keep their source precision (lossless)
    unless --quantize-experts mxfp4 asks for MXFP4 (OCP rounding);
  - --dtype / --override change the precision of non-expert weights, except the indexer's
    projections (token selection is sensitive to their precision: they keep the source dtype)
    and the small precision-sensitive tensors (A_log, dt_bias, conv, norms, router), stored f32;
  - everything is validated before a byte is written; the archive is streamed one tensor (one
    expert) at a time and renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import mxfp4
from .checkpoint import CheckpointPlan, CheckpointReader, Part, plan_checkpoint, read_part
from .config import ModelConfig, load_config
from .errors import CheckpointError, FrontendError
from .irpa import SCOPE as ARCHIVE_SCOPE
from .irpa import ArchiveEntry, write_archive
from .model import KimiModel
from .safetensors_file import TORCH_TO_SAFETENSORS

ABI_VERSION = 1
EXPERT_QUANTIZATIONS = ("mxfp4",)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
INDEXER_PROJECTIONS = re.compile(r"layers\.\d+\.mixer\.indexer\.(wq_b|wk|weights_proj)\.weight")
# Small tensors whose precision matters more than their size: always f32 when precision changes.
KEEP_F32 = re.compile(r"(\.A_log|\.dt_bias|\.[qkv]_conv|norm(\.weight|\.bias)?|\.o_norm|_res\.(proj|norm)"
                      r"|\.router\.(weight|bias))$")


@dataclass
class ConvertOptions:
    layers: int | None = None                       # convert only the first N decoder layers
    dtype: str | None = None                        # f32 | bf16 | f16 for non-expert weights
    overrides: list[tuple[str, str]] = field(default_factory=list)   # (regex, dtype), later wins
    quantize_experts: str | None = None             # None: as the checkpoint has them; "mxfp4"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PlannedTensor:
    name: str
    dtype: torch.dtype                 # as stored in the archive
    shape: tuple[int, ...]
    parts: list[Part]
    action: str                        # "copy", "cast", "quantize-packed", "quantize-scales"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ConversionPlan:
    cfg: ModelConfig                   # of the converted (possibly sliced) model
    source_layers: int                 # decoder layers in the checkpoint
    tensors: list[PlannedTensor]
    checkpoint: CheckpointPlan
    notices: list[str]


def _part_shape(reader: CheckpointReader, part: Part) -> tuple[int, ...]:
    shape = reader.info(part.source).shape
    for step in filter(None, (part.transform or "").split("+")):
        if step == "blocks":
            shape = (*shape[:-2], shape[-2] * shape[-1])
        elif step in ("even_rows", "odd_rows"):
            shape = (*shape[:-2], (shape[-2] + (step == "even_rows")) // 2, shape[-1])
    return tuple(shape)


def slice_config(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    if layers is None or layers == cfg.num_layers:
        return cfg
    if not 1 <= layers <= cfg.num_layers:
        raise FrontendError(f"--layers {layers}: the checkpoint has {cfg.num_layers} decoder layers")
    return cfg.with_overrides(num_layers=layers, layer_kinds=cfg.layer_kinds[:layers], ffn_kinds=cfg.ffn_kinds[:layers])


def plan_conversion(checkpoint: str | Path, options: ConvertOptions) -> ConversionPlan:
    """Everything decided and checked (names, shapes, dtypes, experts, indexer) before writing."""
    full_cfg = load_config(checkpoint)
    cfg = slice_config(full_cfg, options.layers)
    reader = CheckpointReader(checkpoint)
    ckpt = plan_checkpoint(reader, full_cfg, keep_layers=cfg.num_layers)
    if cfg.tie_word_embeddings and "lm_head.weight" in ckpt.parts:
        cfg = cfg.with_overrides(tie_word_embeddings=False)
    # Lossless by default: MXFP4 experts stay MXFP4, float experts stay float; only
    # --quantize-experts mxfp4 changes the model's numbers.
    if options.quantize_experts not in (None, *EXPERT_QUANTIZATIONS):
        raise FrontendError(f"--quantize-experts {options.quantize_experts!r}: expected one of "
                            f"{', '.join(EXPERT_QUANTIZATIONS)}")
    quantized = cfg.expert_format is not None or options.quantize_experts == "mxfp4"
    with torch.device("meta"):
        skeleton = KimiModel(cfg, quantized_experts=quantized)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in skeleton.state_dict().items()}
    overrides = [(re.compile(rx), DTYPES[dt]) for rx, dt in options.overrides]
    notices: list[str] = []
    planned: list[PlannedTensor] = []

    def have(name: str) -> bool:
        return name in ckpt.parts

    for name, (want_shape, want_dtype) in expected.items():
        base, kind = name.rsplit(".", 1)
        source_name = name
        action = "copy"
        if want_dtype == torch.uint8 and not have(name) and have(f"{base}.weight"):
            source_name, action = f"{base}.weight", f"quantize-{kind}"       # float experts -> MXFP4
        if not have(source_name):
            layer = f" (layer {name.split('.')[1]})" if name.startswith("layers.") else ""
            raise CheckpointError(f"missing tensor {name}{layer}")
        parts = ckpt.parts[source_name]
        first = reader.info(parts[0].source)
        shapes = {_part_shape(reader, p) for p in parts}
        if len(shapes) > 1:
            raise CheckpointError(f"{name}: experts disagree on shape {sorted(shapes)}")
        shape = (len(parts), *shapes.pop()) if parts[0].expert is not None else _part_shape(reader, parts[0])
        if action.startswith("quantize"):
            if shape[-1] % mxfp4.BLOCK:
                raise CheckpointError(f"--quantize-experts mxfp4: {parts[0].source} has K={shape[-1]}, not divisible "
                                      f"by the MXFP4 block {mxfp4.BLOCK} (leave the experts in their precision)")
            shape = (*shape[:-1], shape[-1] // (2 if kind == "packed" else mxfp4.BLOCK))
        stored_dtype = torch.uint8 if action.startswith("quantize") else first.torch_dtype
        # A reshape is free (2-D conv weights, [1,1,H,1] A_log); K3's longer A_log is kept whole.
        if name.endswith(".mixer.A_log"):
            if math.prod(shape) < cfg.kda_num_heads:
                raise CheckpointError(f"{first.name}: {math.prod(shape)} entries for {cfg.kda_num_heads} KDA heads")
            shape = want_shape = (math.prod(shape),)
        elif shape != want_shape and math.prod(shape) == math.prod(want_shape) and len(shape) != len(want_shape):
            shape = want_shape
        if shape != want_shape:
            layer = f" (layer {name.split('.')[1]})" if name.startswith("layers.") else ""
            raise CheckpointError(f"tensor {first.name}: shape {list(shape)}, config implies {list(want_shape)}{layer}")
        if want_dtype == torch.uint8 and stored_dtype != torch.uint8:
            raise CheckpointError(f"tensor {first.name}: dtype {first.dtype}, MXFP4 bytes must be uint8")
        if want_dtype != torch.uint8 and not stored_dtype.is_floating_point:
            raise CheckpointError(f"tensor {first.name}: dtype {first.dtype}, expected a float tensor")
        # precision
        if stored_dtype.is_floating_point and ".experts." not in name:
            target = DTYPES[options.dtype] if options.dtype else None
            matched = [dt for rx, dt in overrides if rx.search(name)]
            if matched:
                target = matched[-1]
            if target is not None and target != stored_dtype:
                if INDEXER_PROJECTIONS.fullmatch(name):
                    notices.append(f"notice: {name} keeps its source dtype {first.dtype} "
                                   f"(indexer projections take no precision override)")
                    target = None
                elif KEEP_F32.search(name):
                    target = torch.float32
            if target is not None and target != stored_dtype:
                stored_dtype, action = target, "cast"
        planned.append(PlannedTensor(name, stored_dtype, shape, parts, action))
    used = {p.source for t in planned for p in t.parts}
    unused = [p.source for c, plist in ckpt.parts.items() for p in plist if p.source not in used]
    if unused:
        raise CheckpointError(f"tensor {unused[0]} is not used by this config")
    return ConversionPlan(cfg, full_cfg.num_layers, planned, ckpt, notices)


def _writer(reader: CheckpointReader, t: PlannedTensor) -> Callable:
    def write(f):
        for part in t.parts:
            if t.action == "copy" and not part.transform:
                for piece in reader.chunks(part.source):
                    f.write(piece)
                continue
            tensor = read_part(reader, part)
            if t.action == "cast":
                tensor = tensor.to(t.dtype)
            elif t.action.startswith("quantize"):
                packed, scales = mxfp4.quantize(tensor)
                tensor = packed if t.action == "quantize-packed" else scales
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return write


def _metadata(t: PlannedTensor) -> dict:
    return {"dtype": TORCH_TO_SAFETENSORS[t.dtype], "shape": list(t.shape)}


def source_fingerprint(checkpoint: Path) -> str:
    """Changes when any checkpoint file changes (name, size, mtime): decides whether to convert again."""
    h = hashlib.sha256()
    for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def is_up_to_date(checkpoint: Path, out: Path, options: ConvertOptions) -> bool:
    try:
        manifest = json.loads((out / "model.json").read_text())
        conv = manifest["conversion"]
    except (OSError, json.JSONDecodeError, KeyError):
        return False
    return ((out / "model.irpa").exists() and conv.get("source_fingerprint") == source_fingerprint(checkpoint)
            and conv.get("options") == options.to_json())


def manifest_for(plan: ConversionPlan, checkpoint: Path, options: ConvertOptions) -> dict:
    cfg = plan.cfg
    reader_sizes = {g: plan.checkpoint.dropped_bytes[g] for g in plan.checkpoint.dropped}
    tokenizer_config = {}
    if (checkpoint / "tokenizer_config.json").exists():
        try:
            tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
        except json.JSONDecodeError:
            tokenizer_config = {}
    manifest = {
        "format": "kimi-iree-model",
        "abi_version": ABI_VERSION,
        "kimi_iree_version": _version(),
        "source": {"checkpoint": str(checkpoint.resolve()), "model_type": cfg.model_type},
        "conversion": {
            "options": options.to_json(),
            "source_fingerprint": source_fingerprint(checkpoint),
            "layers": cfg.num_layers,
            "source_layers": plan.source_layers,
            "dropped": {g: {"tensors": n, "bytes": reader_sizes[g]} for g, n in sorted(plan.checkpoint.dropped.items())},
            "tensors_kept": len(plan.tensors),
            "bytes_kept": sum(t.nbytes for t in plan.tensors),
        },
        "config": cfg.to_dict(),
        "parameters": {
            "file": "model.irpa", "scope": ARCHIVE_SCOPE,
            "tensors": {t.name: {**_metadata(t), "sources": [p.source for p in t.parts][:1] + (
                [f"... {len(t.parts)} experts"] if len(t.parts) > 1 else [])} for t in plan.tensors},
        },
        "tokenizer": {"files": [f for f in TOKENIZER_FILES if (checkpoint / f).exists()],
                      "add_bos_token": bool(tokenizer_config.get("add_bos_token", False))},
    }
    if "moe" in cfg.ffn_kinds:
        manifest["experts"] = expert_format(plan, options)
    if cfg.has_indexer:
        manifest["indexer"] = {"index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
                               "index_topk": cfg.index_topk, "index_use_rope": cfg.index_use_rope,
                               "layers": cfg.mla_layers()}
    return manifest


def expert_format(plan: ConversionPlan, options: ConvertOptions) -> dict:
    """How the routed experts are held in model.irpa: {"format": "mxfp4" | a float dtype, "from": what made it}."""
    routed = [t for t in plan.tensors if ".experts." in t.name]
    if any(t.name.endswith(".packed") for t in routed):
        made_by = "checkpoint" if plan.cfg.expert_format else "--quantize-experts mxfp4 (lossy: OCP MX rounding)"
        return {"format": "mxfp4", "from": made_by}
    dtypes = sorted({TORCH_TO_SAFETENSORS[t.dtype] for t in routed})
    return {"format": "/".join(dtypes).lower(), "from": "checkpoint"}


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("kimi-iree")
    except Exception:
        return "0+unknown"


def staging_dir(out: Path, prefix: str) -> Path:
    """A fresh directory inside `out` (created if needed) whose files are renamed into `out` when done."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=out))
    except OSError as e:
        raise FrontendError(f"{out}: output directory not writable ({e.strerror})") from None


def convert(checkpoint: str | Path, out: str | Path, options: ConvertOptions, *, quiet: bool = False,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Convert into `out` (model.irpa, model.json, tokenizer files). Returns the manifest.

    Nothing is written before the whole plan validates; files land by rename, so a failure leaves
    no partial model.irpa and any earlier good output untouched."""
    checkpoint, out = Path(checkpoint), Path(out)
    plan = plan_conversion(checkpoint, options)
    for notice in plan.notices:
        log(notice)
    tmp = staging_dir(out, ".convert-")
    try:
        reader = CheckpointReader(checkpoint)
        total = sum(t.nbytes for t in plan.tensors)
        from tqdm import tqdm
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", file=sys.stderr,
                  disable=quiet, dynamic_ncols=True) as bar:
            write_archive(str(tmp / "model.irpa"),
                          [ArchiveEntry(t.name, t.nbytes, _metadata(t), _writer(reader, t)) for t in plan.tensors],
                          progress=bar.update)
        manifest = manifest_for(plan, checkpoint, options)
        (tmp / "model.json").write_text(json.dumps(manifest, indent=1))
        for f in manifest["tokenizer"]["files"]:
            shutil.copyfile(checkpoint / f, tmp / f)
        for f in ["model.irpa", *manifest["tokenizer"]["files"], "model.json"]:   # the manifest last
            os.replace(tmp / f, out / f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    conv = manifest["conversion"]
    dropped = ", ".join(f"{g} {d['tensors']} tensors ({d['bytes'] / 2**20:.1f} MiB)" for g, d in conv["dropped"].items())
    log(f"kept {conv['tensors_kept']} tensors ({conv['bytes_kept'] / 2**20:.1f} MiB); "
        f"dropped: {dropped or 'nothing'}")
    return manifest
