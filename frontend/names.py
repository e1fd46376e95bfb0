"""Checkpoint tensor names -> our canonical names, one declarative table per family (llama.cpp's
converter style). Nothing else in the project parses Hugging Face tensor names.

A name is first normalised (`normalise`):
  - vision and projector tensors (`vision_tower.*`, `mm_projector.*`, ...) and MTP layers are dropped,
    each counted under its group;
  - `language_model.` is stripped, `language_model.layers.` / `model.blocks.` become `model.layers.`
    (transformers 5.23 writes K2.5's text layers as `blocks`), `block_sparse_moe.` becomes `mlp.`
    (Kimi's module name; transformers also writes Kimi-Linear's dense layer-0 MLP under it).
Then a global rule or, for `model.layers.{i}.*`, a rule of that layer's kind (KDA or MLA mixer,
dense or MoE FFN) maps it. A name no rule takes is an error naming it.

Canonical names are the state-dict names of `frontend.model.KimiModel` and the parameter names in
model.irpa. Routed experts are stacked over the expert axis: `layers.{i}.ffn.experts.w1.packed`
[E, out, in/2] is built from each expert's `w1.weight_packed`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig
from .errors import CheckpointError

DROPPED_PREFIXES = {
    "vision": ("vision_tower.", "model.vision_tower.", "vision_model.", "visual."),
    "mm_projector": ("mm_projector.", "model.mm_projector.", "multi_modal_projector.", "model.multi_modal_projector."),
}


@dataclass(frozen=True)
class Transform:
    """How a checkpoint tensor's bytes are laid into the canonical tensor without changing them: `shape`
    maps the stored shape and `tensor` the stored tensor, side by side so they cannot disagree (the
    converter plans with one and writes with the other; tests/test_names.py holds them together)."""

    name: str
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    tensor: Callable[[Any], Any]


# same elements, canonical shape (conv weights stored 2-D, A_log [1,1,H,1] or K3's [head_dim], which has
# more entries than heads): the converter takes the model's shape when the element counts agree
RESHAPE = Transform("reshape", lambda s: s, lambda t: t)
# gpt-oss' fused gate_up rows interleave gate (even) and up (odd)
EVEN_ROWS = Transform("even_rows", lambda s: (*s[:-2], (s[-2] + 1) // 2, s[-1]), lambda t: t[..., 0::2, :])
ODD_ROWS = Transform("odd_rows", lambda s: (*s[:-2], s[-2] // 2, s[-1]), lambda t: t[..., 1::2, :])
# gpt-oss MXFP4 blocks [..., N, K/32, 16] -> [..., N, K/2]: the same bytes
BLOCKS = Transform("blocks", lambda s: (*s[:-2], s[-2] * s[-1]),
                   lambda t: t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1]))


@dataclass(frozen=True)
class Rule:
    """pattern: regex on the normalised name (layer-relative for layer rules); target: canonical
    name (may use \\1...). expert: the group named `e` is the expert index (stacked).
    transforms: applied in order to the stored tensor (and its shape)."""

    pattern: str
    target: str
    expert: bool = False
    transforms: tuple[Transform, ...] = ()


@dataclass(frozen=True)
class Destination:
    """Where (part of) one checkpoint tensor goes."""

    name: str                  # canonical name
    expert: int | None         # expert index to stack at, or None
    transforms: tuple[Transform, ...]


GLOBAL_RULES = [
    Rule(r"model\.embed_tokens\.weight", "embed.weight"),
    Rule(r"model\.norm\.weight", "norm.weight"),
    Rule(r"lm_head\.weight", "lm_head.weight"),
]
K3_GLOBAL_RULES = [
    Rule(r"model\.output_attn_res_proj\.weight", "output_res.proj"),
    Rule(r"model\.output_attn_res_norm\.weight", "output_res.norm"),
]
NORM_RULES = [
    Rule(r"input_layernorm\.weight", "attn_norm.weight"),
    Rule(r"post_attention_layernorm\.weight", "ffn_norm.weight"),
]
KDA_RULES = [
    Rule(r"self_attn\.([qkv])_proj\.weight", r"mixer.\1_proj.weight"),
    Rule(r"self_attn\.([qkv])_conv1d\.weight", r"mixer.\1_conv", transforms=(RESHAPE,)),
    Rule(r"self_attn\.(f_a|f_b|b|g_a|g_b|o)_proj\.weight", r"mixer.\1_proj.weight"),
    Rule(r"self_attn\.A_log", "mixer.A_log", transforms=(RESHAPE,)),
    Rule(r"self_attn\.dt_bias", "mixer.dt_bias"),
    Rule(r"self_attn\.o_norm\.weight", "mixer.o_norm"),
]
K3_KDA_RULES = [Rule(r"self_attn\.g_proj\.weight", "mixer.g_proj.weight")]   # use_full_rank_gate
MLA_RULES = [
    Rule(r"self_attn\.(q|q_a|q_b|kv_b|o)_proj\.weight", r"mixer.\1_proj.weight"),
    Rule(r"self_attn\.kv_a_proj_with_mqa\.weight", "mixer.kv_a_proj.weight"),
    Rule(r"self_attn\.(q_a|kv_a)_layernorm\.weight", r"mixer.\1_norm.weight"),
]
K3_MLA_RULES = [Rule(r"self_attn\.g_proj\.weight", "mixer.g_proj.weight")]   # mla_use_output_gate
INDEXER_RULES = [
    Rule(r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight", r"mixer.indexer.\1.weight"),
    Rule(r"self_attn\.indexer\.k_norm\.(weight|bias)", r"mixer.indexer.k_norm.\1"),
]
DENSE_FFN_RULES = [Rule(r"mlp\.(gate|up|down)_proj\.weight", r"ffn.\1_proj.weight")]
MOE_RULES = [
    Rule(r"mlp\.gate\.weight", "ffn.router.weight"),
    Rule(r"mlp\.gate\.e_score_correction_bias", "ffn.router.bias"),
    Rule(r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", r"ffn.shared.\1_proj.weight"),
    # DeepSeek spelling and Kimi spelling of the same three projections (w1 = gate, w3 = up, w2 = down)
    Rule(r"mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight", "ffn.experts.w1.weight", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.up_proj\.weight", "ffn.experts.w3.weight", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight", "ffn.experts.w2.weight", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.(w[123])\.weight", r"ffn.experts.\2.weight", expert=True),
]
MXFP4_MOE_RULES = [
    # compressed-tensors mxfp4-pack-quantized (K3): per expert and projection
    Rule(r"mlp\.experts\.(?P<e>\d+)\.(w[123])\.weight_packed", r"ffn.experts.\2.packed", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.(w[123])\.weight_scale", r"ffn.experts.\2.scales", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight_packed", "ffn.experts.w1.packed", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.up_proj\.weight_packed", "ffn.experts.w3.packed", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight_packed", "ffn.experts.w2.packed", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight_scale", "ffn.experts.w1.scales", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.up_proj\.weight_scale", "ffn.experts.w3.scales", expert=True),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight_scale", "ffn.experts.w2.scales", expert=True),
    # gpt-oss fused layout: all experts in one tensor, gate/up rows interleaved (even = gate)
    Rule(r"mlp\.experts\.gate_up_proj_blocks", "ffn.experts.w1.packed", transforms=(BLOCKS, EVEN_ROWS)),
    Rule(r"mlp\.experts\.gate_up_proj_blocks", "ffn.experts.w3.packed", transforms=(BLOCKS, ODD_ROWS)),
    Rule(r"mlp\.experts\.gate_up_proj_scales", "ffn.experts.w1.scales", transforms=(EVEN_ROWS,)),
    Rule(r"mlp\.experts\.gate_up_proj_scales", "ffn.experts.w3.scales", transforms=(ODD_ROWS,)),
    Rule(r"mlp\.experts\.down_proj_blocks", "ffn.experts.w2.packed", transforms=(BLOCKS,)),
    Rule(r"mlp\.experts\.down_proj_scales", "ffn.experts.w2.scales"),
]
K3_MOE_RULES = [
    Rule(r"mlp\.routed_expert_down_proj\.weight", "ffn.latent_down.weight"),
    Rule(r"mlp\.routed_expert_norm\.weight", "ffn.latent_norm.weight"),
    Rule(r"mlp\.routed_expert_up_proj\.weight", "ffn.latent_up.weight"),
]
K3_RESIDUAL_RULES = [
    Rule(r"self_attention_res_proj\.weight", "attn_res.proj"),
    Rule(r"self_attention_res_norm\.weight", "attn_res.norm"),
    Rule(r"mlp_res_proj\.weight", "ffn_res.proj"),
    Rule(r"mlp_res_norm\.weight", "ffn_res.norm"),
]


@dataclass(frozen=True)
class FamilyNames:
    """The rules one family's checkpoints use, by layer kind."""

    global_rules: list[Rule]
    layer_rules: list[Rule]        # every layer
    kda: list[Rule]
    mla: list[Rule]
    dense: list[Rule]
    moe: list[Rule]


