"""kimi-compile: a Hugging Face checkpoint in, OUT/ (model.irpa, model.json, tokenizer files) out.

    kimi-compile CHECKPOINT --convert-only -o OUT [--layers N] [--dtype bf16] [--override RX=DTYPE]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from kimi_iree.frontend.convert import DTYPES, ConvertOptions, convert, is_up_to_date
from kimi_iree.frontend.errors import FrontendError


class UsageError(Exception):
    pass


def _override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--override {text!r}: expected REGEX=DTYPE")
    rx, dtype = text.rsplit("=", 1)
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"--override {text!r}: dtype must be one of {', '.join(DTYPES)}")
    try:
        re.compile(rx)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"--override {text!r}: bad regex ({e})") from None
    return rx, dtype


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kimi-compile", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="Hugging Face checkpoint directory")
    ap.add_argument("-o", "--output", required=True, help="output directory")
    ap.add_argument("--convert-only", action="store_true", help="write model.irpa + model.json and stop")
    ap.add_argument("--layers", type=int, help="convert only the first N decoder layers (a runnable slice)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="precision of the non-expert weights")
    ap.add_argument("--override", type=_override, action="append", default=[], metavar="REGEX=DTYPE",
                    help="precision of the tensors whose canonical name matches REGEX (repeatable)")
    ap.add_argument("--keep-expert-precision", action="store_true",
                    help="keep float routed experts as they are instead of quantising them to MXFP4")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.checkpoint is None:
        ap.error("CHECKPOINT is required")
    checkpoint, out = Path(args.checkpoint), Path(args.output)
    options = ConvertOptions(layers=args.layers, dtype=args.dtype, overrides=[tuple(o) for o in args.override],
                             keep_expert_precision=args.keep_expert_precision)

    def log(msg: str) -> None:
        if not args.quiet or msg.startswith("notice"):
            print(msg, file=sys.stderr)

    try:
        start = time.perf_counter()
        if is_up_to_date(checkpoint, out, options):
            log(f"[convert] {out}/model.irpa is up to date for {checkpoint}; skipped")
        else:
            log(f"[convert] {checkpoint} -> {out}/model.irpa")
            convert(checkpoint, out, options, quiet=args.quiet, log=log)
            log(f"[convert] done in {time.perf_counter() - start:.1f} s")
        if args.convert_only:
            return 0
        print("error: compiling a module is not built yet; use --convert-only", file=sys.stderr)
        return 2
    except FrontendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
