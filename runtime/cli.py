"""kimi-run: generate text, measure perplexity or benchmark a compiled module (iree.runtime + numpy only).

    kimi-run OUT/model.vmfb --prompt "Hello" -n 32 [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1]
    kimi-run OUT/model.vmfb --prompt-ids 1,2,3 -n 8 --json
    kimi-run OUT/model.vmfb --perplexity FILE [--ctx N] [--save-logits OUT.npy] [--kl-divergence BASE.npy] --json
    kimi-run OUT/model.vmfb --bench [--prompt-tokens 64] [--gen-tokens 32] [--depth 0] [--no-warmup] --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from .errors import RuntimeUsageError
from .logits import kl_divergence, load_base, log_softmax, save_logits
from .sampling import sample
from .session import Session
from .tokenizer import Tokenizer


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kimi-run", description=__doc__.split("\n")[0])
    ap.add_argument("module", help="OUT/model.vmfb (or the OUT directory)")
    ap.add_argument("--device", help="driver or device URI overriding the manifest's (e.g. local-sync, vulkan://0)")
    ap.add_argument("--prompt", help="prompt text (tokenised with the checkpoint's tokenizer)")
    ap.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perplexity", metavar="FILE", help="score FILE's tokens in one causal window")
    ap.add_argument("--ctx", type=int, help="with --perplexity: score the first N tokens (default: all that fit)")
    ap.add_argument("--save-logits", metavar="OUT.npy",
                    help="with --perplexity: write the float32 [positions, vocab] logits of every scored position")
    ap.add_argument("--kl-divergence", metavar="BASE.npy",
                    help="with --perplexity: KL divergence and top-1 agreement against logits saved by --save-logits")
    ap.add_argument("--bench", action="store_true", help="llama-bench style prefill/decode throughput (a batched "
                    "module also reports its aggregate with every sequence slot busy)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=0, help="with --bench: tokens already in the state")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="with --bench: time the first calls too (by default a prompt and one token run first, "
                         "as llama-bench does)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _tokenizer(session: Session) -> Tokenizer:
    return Tokenizer(session.directory, session.manifest.tokenizer.files)


def generate(session: Session, args) -> dict:
    if args.prompt_ids:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise RuntimeUsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
        tokenizer = None
        try:
            tokenizer = _tokenizer(session)
        except RuntimeUsageError:
            pass
    elif args.prompt is not None:
        tokenizer = _tokenizer(session)
        ids = tokenizer.encode(args.prompt)
    else:
        raise RuntimeUsageError("give --prompt, --prompt-ids, --perplexity or --bench")
    if session.position + len(ids) + args.max_new_tokens > session.max_context:
        raise RuntimeUsageError(f"prompt ({len(ids)}) + -n ({args.max_new_tokens}) tokens exceed the module's max "
                                f"context {session.max_context}")
    rng = np.random.default_rng(args.seed)
    stream = not args.json
    start = time.perf_counter()
    logits = session.prefill(ids)
    prefill_seconds = time.perf_counter() - start
    tokens: list[int] = []
    shown = ""
    start = time.perf_counter()
    for step in range(args.max_new_tokens):
        token = sample(logits, rng, args.temperature, args.top_k, args.top_p)
        tokens.append(token)
        if stream:
            if tokenizer:
                # decode the whole continuation and print what is new, holding back an unfinished
                # UTF-8 sequence (a byte-level token can end mid-character)
                text = tokenizer.decode(tokens).rstrip("\ufffd")
                sys.stdout.write(text[len(shown):])
                shown = max(shown, text, key=len)
            else:
                sys.stdout.write(f"{token} ")
            sys.stdout.flush()
        if token in session.eos_ids or step == args.max_new_tokens - 1:
            break
        logits = session.decode(token)
    decode_seconds = time.perf_counter() - start
    if stream:
        if tokenizer:
            sys.stdout.write(tokenizer.decode(tokens)[len(shown):])
        sys.stdout.write("\n")
    decoded = max(len(tokens) - 1, 0)        # the first new token comes from the prefill's logits
    return {"tokens": tokens, "text": tokenizer.decode(tokens) if tokenizer else None,
            "prompt_tokens": len(ids),
            "prefill_tokens_per_s": len(ids) / prefill_seconds if prefill_seconds else None,
            "decode_tokens_per_s": decoded / decode_seconds if decoded and decode_seconds else None}


def perplexity(session: Session, args) -> dict:
    path = Path(args.perplexity)
    try:
        text = path.read_text()
    except OSError as e:
        raise RuntimeUsageError(f"{path}: cannot read ({e.strerror})") from None
    ids = _tokenizer(session).encode(text)
    if args.ctx is not None:
        if args.ctx > session.max_context:
            raise RuntimeUsageError(f"--ctx {args.ctx} exceeds the module's max context {session.max_context}")
        ids = ids[: args.ctx]
    else:
        ids = ids[: session.max_context]
    if len(ids) < 2:
        raise RuntimeUsageError(f"{path}: fewer than 2 tokens to score")
    base = None if args.kl_divergence is None else load_base(args.kl_divergence, (len(ids) - 1, session.vocab_size))
    scored = session.prefill(ids, all_logits=True)[:-1]                # [n - 1, vocab]: row i scores token i + 1
    nll = -log_softmax(scored)[np.arange(len(ids) - 1), ids[1:]]
    mean = float(nll.mean())
    result = {"perplexity": math.exp(mean), "tokens": len(ids), "nll": mean}
    if args.save_logits:
        save_logits(args.save_logits, scored)
        result["saved_logits"] = args.save_logits
    if base is not None:
        result.update(kl_divergence(base, scored))
    return result


def bench(session: Session, args) -> dict:
    if args.depth + args.prompt_tokens + args.gen_tokens > session.max_context:
        raise RuntimeUsageError(f"--depth {args.depth} + --prompt-tokens {args.prompt_tokens} + --gen-tokens "
                                f"{args.gen_tokens} exceed the module's max context {session.max_context}")
    rng = np.random.default_rng(args.seed)
    vocab = session.vocab_size
    if args.warmup:
        # llama-bench's warm-up: a prompt and one generated token before the timed run. Without it the
        # timed prefill at depth 0 would also pay each weight's and each state buffer's first touch.
        session.prefill(np.random.default_rng(args.seed + 1).integers(0, vocab, args.prompt_tokens).tolist())
        session.decode(0)
        session.reset()
    if args.depth:
        session.prefill(rng.integers(0, vocab, args.depth).tolist())
    start = time.perf_counter()
    logits = session.prefill(rng.integers(0, vocab, args.prompt_tokens).tolist())
    prefill_seconds = time.perf_counter() - start
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(args.gen_tokens):
        token = int(np.argmax(session.decode(token)))
    decode_seconds = time.perf_counter() - start
    module = session.manifest.module
    result = {"prefill_tokens_per_s": args.prompt_tokens / prefill_seconds,
              "decode_tokens_per_s": args.gen_tokens / decode_seconds if args.gen_tokens else None,
              "depth": args.depth, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "target": module.target, "arch": module.arch, "device": session.device_uri,
              "activations": module.activations}
    if session.max_batch > 1:
        session.reset()
        result.update(bench_all_rows(session, args, rng))
    return result


def bench_all_rows(session: Session, args, rng: np.random.Generator) -> dict:
    """A batched module with every sequence slot busy: aggregate tokens/s of the same prefill and decode
    (every row at the same depth, one call per block or token for all of them)."""
    sequences = [session.new_sequence() for _ in range(session.max_batch)]
    P, vocab = session.prefill_block, session.vocab_size

    def prefill_all(n: int) -> list[np.ndarray]:
        ids = [rng.integers(0, vocab, n).tolist() for _ in sequences]
        for lo in range(0, n, P):
            last = session.prefill_rows([(s, t[lo: lo + P]) for s, t in zip(sequences, ids)], want_logits=lo + P >= n)
        return last

    if args.depth:
        prefill_all(args.depth)
    start = time.perf_counter()
    logits = prefill_all(args.prompt_tokens)
    prefill_seconds = time.perf_counter() - start
    tokens = [int(np.argmax(row)) for row in logits]
    start = time.perf_counter()
    for _ in range(args.gen_tokens):
        tokens = [int(np.argmax(row)) for row in session.decode_rows(list(zip(sequences, tokens)))]
    decode_seconds = time.perf_counter() - start
    B = len(sequences)
    return {"batch": B, "batch_prefill_tokens_per_s": B * args.prompt_tokens / prefill_seconds,
            "batch_decode_tokens_per_s": B * args.gen_tokens / decode_seconds if args.gen_tokens else None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if (args.save_logits or args.kl_divergence) and not args.perplexity:
            raise RuntimeUsageError("--save-logits and --kl-divergence go with --perplexity FILE")
        session = Session(args.module, device=args.device)
        if args.perplexity:
            result = perplexity(session, args)
        elif args.bench:
            result = bench(session, args)
        else:
            result = generate(session, args)
    except RuntimeUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    elif args.perplexity or args.bench:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
