"""Train the demo Kimi-K3.1 on Python's own documentation and write it as a published-layout checkpoint.

    .venv/bin/python demo/train.py --out demo/kimi-k3.1-pydoc

The model is the repository's PyTorch definition (kimi_iree.frontend.model.KimiModel) at a few MB:
KDA and DSA (MLA + lightning indexer, index_topk below the context) layers, latent MoE with routed
experts, K3's attention residuals, over a byte-level vocabulary. The text is `pydoc_data.topics`
(the help() topics shipped with CPython): a deterministic split of topics is held out and written
to demo/heldout.txt. Everything is deterministic from --seed on a given Python and torch version
(the topics text changes between Python releases).

What the training adds to the plain forward, all inside this script (frontend/ is not changed):
  - the routed experts train as float weights (`set_expert_format(model, "float")`); the last
    `qat_steps` steps see them through MXFP4 with a straight-through estimator, and they are
    written as MXFP4 (frontend/mxfp4.py `quantize`, the tensor names frontend/synthetic.py writes);
  - the lightning indexer gets no gradient from the language-model loss (its top-k is a mask), so
    it is trained as DeepSeek-V3.2 trains it: KL divergence from the dense attention distribution
    (averaged over heads) to the softmax of its scores, its inputs detached from the trunk;
  - the router's e_score_correction_bias is DeepSeek-V3's auxiliary-loss-free balancing: after
    each step it moves by `balance_rate` towards the less loaded experts;
  - two kernels are swapped for faster, equivalent ones (`training_kernels`): KDA's chunked form
    with 16-token chunks instead of 32 (the same recurrence: chunking is an exact rewrite), and the
    DSA top-k as a stable sort instead of the export-friendly radix select (the same selection,
    ties to the earliest slot; checked against it when the script starts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from kimi_iree.frontend import dsa, kda, mxfp4, synthetic
from kimi_iree.frontend.config import ModelConfig, parse_config
from kimi_iree.frontend.indexer import LightningIndexer
from kimi_iree.frontend.layers import Linear
from kimi_iree.frontend.model import KimiModel
from kimi_iree.frontend.moe import FloatExperts, Router, set_expert_format
from kimi_iree.frontend.names import map_name, normalise
from kimi_iree.frontend.selection import topk_members

DEMO_DIR = Path(__file__).resolve().parent
SPECIAL_TOKENS = synthetic.SPECIAL_TOKENS            # <|bos|>, <|eos|>, <|pad|>: the last three ids
VOCAB = 256 + len(SPECIAL_TOKENS)                    # byte-level: one token per byte, then the specials
BOS_ID, EOS_ID = VOCAB - 3, VOCAB - 2
# Role-tagged turns over the byte vocabulary; the eos token ends every turn, so it is also what stops
# an assistant's reply. Rendered in the runtime's Jinja sandbox (trim_blocks, lstrip_blocks).
CHAT_TEMPLATE = synthetic.CHAT_TEMPLATE


@dataclass(frozen=True)
class Settings:
    """Everything that decides the trained weights (written next to the checkpoint as training.json)."""

    seed: int = 0
    num_layers: int = 6                  # 1-based attention layers 4 and 6 (DSA), the rest KDA
    seq_len: int = 256                   # training windows (8 x 256 steps ran 22% faster than 4 x 512 here)
    batch: int = 8
    steps: int = 190                     # about 170 s on 2 cores
    qat_steps: int = 30                  # the last steps see the experts through MXFP4 (straight-through)
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    indexer_loss_weight: float = 1.0
    balance_rate: float = 5e-3
    chat_fraction: float = 0.5           # topics also seen as a one-turn chat (title -> first paragraph)
    heldout_min_bytes: int = 8_000       # held-out topics: the first ones in crc32 order that fit,
    heldout_max_bytes: int = 20_000      # until at least min bytes, never above max
    heldout_max_topic_bytes: int = 8_000
    eval_tokens: int = 512               # the eager held-out check after writing
    max_length: int = 4096               # model_max_length: kimi-compile's default context, measured in demo/README.md


def model_size() -> synthetic.SyntheticSize:
    """The demo's widths, in the synthetic writer's terms (so config.json is the one it writes)."""
    return synthetic.SyntheticSize(
        hidden=128, kda_heads=2, kda_head_dim=64, mla_heads=4, q_lora=64, kv_lora=64, nope=32, rope=16,
        v_dim=32, index_heads=4, index_head_dim=32, index_topk=64, experts=8, experts_per_token=2,
        shared_experts=1, moe_intermediate=64, latent=64, intermediate=256, vocab=VOCAB, attn_res_block=2)


def checkpoint_config(settings: Settings) -> dict:
    """config.json: the K3.1 wrapper with frontend/synthetic.py's text_config. Only the language model is
    trained, so there is no vision_config (and no vision or MTP tensor)."""
    text = synthetic.text_config(model_size(), settings.num_layers, "k3.1")
    text["model_max_length"] = settings.max_length
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "tie_word_embeddings": False}


# ----------------------------------------------------------------------------------------------- data
def split_topics(topics: dict[str, str], settings: Settings) -> tuple[list[str], list[str]]:
    """(train, held-out) topic names: held out are the first topics in crc32-of-name order that fit."""
    heldout, total = [], 0
    for name in sorted(topics, key=lambda n: (zlib.crc32(n.encode()), n)):
        size = len(topics[name].encode())
        if total >= settings.heldout_min_bytes:
            break
        if size <= settings.heldout_max_topic_bytes and total + size <= settings.heldout_max_bytes:
            heldout.append(name)
            total += size
    train = sorted(set(topics) - set(heldout))
    return train, sorted(heldout)


def chat_sample(text: str) -> list[dict] | None:
    """A one-turn chat made from a topic: its title asked, its first paragraph answered."""
    lines = text.strip().split("\n")
    if len(lines) < 3 or set(lines[1]) != {"*"}:
        return None
    paragraphs = text.strip().split("\n\n")
    paragraph = paragraphs[1].strip() if len(paragraphs) > 1 else ""
    if not paragraph:
        return None
    return [{"role": "user", "content": lines[0].strip()}, {"role": "assistant", "content": paragraph}]


def training_tokens(topics: dict[str, str], names: list[str], tokenizer, settings: Settings) -> torch.Tensor:
    """One token stream: each topic's bytes followed by eos, and for a deterministic share of topics a
    chat rendering of it (the template above, eos after every turn)."""
    from kimi_iree.runtime.chat_template import ChatTemplate
    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]},
                            "demo/train.py")
    ids: list[int] = []
    for name in names:
        ids += list(topics[name].encode()) + [EOS_ID]
        messages = chat_sample(topics[name])
        if messages and zlib.crc32(b"chat:" + name.encode()) % 1000 < settings.chat_fraction * 1000:
            text = template.render(messages, add_generation_prompt=False)
            ids += tokenizer.encode(text, add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.int64)


def batches(stream: torch.Tensor, settings: Settings) -> Iterator[torch.Tensor]:
    """Random windows of seq_len + 1 tokens (inputs and shifted targets), from a seeded generator."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    while True:
        starts = torch.randint(0, len(stream) - settings.seq_len - 1, (settings.batch,), generator=gen)
        yield torch.stack([stream[s: s + settings.seq_len + 1] for s in starts.tolist()])


