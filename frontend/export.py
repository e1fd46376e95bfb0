"""Export: `torch.export` of the three entry points, imported to torch-dialect MLIR with the FX importer.

  prefill(tokens [B, P] i32, positions [B] i32, lengths [B] i32, *state)
          -> (logits [B, vocab] f32, hidden [B, P, D] f32, *state)
      B is the compiled batch (`--max-batch`, one sequence slot a row), P the prefill block. Row b's
      first lengths[b] tokens are real and go to cache slots positions[b].., the rest is padding; a
      row of length 0 is left as it was (a free slot, or one decoding). The runtime feeds a long
      prompt block by block. logits are each row's last real token's (all generation needs); hidden
      are every position's final (normed) hidden states.
  head(hidden [B, P, D] f32) -> (logits [B, P, vocab] f32)
      every position's logits (perplexity, --save-logits): the output head kept out of prefill, where
      it was a third of the step for one row used.
  decode(tokens [B] i32, positions [B] i32, lengths [B] i32, *state) -> (logits [B, vocab] f32, *state)
      one token a row; lengths[b] = 0 leaves row b as it was (a batch-1 module's row always decodes).
  prefill_wW, decode_wW (one pair per context window W, `kimi-compile --context-windows`)
      the same, with attention over cache slots [0, W) only: a call whose real tokens all sit below W
      gets the whole-cache entry's numbers in time that grows with W, not with the max context.
  prefill_short, prefill_short_wW (`kimi-compile --short-prefill-block S`, S < P)
      prefill on a block of S tokens: a prompt's last few tokens (or a short prompt) pay for S rows,
      not P; the same numbers.

Positions come from the caller, who knows where each sequence is: a row given position 0 starts a
new sequence (its KDA state is zeroed in the module), so a batch slot is reused with no reset call,
and no slot's numbers depend on another's (every op is per row: MoE routing is per token).

State tensors are passed in and returned (ARCHITECTURE.md "State") in the order `state_layout`
gives; IREE updates them in place when the caller donates the inputs (IREE_NOTES §0.5, §6 option A),
so they stay on the device between calls. The KV caches hold max_context + P slots: padding
tokens write past the real ones, where no real query looks.

Weights are never constants in the module: each parameter becomes
`util.global private @NAME = #flow.parameter.named<"model"::"NAME">` with the archive's dtype and
shape, read with `util.global.load`. The import uses torch-mlir's `export_and_import` with IREE's copy
of the same FX importer, so the globals are built in an IREE context next to the torch ops
(IREE_NOTES §5 route 1). The model is traced on the meta device (`skeleton_for_archive`): no
weight is ever loaded to export, whatever the checkpoint's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimi_iree.runtime.manifest import StateSlot, cache_slots, windowed

from .errors import FrontendError
from .irpa import SCOPE as ARCHIVE_SCOPE
from .model import KimiModel, model_holding, use_fused_units
from .units import FusedUnits


def state_layout(model: KimiModel, max_context: int, prefill_block: int, batch: int = 1) -> list[StateSlot]:
    """The state tensors the entry points take and return (the position is an input, not state)."""
    state = model.init_state(batch, cache_slots(max_context, prefill_block))
    return [StateSlot(k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state.items() if k != "position"]


def model_state(positions: torch.Tensor, names: list[str], state: tuple[torch.Tensor, ...]) -> dict:
    """The model's state dict: a batch-1 module's position 0-d (the model's single-sequence form, with
    nothing to reset: the runtime gives a new sequence a zero state), a batched module's per row."""
    position = positions.reshape(()) if positions.shape[0] == 1 else positions
    return {"position": position, **dict(zip(names, state))}


class PrefillEntry(nn.Module):
    def __init__(self, model: KimiModel, names: list[str], window: int | None = None):
        super().__init__()
        self.model, self.names, self.window = model, names, window

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, *state: torch.Tensor):
        logits, hidden, new = self.model.prefill_last(tokens, model_state(positions, self.names, state), length=lengths,
                                                      window=self.window)
        return (logits, hidden, *[new[n] for n in self.names])


class HeadEntry(nn.Module):
    def __init__(self, model: KimiModel):
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor):
        return self.model.head(hidden)


class DecodeEntry(nn.Module):
    def __init__(self, model: KimiModel, names: list[str], window: int | None = None):
        super().__init__()
        self.model, self.names, self.window = model, names, window

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, *state: torch.Tensor):
        batched = tokens.shape[0] > 1
        logits, new = self.model.decode(tokens, model_state(positions, self.names, state),
                                        length=lengths if batched else None, window=self.window)
        return (logits, *[new[n] for n in self.names])


def _element_type(dtype: torch.dtype):
    """The builtin element type torch-mlir pairs with a torch dtype (integers are signless there)."""
    from iree.compiler import ir
    return {
        torch.float32: ir.F32Type.get, torch.bfloat16: ir.BF16Type.get, torch.float16: ir.F16Type.get,
        torch.uint8: lambda: ir.IntegerType.get_signless(8), torch.int8: lambda: ir.IntegerType.get_signless(8),
        torch.int64: lambda: ir.IntegerType.get_signless(64), torch.int32: lambda: ir.IntegerType.get_signless(32),
        torch.int16: lambda: ir.IntegerType.get_signless(16),
    }[dtype]()


