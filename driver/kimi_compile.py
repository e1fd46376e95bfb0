"""kimi-compile: a Hugging Face checkpoint in, a compiled module out.

    kimi-compile CHECKPOINT --target cpu -o OUT         OUT/model.vmfb, model.irpa, model.json, tokenizer
    kimi-compile CHECKPOINT --convert-only -o OUT       only the conversion (model.irpa + model.json)
    kimi-compile --demo --target cpu -o OUT             the synthetic K3.1 checkpoint, then the module

This file only turns arguments into `CompileOptions`; the pipeline is `driver/build.py`
(`compile_checkpoint`), which a program can call directly.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kimi_iree.frontend.convert import DTYPES, ConvertOptions
from kimi_iree.frontend.errors import FrontendError
from kimi_iree.passes import PassError
from kimi_iree.targets import TargetError, list_targets

from .build import (DEFAULT_CPU_PREFILL_BLOCK, DEFAULT_MAX_CONTEXT, DEFAULT_PREFILL_BLOCK, DEFAULT_SHORT_PREFILL_BLOCK,
                    CompileOptions, Progress, compile_checkpoint)


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _windows(text: str) -> tuple[int, ...] | None:
    """--context-windows: "auto" (None), "none" (()) or sizes W1,W2,..."""
    if text == "auto":
        return None
    if text == "none":
        return ()
    try:
        sizes = sorted({int(w) for w in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context-windows {text!r}: expected auto, none or sizes like 256,1024") from None
    if sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--context-windows {text!r}: sizes must be at least 1")
    return tuple(sizes)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kimi-compile", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="Hugging Face checkpoint directory")
    ap.add_argument("-o", "--output", help="output directory")
    ap.add_argument("--target", default="cpu", help="cpu, cuda, rocm, vulkan or metal (see --list-targets)")
    ap.add_argument("--arch", help="architecture for the target (default: the target's default, e.g. host)")
    ap.add_argument("--list-targets", action="store_true", help="print the targets and their architectures")
    ap.add_argument("--demo", action="store_true", help="write the synthetic K3.1 checkpoint and compile it")
    ap.add_argument("--convert-only", action="store_true", help="write model.irpa + model.json and stop")
    ap.add_argument("--max-context", type=_positive, default=DEFAULT_MAX_CONTEXT, help="tokens the state holds")
    ap.add_argument("--prefill-block", type=_positive,
                    help=f"tokens per prefill call (longer prompts go in several calls; default {DEFAULT_CPU_PREFILL_BLOCK} "
                         f"on cpu, {DEFAULT_PREFILL_BLOCK} on GPUs, halved where a GPU target's shared memory cannot "
                         "hold a dispatch)")
    ap.add_argument("--short-prefill-block", type=int, default=None, metavar="S",
                    help="also export prefill entries on blocks of S tokens, which a prompt's last S or fewer tokens "
                         f"take (same numbers, less padding; default {DEFAULT_SHORT_PREFILL_BLOCK} on cpu, none on GPUs; "
                         "0: none)")
    ap.add_argument("--max-batch", type=_positive, default=1,
                    help="sequence slots a call runs, each at its own position (kimi-serve batches its requests "
                         "over them; default 1)")
    ap.add_argument("--context-windows", type=_windows, default=None, metavar="auto|none|W1,W2,..",
                    help="extra entry points whose attention reads only the first W cache slots, for sequences "
                         "that fit (same numbers, less work at short depths; default auto: 64, 256, 1024, ... up to "
                         "half the max context, for models with attention layers)")
    ap.add_argument("--index-topk", type=_positive, help="override the indexer's index_topk (experiments)")
    ap.add_argument("--layers", type=_positive, help="convert only the first N decoder layers (a runnable slice)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="precision of the non-expert weights")
    ap.add_argument("--override", type=_override, action="append", default=[], metavar="REGEX=DTYPE",
                    help="precision of the tensors whose canonical name matches REGEX (repeatable)")
    ap.add_argument("--quantize-experts", choices=["mxfp4"],
                    help="quantise float routed experts to MXFP4 (lossy; default: keep the checkpoint's precision)")
    ap.add_argument("--keep-expert-precision", action="store_true",
                    help="accepted for compatibility: keeping the experts' precision is the default")
    ap.add_argument("--no-weight-fusion", "--no-mxfp4-fusion", dest="no_weight_fusion", action="store_true",
                    help="dequantise block-scaled weights (MXFP4, FP8, INT4) before the matmul (no weight-matmul "
                         "pass; the correctness fallback). --no-mxfp4-fusion is the older spelling")
    ap.add_argument("--no-sparse-attention-fusion", action="store_true",
                    help="keep DSA attention as the reference mask over the whole cache (no sparse-attention pass)")
    ap.add_argument("--no-kda-fusion", action="store_true",
                    help="KDA's decode step as plain torch ops (no x86 dispatch; the correctness fallback)")
    ap.add_argument("--bf16-activations", action="store_true",
                    help="lossy, x86 with AVX512-BF16 only: the bf16 weights' prefill matmuls round their rows to "
                         "bf16 and use bf16 dot products (as llama.cpp does; ~1.5x faster 64-row blocks). Default: "
                         "the weights widened to f32, exact")
    ap.add_argument("--dump-ir", metavar="DIR", help="write the MLIR after each stage into DIR")
    ap.add_argument("--iree-flag", action="append", default=[], metavar="FLAG", help="passed to iree-compile")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    return ap


def options_from(args: argparse.Namespace) -> CompileOptions:
    if args.keep_expert_precision and args.quantize_experts:
        raise FrontendError("--keep-expert-precision and --quantize-experts contradict each other")
    short = args.short_prefill_block
    if short is not None and (short < 0 or (short and args.prefill_block and short >= args.prefill_block)):
        raise FrontendError(f"--short-prefill-block {short}: expected 0 (none) or a block shorter than the "
                            f"prefill block ({args.prefill_block or 'the default'})")
    convert = ConvertOptions(layers=args.layers, dtype=args.dtype, overrides=[tuple(o) for o in args.override],
                             quantize_experts=args.quantize_experts)
    return CompileOptions(target=args.target, arch=args.arch, max_context=args.max_context,
                          prefill_block=args.prefill_block, short_prefill_block=args.short_prefill_block,
                          max_batch=args.max_batch,
                          context_windows=args.context_windows, index_topk=args.index_topk,
                          convert=convert,
                          weight_fusion=not args.no_weight_fusion,
                          sparse_attention_fusion=not args.no_sparse_attention_fusion,
                          kda_fusion=not args.no_kda_fusion, bf16_activations=args.bf16_activations,
                          iree_flags=tuple(args.iree_flag), dump_ir=Path(args.dump_ir) if args.dump_ir else None,
                          convert_only=args.convert_only)


def run(args: argparse.Namespace) -> int:
    log = Progress(args.quiet)
    out = Path(args.output)
    options = options_from(args)
    if args.demo:
        from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
        checkpoint = out / "synthetic-k3.1"
        if not (checkpoint / "config.json").exists():
            write_synthetic_checkpoint(checkpoint)
            log(f"wrote the synthetic K3.1 checkpoint to {checkpoint}")
    elif args.checkpoint is None:
        raise FrontendError("CHECKPOINT is required (or --demo)")
    else:
        checkpoint = Path(args.checkpoint)
    compile_checkpoint(checkpoint, out, options, log=log, quiet=args.quiet)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list_targets:
        for name, (driver, arches) in list_targets().items():
            print(f"{name:7} (driver {driver}): {', '.join(arches)}")
        return 0
    if not args.output:
        ap.error("-o/--output is required")
    try:
        return run(args)
    except (FrontendError, TargetError, PassError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