DEEPSEEK_NAMES = FamilyNames(GLOBAL_RULES, NORM_RULES, [], MLA_RULES, DENSE_FFN_RULES, MOE_RULES + MXFP4_MOE_RULES)
FAMILY_NAMES: dict[str, FamilyNames] = {
    "kimi_linear": FamilyNames(GLOBAL_RULES, NORM_RULES, KDA_RULES, MLA_RULES, DENSE_FFN_RULES,
                               MOE_RULES + MXFP4_MOE_RULES),
    "deepseek_v3": DEEPSEEK_NAMES,
    "deepseek_v32": FamilyNames(GLOBAL_RULES, NORM_RULES, [], MLA_RULES + INDEXER_RULES, DENSE_FFN_RULES,
                                MOE_RULES + MXFP4_MOE_RULES),
    "kimi_k25": DEEPSEEK_NAMES,
    # K3 (and K3.1, which adds the indexer): Kimi-Linear's names plus K3's own tensors.
    "kimi_k3": FamilyNames(GLOBAL_RULES + K3_GLOBAL_RULES, NORM_RULES + K3_RESIDUAL_RULES,
                           KDA_RULES + K3_KDA_RULES, MLA_RULES + K3_MLA_RULES + INDEXER_RULES,
                           DENSE_FFN_RULES, MOE_RULES + MXFP4_MOE_RULES + K3_MOE_RULES),
}



