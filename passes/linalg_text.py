"""A few helpers to write linalg-on-tensors MLIR as text that reads like the math.

    g = Generic("b t s", parallel="b t s")
    g.input("%scores", "b t s", "tensor<1x4x80xf32>")
    ...
The implementation functions of the unit passes are built from these; each helper returns MLIR
lines, so a template stays a readable list of steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def tensor_type(shape: tuple[int, ...] | list[int], element: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{element}>" if shape else f"tensor<{element}>"


def affine_map(dims: list[str], result: list[str]) -> str:
    """affine_map<(d0, d1, ...) -> (...)> with the named loop dims replaced by d-numbers.
    A result entry may be a dim name or an integer constant."""
    index = {d: f"d{i}" for i, d in enumerate(dims)}
    results = ", ".join(index.get(r, r) for r in result)
    return f"affine_map<({', '.join(index.values())}) -> ({results})>"


@dataclass
class Generic:
    """One linalg.generic: named loop dims, inputs and outputs with the dims they are indexed by."""

    dims: list[str]
    reductions: set[str] = field(default_factory=set)
    ins: list[tuple[str, list[str], str]] = field(default_factory=list)     # (value, index dims, type)
    outs: list[tuple[str, list[str], str]] = field(default_factory=list)
    attrs: str = ""

    def input(self, value: str, index: str, type_: str) -> "Generic":
        self.ins.append((value, index.split(), type_))
        return self

    def output(self, value: str, index: str, type_: str) -> "Generic":
        self.outs.append((value, index.split(), type_))
        return self

    def emit(self, result: str, block_args: list[str], body: list[str], yields: list[str]) -> list[str]:
        """`result = linalg.generic ...` with block arguments named block_args (element type after ':')."""
        maps = ", ".join(affine_map(self.dims, idx) for _, idx, _ in self.ins + self.outs)
        iterators = ", ".join('"reduction"' if d in self.reductions else '"parallel"' for d in self.dims)
        ins = ", ".join(v for v, _, _ in self.ins)
        ins_t = ", ".join(t for _, _, t in self.ins)
        outs = ", ".join(v for v, _, _ in self.outs)
        outs_t = ", ".join(t for _, _, t in self.outs)
        res_t = ", ".join(t for _, _, t in self.outs)
        extra = f", {self.attrs}" if self.attrs else ""
        head = (f"{result} = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{iterators}]{extra}}}"
                + (f" ins({ins} : {ins_t})" if self.ins else "") + f" outs({outs} : {outs_t}) {{")
        yield_types = ", ".join(a.split(":")[1].strip() for a in block_args[len(self.ins):])
        return [head, f"^bb0({', '.join(block_args)}):", *[f"  {line}" for line in body],
                f"  linalg.yield {', '.join(yields)} : {yield_types}", f"}} -> {res_t}"]


def filled(name: str, type_: str, value: str, element: str) -> list[str]:
    """%name = a tensor of type_ filled with `value` (an MLIR constant literal of `element`)."""
    return [f"{name}_empty = tensor.empty() : {type_}",
            f"{name}_value = arith.constant {value} : {element}",
            f"{name} = linalg.fill ins({name}_value : {element}) outs({name}_empty : {type_}) -> {type_}"]


def indent(lines: list[str], spaces: int = 2) -> str:
    return "\n".join(" " * spaces + line for line in lines)
