"""kimi-serve under load: aggregate tokens/s and time to first token at 1, 2, 4 and 8 concurrent streams,
over a batch-1 and a batched module, beside the batch-1 module driven directly (kimi-run's code path),
in one run.

    python bench/serve.py [OUT] [--batched OUT2] [--concurrency 1,2,4,8] [--max-tokens 64] [--rounds 2] [--json FILE]

kimi-serve runs over the batch-1 module (slots take turns) and over the same model compiled with
`--max-batch` (slots are rows of one call). OUT defaults to the shipped demo model compiled for
the CPU (max context 1024), OUT2 to the same with --max-batch the highest concurrency. Each stream sends
a different slice of demo/heldout.txt as its prompt and asks for --max-tokens tokens (temperature
0.8, seeded, so streams rarely stop early; the usage counts say what was generated).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = (ROOT / "demo" / "heldout.txt").read_text()


def prompt(i: int, chars: int = 200) -> str:
    start = (i * 397) % (len(HELDOUT) - chars)
    return HELDOUT[start: start + chars]


def stream(base: str, i: int, max_tokens: int) -> tuple[float, int, float]:
    """One SSE completion: (seconds to the first text, completion tokens, total seconds)."""
    body = json.dumps({"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    first, tokens = None, 0
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return (first if first is not None else total), tokens, total


def batch1(out: Path, max_tokens: int, n: int) -> dict:
    """The module driven directly, one request after another: what a single slot can do."""
    from kimi_iree.runtime.sampling import sample
    from kimi_iree.runtime.session import Session
    from kimi_iree.runtime.tokenizer import Tokenizer
    session = Session(out)
    tokenizer = Tokenizer(session.directory, session.manifest.tokenizer.files)
    tokens, ttft = 0, []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        sequence = session.new_sequence()
        rng = np.random.default_rng(i)
        logits = session.prefill(tokenizer.encode(prompt(i)), sequence=sequence)
        ttft.append(time.perf_counter() - t0)
        for step in range(max_tokens):
            token = sample(logits, rng, 0.8)
            tokens += 1
            if token in session.eos_ids or step == max_tokens - 1:
                break
            logits = session.decode(token, sequence)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "ttft_ms": 1e3 * statistics.mean(ttft), "tokens": tokens}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_rows(out: Path, levels: list[int], max_tokens: int, rounds: int) -> dict:
    """kimi-serve over `out` with max(levels) slots: concurrency -> tokens/s, mean TTFT, tokens."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kimi_iree.runtime.server", str(out), "--port", str(port),
                               "--slots", str(max(levels)), "--queue", "0"])
    base = f"http://127.0.0.1:{port}"
    rows = {}
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        stream(base, 0, 4)                                  # warm-up
        for c in levels:
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                results = list(pool.map(lambda i: stream(base, i, max_tokens), range(c * rounds)))
            seconds = time.perf_counter() - start
            tokens = sum(r[1] for r in results)
            rows[c] = {"tokens_per_s": tokens / seconds, "ttft_ms": 1e3 * statistics.mean(r[0] for r in results),
                       "tokens": tokens}
    finally:
        server.terminate()
        server.wait(60)
    return rows


def compile_demo(out: Path, max_batch: int) -> None:
    subprocess.run([sys.executable, "-m", "kimi_iree.driver.kimi_compile", str(ROOT / "demo" / "kimi-k3.1-pydoc"),
                    "--target", "cpu", "--max-context", "1024", "--max-batch", str(max_batch), "-o", str(out),
                    "--quiet"], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="a batch-1 kimi-compile OUT directory (default: the demo model, compiled)")
    ap.add_argument("--batched", help="the same model compiled with --max-batch (default: the demo model, "
                                      "compiled with --max-batch the highest concurrency)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream at each concurrency")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = tempfile.TemporaryDirectory(prefix="kimi-serve-bench-")
    out = Path(args.out) if args.out else Path(tmp.name) / "demo"
    batched = Path(args.batched) if args.batched else Path(tmp.name) / "demo-batched"
    if not args.out:
        compile_demo(out, 1)
    if not args.batched:
        compile_demo(batched, max(levels))
    direct = batch1(out, args.max_tokens, max(levels) * args.rounds)
    turns = serve_rows(out, levels, args.max_tokens, args.rounds)
    together = serve_rows(batched, levels, args.max_tokens, args.rounds)
    print(f"batch-1 module driven directly: {direct['tokens_per_s']:.1f} tok/s, time to first token "
          f"{direct['ttft_ms']:.1f} ms")
    print("| streams | slots on the batch-1 module: tok/s | TTFT (ms) | batched module: tok/s | TTFT (ms) |")
    print("|---|---|---|---|---|")
    for c in levels:
        a, b = turns[c], together[c]
        print(f"| {c} | {a['tokens_per_s']:.1f} | {a['ttft_ms']:.1f} | {b['tokens_per_s']:.1f} | {b['ttft_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "batch1_direct": direct,
                                               "batch1_module": turns, "batched_module": together}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
