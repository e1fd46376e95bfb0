"""Decode/prefill benchmark, side by side in one run: the IREE cpu module (kimi-run --bench's code
path, both passes on), the same module with both passes off (--no-weight-fusion
--no-sparse-attention-fusion) and our eager PyTorch model, on a bench-size synthetic K3.1 (hidden 1024, 8 layers = 6 KDA +
2 DSA, 32 routed MXFP4 experts top-4, vocab 32k), at depth 0 and 4096, with the memory-bandwidth
roofline for decode (bytes a decode step must touch / a measured memcpy bandwidth).

    python bench/decode.py [--depths 0,4096] [--max-context N] [--workdir /tmp/kimi-bench-decode]

Prints a table and writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPT, GEN = 64, 32


def memcpy_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9          # read + write


def decode_bytes(manifest: dict, depth: int) -> int:
    """Bytes one decode step must read: every weight except unselected experts, the KDA state, and
    the cache rows of the `depth` tokens before it."""
    cfg = manifest["config"]
    item = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4}
    total = 0
    for name, t in manifest["parameters"]["tensors"].items():
        nbytes = math.prod(t["shape"]) * item[t["dtype"]]
        if ".experts." in name:
            nbytes = nbytes * cfg["experts_per_token"] // cfg["num_experts"]
        if name == "embed.weight":
            nbytes = nbytes // cfg["vocab_size"]          # one row
        total += nbytes
    for s in manifest["module"]["state"]:
        row = math.prod(s["shape"][2:]) * 4
        total += row * (depth + 1) if s["name"].endswith(("latent", "k_pe", "index_keys")) else math.prod(s["shape"]) * 4
    return total


def bench_iree(out: Path, depth: int) -> dict:
    from kimi_iree.runtime import Session
    from kimi_iree.runtime.cli import bench
    session = Session(out)
    args = argparse.Namespace(depth=depth, prompt_tokens=PROMPT, gen_tokens=GEN, seed=0, warmup=True)
    return bench(session, args)


def bench_eager(checkpoint: Path, depth: int, max_context: int) -> dict:
    import torch
    from kimi_iree.frontend import load_model
    torch.set_num_threads(2)
    model = load_model(checkpoint)
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    with torch.no_grad():
        state = model.init_state(1, max_context)
        if depth:
            for lo in range(0, depth, 512):
                _, state = model.prefill(torch.tensor([rng.integers(0, vocab, min(512, depth - lo)).tolist()]), state)
        t = time.perf_counter()
        logits, state = model.prefill(torch.tensor([rng.integers(0, vocab, PROMPT).tolist()]), state)
        prefill = time.perf_counter() - t
        token = logits[:, -1].argmax(-1)
        t = time.perf_counter()
        for _ in range(GEN):
            logits, state = model.decode(token, state)
            token = logits.argmax(-1)
        decode = time.perf_counter() - t
    return {"prefill_tokens_per_s": PROMPT / prefill, "decode_tokens_per_s": GEN / decode, "depth": depth}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--workdir", default="/tmp/kimi-bench-decode")
    ap.add_argument("--max-context", type=int, default=None,
                    help="the modules' max context (default: the deepest depth + prompt + generated tokens)")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    work = Path(args.workdir)
    ckpt, out = work / "checkpoint", work / "out"
    max_context = args.max_context or max(depths) + PROMPT + GEN
    if max_context < max(depths) + PROMPT + GEN:
        ap.error(f"--max-context {max_context} is below the deepest depth + {PROMPT + GEN} tokens")
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kimi_iree.frontend.synthetic", str(ckpt), "--size", "bench",
                        "--layers", "8"], check=True, stdout=subprocess.DEVNULL)
    unfused = work / "out-unfused"
    # Always rebuilt: a module left in the workdir by an earlier checkout would time that checkout's code.
    for module_dir, extra in ((out, []), (unfused, ["--no-weight-fusion", "--no-sparse-attention-fusion"])):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kimi_iree.driver.kimi_compile", str(ckpt), "--target", "cpu",
                        "-o", str(module_dir), "--max-context", str(max_context), "--quiet", *extra], check=True)
        print(f"compiled {module_dir.name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    manifest_file = out / "model.json"
    manifest = json.loads(manifest_file.read_text())
    bandwidth = memcpy_bandwidth_gbs()
    rows = []
    for depth in depths:
        iree = bench_iree(out, depth)
        iree_unfused = bench_iree(unfused, depth)
        eager = bench_eager(ckpt, depth, max_context)
        touched = decode_bytes(manifest, depth)
        roofline = bandwidth * 1e9 / touched
        rows.append({"depth": depth, "iree": iree, "iree_unfused": iree_unfused, "eager": eager, "decode_bytes": touched,
                     "fused_over_unfused_decode": iree["decode_tokens_per_s"] / iree_unfused["decode_tokens_per_s"],
                     "roofline_decode_tokens_per_s": roofline,
                     "iree_over_eager_decode": iree["decode_tokens_per_s"] / eager["decode_tokens_per_s"],
                     "iree_fraction_of_roofline": iree["decode_tokens_per_s"] / roofline})
    print(f"memcpy bandwidth {bandwidth:.1f} GB/s; max context {max_context}")
    print(f"{'depth':>6} | {'IREE prefill':>12} {'IREE decode':>11} | {'unfused prefill':>15} {'unfused decode':>14} | "
          f"{'eager prefill':>13} {'eager decode':>12} | {'roofline':>8} | {'IREE/eager':>10} {'of roofline':>11}")
    for r in rows:
        print(f"{r['depth']:>6} | {r['iree']['prefill_tokens_per_s']:>12.1f} {r['iree']['decode_tokens_per_s']:>11.1f} | "
              f"{r['iree_unfused']['prefill_tokens_per_s']:>15.1f} {r['iree_unfused']['decode_tokens_per_s']:>14.1f} | "
              f"{r['eager']['prefill_tokens_per_s']:>13.1f} {r['eager']['decode_tokens_per_s']:>12.1f} | "
              f"{r['roofline_decode_tokens_per_s']:>8.0f} | {r['iree_over_eager_decode']:>9.2f}x "
              f"{100 * r['iree_fraction_of_roofline']:>10.1f}%")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "decode.json").write_text(json.dumps({"memcpy_gb_per_s": bandwidth, "max_context": max_context,
                                                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
