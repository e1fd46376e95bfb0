"""Next-token choice from logits: greedy, or temperature with top-k / top-p (nucleus) filtering."""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> int:
    """logits: [vocab] f32. temperature 0 is greedy (the first maximum)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k > 0 and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        cut = np.searchsorted(cumulative, top_p) + 1        # keep the smallest prefix reaching top_p
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))
