"""`make demo` before a compiled module exists: write the synthetic K3.1 checkpoint, load it with the
eager PyTorch model and generate greedily from a prompt (the weights are random, so is the text)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .checkpoint import load_model
from .synthetic import write_synthetic_checkpoint


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0] if argv else "demo-out/checkpoint")
    if not (out / "config.json").exists():
        write_synthetic_checkpoint(out)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = load_model(out)
    prompt = "The Kimi delta attention"
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    new_tokens = 16
    with torch.no_grad():
        state = model.init_state(1, ids.shape[1] + new_tokens)
        start = time.perf_counter()
        logits, state = model.prefill(ids, state)
        token = logits[:, -1].argmax(-1)
        generated = [token.item()]
        for _ in range(new_tokens - 1):
            logits, state = model.decode(token, state)
            token = logits.argmax(-1)
            generated.append(token.item())
        seconds = time.perf_counter() - start
    print(f"checkpoint: {out} ({model.cfg.model_type}, {model.cfg.num_layers} layers: {' '.join(model.cfg.layer_kinds)})")
    print(f"prompt ids: {ids[0].tolist()}")
    print(f"generated ids: {generated}")
    print(f"text: {tokenizer.decode(generated)!r}")
    print(f"eager PyTorch: {len(generated)} tokens in {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
