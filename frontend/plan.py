"""What the model holds, decided once: `plan_conversion` maps, checks and plans every canonical tensor of a
checkpoint (name, shape, stored dtype, the checkpoint parts it is made of, and whether it is copied,
cast or quantised) before a byte is read. The converter (frontend/convert.py) writes that plan into
model.irpa; `load_model` loads the same plan into an eager model. One contract, one set of messages.

    model = load_model("ckpt/")                      # eager, f32 activations, weights widened to f32
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import formats as weight_formats
from . import mxfp4
from .checkpoint import CheckpointPlan, CheckpointReader, Part, plan_checkpoint
from .config import ModelConfig, load_config
from .errors import CheckpointError, FrontendError
from .model import KimiModel, hold_formats, model_holding

EXPERT_QUANTIZATIONS = ("mxfp4",)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TORCH_TO_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8", torch.int32: "I32",
                 torch.float8_e4m3fn: "F8_E4M3"}
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
    action: str                        # "copy", "cast", "quantize-packed", "quantize-scales", "dequantize"
    scale_parts: list[Part] = field(default_factory=list)   # "dequantize": the scales beside the codes
    format: str | None = None          # the block-scaled format of a `.packed`/`.scales` tensor, or dequantised

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def read_part(self, reader: CheckpointReader, part: Part) -> torch.Tensor:
        """One part (one expert) as the archive stores it: the checkpoint's tensor, cast or quantised."""
        tensor = part.read(reader)
        if self.action == "dequantize":           # --dtype/--override widening block-scaled codes
            scales = self.scale_parts[self.parts.index(part)].read(reader)
            codes = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
            tensor = weight_formats.FORMATS[self.format].dequantize(codes, scales, self.shape[-1]).to(self.dtype)
        elif self.action == "cast":
            tensor = tensor.to(self.dtype)
        elif self.action.startswith("quantize"):
            packed, scales = mxfp4.quantize(tensor)
            tensor = packed if self.action == "quantize-packed" else scales
        return tensor.contiguous()

    def read(self, reader: CheckpointReader) -> torch.Tensor:
        """The whole canonical tensor as the archive stores it (routed experts stacked)."""
        parts = [self.read_part(reader, p) for p in self.parts]
        tensor = torch.stack(parts) if self.parts[0].expert is not None else parts[0]
        return tensor.reshape(self.shape)


@dataclass
class ConversionPlan:
    cfg: ModelConfig                   # of the converted (possibly sliced) model
    source_layers: int                 # decoder layers in the checkpoint
    tensors: list[PlannedTensor]
    checkpoint: CheckpointPlan
    notices: list[str]


