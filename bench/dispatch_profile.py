"""Where a decode step and a prefill block spend their time: every dispatch of a compiled module, ranked.

IREE 3.13's HAL profiling (`--device_profiling_mode=host-execution`: local-task has no `dispatch-events`,
and the Python bindings expose none of it) records each dispatch's execution time on the host workers; `iree-benchmark-module` runs the entry point
repeatedly with the module's parameters and a state at the requested depth (zeros, position = depth:
the same work as a real cache), and `iree-profile dispatch` aggregates per executable function.

    python bench/dispatch_profile.py OUT [--entry decode,prefill] [--depth 0] [--repeat 20] [--top 20] [--json FILE]

Prints, per entry point, the dispatches ranked by total time with their share of the step and calls per
step; the time of one call of the entry point (benchmark wall time) beside the sum of dispatch times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

BIN = Path(sys.executable).parent


def write_inputs(out: Path, entry: str, depth: int, work: Path) -> list[str]:
    """--input flags for `entry`: a token block (or one token), its length, the state at `depth`."""
    manifest = json.loads((out / "model.json").read_text())
    module = manifest["module"]
    flags = []
    for spec in module["entry_points"][entry]["inputs"]:
        if spec == "*state":
            for slot in module["state"]:
                value = np.zeros(slot["shape"], dtype=slot["dtype"])
                path = work / f"{entry}-{slot['name']}.npy"
                np.save(path, value)
                flags.append(f"--input=@{path}")
            continue
        name, shape, dtype = spec
        # distinct tokens (a block of one repeated token would route every pair to the same k experts,
        # whose weights then stay in cache), each row at `depth`, every token of a prefill block real
        if name == "tokens":
            value = np.random.default_rng(0).integers(0, manifest["config"]["vocab_size"], shape).astype(dtype)
        else:
            fill = {"positions": depth, "lengths": entry_block(module, entry)}[name]
            value = np.full(shape, fill, dtype=dtype)
        path = work / f"{entry}-{name}.npy"
        np.save(path, value)
        flags.append(f"--input=@{path}")
    return flags


def entry_block(module: dict, entry: str) -> int:
    """Tokens a row of `entry` takes (a prefill entry's block, a decode's 1): its length when all are real."""
    shape = module["entry_points"][entry]["inputs"][0][1]
    return shape[1] if len(shape) == 2 else 1


def profile(out: Path, entry: str, depth: int, repeat: int, work: Path) -> dict:
    capture = work / f"{entry}.ireeprof"
    bench = subprocess.run(
        [str(BIN / "iree-benchmark-module"), f"--module={out / 'model.vmfb'}", f"--parameters=model={out / 'model.irpa'}",
         f"--function={entry}", "--device=local-task", *write_inputs(out, entry, depth, work),
         f"--benchmark_repetitions={repeat}", "--benchmark_min_time=1x", "--benchmark_format=json",
         "--device_profiling_mode=host-execution", f"--device_profiling_output={capture}"],
        capture_output=True, text=True)
    if bench.returncode:
        raise SystemExit(f"error: iree-benchmark-module failed on {out}: {bench.stderr[-2000:]}")
    runs = [b for b in json.loads(bench.stdout)["benchmarks"] if b.get("run_type") == "iteration"]
    wall_ms = float(np.median([b["real_time"] for b in runs]))
    unit = runs[0].get("time_unit", "ms")
    wall_ms *= {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    calls = len(runs)
    rows = subprocess.run([str(BIN / "iree-profile"), "dispatch", "--format=jsonl", str(capture)],
                          capture_output=True, text=True, check=True).stdout
    functions = [json.loads(line) for line in rows.splitlines() if line.strip()]
    return {"entry": entry, "depth": depth, "calls": calls, "wall_ms": wall_ms, "functions": functions}


def table(result: dict, top: int) -> str:
    funcs = [f for f in result["functions"] if "key" in f and "total_ns" in f]
    timed = sorted(((f, float(f["total_ns"])) for f in funcs), key=lambda p: -p[1])
    total = sum(t for _, t in timed)
    per_call = total / result["calls"] / 1e6
    lines = [f"{result['entry']} at depth {result['depth']}: {result['wall_ms']:.2f} ms a call "
             f"(dispatches {per_call:.2f} ms, {len(timed)} functions)",
             "| # | dispatch | ms / call | share | dispatches / call |", "|---|---|---|---|---|"]
    for i, (f, t) in enumerate(timed[:top], 1):
        name, count = f["key"], f["count"] / result["calls"]
        lines.append(f"| {i} | `{name}` | {t / result['calls'] / 1e6:.3f} | {100 * t / total:.1f}% | {count:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="a kimi-compile output directory (cpu target)")
    ap.add_argument("--entry", default="decode,prefill")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in args.entry.split(","):
            results.append(profile(args.out, entry, args.depth, args.repeat, Path(tmp)))
            print(table(results[-1], args.top) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
