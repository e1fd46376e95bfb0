"""The compile pipeline as a library: a checkpoint in, OUT/ (model.vmfb, model.irpa, model.json) out.

    from kimi_iree.driver.build import CompileOptions, compile_checkpoint
    manifest = compile_checkpoint("ckpt/", "out/", CompileOptions(target="vulkan", max_context=8192))

Stages, each a short function below: `convert_stage` (skipped when OUT/model.irpa is up to date) ->
`build_module`: export (torch.export + FX import, traced on the meta device) -> passes (the fusion
units' rewrites) -> iree-compile, walking the fallbacks of `next_attempt` when a compile fails ->
`install` (everything is built in a staging directory inside OUT and renamed into place at the end,
so a failed run leaves an earlier good OUT/ as it was). kimi-compile (driver/kimi_compile.py) only
parses arguments into CompileOptions.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kimi_iree.frontend.convert import ConvertOptions, convert, is_up_to_date, staging_dir
from kimi_iree.frontend.errors import FrontendError
from kimi_iree.frontend.units import FusedUnits
from kimi_iree.passes.kda import kda_decode_applies
from kimi_iree.runtime.manifest import MODULE_ABI_VERSION, EntryPoint, Manifest, Module, package_version, windowed
from kimi_iree.targets import CompileTarget, get_target

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_PREFILL_BLOCK = 32
# On llvm-cpu a block of 64: every block reads each routed expert it touches (a 32-token block of a
# bench-size MoE reads all of them), so a longer block halves that traffic per token (bench-size K3:
# 64-token prefill +25%, DeepSeek-V3.2 +12%); a short block beside it keeps a short prompt, or a long
# one's last few tokens, from paying for 64 rows (an 8-token prompt: 108 ms at block 64 against 58 at 32).
DEFAULT_CPU_PREFILL_BLOCK = 64
DEFAULT_SHORT_PREFILL_BLOCK = 16
MIN_PREFILL_BLOCK = 8
# IREE's SPIR-V codegen sizes a dispatch's workgroup buffers from its tile, which grows with the
# prefill block; on a profile with little shared memory a smaller block is the fallback.
SHARED_MEMORY_OVERFLOW = re.compile(r"uses (\d+) bytes of shared memory; exceeded the limit of (\d+) bytes")


@dataclass(frozen=True)
class CompileOptions:
    target: str = "cpu"                      # cpu, cuda, rocm, vulkan, metal
    arch: str | None = None                  # None: the target's default (host where there is one)
    max_context: int = DEFAULT_MAX_CONTEXT
    prefill_block: int | None = None         # None: the target's default block, halved where a GPU needs it
    short_prefill_block: int | None = None   # None: DEFAULT_SHORT_PREFILL_BLOCK on llvm-cpu, none on GPUs; 0: none
    max_batch: int = 1                       # sequence slots each call runs (kimi-serve's concurrent requests)
    context_windows: tuple[int, ...] | None = None   # entries reading the first W cache slots; None: auto
    index_topk: int | None = None            # override the indexer's (experiments)
    convert: ConvertOptions = field(default_factory=ConvertOptions)
    weight_fusion: bool = True               # the weight-matmul pass (block-scaled weights)
    sparse_attention_fusion: bool = True
    kda_fusion: bool = True                  # KDA's decode step as the x86 dispatch (llvm-cpu with AVX2 / AVX-512F)
    bf16_activations: bool = False           # lossy: bf16 matmuls' rows rounded to bf16 (x86 with AVX512-BF16)
    iree_flags: tuple[str, ...] = ()
    dump_ir: Path | None = None
    convert_only: bool = False


class CompileError(FrontendError):
    """iree-compile failed; `shared_memory` = (bytes needed, bytes the target has) when a dispatch's
    workgroup memory was the reason; `function` = the function of the input the error points into
    (a unit's kernel, kimi_<kernel>_..., or an entry point), where the error has a location."""

    def __init__(self, first_error: str, function: str | None = None):
        super().__init__(f"iree-compile failed: {first_error}")
        self.first_error, self.function = first_error, function
        overflow = SHARED_MEMORY_OVERFLOW.search(first_error)
        self.shared_memory = (int(overflow[1]), int(overflow[2])) if overflow else None


ERROR_LINE = re.compile(r"<stdin>:(\d+):")
FUNCTION_HEAD = re.compile(r"^\s*(?:util|func)\.func (?:private |public )?@([\w$.]+)")


def failing_function(mlir: str, first_error: str) -> str | None:
    """The function of `mlir` (iree-compile's input) holding the line the error points to."""
    at = ERROR_LINE.search(first_error)
    if at is None:
        return None
    lines = mlir.splitlines()
    for line in reversed(lines[: int(at[1])]):
        head = FUNCTION_HEAD.match(line)
        if head:
            return head[1]
    return None


class Progress:
    """Timestamped progress lines on stderr; notices and warnings even when quiet."""

    def __init__(self, quiet: bool):
        self.quiet, self.start = quiet, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet or msg.startswith(("notice", "warning")):
            print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ iree-compile
def with_device_targets(mlir: str, device_targets: str) -> str:
    """The module with a `hal.device.targets` attribute: IREE then compiles for exactly that target
    (one built from a device's properties) instead of one named by flags."""
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(mlir)
        module.operation.attributes["hal.device.targets"] = ir.Attribute.parse(device_targets)
        return str(module)


def compile_module(mlir: str, flags: list[str], dump_dir: Path | None, log: Callable[[str], None]) -> bytes:
    import iree.compiler as ic

    if dump_dir is not None:
        for phase in ("input", "flow"):
            text = ic.compile_str(mlir, input_type="torch", extra_args=[*flags, f"--compile-to={phase}"])
            (dump_dir / f"03-iree-{phase}.mlir").write_bytes(text)
            log(f"dumped IREE {phase} IR")
    try:
        return ic.compile_str(mlir, input_type="torch", extra_args=flags)
    except ic.CompilerToolError as e:
        first = next((line for line in str(e).splitlines() if "error:" in line), str(e).splitlines()[0]).strip()
        raise CompileError(first, failing_function(mlir, first)) from None


def compile_for_target(mlir: str, target: CompileTarget, extra_flags: tuple[str, ...] = (),
                       dump_dir: Path | None = None, log: Callable[[str], None] = lambda msg: None) -> bytes:
    """iree-compile `mlir` (torch dialect, units already rewritten) for `target` at O3."""
    if target.device_targets is not None:
        mlir = with_device_targets(mlir, target.device_targets)
    return compile_module(mlir, [*target.flags, "--iree-opt-level=O3", *extra_flags], dump_dir, log)


# --------------------------------------------------------------------------------------- fallbacks
@dataclass(frozen=True)
class Attempt:
    """One way to build the module; a failed compile moves to the next (`next_attempt`)."""

    target: CompileTarget
    block: int
    fused: FusedUnits
    notes: tuple[str, ...] = ()          # why this attempt differs from what was asked


# the fusion units in the order their reference forms are tried, the flag that asks for it, and the
# kernel names their passes emit (passes/kernels `kernel_name`: kimi_<kernel>_<shape>)
UNIT_FLAGS = (("sparse_attention", "--no-sparse-attention-fusion"), ("kda_decode", "--no-kda-fusion"),
              ("dense_matmul", "--no-weight-fusion"), ("weight_matmul", "--no-weight-fusion"))
UNIT_KERNELS = {"sparse_attention": ("sparse_mla_attention",), "kda_decode": ("kda_decode",),
                "dense_matmul": ("bf16_", "per_head_"), "weight_matmul": ("mxfp4_", "fp8_", "int4_")}


def unit_of_kernel(function: str | None) -> str | None:
    """The fusion unit whose pass emitted `function`, or None (an entry point, or no location)."""
    if function is None or not function.startswith("kimi_"):
        return None
    kernel = function[len("kimi_"):]
    return next((unit for unit, prefixes in UNIT_KERNELS.items() if kernel.startswith(prefixes)), None)


def next_attempt(attempt: Attempt, error: CompileError, block_given: bool) -> Attempt | None:
    """The fallback after iree-compile failed with `error`, cheapest change first; None when none is left.

    A slower module, never a failed compile or a wrong one:
      1. a shared-memory overflow on a GPU target halves the default prefill block (down to 8);
      2. a stock SPIR-V profile (Vulkan vendor profile, Metal) is rebuilt in the portable form;
      3. a unit takes its reference form (plain torch ops): the one whose kernel the error points into,
         else the sparse-attention unit, then KDA's decode unit, the bf16 dense unit and the block-scaled
         weight unit in turn (the error named no unit: each is tried)."""
    if error.shared_memory and not block_given and attempt.block // 2 >= MIN_PREFILL_BLOCK:
        needed, limit = error.shared_memory
        note = (f"prefill block {attempt.block // 2}, not {attempt.block}: at {attempt.block} a dispatch needs "
                f"{needed} B of workgroup memory, the target has {limit} B")
        return replace(attempt, block=attempt.block // 2, notes=(*attempt.notes, note))
    portable = attempt.target.fallback(error.first_error)
    if portable is not None:
        return replace(attempt, target=portable, notes=(*attempt.notes, *portable.notes[len(attempt.target.notes):]))
    named = unit_of_kernel(error.function)
    for unit, flag in sorted(UNIT_FLAGS, key=lambda u: u[0] != named):
        if getattr(attempt.fused, unit):
            note = f"{unit} unit in its reference form (as {flag}): the fused form failed to compile: {error.first_error}"
            return replace(attempt, fused=replace(attempt.fused, **{unit: False}), notes=(*attempt.notes, note))
    return None


# ------------------------------------------------------------------------------------------ stages
SMALLEST_WINDOW = 64     # the first default context window; each next one 4x


def context_windows(cfg, options: CompileOptions) -> tuple[int, ...]:
    """The windows to export entries for: the asked ones (each below the max context), or by default
    64, 256, 1024, 4096, ... up to half the max context where the model has attention layers (KDA state
    does not grow with the context). Attention over the cache costs in proportion to the slots it reads,
    and a short sequence (a chat turn, a depth-0 benchmark) reads a few hundred of --max-context: a
    64-token prompt over window 64 rather than 256 prefilled 25-35% faster (bench-size DeepSeek-V3.2,
    kimi-run --bench, alternating)."""
    if options.context_windows is not None:
        return tuple(sorted(options.context_windows))
    if "mla" not in cfg.layer_kinds:
        return ()
    windows, w = [], SMALLEST_WINDOW
    while 2 * w <= options.max_context:
        windows.append(w)
        w *= 4
    return tuple(windows)


def check_options(options: CompileOptions) -> None:
    """Refuse what needs no checkpoint to refuse, before anything is converted."""
    too_big = [w for w in options.context_windows or () if w >= options.max_context]
    if too_big:
        raise FrontendError(f"--context-windows {too_big[0]}: a window must be below the max context "
                            f"{options.max_context}")


def resolve_target(options: CompileOptions) -> CompileTarget:
    target_module = get_target(options.target)
    target = target_module.flags(options.arch or target_module.DEFAULT_ARCH)
    if options.bf16_activations and not target.avx512_bf16:
        raise FrontendError(f"--bf16-activations: the {target.target} target ({target.arch}) has no AVX512-BF16 "
                            "dot product (x86 CPUs with AVX512-BF16 only: host where it has it, znver4, "
                            "sapphirerapids)")
    return target


def convert_stage(checkpoint: Path, out: Path, staging: Path, options: CompileOptions,
                  log: Callable[[str], None], quiet: bool) -> Manifest:
    """The conversion into `staging`: reused (hard-linked) when OUT/model.irpa is up to date."""
    if is_up_to_date(checkpoint, out, options.convert):
        log(f"convert: {out / 'model.irpa'} is up to date; reused")
        os.link(out / "model.irpa", staging / "model.irpa")
        manifest = Manifest.load(out, need_module=False)
        for f in manifest.tokenizer.files:
            shutil.copyfile(out / f, staging / f)
        manifest.module = None
        return manifest
    log(f"convert: {checkpoint} -> model.irpa")
    return convert(checkpoint, staging, options.convert, quiet=quiet, log=log)


def build_module(manifest: Manifest, target: CompileTarget, options: CompileOptions, staging: Path,
                 log: Callable[[str], None]) -> Module:
    """Export, passes and iree-compile into staging/model.vmfb, falling back as `next_attempt` says."""
    import torch

    from kimi_iree.frontend.config import ModelConfig
    from kimi_iree.frontend.export import export_model, skeleton_for_archive
    from kimi_iree.passes import PassOptions, run_passes

    cfg = ModelConfig.from_dict(manifest.config)
    if options.index_topk is not None:
        if not cfg.has_indexer:
            raise FrontendError("--index-topk: this model has no lightning indexer")
        cfg = cfg.with_overrides(index_topk=options.index_topk)
    dump_dir = options.dump_ir
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
    windows = context_windows(cfg, options)
    tensors = manifest.parameters.tensors
    has_bf16 = any(t["dtype"] == "BF16" for t in tensors.values())

    def export_and_compile(attempt: Attempt):
        target, fused = attempt.target, attempt.fused
        # IREE-WORKAROUND(spirv): no bf16 type; the same bytes as 16-bit integers, or as 32-bit words of
        # two values where the target has no 16-bit storage (layers.widen_to_f32 widens them)
        bf16_as = None
        if target.backend == "spirv" and has_bf16:
            bf16_as = torch.int16 if target.storage16 else torch.int32
        skeleton = skeleton_for_archive(cfg, tensors, bf16_as=bf16_as, fused=fused)
        batch = f", {options.max_batch} sequence slots" if options.max_batch > 1 else ""
        also = f", context windows {', '.join(map(str, windows))}" if windows else ""
        short = short_block(options, target.backend, attempt.block)
        shorter = f", short block {short}" if short else ""
        log(f"export: prefill (block {attempt.block}{shorter}) and decode, max context {options.max_context}{batch}{also}")
        exported = export_model(skeleton, options.max_context, attempt.block, options.max_batch, windows, short)
        if dump_dir is not None:
            (dump_dir / "01-torch.mlir").write_text(exported.mlir)
        passes = run_passes(exported.mlir, PassOptions(weight_matmul=fused.weight_matmul or fused.dense_matmul,
                                                       sparse_attention=fused.sparse_attention, backend=target.backend,
                                                       avx512=target.avx512, avx2=target.avx2,
                                                       bf16_dot=options.bf16_activations))
        log("passes: " + (", ".join(f"{n} x{c}" for n, c in passes.rewritten.items()) or "none"))
        if dump_dir is not None:
            (dump_dir / "02-after-passes.mlir").write_text(passes.mlir)
        log(f"iree-compile: target {target.target} ({target.arch})")
        return exported, passes, compile_for_target(passes.mlir, target, options.iree_flags, dump_dir, log), short

    block_given = options.prefill_block is not None
    attempt = Attempt(target, options.prefill_block or default_prefill_block(target.backend),
                      FusedUnits(weight_matmul=options.weight_fusion, sparse_attention=options.sparse_attention_fusion,
                                 # bf16 linears through our kernel where IREE's own matvec is slow (llvm-cpu)
                                 dense_matmul=options.weight_fusion and target.backend == "llvm-cpu",
                                 kda_decode=(options.kda_fusion and target.backend == "llvm-cpu"
                                             and (target.avx512 or target.avx2) and "kda" in cfg.layer_kinds
                                             and kda_decode_applies(cfg.kda_head_dim, target.avx512))))
    while True:
        try:
            exported, passes, vmfb, short = export_and_compile(attempt)
            break
        except CompileError as e:
            following = next_attempt(attempt, e, block_given)
            if following is None:
                hint = f" (--prefill-block {attempt.block}: try a smaller block)" if block_given and e.shared_memory else ""
                raise FrontendError(f"{e}{hint}") from None
            log(f"warning: {following.notes[-1]}; trying again")
            attempt = following
    target, block = attempt.target, attempt.block
    fallbacks = [*target.notes, *[n for n in attempt.notes if n not in target.notes], *passes.notes]
    if target.backend == "spirv" and has_bf16:
        fallbacks.append("bf16 weights read as 16-bit integers and widened to f32 in-kernel (SPIR-V has no bf16)"
                         if target.storage16 else "bf16 weights read as 32-bit words of two values and widened "
                         "to f32 in-kernel (SPIR-V has no bf16; the target has no 16-bit storage)")
    rounded = passes.rewritten.get("dense_matmul_bf16_dot", 0)
    if options.bf16_activations and not rounded:
        log("notice: --bf16-activations: no matmul here rounds its rows (it needs bf16 weights, K a multiple of 32, "
            "and a block of rows); the module is exact")
    (staging / "model.vmfb").write_bytes(vmfb)
    log(f"iree-compile: model.vmfb {len(vmfb) / 2**20:.1f} MiB")
    return Module(
        file="model.vmfb", abi_version=MODULE_ABI_VERSION, iree_compiler_version=package_version("iree-base-compiler"),
        target=target.target, arch=target.arch, driver=target.driver, executable_format=target.executable_format,
        flags=[*target.flags, "--iree-opt-level=O3", *options.iree_flags], fallbacks=fallbacks,
        fused_units=passes.rewritten, vulkan_profile=target.profile,
        subgroup_sizes=None if target.subgroup_sizes is None else list(target.subgroup_sizes),
        max_context=options.max_context, prefill_block=block, max_batch=options.max_batch, index_topk=cfg.index_topk,
        entry_points=entry_points(options.max_batch, block, cfg.hidden_size, cfg.vocab_size, windows, short),
        state=exported.state, context_windows=list(windows), short_prefill_block=short,
        activations="bf16" if rounded else "f32")


def default_prefill_block(backend: str) -> int:
    return DEFAULT_CPU_PREFILL_BLOCK if backend == "llvm-cpu" else DEFAULT_PREFILL_BLOCK


def short_block(options: CompileOptions, backend: str, block: int) -> int | None:
    """The short prefill block to export beside `block`: the one asked for, else the default on llvm-cpu;
    None where it would not be shorter."""
    short = options.short_prefill_block
    if short is None:
        short = DEFAULT_SHORT_PREFILL_BLOCK if backend == "llvm-cpu" else 0
    return short if 0 < short < block else None


def entry_points(B: int, block: int, hidden: int, vocab: int, windows: tuple[int, ...] = (),
                 short: int | None = None) -> dict[str, EntryPoint]:
    """The exported functions' signatures (frontend/export.py); a window's entries have their whole-cache
    twin's."""
    rows = [["positions", [B], "int32"], ["lengths", [B], "int32"]]

    def prefill_of(block: int) -> EntryPoint:
        return EntryPoint(inputs=[["tokens", [B, block], "int32"], *rows, "*state"],
                          outputs=[["logits", [B, vocab], "float32"], ["hidden", [B, block, hidden], "float32"], "*state"])
    prefill = prefill_of(block)
    decode = EntryPoint(inputs=[["tokens", [B], "int32"], *rows, "*state"],
                        outputs=[["logits", [B, vocab], "float32"], "*state"])
    head = EntryPoint(inputs=[["hidden", [B, block, hidden], "float32"]], outputs=[["logits", [B, block, vocab], "float32"]])
    entries = {"prefill": prefill, "head": head, "decode": decode}
    for w in windows:
        entries.update({windowed("prefill", w): prefill, windowed("decode", w): decode})
    if short:
        entries.update({windowed("prefill_short", w): prefill_of(short) for w in (None, *windows)})
    return entries


def install(staging: Path, out: Path, manifest: Manifest) -> None:
    """Rename the staged files into OUT, the manifest last: it vouches for the rest."""
    manifest.write(staging / "model.json")
    names = [f for f in ("model.irpa", *manifest.tokenizer.files, "model.vmfb") if (staging / f).exists()]
    for f in [*names, "model.json"]:
        os.replace(staging / f, out / f)
    if manifest.module is None and (out / "model.vmfb").exists():
        (out / "model.vmfb").unlink()          # built against the previous archive


def compile_checkpoint(checkpoint: str | Path, out: str | Path, options: CompileOptions = CompileOptions(), *,
                       log: Callable[[str], None] | None = None, quiet: bool = True) -> Manifest:
    """Convert `checkpoint` into `out` and, unless options.convert_only, compile its module. Returns the
    manifest written to out/model.json. Errors are FrontendError / TargetError / PassError."""
    checkpoint, out = Path(checkpoint), Path(out)
    log = log or Progress(quiet)
    check_options(options)
    target = resolve_target(options)
    if options.convert_only and is_up_to_date(checkpoint, out, options.convert):
        log(f"convert: {out / 'model.irpa'} is up to date for {checkpoint}; skipped")
        return Manifest.load(out, need_module=False)
    staging = staging_dir(out, ".build-")
    try:
        manifest = convert_stage(checkpoint, out, staging, options, log, quiet)
        if not options.convert_only:
            manifest.module = build_module(manifest, target, options, staging, log)
        install(staging, out, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"done: {out}")
    manifest.directory = out
    return manifest
