"""DSA on the demo model: held-out perplexity with index_topk below, at and above the scored context.

    .venv/bin/python demo/index_topk_experiment.py [--context 4096] [--topk 16 32 64 128 256 1024] [--work DIR]

For every index_topk K it compiles the shipped checkpoint and scores demo/heldout.txt in one causal window:
    kimi-compile demo/kimi-k3.1-pydoc --target cpu --max-context C --index-topk K -o DIR/topk-K --quiet
    kimi-run DIR/topk-K/model.vmfb --perplexity demo/heldout.txt --ctx N --json
and the dense equivalents three ways:
  - K = C: index_topk covers the whole cache, so the MLA layers take the dense path (no selection,
    no sparse-attention unit in the module);
  - K = C - 1 scored at N = C - 1: the sparse-attention unit is in the module but every query sees at
    most C - 1 tokens, so it selects all of them; it must match K = C scored at the same N;
  - the eager PyTorch model (`load_model(..., index_topk=...)`) with K far above the context, and with
    the shipped index_topk, on the same tokens.
Prints a Markdown table (the one demo/README.md quotes) and writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def compile_module(checkpoint: Path, out: Path, context: int, topk: int) -> list[str]:
    command = [str(BIN / "kimi-compile"), str(checkpoint), "--target", "cpu", "--max-context", str(context),
               "--index-topk", str(topk), "-o", str(out), "--quiet"]
    subprocess.run(command, check=True)
    return command


def module_perplexity(out: Path, heldout: Path, tokens: int) -> tuple[float, list[str]]:
    command = [str(BIN / "kimi-run"), str(out / "model.vmfb"), "--perplexity", str(heldout), "--ctx", str(tokens),
               "--json"]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert result["tokens"] == tokens, result
    return result["perplexity"], command


def eager_perplexity(checkpoint: Path, heldout: Path, tokens: int, topk: int) -> float:
    """The PyTorch reference (frontend/): the same checkpoint and tokens, index_topk overridden."""
    import torch
    import torch.nn.functional as F
    from kimi_iree.frontend import load_model
    torch.set_num_threads(2)
    ids = torch.tensor([list(heldout.read_bytes())[:tokens]])
    with torch.no_grad():
        logits = load_model(checkpoint, index_topk=topk)(ids)[0, :-1]
    return math.exp(float(F.cross_entropy(logits, ids[0, 1:])))


def relative(value: float, dense: float) -> str:
    return f"{value - dense:+.6f} ({(value / dense - 1) * 100:+.2f}%)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=DEMO_DIR / "kimi-k3.1-pydoc")
    ap.add_argument("--heldout", type=Path, default=DEMO_DIR / "heldout.txt")
    ap.add_argument("--context", type=int, default=4096, help="the modules' --max-context and the scored tokens")
    ap.add_argument("--topk", type=int, nargs="+", default=[16, 32, 64, 128, 256, 1024])
    ap.add_argument("--work", type=Path, default=Path("/tmp/kimi-demo-topk"))
    args = ap.parse_args(argv)
    C = args.context
    shipped = json.loads((args.checkpoint / "config.json").read_text())["text_config"]["index_topk"]
    if len(args.heldout.read_bytes()) < C:
        ap.error(f"{args.heldout} has fewer than --context {C} tokens")
    rows, commands = [], []

    def measure(label: str, topk: int, tokens: int) -> float:
        out = args.work / f"topk-{topk}"
        if not (out / "model.vmfb").exists():
            commands.append(" ".join(compile_module(args.checkpoint, out, C, topk)))
        ppl, command = module_perplexity(out, args.heldout, tokens)
        commands.append(" ".join(command))
        rows.append({"what": label, "index_topk": topk, "tokens": tokens, "perplexity": ppl})
        return ppl

    dense = measure("module, index_topk = max context (dense path)", C, C)
    for k in sorted(set(args.topk) - {C}):
        measure(f"module{' (shipped config)' if k == shipped else ''}", k, C)
    dense_short = measure("module, index_topk = max context (dense path)", C, C - 1)
    measure("module, sparse unit selecting every visible token", C - 1, C - 1)
    eager_runs = (("eager PyTorch, dense (index_topk 1e9)", 10 ** 9), ("eager PyTorch, shipped index_topk", shipped))
    for label, k in eager_runs:
        rows.append({"what": label, "index_topk": k, "tokens": C,
                     "perplexity": eager_perplexity(args.checkpoint, args.heldout, C, k)})

    print("| run | index_topk | scored tokens | perplexity | vs dense at the same tokens |")
    print("|---|---|---|---|---|")
    for row in rows:
        base = dense if row["tokens"] == C else dense_short
        print(f"| {row['what']} | {row['index_topk']} | {row['tokens']} | {row['perplexity']:.6f} | "
              f"{relative(row['perplexity'], base)} |")
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "results.json").write_text(json.dumps({"rows": rows, "commands": commands}, indent=1) + "\n")
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
