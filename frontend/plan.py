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

from . import mxfp4
from .checkpoint import CheckpointPlan, CheckpointReader, Part, plan_checkpoint
from .config import ModelConfig, load_config
from .errors import CheckpointError, FrontendError
from .model import KimiModel, model_holding
from .moe import set_expert_format

EXPERT_QUANTIZATIONS = ("mxfp4",)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
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

    def read_part(self, reader: CheckpointReader, part: Part) -> torch.Tensor:
        """One part (one expert) as the archive stores it: the checkpoint's tensor, cast or quantised."""
        tensor = part.read(reader)
        if self.action == "cast":
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
        skeleton = set_expert_format(KimiModel(cfg), "mxfp4" if quantized else "float")
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
        state[t.name] = tensor if tensor.dtype == torch.uint8 else tensor.to(torch.float32)
    model = model_holding(cfg, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()