# -------------------------------------------------------------------------------- training kernels
def stable_topk_members(x: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """selection.topk_members by a stable descending sort: the top k along the last dim, ties to the
    earliest index, only valid entries (all of them when fewer than k)."""
    if valid is not None:
        x = x.masked_fill(~valid, float("-inf"))
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, order, True)
    return keep if valid is None else torch.logical_and(keep, valid.expand(x.shape))


def check_stable_topk() -> None:
    """The swap is only worth making if it selects what the model's own selection does (ties included)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (3, 40, 64), generator=gen).float()         # many ties, negative values too
    valid = torch.rand(1, 40, 64, generator=gen) < 0.7
    for k in (1, 5, 16, 64):
        assert torch.equal(stable_topk_members(x, k, valid), topk_members(x, k, valid)), k


class IndexerLoss:
    """Collects, for every DSA layer call, KL(dense attention over heads || softmax of the indexer scores)."""

    def __init__(self):
        self.terms: list[torch.Tensor] = []

    def __call__(self, q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions, softmax_scale,
                 index_scale) -> None:
        visible = dsa.visible_slots(positions, latent.shape[1])                   # [B, T, S]
        with torch.no_grad():
            scores = (torch.einsum("bthr,bsr->bhts", q_latent, latent)
                      + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)) * softmax_scale
            target = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), -1).mean(1)
        index = dsa.index_scores(index_q, index_w, index_keys, index_scale)
        log_p = torch.log_softmax(index.masked_fill(~visible, float("-inf")), -1)
        kl = (target * (torch.log(target.clamp_min(1e-20)) - log_p)).masked_fill(~visible, 0.0).sum(-1)
        self.terms.append(kl.mean())

    def pop(self) -> torch.Tensor:
        loss = torch.stack(self.terms).mean() if self.terms else torch.zeros(())
        self.terms = []
        return loss


@contextlib.contextmanager
def training_kernels(indexer_loss: IndexerLoss | None):
    """Within: KDA in 16-token chunks, the DSA top-k by a stable sort, the indexer's inputs detached and
    every DSA call reported to `indexer_loss`. The module attributes are restored on exit."""
    check_stable_topk()
    saved = (kda.kda_chunked, dsa.topk_members, dsa.sparse_mla_attention, LightningIndexer.key,
             LightningIndexer.queries)
    chunked, sparse, key, queries = saved[0], saved[2], saved[3], saved[4]

    def sparse_with_loss(q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions, softmax_scale,
                         index_scale, topk):
        if indexer_loss is not None:
            indexer_loss(q_latent.detach(), q_pe.detach(), latent.detach(), k_pe.detach(), index_q, index_w,
                         index_keys, positions, softmax_scale, index_scale)
        return sparse(q_latent, q_pe, latent, k_pe, index_q, index_w, index_keys, positions, softmax_scale,
                      index_scale, topk)

    kda.kda_chunked = functools.partial(chunked, chunk_size=16)
    dsa.topk_members = stable_topk_members
    dsa.sparse_mla_attention = sparse_with_loss
    # DeepSeek-V3.2: the indexer learns only from its own loss (its selection is not differentiable)
    LightningIndexer.key = lambda self, x, cos, sin: key(self, x.detach(), cos, sin)
    LightningIndexer.queries = lambda self, x, cq, cos, sin: queries(self, x.detach(), cq.detach(), cos, sin)
    try:
        yield
    finally:
        (kda.kda_chunked, dsa.topk_members, dsa.sparse_mla_attention, LightningIndexer.key,
         LightningIndexer.queries) = saved


class MXFP4StraightThrough(nn.Module):
    """Parametrisation: the forward sees the MXFP4 round trip of the weight, the gradient passes as is."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rounded = mxfp4.dequantize(*mxfp4.quantize(weight))
        return weight + (rounded - weight).detach()


