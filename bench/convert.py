"""Conversion benchmark: peak resident memory and throughput of `kimi-compile --convert-only` on a
generated ~2 GB synthetic K3.1 checkpoint (bench-size layers, bf16 weights, MXFP4 experts).

    python bench/convert.py [--layers 64] [--workdir /tmp/kimi-bench-convert]

Prints a table and writes bench/results/convert.json. The goal: peak RSS under 1 GB, i.e.
bounded by a few times the largest tensor, not by the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

ITEMSIZE = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/kimi-bench-convert")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()
    work = Path(args.workdir)
    ckpt, out = work / "checkpoint", work / "out"
    if not (ckpt / "config.json").exists():
        print(f"generating a {args.layers}-layer bench-size checkpoint in {ckpt} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kimi_iree.frontend.synthetic", str(ckpt), "--size", "bench",
                        "--layers", str(args.layers), "--shards", "8"], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(out, ignore_errors=True)
    checkpoint_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    # The converter runs in its own process, which reports its own peak RSS (the generator's
    # memory must not count).
    probe = ("import resource, sys, time; from kimi_iree.driver.kimi_compile import main; t = time.perf_counter(); "
             "code = main(sys.argv[1:]); print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
             "; sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", probe, str(ckpt), "--convert-only", "-o", str(out), "--quiet"],
                         check=True, capture_output=True, text=True)
    seconds_text, peak_rss_text = run.stdout.split()
    seconds, peak_rss_kib = float(seconds_text), int(peak_rss_text)
    manifest = json.loads((out / "model.json").read_text())
    result = {
        "checkpoint_bytes": checkpoint_bytes,
        "archive_bytes": (out / "model.irpa").stat().st_size,
        "tensors": manifest["conversion"]["tensors_kept"],
        "largest_tensor_bytes": max(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]
                                    for t in manifest["parameters"]["tensors"].values()),
        "seconds": round(seconds, 2),
        "mb_per_s": round(checkpoint_bytes / 1e6 / seconds, 1),
        "peak_rss_mb": round(peak_rss_kib / 1024, 1),
    }
    print(f"{'checkpoint':>12} {'archive':>10} {'tensors':>8} {'largest':>9} {'seconds':>8} {'MB/s':>7} {'peak RSS':>9}")
    print(f"{checkpoint_bytes / 1e9:>10.2f}GB {result['archive_bytes'] / 1e9:>8.2f}GB {result['tensors']:>8} "
          f"{result['largest_tensor_bytes'] / 1e6:>7.1f}MB {seconds:>8.1f} {result['mb_per_s']:>7.1f} "
          f"{result['peak_rss_mb']:>7.0f}MB")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "convert.json").write_text(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["peak_rss_mb"] < 1024 else 1


if __name__ == "__main__":
    sys.exit(main())
