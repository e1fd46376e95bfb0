"""Logits as a measurement (what llama-perplexity offers): save a run's logits, compare another run with them.

    kimi-run A/model.vmfb --perplexity text.txt --save-logits base.npy      # e.g. the CPU module
    kimi-run B/model.vmfb --perplexity text.txt --kl-divergence base.npy    # e.g. Vulkan, or MXFP4 experts

Saved logits are float32 [scored positions, vocab]: row i holds the logits at token i, which score
token i + 1 (the last token scores nothing). Perplexity alone hides large logit errors on random
weights (nearly flat distributions), so the comparison is per position: the KL divergence
KL(base || this) of the two next-token distributions, and whether their top-1 tokens agree.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .errors import RuntimeUsageError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., vocab] -> log-probabilities in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def save_logits(path: str | Path, logits: np.ndarray) -> None:
    """Write float32 logits to `path` (.npy) through a temporary file renamed into place."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npy", dir=path.parent if str(path.parent) else ".")
    except OSError as e:
        raise RuntimeUsageError(f"--save-logits {path}: cannot write there ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.ascontiguousarray(logits, dtype=np.float32))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_base(path: str | Path, shape: tuple[int, int]) -> np.ndarray:
    """Saved logits of the same positions and vocabulary as `shape`, or a one-line error."""
    path = Path(path)
    try:
        base = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise RuntimeUsageError(f"--kl-divergence {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise RuntimeUsageError(f"--kl-divergence {path}: not a saved logits file ({e})") from None
    if base.ndim != 2 or not np.issubdtype(base.dtype, np.floating):
        raise RuntimeUsageError(f"--kl-divergence {path}: expected float [positions, vocab] logits, "
                                f"got {base.dtype} {list(base.shape)}")
    if base.shape[1] != shape[1]:
        raise RuntimeUsageError(f"--kl-divergence {path}: vocabulary {base.shape[1]}, this module's is {shape[1]}")
    if base.shape[0] != shape[0]:
        raise RuntimeUsageError(f"--kl-divergence {path}: {base.shape[0]} scored positions, this run scores "
                                f"{shape[0]} (same text and --ctx?)")
    return base


def kl_divergence(base: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """Per position KL(base || logits) in nats: its mean, 99th percentile and max, and the fraction of
    positions whose top-1 token is the same."""
    log_p, log_q = log_softmax(base), log_softmax(logits)
    kl = np.maximum((np.exp(log_p) * (log_p - log_q)).sum(-1), 0.0)    # >= 0; rounding can dip below
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "top1_agreement": float((base.argmax(-1) == logits.argmax(-1)).mean()),
            "max_logit_error": float(np.abs(base - logits).max() / np.abs(base).max())}