# ---------------------------------------------------------------------------------------- the model
def build_model(cfg: ModelConfig, seed: int) -> KimiModel:
    """KimiModel with float routed experts, initialised (the constructor leaves many tensors zero)."""
    torch.manual_seed(seed)
    model = set_expert_format(KimiModel(cfg), "float")
    depth_scale = (2 * cfg.num_layers) ** -0.5          # GPT-2: residual-branch outputs shrink with depth
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                std = module.in_features ** -0.5 * (depth_scale if _writes_residual(name) else 1.0)
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            elif isinstance(module, FloatExperts):
                E, out, inp = module.shape
                std = inp ** -0.5 * (depth_scale if name.endswith("w2") else 1.0)
                module.weight.copy_(torch.randn(module.shape, generator=gen) * std)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=gen))
        for block in model.layers:
            mixer = block.mixer
            if block.kind == "kda":
                _init_kda(mixer, cfg, gen)
    return model


def _writes_residual(name: str) -> bool:
    return name.endswith(("o_proj", "down_proj", "latent_up"))


def _init_kda(mixer: nn.Module, cfg: ModelConfig, gen: torch.Generator) -> None:
    """Conv taps as torch's Conv1d default; K3's safe gate starting with per-channel decays exp(g) whose
    half-lives span about 1 to 70 tokens."""
    for conv in (mixer.q_conv, mixer.k_conv, mixer.v_conv):
        conv.copy_(torch.rand(conv.shape, generator=gen) - 0.5)
    H = cfg.kda_num_heads
    mixer.A_log.copy_(torch.empty(H).uniform_(1.0, 16.0, generator=gen).log())
    # g = lb * sigmoid(rate * (f + dt_bias)): pick sigmoid(rate * dt_bias) log-uniform in [0.002, 0.1]
    s = torch.exp(torch.empty(mixer.dt_bias.shape).uniform_(math.log(2e-3), math.log(0.1), generator=gen))
    rate = mixer.A_log.exp().repeat_interleave(cfg.kda_head_dim)
    mixer.dt_bias.copy_(torch.log(s / (1 - s)) / rate)


class LoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: counts each router's expert loads in the forward, then
    moves its e_score_correction_bias by `rate` towards the less loaded experts."""

    def __init__(self, model: KimiModel, rate: float):
        self.rate, self.loads = rate, {}
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: Router, inputs, combine: torch.Tensor) -> None:
        self.loads[router] = (combine > 0).sum(0).float()

    @torch.no_grad()
    def step(self) -> float:
        """Applies the update; returns the worst max-load / mean-load ratio over the routers."""
        worst = 0.0
        for router, load in self.loads.items():
            router.bias.add_(self.rate * torch.sign(load.mean() - load))
            worst = max(worst, float(load.max() / load.mean()))
        return worst


# ------------------------------------------------------------------------------------------ training
def learning_rate(step: int, settings: Settings) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 1 + math.cos(math.pi * progress)
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * cosine)


def optimizer_for(model: KimiModel, settings: Settings) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, gates' biases, A_log, the router bias)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))


def lm_loss(model: KimiModel, window: torch.Tensor) -> torch.Tensor:
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


def train(model: KimiModel, stream: torch.Tensor, settings: Settings, log) -> list[dict]:
    """Runs settings.steps optimiser steps; returns the logged curve."""
    model.train()
    for router in (m for m in model.modules() if isinstance(m, Router)):
        router.bias.requires_grad_(False)               # moved by the balancer, not by gradients
    optimizer = optimizer_for(model, settings)
    balancer = LoadBalancer(model, settings.balance_rate)
    indexer_loss = IndexerLoss()
    curve, data, start = [], batches(stream, settings), time.perf_counter()
    with training_kernels(indexer_loss):
        for step in range(settings.steps):
            if step == settings.steps - settings.qat_steps:
                set_expert_quantisation(model, True)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            loss = lm_loss(model, next(data))
            aux = indexer_loss.pop()
            optimizer.zero_grad(set_to_none=True)
            (loss + settings.indexer_loss_weight * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            imbalance = balancer.step()
            if step % 20 == 0 or step == settings.steps - 1:
                row = {"step": step, "loss": round(loss.item(), 4), "indexer_kl": round(aux.item(), 4),
                       "max_load_ratio": round(imbalance, 2), "seconds": round(time.perf_counter() - start, 1)}
                curve.append(row)
                log(json.dumps(row))
    set_expert_quantisation(model, False)
    return curve


def set_expert_quantisation(model: KimiModel, on: bool) -> None:
    """Straight-through MXFP4 on every routed-expert weight (on), or back to the plain float weights."""
    for module in model.modules():
        if isinstance(module, FloatExperts):
            if on and not parametrize.is_parametrized(module, "weight"):
                parametrize.register_parametrization(module, "weight", MXFP4StraightThrough())
            elif not on and parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


@torch.no_grad()
def heldout_nll(model: KimiModel, ids: list[int], context: int) -> float:
    """Mean next-token NLL of the first `context` held-out tokens in one causal window (what
    `kimi-run --perplexity FILE --ctx context` measures), with the model's own kernels."""
    model.eval()
    window = torch.tensor([ids[:context]])
    logits = model(window)[0, :-1]
    return float(F.cross_entropy(logits, window[0, 1:]))


# ---------------------------------------------------------------------------------------- checkpoint
def canonical_names(cfg: ModelConfig, settings: Settings) -> dict[str, tuple[str, int | None, torch.Tensor]]:
    """checkpoint name -> (canonical name, expert index, the synthetic writer's tensor of that name): the
    published layout as frontend/synthetic.py writes it, mapped by the loader's own name tables."""
    layout = synthetic.synthetic_tensors(model_size(), settings.num_layers, "k3.1", settings.seed)
    out = {}
    for name, tensor in layout.items():
        normalised, _ = normalise(name, cfg)
        if normalised is None:                        # vision, projector, MTP: not trained, not written
            continue
        (dest,) = map_name(normalised, cfg)
        out[name] = (dest.name, dest.expert, tensor)
    return out