def _parameter_hooks(prefix: str):
    """FX importer hooks turning each model parameter into an external `#flow.parameter.named` global."""
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporterHooks
    from torch.export.graph_signature import InputKind

    class ExternalParameters(FxImporterHooks):
        def __init__(self):
            self.globals: dict[str, str] = {}
            self.module = None

        def prepare_module(self, module_op):
            self.module = module_op

        def resolve_literal(self, gni, literal, info):
            if info is None or info.input_spec.kind != InputKind.PARAMETER and not (
                    info.input_spec.kind == InputKind.BUFFER and info.input_spec.persistent):
                return None          # small non-persistent buffers (RoPE frequencies) stay inline
            target = info.input_spec.target
            name = target[len(prefix):] if target.startswith(prefix) else target
            tensor_type = ir.RankedTensorType.get(list(literal.shape), _element_type(literal.dtype))
            symbol = self.globals.get(name)
            if symbol is None:
                symbol = self.globals[name] = "param." + name
                op = ir.Operation.parse(
                    f'util.global private @"{symbol}" = #flow.parameter.named<"{ARCHIVE_SCOPE}"::"{name}"> : {tensor_type}')
                body = self.module.regions[0].blocks[0]
                ir.InsertionPoint.at_block_begin(body).insert(op)
            loaded = ir.Operation.create("util.global.load", results=[tensor_type],
                                         attributes={"global": ir.FlatSymbolRefAttr.get(symbol)}).result
            return ir.Operation.create("torch_c.from_builtin_tensor", results=[info.ir_type], operands=[loaded]).result

    return ExternalParameters()


# archive dtype -> what the model holds: FP8 codes are held as their bytes (decoded with integer ops)
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8,
                "F8_E4M3": torch.uint8, "I32": torch.int32}


def skeleton_for_archive(cfg, parameters: dict[str, dict], bf16_as: torch.dtype | None = None,
                         fused: FusedUnits = FusedUnits()) -> KimiModel:
    """A KimiModel on the meta device whose parameters have the archive's dtypes and shapes
    (`parameters`: the manifest's name -> {"dtype", "shape"}). bf16_as: for targets that cannot
    lower bf16, declare bf16 weights (the same bytes) as torch.int16, or as torch.int32 words holding
    two values of the last dim (targets without 16-bit storage); layers.widen_to_f32 widens them.
    fused: the fusion units to emit as custom ops (their passes must then run)."""
    tensors = {}
    for name, meta in parameters.items():
        dtype, shape = TORCH_DTYPES[meta["dtype"]], list(meta["shape"])
        if bf16_as is not None and meta["dtype"] == "BF16":
            dtype = bf16_as
            if dtype == torch.int32:
                if not shape or shape[-1] % 2:
                    raise FrontendError(f"tensor {name}: bf16 of shape {shape} cannot be read as 32-bit words "
                                        "(odd last dim) on a target without 16-bit storage")
                shape[-1] //= 2
        tensors[name] = (dtype, tuple(shape))
    try:
        model = model_holding(cfg, tensors, device="meta")
    except ValueError as e:
        raise FrontendError(f"model.irpa does not fit this model: {e}") from None
    return use_fused_units(model, fused)


@dataclass
class ExportedModel:
    mlir: str                           # torch-dialect MLIR text with external parameters
    state: list[StateSlot]
    prefill_block: int
    max_context: int
    max_batch: int


def export_model(model: KimiModel, max_context: int, prefill_block: int = 32, max_batch: int = 1,
                 windows: tuple[int, ...] = (), short_block: int | None = None) -> ExportedModel:
    """The entry points of `model` (a `skeleton_for_archive`, or any model holding the archive's dtypes);
    for each of `windows` a prefill and a decode whose attention reads only that many cache slots (the
    runtime calls the smallest that holds a call's tokens); with `short_block`, prefill entries on a block
    of that many tokens beside them."""
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter
    from torch_mlir import fx

    model = model.eval()
    device = next(model.parameters()).device     # "meta" exports without holding any weight
    slots = state_layout(model, max_context, prefill_block, max_batch)
    names = [s.name for s in slots]
    state = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in slots]
    hooks = _parameter_hooks("model.")
    context = ir.Context()
    importer = FxImporter(context=context, hooks=hooks)
    hooks.prepare_module(importer.module.operation)
    # No decomposition pass: torch-mlir's own lowering (inside iree-compile) takes the exported ops
    # directly, and re-tracing through the default table would double the export time. The model
    # avoids the few ops that then have no lowering (index_copy, bool `&`, 3-operand einsum).
    decomp = {"decomposition_table": {}}
    with torch.no_grad():
        B = max_batch
        positions = torch.zeros(B, dtype=torch.int32, device=device)
        blocks = {"prefill": prefill_block, **({"prefill_short": short_block} if short_block else {})}
        for window in (None, *windows):
            for entry, block in blocks.items():
                tokens = torch.zeros(B, block, dtype=torch.int32, device=device)
                lengths = torch.full((B,), block, dtype=torch.int32, device=device)
                fx.export_and_import(PrefillEntry(model, names, window), tokens, positions, lengths, *state,
                                     fx_importer=importer, experimental_support_mutation=True,
                                     func_name=windowed(entry, window), **decomp)
            fx.export_and_import(DecodeEntry(model, names, window), torch.zeros(B, dtype=torch.int32, device=device),
                                 positions, torch.ones(B, dtype=torch.int32, device=device), *state,
                                 fx_importer=importer, experimental_support_mutation=True,
                                 func_name=windowed("decode", window), **decomp)
        hidden = torch.zeros(B, prefill_block, model.cfg.hidden_size, dtype=torch.float32, device=device)
        fx.export_and_import(HeadEntry(model), hidden, fx_importer=importer, experimental_support_mutation=True,
                             func_name="head", **decomp)
    return ExportedModel(str(importer.module), slots, prefill_block, max_context, max_batch)
