"""ModelConfig: one dataclass for every family we load, parsed from a Hugging Face config.json.

Families (MODEL_SPEC "Families the loader accepts"):
  kimi_linear            KDA + MLA (NoPE, q_proj) + MoE
  deepseek_v3 / kimi_k2  MLA (RoPE, YaRN) + MoE
  deepseek_v32           MLA + lightning indexer (DSA) + MoE
  kimi_k25               multimodal wrapper, text_config = deepseek_v3
  kimi_k3                multimodal wrapper, text_config = kimi_linear with K3's extensions;
                         with `index_*` keys in text_config it is K3.1 (DSA on every attention layer)

The parser accepts both layer-kind encodings (1-based `linear_attn_config` lists and
`layer_types`), both MoE key spellings (DeepSeek's `n_routed_experts` ... and Kimi's
`num_experts` ...) and `quantization_config` at either level. A missing key, or two spellings
that disagree, is a ConfigError naming the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kimi_iree.runtime.errors import read_json

from .errors import ConfigError
from .names import TEXT_ALIASES, TEXT_FAMILIES, WRAPPERS, TextFamily

SUPPORTED_MODEL_TYPES = sorted({*WRAPPERS, *TEXT_FAMILIES, *TEXT_ALIASES})

KDA_LAYER_TYPES = {"kda_attention", "linear_attention"}
ATTENTION_LAYER_TYPES = {"full_attention", "deepseek_sparse_attention", "indexed_attention"}

_MISSING = object()


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE extension (DeepSeek-V3/V3.2, Kimi-K2), MODEL_SPEC 3.2."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    # --- where it came from
    model_type: str                      # the top-level model_type of the checkpoint
    text_model_type: str                 # the text backbone's model_type
    # --- trunk
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_kinds: tuple[str, ...]         # per layer: "kda" or "mla"
    ffn_kinds: tuple[str, ...]           # per layer: "dense" or "moe"
    intermediate_size: int               # dense FFN width
    hidden_act: str = "silu"             # "silu" or "situ" (K3)
    situ_beta: float = 4.0               # activation_situ_beta
    situ_linear_beta: float = 25.0       # activation_situ_linear_beta
    # --- KDA (Kimi Delta Attention)
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None   # K3 safe gate when set
    kda_full_rank_gate: bool = False            # K3: one g_proj instead of g_a/g_b
    # --- MLA
    num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_nope: bool = False           # Kimi: the rope dims exist but are never rotated
    mla_output_gate: bool = False        # K3: o * sigmoid(g_proj(x)) before o_proj
    rope_theta: float = 10000.0
    rope_interleave: bool = True         # DeepSeek MLA pairs adjacent dims
    yarn: YarnScaling | None = None
    max_position_embeddings: int = 4096
    # --- lightning indexer (DSA); index_topk None = no indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int | None = None
    index_use_rope: bool = True
    # --- MoE
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None   # K3 latent MoE
    latent_moe_use_norm: bool = False
    # --- K3 attention residuals
    attn_res_block_size: int | None = None
    # --- block-scaled weights in the checkpoint (frontend/formats.py), from its quantization_config
    expert_format: str | None = None     # routed experts: None (float), "mxfp4", "int4_g32", "fp8_e4m3_b128"
    weight_format: str | None = None     # other linear layers with scales beside them: "fp8_e4m3_b128"
    # --- tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    # ---------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def expert_input_size(self) -> int:
        """Width routed experts read: the latent width in K3's latent MoE, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def attention_softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale

    def mla_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mla"]

    def with_overrides(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (e.g. `index_topk` for the forced-selection experiment)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["yarn"] = None if self.yarn is None else dict(self.yarn.__dict__)
        out["layer_kinds"] = list(self.layer_kinds)
        out["ffn_kinds"] = list(self.ffn_kinds)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of to_dict (the manifest form)."""
        d = dict(d)
        d["yarn"] = None if d.get("yarn") is None else YarnScaling(**d["yarn"])
        d["layer_kinds"] = tuple(d["layer_kinds"])
        d["ffn_kinds"] = tuple(d["ffn_kinds"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# -------------------------------------------------------------------- parsing
class _Keys:
    """Looks keys up in a config dict, tracking the dotted path for error messages."""

    def __init__(self, d: dict[str, Any], where: str):
        self.d, self.where = d, where

    def get(self, *names: str, default: Any = _MISSING, kind: type | tuple = object) -> Any:
        """First of `names` present. Two spellings present with different values is an error."""
        found = [(n, self.d[n]) for n in names if n in self.d and self.d[n] is not None]
        if len({json.dumps(v, sort_keys=True) for _, v in found}) > 1:
            desc = ", ".join(f"{n}={v!r}" for n, v in found)
            raise ConfigError(f"{self.where}: contradicting keys {desc}")
        if not found:
            if default is _MISSING:
                raise ConfigError(f"{self.where}: missing key {' / '.join(names)!r}")
            return default
        name, value = found[0]
        if kind is not object and not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
            raise ConfigError(f"{self.where}: key {name!r} should be {getattr(kind, '__name__', kind)}, got {value!r}")
        return value


def load_config(path: str | Path) -> ModelConfig:
    """Parse `path` (a checkpoint directory or its config.json) into a ModelConfig."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    raw = read_json(file, ConfigError, "no config.json")
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a config.json dict (top level, with `text_config` for multimodal wrappers)."""
    if not isinstance(raw, dict):
        raise ConfigError("config is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

    if model_type in WRAPPERS:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"missing key 'text_config' (model_type {model_type} is multimodal)")
        text_type = text.get("model_type", WRAPPERS[model_type])
        where = "text_config"
    else:
        text, text_type, where = raw, model_type, "config"
    text_type = TEXT_ALIASES.get(text_type, text_type)
    if text_type not in TEXT_FAMILIES:
        raise ConfigError(f"{where}: unsupported text model_type {text_type!r}")
    family = TEXT_FAMILIES[text_type]
    k = _Keys(text, where)

    num_layers = k.get("num_hidden_layers", kind=int)
    hidden = k.get("hidden_size", kind=int)

    fields: dict[str, Any] = dict(
        model_type=model_type,
        text_model_type=text_type,
        vocab_size=k.get("vocab_size", kind=int),
        hidden_size=hidden,
        num_layers=num_layers,
        rms_norm_eps=float(k.get("rms_norm_eps", default=1e-6)),
        intermediate_size=k.get("intermediate_size", kind=int),
        max_position_embeddings=k.get("max_position_embeddings", "model_max_length", default=4096, kind=int),
        bos_token_id=k.get("bos_token_id", default=None),
    )
    eos = k.get("eos_token_id", default=None)
    fields["eos_token_ids"] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    # A wrapper's own tie flag decides (HF ties K2.5's lm_head from the top level); the loader
    # still uses lm_head.weight when the checkpoint has one.
    tie = raw.get("tie_word_embeddings") if model_type in WRAPPERS else None
    fields["tie_word_embeddings"] = bool(tie if tie is not None else k.get("tie_word_embeddings", default=False))

    fields["layer_kinds"] = _layer_kinds(k, num_layers, family)
    fields.update(_activation(k))
    fields.update(_mla(k, family))
    fields.update(_indexer(k, family, fields))
    if "kda" in fields["layer_kinds"]:
        fields.update(_kda(k))
    fields.update(_moe(k, num_layers, family))
    block = k.get("attn_res_block_size", default=None)
    fields["attn_res_block_size"] = block if block else None
    fields["expert_format"], fields["weight_format"] = _quantization(raw, text)
    cfg = ModelConfig(**fields)
    _validate(cfg, where)
    return cfg


def _layer_kinds(k: _Keys, num_layers: int, family: TextFamily) -> tuple[str, ...]:
    from_lists = from_types = None
    lac = k.d.get("linear_attn_config")
    if isinstance(lac, dict) and ("kda_layers" in lac or "full_attn_layers" in lac):
        kda = set(lac.get("kda_layers") or [])
        full = set(lac.get("full_attn_layers") or [])
        if kda & full:
            raise ConfigError(f"{k.where}: linear_attn_config lists layers {sorted(kda & full)} as both KDA and attention")
        bad = [i for i in kda | full if not (1 <= i <= num_layers)]
        if bad:
            raise ConfigError(f"{k.where}: linear_attn_config layer numbers {bad} outside 1..{num_layers} (1-based)")
        # Layer kind rule (MODEL_SPEC 1.2): 0-based i is KDA iff (i + 1) in kda_layers.
        from_lists = tuple("kda" if i + 1 in kda else "mla" for i in range(num_layers))
    types = k.d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(f"{k.where}: layer_types should list {num_layers} entries")
        kinds = []
        for i, t in enumerate(types):
            if t in KDA_LAYER_TYPES:
                kinds.append("kda")
            elif t in ATTENTION_LAYER_TYPES:
                kinds.append("mla")
            else:
                raise ConfigError(f"{k.where}: layer_types[{i}] = {t!r} is not a known layer type")
        from_types = tuple(kinds)
    if from_lists and from_types and from_lists != from_types:
        raise ConfigError(f"{k.where}: layer_types contradicts linear_attn_config.kda_layers/full_attn_layers")
    kinds = from_lists or from_types
    if kinds is None:
        if family.kda:
            raise ConfigError(f"{k.where}: missing key 'linear_attn_config.kda_layers' (or 'layer_types')")
        kinds = ("mla",) * num_layers
    elif not family.kda and "kda" in kinds:
        raise ConfigError(f"{k.where}: layer_types names KDA layers, which this family does not have")
    return kinds


def _activation(k: _Keys) -> dict[str, Any]:
    act = k.get("hidden_act", default="silu")
    if act not in ("silu", "situ"):
        raise ConfigError(f"{k.where}: hidden_act {act!r} is not supported (silu, situ)")
    out: dict[str, Any] = {"hidden_act": act}
    if act == "situ":
        out["situ_beta"] = float(k.get("activation_situ_beta"))
        out["situ_linear_beta"] = float(k.get("activation_situ_linear_beta"))
    return out


def _kda(k: _Keys) -> dict[str, Any]:
    lac = k.d.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"{k.where}: linear_attn_config should be an object")
    lk = _Keys({**{n: v for n, v in k.d.items() if n.startswith("linear_")}, **lac}, f"{k.where}.linear_attn_config")
    lb = lk.get("gate_lower_bound", "linear_lower_bound", default=None)
    return dict(
        kda_num_heads=lk.get("num_heads", "linear_num_heads", "linear_num_key_heads", kind=int),
        kda_head_dim=lk.get("head_dim", "linear_head_dim", "linear_key_head_dim", kind=int),
        kda_conv_size=lk.get("short_conv_kernel_size", "linear_conv_kernel_dim", default=4, kind=int),
        kda_gate_lower_bound=None if lb is None else float(lb),
        kda_full_rank_gate=bool(lk.get("use_full_rank_gate", default=False)),
    )


def _mla(k: _Keys, family: TextFamily) -> dict[str, Any]:
    rope = k.get("rope_scaling", "rope_parameters", default=None)
    rope = rope if isinstance(rope, dict) else {}
    theta = k.get("rope_theta", default=None)
    if theta is None:
        theta = rope.get("rope_theta", 10000.0)
    yarn = None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        rk = _Keys(rope, f"{k.where}.rope_scaling")
        yarn = YarnScaling(
            factor=float(rk.get("factor")),
            original_max_position_embeddings=int(rk.get("original_max_position_embeddings")),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 1.0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            truncate=bool(rope.get("truncate", True)),
        )
    elif rope_type not in ("default", None):
        raise ConfigError(f"{k.where}: rope type {rope_type!r} is not supported (default, yarn)")
    interleave = True if family.rope_always_interleaved else bool(k.get("rope_interleave", default=True))
    return dict(
        num_heads=k.get("num_attention_heads", kind=int),
        q_lora_rank=k.get("q_lora_rank", default=None),
        kv_lora_rank=k.get("kv_lora_rank", kind=int),
        qk_nope_head_dim=k.get("qk_nope_head_dim", kind=int),
        qk_rope_head_dim=k.get("qk_rope_head_dim", kind=int),
        v_head_dim=k.get("v_head_dim", kind=int),
        mla_use_nope=bool(k.get("mla_use_nope", default=family.mla_nope_default)),
        mla_output_gate=bool(k.get("mla_use_output_gate", default=False)),
        rope_theta=float(theta),
        rope_interleave=interleave,
        yarn=yarn,
    )


def _indexer(k: _Keys, family: TextFamily, fields: dict[str, Any]) -> dict[str, Any]:
    present = [n for n in ("index_n_heads", "index_head_dim", "index_topk") if n in k.d]
    if not present and not family.indexer_always:
        return {}
    if fields["q_lora_rank"] is None:
        raise ConfigError(f"{k.where}: index_* keys need q_lora_rank (the indexer query is built from the q latent)")
    return dict(
        index_n_heads=k.get("index_n_heads", kind=int),
        index_head_dim=k.get("index_head_dim", kind=int),
        index_topk=k.get("index_topk", kind=int),
        index_use_rope=bool(k.get("index_use_rope", default=True)),
    )


def _moe(k: _Keys, num_layers: int, family: TextFamily) -> dict[str, Any]:
    first_dense = k.get("first_k_dense_replace", default=family.first_k_dense_default, kind=int)
    freq = k.get("moe_layer_freq", default=1, kind=int)
    rule = tuple("moe" if (i >= first_dense and i % freq == 0) else "dense" for i in range(num_layers))
    mlp_types = k.d.get("mlp_layer_types")
    if mlp_types is not None:
        if not isinstance(mlp_types, list) or len(mlp_types) != num_layers:
            raise ConfigError(f"{k.where}: mlp_layer_types should list {num_layers} entries")
        kinds = tuple("moe" if t == "sparse" else "dense" for t in mlp_types)
        if "first_k_dense_replace" in k.d and kinds != rule:
            raise ConfigError(f"{k.where}: mlp_layer_types contradicts first_k_dense_replace={first_dense}")
    else:
        kinds = rule
    out: dict[str, Any] = {"ffn_kinds": kinds}
    if "moe" not in kinds:
        return out
    scoring = k.get("scoring_func", "moe_router_activation_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{k.where}: router scoring {scoring!r} is not supported (sigmoid)")
    method = k.get("topk_method", default="noaux_tc")
    if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ConfigError(f"{k.where}: topk_method {method!r} is not supported")
    out.update(
        num_experts=k.get("num_experts", "n_routed_experts", "num_local_experts", kind=int),
        experts_per_token=k.get("num_experts_per_token", "num_experts_per_tok", kind=int),
        num_shared_experts=k.get("num_shared_experts", "n_shared_experts", default=0, kind=int),
        moe_intermediate_size=k.get("moe_intermediate_size", kind=int),
        n_group=k.get("n_group", "num_expert_group", default=1, kind=int),
        topk_group=k.get("topk_group", default=1, kind=int),
        norm_topk_prob=bool(k.get("norm_topk_prob", "moe_renormalize", default=True)),
        routed_scaling_factor=float(k.get("routed_scaling_factor", default=1.0)),
        routed_expert_hidden_size=k.get("routed_expert_hidden_size", default=None),
        latent_moe_use_norm=bool(k.get("latent_moe_use_norm", default=False)),
    )
    return out


def _quantization(raw: dict[str, Any], text: dict[str, Any]) -> tuple[str | None, str | None]:
    """quantization_config -> (expert format, other linears' format). Which tensors are block-scaled is
    then read from the checkpoint itself (a `weight_scale_inv` or `weight_packed` beside a weight)."""
    qcs = [q for q in (raw.get("quantization_config"), text.get("quantization_config")) if q]
    if len(qcs) == 2 and qcs[0] != qcs[1]:
        raise ConfigError("quantization_config differs between the top level and text_config")
    if not qcs:
        return None, None
    q = qcs[0]
    method = q.get("quant_method")
    if method == "mxfp4":
        return "mxfp4", None                                   # gpt-oss
    if method == "fp8":
        return (_fp8(q),) * 2
    if method == "compressed-tensors":
        groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
        formats = {q.get("format")} | {g.get("format") for g in groups}
        formats.discard(None)
        if formats == {"mxfp4-pack-quantized"}:
            return "mxfp4", None
        if formats == {"pack-quantized"}:
            for g in groups:
                _int4_group(g.get("weights") or {})
            return "int4_g32", None
        raise ConfigError(f"quantization_config.format {sorted(formats)} is not supported "
                          "(mxfp4-pack-quantized, pack-quantized)")
    raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (mxfp4, fp8, compressed-tensors)")


def _fp8(q: dict[str, Any]) -> str:
    """DeepSeek-V3 / V3.2 / Kimi-K2 block FP8. Activations stay f32 here (the published `dynamic`
    activation scheme quantises them in their kernels; we do not: lossless)."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt {q.get('fmt')!r} is not supported (e4m3)")
    if list(q.get("weight_block_size") or []) != [128, 128]:
        raise ConfigError(f"quantization_config.weight_block_size {q.get('weight_block_size')!r} is not supported "
                          "([128, 128])")
    if q.get("scale_fmt") not in (None, "ue8m0", "float"):
        raise ConfigError(f"quantization_config.scale_fmt {q.get('scale_fmt')!r} is not supported (ue8m0)")
    return "fp8_e4m3_b128"


def _int4_group(w: dict[str, Any]) -> None:
    """compressed-tensors pack-quantized weights: symmetric int4, groups of 32 along K, no zero point."""
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for key, value in want.items():
        if w.get(key, value) != value:
            raise ConfigError(f"quantization_config weights.{key} {w.get(key)!r} is not supported ({value!r})")
    if w.get("dynamic"):
        raise ConfigError("quantization_config weights.dynamic is not supported")


def _validate(cfg: ModelConfig, where: str) -> None:
    if "mla" in cfg.layer_kinds:
        if cfg.num_heads <= 0 or cfg.kv_lora_rank <= 0:
            raise ConfigError(f"{where}: attention layers need num_attention_heads and kv_lora_rank > 0")
        if not cfg.mla_use_nope and cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"{where}: qk_rope_head_dim must be even for RoPE, got {cfg.qk_rope_head_dim}")
    if cfg.has_indexer:
        if cfg.q_lora_rank is None:
            raise ConfigError(f"{where}: the lightning indexer needs q_lora_rank")
        if cfg.index_use_rope and cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ConfigError(f"{where}: index_head_dim {cfg.index_head_dim} < qk_rope_head_dim {cfg.qk_rope_head_dim}")
        if cfg.index_topk < 1:
            raise ConfigError(f"{where}: index_topk must be >= 1, got {cfg.index_topk}")
    if "moe" in cfg.ffn_kinds:
        if cfg.num_experts % cfg.n_group:
            raise ConfigError(f"{where}: n_group {cfg.n_group} does not divide {cfg.num_experts} experts")
        if not 1 <= cfg.experts_per_token <= cfg.num_experts:
            raise ConfigError(f"{where}: num_experts_per_tok {cfg.experts_per_token} not in 1..{cfg.num_experts}")
        if cfg.expert_format == "mxfp4" and (cfg.expert_input_size % 32 or cfg.moe_intermediate_size % 32):
            raise ConfigError(f"{where}: MXFP4 experts need widths divisible by 32 "
                              f"(expert input {cfg.expert_input_size}, moe_intermediate_size {cfg.moe_intermediate_size})")
    if cfg.attn_res_block_size is not None and cfg.attn_res_block_size < 1:
        raise ConfigError(f"{where}: attn_res_block_size must be >= 1")