@dataclass(frozen=True)
class TextFamily:
    """What a text backbone's config.json means beyond the keys every family shares (frontend/config.py
    reads these), kept beside the family's name table: one place per family, as llama.cpp's converter
    classes."""

    kda: bool                        # its layers may be KDA (and it must say which, linear_attn_config / layer_types)
    mla_nope_default: bool           # MLA's rope dims exist but are not rotated unless mla_use_nope says so
    rope_always_interleaved: bool    # transformers' port rotates MLA's rope dims as pairs whatever the config
    indexer_always: bool             # index_* keys are required (DSA on every attention layer)
    first_k_dense_default: int       # dense FFN layers before the MoE ones when the key is absent


TEXT_FAMILIES: dict[str, TextFamily] = {
    "kimi_linear": TextFamily(kda=True, mla_nope_default=True, rope_always_interleaved=False, indexer_always=False,
                              first_k_dense_default=1),
    "deepseek_v3": TextFamily(kda=False, mla_nope_default=False, rope_always_interleaved=False,
                              indexer_always=False, first_k_dense_default=3),
    "deepseek_v32": TextFamily(kda=False, mla_nope_default=False, rope_always_interleaved=True,
                               indexer_always=True, first_k_dense_default=3),
}
TEXT_ALIASES = {"kimi_k2": "deepseek_v3"}          # Kimi-K2's published model_type
# multimodal wrappers (text_config inside) and the text backbone they hold when text_config names none
WRAPPERS = {"kimi_k25": "deepseek_v3", "kimi_k3": "kimi_linear"}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def family_names(cfg: ModelConfig) -> FamilyNames:
    key = cfg.model_type if cfg.model_type in FAMILY_NAMES else cfg.text_model_type
    return FAMILY_NAMES[key]


def normalise(name: str, cfg: ModelConfig) -> tuple[str | None, str | None]:
    """-> (normalised name, None) for a kept tensor, or (None, group) for a dropped one."""
    for group, prefixes in DROPPED_PREFIXES.items():
        if name.startswith(prefixes):
            return None, group
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if name.startswith("layers."):
            name = "model." + name
    if name.startswith("model.mtp.") or name.startswith("mtp."):
        return None, "mtp"
    if name.startswith("model.blocks."):
        name = "model.layers." + name[len("model.blocks."):]
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _LAYER.fullmatch(name)
    if m and int(m.group(1)) >= cfg.num_layers:
        return None, "mtp"   # DeepSeek appends its MTP layers after the last decoder layer
    return name, None


# Tensors published beside a quantised weight: mapped as the weight they belong to is, then renamed
# (`.weight` or `.packed` -> the suffix). FP8 checkpoints put `X.weight_scale_inv` beside `X.weight`;
# compressed-tensors puts `X.weight_shape` (the unpadded [O, K], checked then dropped) beside `X.weight_packed`.
COMPANIONS = {"weight_scale_inv": ("weight", "scales"), "weight_shape": ("weight_packed", "weight_shape")}


def block_scaled_codes(destination: Destination) -> Destination:
    """A float-named destination (`X.weight`) whose tensor holds block-scaled codes (FP8 bytes): `X.packed`."""
    base, _ = destination.name.rsplit(".", 1)
    return Destination(f"{base}.packed", destination.expert, destination.transforms)


def map_name(name: str, cfg: ModelConfig) -> list[Destination]:
    """Canonical targets of one normalised checkpoint name; [] never happens — unknown names raise."""
    base, _, suffix = name.rpartition(".")
    if suffix in COMPANIONS:
        owner, canonical = COMPANIONS[suffix]
        return [Destination(f"{d.name.rsplit('.', 1)[0]}.{canonical}", d.expert, d.transforms)
                for d in map_name(f"{base}.{owner}", cfg)]
    names = family_names(cfg)
    m = _LAYER.fullmatch(name)
    if m is None:
        rules, rest, layer = names.global_rules, name, None
    else:
        layer, rest = int(m.group(1)), m.group(2)
        mixer = names.kda if cfg.layer_kinds[layer] == "kda" else names.mla
        ffn = names.moe if cfg.ffn_kinds[layer] == "moe" else names.dense
        rules = names.layer_rules + mixer + ffn
    targets, seen = [], set()
    for rule in rules:
        hit = re.fullmatch(rule.pattern, rest)
        if hit is None:
            continue
        target = hit.expand(rule.target)
        if target in seen:   # an earlier, more specific rule already claimed this name
            continue
        seen.add(target)
        expert = int(hit.group("e")) if rule.expert else None
        targets.append(Destination(target if layer is None else f"layers.{layer}.{target}", expert, rule.transforms))
    if not targets:
        where = f" (layer {layer} is {cfg.layer_kinds[layer]} + {cfg.ffn_kinds[layer]})" if layer is not None else ""
        raise CheckpointError(f"unknown tensor {name!r}{where}")
    return targets