def checkpoint_tensors(model: KimiModel, cfg: ModelConfig, settings: Settings) -> dict[str, torch.Tensor]:
    """The trained weights under the published names, dtypes and shapes; routed experts as MXFP4."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {}
    for name, (canonical, expert, like) in canonical_names(cfg, settings).items():
        if canonical.endswith((".packed", ".scales")):
            weight = state[canonical.rsplit(".", 1)[0] + ".weight"][expert]
            packed, scales = mxfp4.quantize(weight)
            tensor = packed if canonical.endswith(".packed") else scales
        else:
            tensor = state[canonical]
            if canonical.endswith("A_log") and tensor.numel() < like.numel():
                tensor = F.pad(tensor, (0, like.numel() - tensor.numel()))   # K3: [head_dim], zero past the heads
            tensor = tensor.reshape(like.shape).to(like.dtype)
        if tensor.shape != like.shape or tensor.dtype != like.dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the layout has {tuple(like.shape)} {like.dtype}")
        tensors[name] = tensor.contiguous()
    return tensors


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict, extra: dict[str, object]) -> None:
    """The checkpoint in two shards with config.json, tokenizer files and `extra` JSON files, atomically."""
    files = {"config.json": config,
             "tokenizer.json": synthetic.byte_level_tokenizer(VOCAB),
             "tokenizer_config.json": {"add_bos_token": False, "bos_token": SPECIAL_TOKENS[0],
                                       "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
                                       "model_max_length": config["text_config"]["model_max_length"],
                                       "chat_template": CHAT_TEMPLATE},
             **extra}
    text = {file: json.dumps(content, indent=1 if file != "tokenizer.json" else None) + "\n"
            for file, content in files.items()}
    synthetic.write_checkpoint(out, tensors, text, num_shards=2)


def check_written(out: Path, model: KimiModel, ids: list[int], context: int) -> dict[str, float]:
    """Load the written checkpoint with the repository's loader and compare its held-out NLL with the
    trained model's (float experts) and with the trained model on MXFP4-rounded experts."""
    from kimi_iree.frontend import load_model
    loaded_nll = heldout_nll(load_model(out), ids, context)
    float_nll = heldout_nll(model, ids, context)
    set_expert_quantisation(model, True)
    rounded_nll = heldout_nll(model, ids, context)
    set_expert_quantisation(model, False)
    return {"float_experts": float_nll, "mxfp4_experts_in_training_model": rounded_nll, "loaded_checkpoint": loaded_nll}


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEMO_DIR / "kimi-k3.1-pydoc", help="checkpoint directory to write")
    ap.add_argument("--heldout", type=Path, default=DEMO_DIR / "heldout.txt", help="where the held-out text goes")
    ap.add_argument("--seed", type=int, default=Settings.seed)
    ap.add_argument("--steps", type=int, default=Settings.steps, help="optimiser steps (default: the shipped run)")
    args = ap.parse_args(argv)
    script_start = time.perf_counter()
    settings = Settings(seed=args.seed, steps=args.steps, qat_steps=min(Settings.qat_steps, args.steps // 4))
    torch.set_num_threads(2)
    log = functools.partial(print, flush=True)

    import pydoc_data.topics
    from tokenizers import Tokenizer
    topics = pydoc_data.topics.topics
    train_names, heldout_names = split_topics(topics, settings)
    heldout_text = "\n\n".join(topics[n].strip() for n in heldout_names) + "\n"
    args.heldout.write_text(heldout_text)
    tokenizer = Tokenizer.from_str(json.dumps(synthetic.byte_level_tokenizer(VOCAB)))
    stream = training_tokens(topics, train_names, tokenizer, settings)
    heldout_ids = list(heldout_text.encode())
    log(f"train: {len(train_names)} topics, {len(stream)} tokens; held out: {heldout_names} "
        f"({len(heldout_ids)} bytes) -> {args.heldout}")

    config = checkpoint_config(settings)
    cfg = parse_config(config)
    model = build_model(cfg, settings.seed)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, layers {cfg.layer_kinds}")
    start = time.perf_counter()
    curve = train(model, stream, settings, log)
    seconds = time.perf_counter() - start

    tensors = checkpoint_tensors(model, cfg, settings)
    record = {"settings": asdict(settings), "python": sys.version.split()[0], "torch": torch.__version__,
              "train_seconds": round(seconds, 1), "train_topics": len(train_names), "train_tokens": len(stream),
              "heldout_topics": heldout_names, "heldout_bytes": len(heldout_ids), "curve": curve}
    write_checkpoint(args.out, tensors, config, {"training.json": record})
    nll = check_written(args.out, model, heldout_ids, settings.eval_tokens)
    record["heldout_nll_eager"] = {k: round(v, 4) for k, v in nll.items()}
    record["heldout_perplexity_eager"] = {k: round(math.exp(v), 3) for k, v in nll.items()}
    record["script_seconds"] = round(time.perf_counter() - script_start, 1)
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"trained in {seconds:.0f} s; held-out perplexity (first {settings.eval_tokens} tokens, eager): "
        f"{record['heldout_perplexity_eager']}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
