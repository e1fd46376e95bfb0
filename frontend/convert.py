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
  - everything is validated before a byte is written (frontend/plan.py `plan_conversion`, the plan
    `load_model` loads too); the archive is streamed one tensor (one expert) at a time and renamed
    into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kimi_iree.runtime.errors import RuntimeUsageError
from kimi_iree.runtime.manifest import Conversion, Manifest, Parameters, Tokenizer, package_version

from .checkpoint import CheckpointReader
from .errors import FrontendError
from .irpa import SCOPE as ARCHIVE_SCOPE
from .irpa import ArchiveEntry, write_archive
from .plan import DTYPES, ConversionPlan, ConvertOptions, PlannedTensor, plan_conversion  # noqa: F401 (re-exported)
from .safetensors_file import TORCH_TO_SAFETENSORS

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def _writer(reader: CheckpointReader, t: PlannedTensor) -> Callable:
    def write(f):
        for part in t.parts:
            if t.action == "copy" and not part.transforms:
                for piece in reader.chunks(part.source):       # the checkpoint's bytes, bounded buffers
                    f.write(piece)
                continue
            f.write(t.read_part(reader, part).view(torch.uint8).numpy().tobytes())
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
        conversion = Manifest.load(out, need_module=False).conversion
    except RuntimeUsageError:
        return False
    return ((out / "model.irpa").exists() and conversion.source_fingerprint == source_fingerprint(checkpoint)
            and conversion.options == options.to_json())


def manifest_for(plan: ConversionPlan, checkpoint: Path, options: ConvertOptions) -> Manifest:
    """The conversion's half of model.json (runtime/manifest.py); kimi-compile adds the module."""
    cfg = plan.cfg
    tokenizer_config = {}
    if (checkpoint / "tokenizer_config.json").exists():
        try:
            tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
        except json.JSONDecodeError:
            tokenizer_config = {}
    dropped = plan.checkpoint.dropped
    conversion = Conversion(
        options=options.to_json(), source_fingerprint=source_fingerprint(checkpoint), layers=cfg.num_layers,
        source_layers=plan.source_layers,
        dropped={g: {"tensors": n, "bytes": plan.checkpoint.dropped_bytes[g]} for g, n in sorted(dropped.items())},
        tensors_kept=len(plan.tensors), bytes_kept=sum(t.nbytes for t in plan.tensors))
    tensors = {t.name: {**_metadata(t), "sources": [p.source for p in t.parts][:1] + (
        [f"... {len(t.parts)} experts"] if len(t.parts) > 1 else [])} for t in plan.tensors}
    indexer = None
    if cfg.has_indexer:
        indexer = {"index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
                   "index_topk": cfg.index_topk, "index_use_rope": cfg.index_use_rope, "layers": cfg.mla_layers()}
    return Manifest(
        kimi_iree_version=package_version("kimi-iree"), source={"checkpoint": str(checkpoint.resolve()), "model_type": cfg.model_type},
        conversion=conversion, config=cfg.to_dict(), parameters=Parameters("model.irpa", ARCHIVE_SCOPE, tensors),
        tokenizer=Tokenizer([f for f in TOKENIZER_FILES if (checkpoint / f).exists()],
                            bool(tokenizer_config.get("add_bos_token", False))),
        experts=expert_format(plan, options) if "moe" in cfg.ffn_kinds else None, weights=weight_formats(plan),
        indexer=indexer)


def expert_format(plan: ConversionPlan, options: ConvertOptions) -> dict:
    """How the routed experts are held in model.irpa: {"format": a block-scaled format (frontend/formats.py)
    or a float dtype, "from": what made it}."""
    routed = [t for t in plan.tensors if ".experts." in t.name]
    packed = [t for t in routed if t.name.endswith(".packed")]
    if packed:
        made_by = ("checkpoint" if packed[0].action == "copy"
                   else "--quantize-experts mxfp4 (lossy: OCP MX rounding)")
        return {"format": packed[0].format, "from": made_by}
    dtypes = sorted({TORCH_TO_SAFETENSORS[t.dtype] for t in routed})
    return {"format": "/".join(dtypes).lower(), "from": "checkpoint"}


def weight_formats(plan: ConversionPlan) -> dict:
    """Non-expert weight matrices (linears, embedding, lm_head) by how model.irpa holds them: {format or
    dtype: count} (e.g. FP8 layers kept as published, or widened by --dtype/--override)."""
    counts: dict[str, int] = {}
    for t in plan.tensors:
        if ".experts." in t.name or not t.name.endswith((".packed", ".weight")) or t.name.endswith("norm.weight"):
            continue
        key = t.format if t.name.endswith(".packed") else TORCH_TO_SAFETENSORS[t.dtype].lower()
        if t.action == "dequantize":
            key = f"{key} (from {t.format})"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def staging_dir(out: Path, prefix: str) -> Path:
    """A fresh directory inside `out` (created if needed) whose files are renamed into `out` when done."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=out))
    except OSError as e:
        raise FrontendError(f"{out}: output directory not writable ({e.strerror})") from None


def convert(checkpoint: str | Path, out: str | Path, options: ConvertOptions, *, quiet: bool = False,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Manifest:
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
        manifest.write(tmp / "model.json")
        for f in manifest.tokenizer.files:
            shutil.copyfile(checkpoint / f, tmp / f)
        for f in ["model.irpa", *manifest.tokenizer.files, "model.json"]:   # the manifest last
            os.replace(tmp / f, out / f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    conv = manifest.conversion
    dropped = ", ".join(f"{g} {d['tensors']} tensors ({d['bytes'] / 2**20:.1f} MiB)" for g, d in conv.dropped.items())
    log(f"kept {conv.tensors_kept} tensors ({conv.bytes_kept / 2**20:.1f} MiB); "
        f"dropped: {dropped or 'nothing'}")
    return manifest
