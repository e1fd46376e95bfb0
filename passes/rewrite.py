"""What every unit pass shares: finding a unit's `torch.operator` in torch-dialect MLIR and replacing it
with a call to an implementation function written in linalg on builtin tensors.

A unit (frontend/units.py) reaches MLIR as
    %r = torch.operator "torch.kimi.NAME"(%tensor, ..., %int, %float) : (...) -> !torch.vtensor<[...],f32>
Tensor operands cross to builtin tensors with `torch_c.to_builtin_tensor`, scalar operands must be
`torch.constant.*` (their values are baked into the implementation), and the implementation is a
`util.func private` that IREE inlines into the caller before forming dispatches (IREE_NOTES §1a).
One implementation function is emitted per distinct signature.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from iree.compiler import ir

UNIT_PREFIX = "torch.kimi."

# torch dtype spelling in !torch.vtensor -> builtin element type (torch-mlir's integers are signless)
ELEMENT_TYPES = {"f32": "f32", "f16": "f16", "bf16": "bf16", "si64": "i64", "si32": "i32", "si16": "i16",
                 "ui8": "i8", "si8": "i8", "i1": "i1"}


class PassError(Exception):
    """A unit the pass cannot rewrite (the driver reports it as one line)."""


@dataclass(frozen=True)
class TensorArg:
    shape: tuple[int, ...]
    dtype: str                  # torch spelling: f32, ui8, si64, ...

    @property
    def builtin(self) -> str:
        """The builtin tensor type, e.g. tensor<1x16x4x32xf32>."""
        return f"tensor<{'x'.join(map(str, self.shape))}x{ELEMENT_TYPES[self.dtype]}>"


_VTENSOR = re.compile(r"!torch\.vtensor<\[([0-9,]*)\],(\w+)>")


def tensor_arg(type_: ir.Type) -> TensorArg | None:
    """A static-shaped !torch.vtensor type as TensorArg (None for anything else, e.g. a dynamic dim)."""
    m = _VTENSOR.fullmatch(str(type_))
    if m is None or m.group(2) not in ELEMENT_TYPES:
        return None
    return TensorArg(tuple(int(d) for d in m.group(1).split(",") if d), m.group(2))


def scalar_value(value: ir.Value) -> int | float | None:
    """The value of a `torch.constant.int` / `torch.constant.float` operand (None if it is not one)."""
    owner = value.owner
    if not isinstance(owner, ir.OpView) and not isinstance(owner, ir.Operation):
        return None
    op = owner.operation
    if op.name == "torch.constant.int":
        return ir.IntegerAttr(op.attributes["value"]).value
    if op.name == "torch.constant.float":
        return ir.FloatAttr(op.attributes["value"]).value
    return None


def string_value(value: ir.Value) -> str | None:
    """The value of a `torch.constant.str` operand (None if it is not one)."""
    op = value.owner.operation if hasattr(value.owner, "operation") else value.owner
    if getattr(op, "name", None) != "torch.constant.str":
        return None
    return ir.StringAttr(op.attributes["value"]).value


def find_units(module: ir.Module, name: str) -> list[ir.Operation]:
    """Every `torch.operator "torch.kimi.<name>"` in the module, in order."""
    found: list[ir.Operation] = []

    def visit(op):
        op = op.operation if hasattr(op, "operation") else op
        if op.name == "torch.operator" and ir.StringAttr(op.attributes["name"]).value == UNIT_PREFIX + name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def unit_names(module: ir.Module) -> list[str]:
    """The names of the units left in the module (after the passes: the ones nothing lowered)."""
    names: list[str] = []

    def visit(op):
        op = op.operation if hasattr(op, "operation") else op
        if op.name == "torch.operator":
            n = ir.StringAttr(op.attributes["name"]).value
            if n.startswith(UNIT_PREFIX):
                names.append(n[len(UNIT_PREFIX):])
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return names


class FunctionTable:
    """The implementation functions added to one module: one per distinct unit signature, each named by
    its specialisation (passes/kernels `kernel_name`)."""

    def __init__(self, module: ir.Module):
        self.module = module
        self.names: dict[object, str] = {}

    def get(self, key: object, name: str, build: Callable[[str], str]) -> str:
        """The symbol for `key`, parsing `build(symbol)` (MLIR text of the function and any helpers it
        calls, all named after the symbol) into the module the first time. `name` is the specialised
        name; two keys that share it (equal shapes, other constants) get a numbered suffix."""
        if key not in self.names:
            taken = set(self.names.values())
            symbol = name if name not in taken else next(f"{name}_v{i}" for i in range(2, 10**6)
                                                         if f"{name}_v{i}" not in taken)
            text = build(symbol)
            try:
                parsed = ir.Module.parse(text, self.module.context)
            except ir.MLIRError as e:
                raise PassError(f"{symbol}: generated MLIR does not parse: {e}") from None
            for op in list(parsed.body.operations):
                op.detach_from_parent()
                self.module.body.append(op)
            self.names[key] = symbol
        return self.names[key]


def replace_with_call(unit: ir.Operation, tensors: list[ir.Value], symbol: str,
                      result: TensorArg | list[TensorArg]) -> None:
    """Replace `unit` by torch_c.to_builtin_tensor(tensors) -> util.call @symbol -> torch_c.from_builtin_tensor
    (one result, or a list for a unit with several)."""
    results = result if isinstance(result, list) else [result]
    with ir.InsertionPoint(unit), unit.location:
        builtin = []
        for v in tensors:
            arg = tensor_arg(v.type)
            builtin.append(ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(arg.builtin)],
                                               operands=[v]).result)
        call = ir.Operation.create("util.call", results=[ir.Type.parse(r.builtin) for r in results], operands=builtin,
                                   attributes={"callee": ir.FlatSymbolRefAttr.get(symbol)})
        backs = [ir.Operation.create("torch_c.from_builtin_tensor", results=[unit.results[i].type],
                                     operands=[call.results[i]]) for i in range(len(results))]
    for i, back in enumerate(backs):
        unit.results[i].replace_all_uses_with(back.result)
    unit.erase()
