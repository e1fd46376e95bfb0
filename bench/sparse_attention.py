"""One DSA layer's attention, side by side in one run (IREE llvm-cpu, --iree-opt-level=O3):

  fused     the unit through passes/sparse_attention.py: indexer, top-k, attention over k rows
  unfused   the unit's reference (--no-sparse-attention-fusion): indexer, top-k as a mask, attention
            over the whole cache
  dense     MLA attention over the whole cache, no indexer (what the layer costs without DSA)
  indexer   the indexer scores + top-k selection alone (the part that must grow with the context)

Decode: one query at contexts 1k, 4k, 16k, 32k with index_topk 2048 and DeepSeek-V3.2's attention
sizes (128 heads, latent 512, rope 64; indexer 64 heads of 128). Each form is one compiled function
whose inputs stay on the device; the time is the median of several calls.
Prefill memory: peak RSS of a process running a 4096-token prefill of the unit (one call, 4096
queries against 4096 cache slots) in each form, at 16 heads and 16 indexer heads so the unfused
form fits in memory (its [heads x tokens x context] scores alone are 1 GiB there).

    python bench/sparse_attention.py [--contexts 1024,4096,16384,32768] [--skip-prefill]

Prints a table and writes bench/results/sparse_attention.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kimi_iree.frontend import dsa, units  # noqa: F401  (units registers torch.ops.kimi.*)
from kimi_iree.frontend.selection import topk_members
from kimi_iree.passes import PassOptions, run_passes

FLAGS = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host", "--iree-opt-level=O3"]
SIZES = dict(H=128, R=512, P=64, HI=64, DI=128)
SOFTMAX_SCALE, INDEX_SCALE = 192 ** -0.5, 128 ** -0.5


class Fused(torch.nn.Module):
    def __init__(self, topk):
        super().__init__()
        self.topk = topk

    def forward(self, *args):
        return torch.ops.kimi.sparse_mla_attention(*args, SOFTMAX_SCALE, INDEX_SCALE, self.topk)


class Unfused(Fused):
    def forward(self, *args):
        return dsa.sparse_mla_attention(*args, SOFTMAX_SCALE, INDEX_SCALE, self.topk)


class Dense(torch.nn.Module):
    def forward(self, ql, qp, latent, k_pe, iq, iw, ik, positions):
        return dsa.latent_attention(ql, qp, latent, k_pe, dsa.visible_slots(positions, latent.shape[1]),
                                    SOFTMAX_SCALE)


class Indexer(Fused):
    def forward(self, ql, qp, latent, k_pe, iq, iw, ik, positions):
        keep = topk_members(dsa.index_scores(iq, iw, ik, INDEX_SCALE), self.topk,
                            dsa.visible_slots(positions, latent.shape[1]))
        return keep.to(torch.int32).sum(-1)


def inputs(T: int, S: int, H: int, R: int, P: int, HI: int, DI: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, T, H, R, generator=g), torch.randn(1, T, H, P, generator=g),
            torch.randn(1, S, R, generator=g), torch.randn(1, S, P, generator=g),
            torch.randn(1, T, HI, DI, generator=g), torch.randn(1, T, HI, generator=g),
            torch.randn(1, S, DI, generator=g), torch.arange(S - T, S)[None]]


def compile_form(module: torch.nn.Module, args: list[torch.Tensor]) -> bytes:
    import iree.compiler as ic
    from torch_mlir import fx

    mlir = str(fx.export_and_import(module, *args, func_name="main", decomposition_table={}))
    mlir = run_passes(mlir, PassOptions(sparse_attention=True)).mlir
    return ic.compile_str(mlir, input_type="torch", extra_args=FLAGS)


def time_calls(vmfb: bytes, args: list[torch.Tensor], calls: int) -> float:
    import iree.runtime as rt

    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    device_args = [rt.asdevicearray(config.device, a.numpy()) for a in args]
    main = context.modules.module.main
    main(*device_args).to_host()                  # warm-up
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        main(*device_args).to_host()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def decode_table(contexts: list[int], topk: int) -> list[dict]:
    rows = []
    for S in contexts:
        args = inputs(1, S, **SIZES)
        row = {"context": S, "index_topk": topk}
        row["indexer_ms"] = 0.0          # topk covers the context: the layer runs no indexer at all
        for name, module in (("fused", Fused(topk)), ("unfused", Unfused(topk)), ("dense", Dense()),
                             ("indexer", Indexer(topk))):
            if name == "indexer" and topk >= S:
                continue
            vmfb = compile_form(module, args)
            row[f"{name}_ms"] = 1e3 * time_calls(vmfb, args, calls=7 if S >= 16384 else 15)
        row["fused_over_unfused"] = row["fused_ms"] / row["unfused_ms"]
        row["fused_attention_ms"] = row["fused_ms"] - row["indexer_ms"]
        rows.append(row)
        print(f"context {S:6}: fused {row['fused_ms']:8.2f} ms  unfused {row['unfused_ms']:8.2f} ms  "
              f"dense {row['dense_ms']:8.2f} ms  indexer+top-k {row['indexer_ms']:8.2f} ms  "
              f"fused/unfused {row['fused_over_unfused']:.2f}", flush=True)
    return rows


def prefill_peak_rss(form: str, tokens: int, topk: int) -> dict:
    """Run one prefill of `tokens` queries in a fresh process; its peak RSS (the compile happens there
    too, so the baseline of a process that only compiles is subtracted)."""
    code = f"import sparse_attention as b; print(b.prefill_child({form!r}, {tokens}, {topk}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    if out.returncode != 0:
        return {"form": form, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def prefill_child(form: str, tokens: int, topk: int) -> str:
    import iree.runtime as rt

    sizes = dict(H=16, R=512, P=64, HI=16, DI=128)
    args = inputs(tokens, tokens, **sizes)
    args[-1] = torch.arange(tokens)[None]
    vmfb = compile_form(Fused(topk) if form == "fused" else Unfused(topk), args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    start = time.perf_counter()
    context.modules.module.main(*[a.numpy() for a in args]).to_host()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return json.dumps({"form": form, "tokens": tokens, "seconds": seconds, "peak_rss_mib": peak / 1024,
                       "rss_growth_mib": (peak - before) / 1024, **sizes})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--index-topk", type=int, default=2048)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    result = {"sizes": SIZES, "decode": decode_table([int(c) for c in args.contexts.split(",")], args.index_topk)}
    if not args.skip_prefill:
        result["prefill"] = [prefill_peak_rss(form, args.prefill_tokens, args.index_topk)
                             for form in ("fused", "unfused")]
        for r in result["prefill"]:
            print(f"prefill {args.prefill_tokens} tokens, {r['form']}: " +
                  (f"peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} MiB running), "
                   f"{r['seconds']:.1f} s" if "error" not in r else r["error"]), flush=True)
    out = Path(__file__).parent / "results" / "sparse_attention.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
