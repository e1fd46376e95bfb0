"""The whole model: embeddings, decoder blocks (KDA or MLA/DSA mixer + dense or MoE FFN), final norm,
lm_head (MODEL_SPEC 0), with K3's attention residuals (MODEL_SPEC "K3 facts", 3.6) when configured.

The forward is functional about state: `prefill(tokens, state) -> (logits, state)` and
`decode(token, state) -> (logits, state)`, where state is a flat dict of plain tensors
(`init_state`), so the same code exports:
  position                          [] int32     tokens already in the state
  layers.{i}.conv_q|conv_k|conv_v   [B, W-1, H*d] KDA conv tails
  layers.{i}.recurrent              [B, H, d, d]  KDA state S, fp32
  layers.{i}.latent                 [B, S, r_kv]  MLA latent cache
  layers.{i}.k_pe                   [B, S, dr]    MLA shared rope key
  layers.{i}.index_keys             [B, S, d_I]   indexer keys (DSA layers)
`model(input_ids)` is the plain full causal forward (a fresh state sized to the prompt).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .kda import KDA
from .layers import (BlockScaledLinear, GatedFFN, Linear, RMSNorm, Step, rope_cos_sin, rope_inv_freq,
                     set_linear_format, widen_to_f32)
from .mla import MLA
from .moe import BlockScaledExperts, FloatExperts, MoE, set_expert_format
from . import units
from .units import FusedUnits

State = dict[str, torch.Tensor]


class AttnResMix(nn.Module):
    """K3 attention residual: a softmax over depth of [bank rows..., current stream].

    score_n = (V_n / rms(V_n)) . (norm ⊙ proj)  (no weight inside the RMS), p = softmax_n(score),
    output = sum_n p_n V_n over the raw rows.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.proj = nn.Parameter(torch.zeros(1, dim))
        self.norm = nn.Parameter(torch.ones(dim))

    def forward(self, bank: list[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        rows = torch.stack([*bank, current], dim=0)                   # [n, B, T, D]
        keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        query = widen_to_f32(self.norm) * widen_to_f32(self.proj)[0]
        p = torch.softmax((keys * query).sum(-1), dim=0)                      # [n, B, T]
        return (p.unsqueeze(-1) * rows).sum(0)


def make_step(cfg: ModelConfig, position: torch.Tensor, tokens: int, length: torch.Tensor | None = None,
              window: int | None = None) -> Step:
    """The Step of `tokens` new tokens written from cache slot `position` (0-d: every sequence of the batch
    there; [B]: one per sequence): their slots and RoPE angles (YaRN-scaled where configured); attention
    over the first `window` cache slots (None: all)."""
    positions = position.reshape(-1, 1) + torch.arange(tokens, device=position.device)   # [Bp, T] int64
    inv_freq, attention_factor = rope_inv_freq(cfg.qk_rope_head_dim or 2, cfg.rope_theta, cfg.yarn, position.device)
    return Step(positions, rope_cos_sin(positions, inv_freq, attention_factor),
                None if length is None else length.reshape(-1).to(torch.int32), window)


def use_fused_units(model: nn.Module, fused: FusedUnits) -> nn.Module:
    """Emit the fusion units `fused` names as custom ops (frontend/units.py) for the compiler's passes;
    eager results are the same either way (each op's eager implementation is its reference)."""
    for module in model.modules():
        if isinstance(module, (BlockScaledExperts, BlockScaledLinear)):
            module.fused = fused.weight_matmul
        elif isinstance(module, (Linear, FloatExperts)):
            module.fused = fused.dense_matmul
        elif isinstance(module, KimiModel):
            module.fused_dense = fused.dense_matmul           # the output head (lm_head or tied embeddings)
        elif isinstance(module, MLA):
            module.fused_sparse_attention = fused.sparse_attention
            module.fused_per_head = fused.dense_matmul
        elif isinstance(module, KDA):
            module.fused_decode = fused.kda_decode
    return model


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.kind = cfg.layer_kinds[layer]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "kda":
            self.mixer = KDA(cfg)
        else:
            self.mixer = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.ffn_kinds[layer] == "moe":
            self.ffn = MoE(cfg)
        else:
            self.ffn = GatedFFN(cfg, cfg.hidden_size, cfg.intermediate_size)
        if cfg.attn_res_block_size:
            self.attn_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, x: torch.Tensor, step: Step, state: State) -> tuple[torch.Tensor, State]:
        return self.mixer(self.attn_norm(x), step, state)


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """Routed experts in the checkpoint's format (`moe.set_expert_format` changes it), no fusion unit
        emitted (`use_fused_units` turns them on for export)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fused_dense = False                 # use_fused_units: a bf16 head through kimi::dense_batched_matmul
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.attn_res_block_size:
            self.output_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)

    # ------------------------------------------------------------------ state
    def init_state(self, batch: int, max_context: int) -> State:
        """A zero state for `batch` sequences and a cache of `max_context` tokens."""
        # IREE-WORKAROUND(spirv without Int64): int32, like the token ids a module takes: no 64-bit integer
        # crosses a module's boundary, so targets without them can demote the index arithmetic inside
        state: State = {"position": torch.zeros((), dtype=torch.int32)}
        for i, block in enumerate(self.layers):
            state.update({f"layers.{i}.{k}": v for k, v in block.mixer.init_state(batch, max_context).items()})
        return state

    def start_rows(self, state: State, fresh: torch.Tensor) -> State:
        """`state` with the rows where `fresh` [B] bool is set as a new sequence's: zero KDA conv tails and
        recurrent state. The caches need nothing: a query sees only the slots its own sequence wrote."""
        out = dict(state)
        for i, block in enumerate(self.layers):
            if isinstance(block.mixer, KDA):
                for k in KDA.STATE_NAMES:
                    name = f"layers.{i}.{k}"
                    keep = ~fresh.view(-1, *[1] * (state[name].dim() - 1))
                    out[name] = torch.where(keep, state[name], torch.zeros((), dtype=state[name].dtype))
        return out

    @staticmethod
    def layer_state(state: State, i: int) -> State:
        prefix = f"layers.{i}."
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

    # ---------------------------------------------------------------- forward
    def prefill(self, tokens: torch.Tensor, state: State, length: torch.Tensor | None = None,
                window: int | None = None) -> tuple[torch.Tensor, State]:
        """tokens [B, T] (int32 or int64) at positions state["position"] + 0..T-1 -> logits [B, T, vocab] (fp32).
        state["position"] is 0-d (the batch in step) or [B] (each sequence at its own place).

        length: int32, 0-d or [B], when only the first `length` tokens of a row are real (a fixed-size
        block padded at the end, as the exported prefill takes it); a row then advances by its length,
        and a row of length 0 changes nothing its later tokens read. The cache must have room for the
        whole block past the last real position.

        window: attention reads only the first `window` cache slots, which must hold every real token's
        position (the exported entries of one window each, `kimi-compile --context-windows`).
        """
        h, new_state = self.prefill_hidden(tokens, state, length, window)
        return self.head(h), new_state

    def prefill_last(self, tokens: torch.Tensor, state: State, length: torch.Tensor | None = None,
                     window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, State]:
        """As prefill, but logits [B, vocab] of the last real token only, plus the final hidden states
        [B, T, hidden] that `head` turns into every position's logits. Generation needs one row: the
        output head over a whole block was a third of a prefill step (bench/dispatch_profile.py)."""
        h, new_state = self.prefill_hidden(tokens, state, length, window)
        B, T, D = h.shape
        if length is None:
            return self.head(h[:, T - 1]), h, new_state
        # a row of length 0 (a batch slot with nothing to do) reads its first position: logits nobody uses
        last = (length.reshape(-1, 1, 1).to(torch.int64) - 1).clamp(min=0).expand(B, 1, D)
        return self.head(h.gather(1, last))[:, 0], h, new_state

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., hidden] (normed) -> logits [..., vocab] (fp32)."""
        head = self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        fused = self.fused_dense and head.dtype == torch.bfloat16
        return units.dense_matmul(h, head, fused=fused)

    def prefill_hidden(self, tokens: torch.Tensor, state: State, length: torch.Tensor | None = None,
                       window: int | None = None) -> tuple[torch.Tensor, State]:
        """The layers and the final norm of prefill: hidden states [B, T, hidden] (fp32) and the new state."""
        cfg = self.cfg
        T = tokens.shape[1]
        step = make_step(cfg, state["position"], T, length, window)
        new_state: State = {"position": state["position"] + (T if length is None else length.to(torch.int32))}
        # rows at position 0 begin a sequence: a batch slot reused for a new one holds the old one's state
        step_state = state if state["position"].dim() == 0 else self.start_rows(state, state["position"] == 0)

        def run_mixer(i: int, block: Block, x: torch.Tensor) -> torch.Tensor:
            out, sub = block.mix(x, step, self.layer_state(step_state, i))
            new_state.update({f"layers.{i}.{k}": v for k, v in sub.items()})
            return out

        h = widen_to_f32(self.embed(tokens))          # activations are f32 whatever the stored dtype
        if not cfg.attn_res_block_size:
            for i, block in enumerate(self.layers):
                h = h + run_mixer(i, block, h)
                h = h + block.ffn(block.ffn_norm(h))
            h = self.norm(h)
        else:
            # Attention residuals: the stream restarts at each block of attn_res_block_size layers;
            # the bank holds the embeddings and each finished block's sum, and every layer input is
            # a learned softmax mix over [bank..., current block sum].
            bank: list[torch.Tensor] = []
            prefix = h
            for i, block in enumerate(self.layers):
                x_in = block.attn_res(bank, prefix) if bank else prefix
                restart = i % cfg.attn_res_block_size == 0
                if restart:
                    bank.append(prefix)
                a = run_mixer(i, block, x_in)
                prefix = a if restart else prefix + a
                prefix = prefix + block.ffn(block.ffn_norm(block.ffn_res(bank, prefix)))
            h = self.norm(self.output_res(bank, prefix))
        return h, new_state

    def decode(self, token: torch.Tensor, state: State, length: torch.Tensor | None = None,
               window: int | None = None) -> tuple[torch.Tensor, State]:
        """token [B] (or [B, 1]) -> logits [B, vocab], one step of the recurrent/cached form; length [B]
        (0 or 1) leaves the rows at 0 as they were; window as in `prefill`."""
        logits, state = self.prefill(token.reshape(-1, 1), state, length, window)
        return logits[:, -1], state

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward of [B, T] tokens from an empty state -> logits [B, T, vocab]."""
        state = self.init_state(input_ids.shape[0], input_ids.shape[1])
        return self.prefill(input_ids, state)[0]


def model_holding(cfg: ModelConfig, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                  device: str | torch.device = "cpu") -> KimiModel:
    """A KimiModel whose parameters and buffers are empty tensors of exactly the given dtypes and shapes
    (a stored dtype, K3's longer A_log, bf16 carried as integers for SPIR-V), on `device` ("meta" to
    trace without weights). Weights held block-scaled (`.packed` + `.scales`) take their format from
    the names and dtypes (`weight_formats`). A name on one side only is an error naming it."""
    with torch.device("meta"):
        model = hold_formats(KimiModel(cfg), weight_formats(tensors))
    own = dict(model.state_dict())
    if set(own) != set(tensors):
        name = sorted(set(own) - set(tensors)) or sorted(set(tensors) - set(own))
        raise ValueError(f"the model and the given tensors disagree on {name[0]}")
    for name, (dtype, shape) in tensors.items():
        owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
        holder = model.get_submodule(owner) if owner else model
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if isinstance(getattr(holder, attr), nn.Parameter):
            setattr(holder, attr, nn.Parameter(tensor, requires_grad=False))
        else:
            setattr(holder, attr, tensor)
    return model.eval()


def weight_formats(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, str]:
    """module name -> block-scaled format, for every `NAME.packed` in `tensors` (name -> (dtype, shape)):
    i32 codes are INT4, u8 codes with f32 scales FP8, u8 codes with u8 scales MXFP4. bf16 scales may
    arrive as integer words on SPIR-V targets, which leaves the code dtype to decide."""
    out = {}
    for name, (dtype, _) in tensors.items():
        if name.endswith(".packed"):
            base = name[: -len(".packed")]
            scales = tensors.get(f"{base}.scales", (None,))[0]
            out[base] = ("int4_g32" if dtype == torch.int32 else
                         "fp8_e4m3_b128" if scales == torch.float32 else "mxfp4")
    return out


def hold_formats(model: KimiModel, formats: dict[str, str]) -> KimiModel:
    """Routed experts and linear layers of `model` held in the block-scaled formats `formats` names
    (module name -> format; the routed experts of one model share a format), the rest float."""
    expert = {f for n, f in formats.items() if ".experts." in n}
    if len(expert) > 1:
        raise ValueError(f"routed experts in several formats {sorted(expert)}")
    set_expert_format(model, expert.pop() if expert else "float")
    for name, module in list(model.named_modules()):
        if isinstance(module, (Linear, BlockScaledLinear)):
            set_linear_format(model, name, formats.get(name))
    return model
