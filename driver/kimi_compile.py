"""kimi-compile: a Hugging Face checkpoint in, a compiled module out.

    kimi-compile CHECKPOINT --target cpu -o OUT         OUT/model.vmfb, model.irpa, model.json, tokenizer
    kimi-compile CHECKPOINT --convert-only -o OUT       only the conversion (model.irpa + model.json)
    kimi-compile --demo --target cpu -o OUT             the synthetic K3.1 checkpoint, then the module

Stages: convert (skipped when OUT/model.irpa is up to date) -> export (torch.export + FX import,
traced on the meta device) -> passes (passes/: the fusion units' rewrites) -> iree-compile. Everything is built in a staging
directory inside OUT and renamed into place at the end, so a failed run leaves an earlier good
OUT/ as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kimi_iree.frontend.convert import DTYPES, ConvertOptions, convert, is_up_to_date, staging_dir
from kimi_iree.frontend.errors import FrontendError
from kimi_iree.frontend.units import FusedUnits
from kimi_iree.passes import PassError
from kimi_iree.targets import TargetError, TargetFlags, get_target, list_targets

MODULE_ABI_VERSION = 2          # 2: token ids, lengths and the position are int32
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_PREFILL_BLOCK = 32
MIN_PREFILL_BLOCK = 8
# IREE's SPIR-V codegen sizes a dispatch's workgroup buffers from its tile, which grows with the
# prefill block; on a profile with little shared memory a smaller block is the fallback.
SHARED_MEMORY_OVERFLOW = re.compile(r"uses (\d+) bytes of shared memory; exceeded the limit of (\d+) bytes")


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
                    help=f"tokens per prefill call (longer prompts go in several calls; default {DEFAULT_PREFILL_BLOCK}, "
                         "halved where a GPU target's shared memory cannot hold a dispatch)")
    ap.add_argument("--index-topk", type=_positive, help="override the indexer's index_topk (experiments)")
    ap.add_argument("--layers", type=_positive, help="convert only the first N decoder layers (a runnable slice)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="precision of the non-expert weights")
    ap.add_argument("--override", type=_override, action="append", default=[], metavar="REGEX=DTYPE",
                    help="precision of the tensors whose canonical name matches REGEX (repeatable)")
    ap.add_argument("--quantize-experts", choices=["mxfp4"],
                    help="quantise float routed experts to MXFP4 (lossy; default: keep the checkpoint's precision)")
    ap.add_argument("--keep-expert-precision", action="store_true",
                    help="accepted for compatibility: keeping the experts' precision is the default")
    ap.add_argument("--no-mxfp4-fusion", action="store_true",
                    help="dequantise MXFP4 experts before the matmul (no MXFP4 pass; the correctness fallback)")
    ap.add_argument("--no-sparse-attention-fusion", action="store_true",
                    help="keep DSA attention as the reference mask over the whole cache (no sparse-attention pass)")
    ap.add_argument("--dump-ir", metavar="DIR", help="write the MLIR after each stage into DIR")
    ap.add_argument("--iree-flag", action="append", default=[], metavar="FLAG", help="passed to iree-compile")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    return ap


class Progress:
    def __init__(self, quiet: bool):
        self.quiet, self.start = quiet, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet or msg.startswith(("notice", "warning")):
            print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _iree_compiler_version() -> str:
    try:
        from importlib.metadata import version
        return version("iree-base-compiler")
    except Exception:
        return "unknown"


def with_device_targets(mlir: str, device_targets: str) -> str:
    """The module with a `hal.device.targets` attribute: IREE then compiles for exactly that target
    (one built from a device's properties) instead of one named by flags."""
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(mlir)
        module.operation.attributes["hal.device.targets"] = ir.Attribute.parse(device_targets)
        return str(module)


def compile_module(mlir: str, flags: list[str], dump_dir: Path | None, log: Progress) -> bytes:
    import iree.compiler as ic

    if dump_dir is not None:
        for phase in ("input", "flow"):
            text = ic.compile_str(mlir, input_type="torch", extra_args=[*flags, f"--compile-to={phase}"])
            (dump_dir / f"03-iree-{phase}.mlir").write_bytes(text)
            log(f"dumped IREE {phase} IR")
    try:
        return ic.compile_str(mlir, input_type="torch", extra_args=flags)
    except ic.CompilerToolError as e:
        first = next((line for line in str(e).splitlines() if "error:" in line), str(e).splitlines()[0])
        raise FrontendError(f"iree-compile failed: {first.strip()}") from None


def compile_for_target(mlir: str, target, extra_flags: list[str] = (), dump_dir: Path | None = None,
                       log=lambda msg: None) -> bytes:
    """iree-compile `mlir` (torch dialect, units already rewritten) for `target` (a TargetFlags) at O3."""
    if target.device_targets is not None:
        mlir = with_device_targets(mlir, target.device_targets)
    return compile_module(mlir, [*target.flags, "--iree-opt-level=O3", *extra_flags], dump_dir, log)


def run(args: argparse.Namespace) -> int:
    log = Progress(args.quiet)
    out = Path(args.output)
    target_module = get_target(args.target)
    target = target_module.flags(args.arch or target_module.DEFAULT_ARCH)
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
    options = ConvertOptions(layers=args.layers, dtype=args.dtype, overrides=[tuple(o) for o in args.override],
                             quantize_experts=args.quantize_experts)
    if args.keep_expert_precision and args.quantize_experts:
        raise FrontendError("--keep-expert-precision and --quantize-experts contradict each other")
    if args.convert_only and is_up_to_date(checkpoint, out, options):
        log(f"convert: {out / 'model.irpa'} is up to date for {checkpoint}; skipped")
        return 0
    staging = staging_dir(out, ".build-")
    try:
        if is_up_to_date(checkpoint, out, options):
            log(f"convert: {out / 'model.irpa'} is up to date; reused")
            os.link(out / "model.irpa", staging / "model.irpa")
            manifest = json.loads((out / "model.json").read_text())
            for f in manifest["tokenizer"]["files"]:
                shutil.copyfile(out / f, staging / f)
            manifest.pop("module", None)
        else:
            log(f"convert: {checkpoint} -> model.irpa")
            manifest = convert(checkpoint, staging, options, quiet=args.quiet, log=log)
        if args.convert_only:
            (staging / "model.json").write_text(json.dumps(manifest, indent=1))
        else:
            manifest["module"] = build_module(args, manifest, target, staging, log)
            (staging / "model.json").write_text(json.dumps(manifest, indent=1))
        names = [f for f in ("model.irpa", *manifest["tokenizer"]["files"], "model.vmfb") if (staging / f).exists()]
        for f in [*names, "model.json"]:           # the manifest last: it vouches for the rest
            os.replace(staging / f, out / f)
        if args.convert_only and (out / "model.vmfb").exists():
            (out / "model.vmfb").unlink()          # it was built against the previous archive
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"done: {out}")
    return 0