def slice_config(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    if layers is None or layers == cfg.num_layers:
        return cfg
    if not 1 <= layers <= cfg.num_layers:
        raise FrontendError(f"--layers {layers}: the checkpoint has {cfg.num_layers} decoder layers")
    return cfg.with_overrides(num_layers=layers, layer_kinds=cfg.layer_kinds[:layers], ffn_kinds=cfg.ffn_kinds[:layers])


def _target_dtype(name: str, options: ConvertOptions, overrides, notices: list[str], source: str) -> torch.dtype | None:
    """The dtype --dtype / --override ask for a non-expert weight (None: keep), after the exceptions."""
    target = DTYPES[options.dtype] if options.dtype else None
    matched = [dt for rx, dt in overrides if rx.search(name)]
    if matched:
        target = matched[-1]
    if target is not None and INDEXER_PROJECTIONS.fullmatch(name):
        notices.append(f"notice: {name} keeps its source dtype {source} "
                       f"(indexer projections take no precision override)")
        return None
    if target is not None and KEEP_F32.search(name):
        return torch.float32
    return target


def _block_scaled(ckpt: CheckpointPlan, reader: CheckpointReader) -> dict[str, str]:
    """module name -> block-scaled format of every weight the checkpoint holds as codes + scales."""
    found = {}
    for name, parts in ckpt.parts.items():
        if not name.endswith(".packed"):
            continue
        base = name[: -len(".packed")]
        info = reader.info(parts[0].source)
        if f"{base}.scales" not in ckpt.parts:
            missing = "weight_scale_inv" if info.dtype == "F8_E4M3" else "weight_scale"
            raise CheckpointError(f"tensor {parts[0].source}: {info.dtype} codes without their {missing} "
                                  f"({parts[0].source.rsplit('.', 1)[0]}.{missing} is missing)")
        scales = reader.info(ckpt.parts[f"{base}.scales"][0].source)
        if info.dtype == "F8_E4M3":
            found[base] = "fp8_e4m3_b128"
        elif info.dtype == "I32":
            found[base] = "int4_g32"
        elif info.dtype == "U8" and scales.dtype == "U8":
            found[base] = "mxfp4"
        else:
            raise CheckpointError(f"tensor {parts[0].source}: dtype {info.dtype} with {scales.dtype} scales is no "
                                  "block-scaled format we read (mxfp4 U8+U8, fp8 F8_E4M3+F32, int4 I32+BF16)")
    return found


def _check_row_shapes(ckpt: CheckpointPlan, reader: CheckpointReader, expected: dict[str, tuple[int, int]]) -> None:
    """compressed-tensors' `weight_shape` beside each packed weight: two integers, the unpadded [O, K]."""
    for packed, parts in ckpt.row_shapes.items():
        for part in parts:
            info = reader.info(part.source)
            if info.dtype not in ("I32", "I64") or info.shape != (2,):
                raise CheckpointError(f"tensor {part.source}: {info.dtype} {list(info.shape)}, expected 2 integers "
                                      "(the unpadded [rows, columns])")
            got = tuple(int(v) for v in reader.get(part.source).tolist())
            if packed in expected and got != expected[packed]:
                raise CheckpointError(f"tensor {part.source}: weight_shape {list(got)}, config implies "
                                      f"{list(expected[packed])}")


def plan_conversion(checkpoint: str | Path, options: ConvertOptions) -> ConversionPlan:
    """Everything decided and checked (names, shapes, dtypes, experts, indexer) before writing."""
    full_cfg = load_config(checkpoint)
    cfg = slice_config(full_cfg, options.layers)
    reader = CheckpointReader(checkpoint)
    ckpt = plan_checkpoint(reader, full_cfg, keep_layers=cfg.num_layers)
    if cfg.tie_word_embeddings and "lm_head.weight" in ckpt.parts:
        cfg = cfg.with_overrides(tie_word_embeddings=False)
    # Lossless by default: block-scaled weights stay as published, float experts stay float; only
    # --quantize-experts mxfp4 (float experts) and --dtype/--override (other weights) change numbers.
    if options.quantize_experts not in (None, *EXPERT_QUANTIZATIONS):
        raise FrontendError(f"--quantize-experts {options.quantize_experts!r}: expected one of "
                            f"{', '.join(EXPERT_QUANTIZATIONS)}")
    overrides = [(re.compile(rx), DTYPES[dt]) for rx, dt in options.overrides]
    notices: list[str] = []
    held = _block_scaled(ckpt, reader)
    widened: dict[str, tuple[str, torch.dtype]] = {}   # block-scaled linears --dtype/--override widen
    for base, fmt in list(held.items()):
        if ".experts." in base:
            continue
        source = reader.info(ckpt.parts[f"{base}.packed"][0].source)
        target = _target_dtype(f"{base}.weight", options, overrides, notices, source.dtype)
        if target is not None:
            widened[base] = (fmt, target)
            del held[base]
    expert_formats = {f for b, f in held.items() if ".experts." in b}
    if options.quantize_experts == "mxfp4":
        if expert_formats - {"mxfp4"}:
            raise FrontendError(f"--quantize-experts mxfp4: the checkpoint's experts are already "
                                f"{sorted(expert_formats)[0]} (requantising would lose precision twice)")
        if "moe" in cfg.ffn_kinds and not expert_formats:
            held.update({f"layers.{i}.ffn.experts.{w}": "mxfp4" for i, k in enumerate(cfg.ffn_kinds) if k == "moe"
                         for w in ("w1", "w2", "w3")})
    with torch.device("meta"):
        skeleton = hold_formats(KimiModel(cfg), held)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in skeleton.state_dict().items()}
    _check_row_shapes(ckpt, reader, {f"{b}.packed": _weight_shape(skeleton, b) for b in held})
    planned: list[PlannedTensor] = []

    def have(name: str) -> bool:
        return name in ckpt.parts

    for name, (want_shape, want_dtype) in expected.items():
        base, kind = name.rsplit(".", 1)
        fmt = held.get(base)
        source_name, action, scale_parts = name, "copy", []
        if fmt == "mxfp4" and not have(name) and have(f"{base}.weight"):
            source_name, action = f"{base}.weight", f"quantize-{kind}"       # float experts -> MXFP4
        elif base in widened and kind == "weight":
            source_name, action = f"{base}.packed", "dequantize"
            scale_parts = ckpt.parts[f"{base}.scales"]
        if not have(source_name):
            layer = f" (layer {name.split('.')[1]})" if name.startswith("layers.") else ""
            missing = {"scales": "scales (weight_scale_inv / weight_scale)", "packed": "codes"}.get(kind, "")
            raise CheckpointError(f"missing tensor {name}{layer}" + (f": its {missing}" if fmt and missing else ""))
        parts = ckpt.parts[source_name]
        first = reader.info(parts[0].source)
        for part in parts[1:]:
            info = reader.info(part.source)
            if info.dtype != first.dtype:
                raise CheckpointError(f"tensor {part.source}: dtype {info.dtype}, {parts[0].source} has {first.dtype} "
                                      "(experts of one layer must share a dtype)")
        shapes = {p.shape(reader) for p in parts}
        if len(shapes) > 1:
            raise CheckpointError(f"{name}: experts disagree on shape {sorted(shapes)}")
        shape = (len(parts), *shapes.pop()) if parts[0].expert is not None else parts[0].shape(reader)
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
            if fmt and kind == "scales":
                rows, cols = _weight_shape(skeleton, base)
                f = weight_formats.FORMATS[fmt]
                raise CheckpointError(f"tensor {first.name}: scale grid {list(shape[-2:])} does not cover the "
                                      f"[{rows}, {cols}] weight in {f.block_rows}x{f.block_cols} blocks "
                                      f"(expected {list(want_shape[-2:])}){layer}")
            raise CheckpointError(f"tensor {first.name}: shape {list(shape)}, config implies {list(want_shape)}{layer}")
        if fmt and kind in ("packed", "scales") and action == "copy":
            f = weight_formats.FORMATS[fmt]
            allowed = {f.packed_dtype if kind == "packed" else f.scales_dtype}
            if fmt == "fp8_e4m3_b128" and kind == "packed":
                allowed = {torch.float8_e4m3fn}
            if stored_dtype not in allowed:
                raise CheckpointError(f"tensor {first.name}: dtype {first.dtype}, {fmt} {kind} must be "
                                      f"{TORCH_TO_NAME[allowed.pop()]}")
        elif want_dtype == torch.uint8 and stored_dtype != torch.uint8:
            raise CheckpointError(f"tensor {first.name}: dtype {first.dtype}, MXFP4 bytes must be uint8")
        elif not fmt and action != "dequantize" and not stored_dtype.is_floating_point:
            raise CheckpointError(f"tensor {first.name}: dtype {first.dtype}, expected a float tensor")
        # precision: --dtype / --override for non-expert float weights; block-scaled ones were decided above
        if action == "dequantize":
            stored_dtype = widened[base][1]
        elif stored_dtype.is_floating_point and not fmt and ".experts." not in name:
            target = _target_dtype(name, options, overrides, notices, first.dtype)
            if target is not None and target != stored_dtype:
                stored_dtype, action = target, "cast"
        planned.append(PlannedTensor(name, stored_dtype, shape, parts, action, scale_parts,
                                     widened[base][0] if action == "dequantize" else fmt))
    used = {p.source for t in planned for p in (*t.parts, *t.scale_parts)}
    used |= {p.source for plist in ckpt.row_shapes.values() for p in plist}
    unused = [p.source for c, plist in ckpt.parts.items() for p in plist if p.source not in used]
    if unused:
        raise CheckpointError(f"tensor {unused[0]} is not used by this config")
    return ConversionPlan(cfg, full_cfg.num_layers, planned, ckpt, notices)


