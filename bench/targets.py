"""One definition, every target: compile time and module size per target for the synthetic K3.1 (the
tiny one `make demo` uses), and prefill/decode tokens/s where this machine can run the module (the
CPU, and Vulkan on Mesa's lavapipe: a software driver, so its figure is for catching regressions, not
a claim about GPUs). Both passes are on, as kimi-compile's default.

    python bench/targets.py [--workdir /tmp/kimi-bench-targets] [--max-context 512]

Prints a table and writes bench/results/targets.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

TARGETS = [("cpu", "host"), ("cpu", "aarch64-linux-gnu"), ("vulkan", "host"), ("cuda", "sm_90"),
           ("rocm", "gfx942"), ("rocm", "gfx950"), ("metal", "apple")]
RUNNABLE = {"cpu": "host", "vulkan": "host"}


def compile_target(checkpoint: Path, out: Path, target: str, arch: str, max_context: int) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "kimi_iree.driver.kimi_compile", str(checkpoint), "-o", str(out),
                             "--target", target, "--arch", arch, "--max-context", str(max_context), "--quiet"],
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        return {"target": target, "arch": arch, "error": result.stderr.strip().splitlines()[-1]}
    module = json.loads((out / "model.json").read_text())["module"]
    return {"target": target, "arch": arch, "compile_seconds": seconds,
            "module_mib": (out / "model.vmfb").stat().st_size / 2**20,
            "executable_format": module["executable_format"], "fused_units": module["fused_units"],
            "fallbacks": module["fallbacks"]}


def run_module(out: Path) -> dict:
    """kimi-run --bench in a fresh process (the first run includes lavapipe's pipeline builds, so it
    runs twice and the second is reported)."""
    figures = {}
    for attempt in ("cold", "warm"):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "kimi_iree.runtime.cli", str(out / "model.vmfb"), "--bench",
                                 "--prompt-tokens", "64", "--gen-tokens", "32", "--json"], capture_output=True, text=True)
        if result.returncode != 0:
            return {"run_error": result.stderr.strip().splitlines()[-1]}
        figures[f"{attempt}_run_seconds"] = time.perf_counter() - start
        figures.update(json.loads(result.stdout))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/kimi-bench-targets")
    ap.add_argument("--max-context", type=int, default=512)
    args = ap.parse_args()
    from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
    from kimi_iree.targets.vulkan import query_host_device

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    checkpoint = write_synthetic_checkpoint(work / "synthetic-k3.1")
    vulkan = query_host_device()
    rows = []
    for target, arch in TARGETS:
        if target == "vulkan" and vulkan is None:
            rows.append({"target": target, "arch": arch, "error": "no Vulkan device"})
            continue
        out = work / f"{target}-{arch}"
        row = compile_target(checkpoint, out, target, arch, args.max_context)
        if "error" not in row and RUNNABLE.get(target) == arch:
            row.update(run_module(out))
        rows.append(row)
        speed = (f"prefill {row['prefill_tokens_per_s']:7.1f} tok/s  decode {row['decode_tokens_per_s']:6.1f} tok/s"
                 if "decode_tokens_per_s" in row else row.get("run_error", ""))
        print(f"{target:6} {arch:18} " + (row["error"] if "error" in row else
              f"compile {row['compile_seconds']:5.1f} s  module {row['module_mib']:5.2f} MiB  {speed}"), flush=True)
    device = {"vulkan": vulkan.name if vulkan else None}
    out = Path(__file__).parent / "results" / "targets.json"
    out.write_text(json.dumps({"device": device, "max_context": args.max_context, "targets": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