@dataclass(frozen=True)
class Attempt:
    """One way to build the module; a failed compile moves to the next (`next_attempt`)."""

    target: TargetFlags
    block: int
    fused: FusedUnits
    notes: tuple[str, ...] = ()          # why this attempt differs from what was asked


def next_attempt(attempt: Attempt, error: str, block_given: bool) -> Attempt | None:
    """The fallback after iree-compile failed with `error`, cheapest change first; None when none is left.

    A slower module, never a failed compile or a wrong one:
      1. a shared-memory overflow on a GPU target halves the default prefill block (down to 8);
      2. a stock SPIR-V profile (Vulkan vendor profile, Metal) is rebuilt in the portable form;
      3. the sparse-attention unit, then the MXFP4 unit, take their reference form (plain torch ops)."""
    first = error.removeprefix("iree-compile failed: ")
    overflow = SHARED_MEMORY_OVERFLOW.search(error)
    if overflow and not block_given and attempt.block // 2 >= MIN_PREFILL_BLOCK:
        note = (f"prefill block {attempt.block // 2}, not {attempt.block}: at {attempt.block} a dispatch needs "
                f"{overflow[1]} B of workgroup memory, the target has {overflow[2]} B")
        return replace(attempt, block=attempt.block // 2, notes=(*attempt.notes, note))
    portable = attempt.target.fallback(first)
    if portable is not None:
        return replace(attempt, target=portable, notes=(*attempt.notes, portable.notes[-1]))
    for unit, flag in (("sparse_attention", "--no-sparse-attention-fusion"), ("mxfp4_matmul", "--no-mxfp4-fusion")):
        if getattr(attempt.fused, unit):
            note = f"{unit} unit in its reference form (as {flag}): the fused form failed to compile: {first}"
            return replace(attempt, fused=replace(attempt.fused, **{unit: False}), notes=(*attempt.notes, note))
    return None


def build_module(args: argparse.Namespace, manifest: dict, target: TargetFlags, staging: Path, log: Progress) -> dict:
    import torch

    from kimi_iree.frontend.config import ModelConfig
    from kimi_iree.frontend.export import export_model, skeleton_for_archive
    from kimi_iree.passes import PassOptions, run_passes

    cfg = ModelConfig.from_dict(manifest["config"])
    if args.index_topk is not None:
        if not cfg.has_indexer:
            raise FrontendError("--index-topk: this model has no lightning indexer")
        cfg = cfg.with_overrides(index_topk=args.index_topk)
    dump_dir = Path(args.dump_ir) if args.dump_ir else None
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
    has_bf16 = any(t["dtype"] == "BF16" for t in manifest["parameters"]["tensors"].values())

    def export_and_compile(attempt: Attempt):
        target, fused = attempt.target, attempt.fused
        bf16_as = None
        if target.backend == "spirv" and has_bf16:
            bf16_as = torch.int16 if target.storage16 else torch.int32
        skeleton = skeleton_for_archive(cfg, manifest["parameters"]["tensors"], bf16_as=bf16_as, fused=fused)
        log(f"export: prefill (block {attempt.block}) and decode, max context {args.max_context}")
        exported = export_model(skeleton, args.max_context, attempt.block)
        if dump_dir is not None:
            (dump_dir / "01-torch.mlir").write_text(exported.mlir)
        passes = run_passes(exported.mlir, PassOptions(mxfp4_matmul=fused.mxfp4_matmul,
                                                       sparse_attention=fused.sparse_attention, backend=target.backend,
                                                       avx512=target.avx512))
        log("passes: " + (", ".join(f"{n} x{c}" for n, c in passes.rewritten.items()) or "none"))
        if dump_dir is not None:
            (dump_dir / "02-after-passes.mlir").write_text(passes.mlir)
        log(f"iree-compile: target {target.target} ({target.arch})")
        return exported, passes, compile_for_target(passes.mlir, target, args.iree_flag, dump_dir, log)

    attempt = Attempt(target, args.prefill_block or DEFAULT_PREFILL_BLOCK,
                      FusedUnits(mxfp4_matmul=not args.no_mxfp4_fusion,
                                 sparse_attention=not args.no_sparse_attention_fusion))
    while True:
        try:
            exported, passes, vmfb = export_and_compile(attempt)
            break
        except FrontendError as e:
            following = next_attempt(attempt, str(e), block_given=args.prefill_block is not None)
            if following is None:
                hint = (f" (--prefill-block {attempt.block}: try a smaller block)"
                        if args.prefill_block is not None and SHARED_MEMORY_OVERFLOW.search(str(e)) else "")
                raise FrontendError(f"{e}{hint}") from None
            log(f"warning: {following.notes[-1]}; trying again")
            attempt = following
    target = attempt.target
    block = attempt.block
    fallbacks = [*target.notes, *[n for n in attempt.notes if n not in target.notes], *passes.notes]
    if target.backend == "spirv" and has_bf16:
        fallbacks.append("bf16 weights read as 16-bit integers and widened to f32 in-kernel (SPIR-V has no bf16)"
                         if target.storage16 else "bf16 weights read as 32-bit words of two values and widened "
                         "to f32 in-kernel (SPIR-V has no bf16; the target has no 16-bit storage)")
    (staging / "model.vmfb").write_bytes(vmfb)
    log(f"iree-compile: model.vmfb {len(vmfb) / 2**20:.1f} MiB")
    return {
        "file": "model.vmfb",
        "abi_version": MODULE_ABI_VERSION,
        "iree_compiler_version": _iree_compiler_version(),
        "target": target.target, "arch": target.arch, "driver": target.driver,
        "executable_format": target.executable_format,
        "flags": [*target.flags, "--iree-opt-level=O3", *args.iree_flag], "fallbacks": fallbacks,
        "fused_units": passes.rewritten,
        "vulkan_profile": target.profile, "subgroup_sizes": target.subgroup_sizes,
        "max_context": args.max_context, "prefill_block": block,
        "index_topk": cfg.index_topk,
        "entry_points": {
            "prefill": {"inputs": [["tokens", [1, block], "int32"], ["length", [], "int32"], "*state"],
                        "outputs": [["logits", [1, block, cfg.vocab_size], "float32"], "*state"]},
            "decode": {"inputs": [["token", [1], "int32"], "*state"],
                       "outputs": [["logits", [1, cfg.vocab_size], "float32"], "*state"]},
        },
        "state": [s.to_json() for s in exported.state],
    }


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
