"""What a lossy compile option costs: two modules of one checkpoint (the exact one first), the same tokens.

    python bench/activations.py EXACT_OUT LOSSY_OUT [--tokens 70] [--decodes 16]

A prefill of random token ids with every position's logits, then greedy decodes (the exact module's
choice fed to both); per phase: max|diff| / max|logit|, KL(exact || lossy) per position (mean and max,
runtime/logits.py) and the top-1 agreement. For `kimi-compile --bf16-activations` against the default.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kimi_iree.runtime import Session
from kimi_iree.runtime.logits import kl_divergence


def compare(exact: np.ndarray, lossy: np.ndarray) -> str:
    kl = kl_divergence(exact, lossy)
    return (f"max|diff| / max|logit| {kl['max_logit_error']:.2e}, KL mean {kl['kl_mean']:.2e} p99 {kl['kl_p99']:.2e} "
            f"max {kl['kl_max']:.2e}, top-1 agreement {kl['top1_agreement']:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("exact")
    ap.add_argument("lossy")
    ap.add_argument("--tokens", type=int, default=70)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    a, b = Session(args.exact), Session(args.lossy)
    for s, name in ((a, args.exact), (b, args.lossy)):
        print(f"{name}: activations {s.manifest.module.activations}")
    ids = np.random.default_rng(args.seed).integers(0, a.vocab_size, args.tokens).tolist()
    want, got = a.prefill(ids, all_logits=True), b.prefill(ids, all_logits=True)
    print(f"prefill ({args.tokens} positions): {compare(want, got)}")
    token, want, got = int(want[-1].argmax()), [], []
    for _ in range(args.decodes):
        x, y = a.decode(token), b.decode(token)
        want.append(x)
        got.append(y)
        token = int(x.argmax())
    print(f"decode ({args.decodes} greedy steps): {compare(np.array(want), np.array(got))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
