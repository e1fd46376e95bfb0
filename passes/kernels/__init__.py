"""Kernels whose structure is fixed, as Jinja2 templates of MLIR (`*.mlir` beside this file): Python decides
which kernel and its shapes, the template says what it computes (sharktank's kernels/templates).

    text = render("mxfp4_avx512.mlir", name=kernel_name("mxfp4_avx512", R=32, K=1024, O=2048, E=64), R=32, ...)

`kernel_name` names a function by its specialisation (kimi_mxfp4_avx512_R32_K1024_O2048_E64), so the IR
says what each call computes and equal specialisations share one function. `render` parses what it
produced and reports a failure with the rendered text, numbered, around the failing line.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from ..rewrite import PassError

TEMPLATES = Path(__file__).parent


@cache
def _environment():
    import jinja2
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def kernel_name(kernel: str, **shape: object) -> str:
    """kimi_<kernel>_<key><value>_...: e.g. kimi_mxfp4_avx512_R32_K1024_O2048_E64."""
    parts = [f"{k}{v}".replace(".", "p").replace("-", "m") for k, v in shape.items()]
    return "_".join(["kimi", kernel, *parts])


def render(template: str, **params: object) -> str:
    """The template rendered with `params` (a missing parameter is an error), checked to parse."""
    text = _environment().get_template(template).render(**params)
    check_parses(text, template)
    return text


def check_parses(text: str, what: str) -> None:
    """PassError naming `what` and showing the numbered lines around the first error when `text` does not parse."""
    from iree.compiler import ir

    try:
        with ir.Context():
            ir.Module.parse(text)
    except ir.MLIRError as e:
        # the diagnostics say what is wrong; str(e) alone is "Unable to parse module assembly:"
        message = "; ".join(d.message for d in getattr(e, "error_diagnostics", [])) or str(e)
        at = re.search(r":(\d+):\d+", message)
        line = int(at[1]) if at else 1
        lines = text.splitlines()
        shown = "\n".join(f"{i:5d} {'>' if i == line else ' '} {lines[i - 1]}"
                          for i in range(max(1, line - 5), min(len(lines), line + 5) + 1))
        raise PassError(f"{what}: the rendered kernel does not parse: {message.splitlines()[0]}\n{shown}") from None