def _weight_shape(model: KimiModel, base: str) -> tuple[int, int]:
    """The [O, K] weight the module `base` of `model` computes with (one expert's, for routed experts)."""
    module = model.get_submodule(base)
    return tuple(module.shape[1:]) if hasattr(module, "shape") else (module.out_features, module.in_features)


def load_model(checkpoint_dir: str | Path, *, index_topk: int | None = None,
               options: ConvertOptions | None = None) -> KimiModel:
    """An eager KimiModel holding what `plan_conversion` plans for the checkpoint (with `options`, e.g. a
    `--layers` slice or `quantize_experts`), float weights widened to f32 (MXFP4 stays bytes).

    index_topk: override the config's (the forced-selection experiment)."""
    plan = plan_conversion(checkpoint_dir, options or ConvertOptions())
    cfg = plan.cfg
    if index_topk is not None:
        if not cfg.has_indexer:
            raise CheckpointError(f"{checkpoint_dir}: --index-topk given but the model has no indexer")
        cfg = cfg.with_overrides(index_topk=index_topk)
    reader = CheckpointReader(checkpoint_dir)
    state = {}
    for t in plan.tensors:
        tensor = t.read(reader)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = tensor.view(torch.uint8)            # FP8 codes: decoded by the model (frontend/formats.py)
        state[t.name] = tensor if not tensor.is_floating_point() else tensor.to(torch.float32)
    model = model_holding(cfg, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()
