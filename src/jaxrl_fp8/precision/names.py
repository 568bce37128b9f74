"""The one table that maps Hugging Face tensor names to trainer parameter paths.

Why one table: per-layer exceptions are written as regexes on either naming scheme (HF names for the
converter and rollout export, trainer names for the training forward). Both must pick the same tensors,
so every translation between the two goes through `TABLE` and nothing else.

Trainer paths are dot-joined NNX state paths of `jaxrl_fp8.model`. Experts are stacked in the trainer
(`[E, N, K]`, HF `[out, in]` layout per expert), so an HF expert tensor maps to a trainer path plus an
expert index.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["NameRule", "TABLE", "hf_to_trainer", "trainer_to_hf", "TensorRole", "role_of_hf", "fused_group_of_hf"]


@dataclasses.dataclass(frozen=True)
class NameRule:
    hf: str  # regex with named groups L (layer) and optionally E (expert), P (projection)
    trainer: str  # format string using the same group names
    role: str  # see TensorRole


class TensorRole:
    """What a tensor is, as far as precision is concerned."""

    LINEAR = "linear"  # quantizable projection (q/k/v/o, dense mlp)
    EXPERT = "expert"  # quantizable MoE expert projection (stacked in the trainer)
    ROUTER = "router"  # MoE router: always high precision
    NORM = "norm"  # RMSNorm scales: always high precision
    EMBED = "embed"  # token embedding: always high precision
    LM_HEAD = "lm_head"  # output projection: always high precision


_L = r"(?P<L>\d+)"
TABLE: tuple[NameRule, ...] = (
    NameRule(r"model\.embed_tokens\.weight", "embed.embedding", TensorRole.EMBED),
    NameRule(r"model\.norm\.weight", "final_norm.scale", TensorRole.NORM),
    NameRule(r"lm_head\.weight", "lm_head.weight", TensorRole.LM_HEAD),
    NameRule(rf"model\.layers\.{_L}\.input_layernorm\.weight", "layers.{L}.input_norm.scale", TensorRole.NORM),
    NameRule(rf"model\.layers\.{_L}\.post_attention_layernorm\.weight", "layers.{L}.post_attn_norm.scale", TensorRole.NORM),
    NameRule(rf"model\.layers\.{_L}\.self_attn\.(?P<P>q|k)_norm\.weight", "layers.{L}.attn.{P}_norm.scale", TensorRole.NORM),
    NameRule(rf"model\.layers\.{_L}\.self_attn\.(?P<P>q|k|v|o)_proj\.weight", "layers.{L}.attn.{P}_proj.weight", TensorRole.LINEAR),
    NameRule(rf"model\.layers\.{_L}\.mlp\.gate\.weight", "layers.{L}.moe.router.weight", TensorRole.ROUTER),
    NameRule(
        rf"model\.layers\.{_L}\.mlp\.experts\.(?P<E>\d+)\.(?P<P>gate|up|down)_proj\.weight",
        "layers.{L}.moe.{P}_proj.weight",
        TensorRole.EXPERT,
    ),
    NameRule(rf"model\.layers\.{_L}\.mlp\.(?P<P>gate|up|down)_proj\.weight", "layers.{L}.mlp.{P}_proj.weight", TensorRole.LINEAR),
)
_COMPILED = tuple((re.compile(r.hf + r"\Z"), r) for r in TABLE)


def _match_hf(hf_name: str):
    for rx, rule in _COMPILED:
        m = rx.match(hf_name)
        if m:
            return m, rule
    raise KeyError(f"tensor {hf_name!r} is not a Qwen3/Qwen3-MoE tensor name known to jaxrl_fp8.precision.names.TABLE")


def hf_to_trainer(hf_name: str) -> tuple[str, int | None]:
    """`model.layers.3.mlp.experts.7.up_proj.weight` -> (`layers.3.moe.up_proj.weight`, 7)."""
    m, rule = _match_hf(hf_name)
    groups = m.groupdict()
    expert = groups.pop("E", None)
    return rule.trainer.format(**groups), (int(expert) if expert is not None else None)


def role_of_hf(hf_name: str) -> str:
    return _match_hf(hf_name)[1].role


def _trainer_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    pattern = pattern.replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{P\}", r"(?P<P>[a-z]+)")
    return re.compile(pattern + r"\Z")


_TRAINER_COMPILED = tuple((_trainer_regex(r.trainer), r) for r in TABLE)


def trainer_to_hf(trainer_name: str, expert: int | None = None) -> str:
    """Inverse of `hf_to_trainer`; `expert` is required for stacked expert tensors."""
    for rx, rule in _TRAINER_COMPILED:
        m = rx.match(trainer_name)
        if not m:
            continue
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        if rule.role == TensorRole.EXPERT:
            if expert is None:
                raise ValueError(f"trainer tensor {trainer_name!r} is an expert stack: pass expert=<index>")
            groups["E"] = str(expert)
        hf = _rebuild(rule.hf, groups)
        if _match_hf(hf)[1] is rule:
            return hf
    raise KeyError(f"trainer path {trainer_name!r} has no entry in jaxrl_fp8.precision.names.TABLE")


def _rebuild(hf_regex: str, groups: dict[str, str]) -> str:
    out = hf_regex
    for key, value in groups.items():
        out = re.sub(r"\(\?P<%s>[^)]*\)" % key, value, out)
    return out.replace("\\.", ".")


def fused_group_of_hf(hf_name: str) -> str | None:
    """Key of the SGLang fused module a tensor belongs to, or None if it is not fused.

    SGLang fuses q/k/v into `qkv_proj`, dense gate/up into `gate_up_proj`, and runs all experts of a layer
    as one fused MoE module; it refuses a checkpoint that quantizes only part of such a group.
    """
    m, rule = _match_hf(hf_name)
    g = m.groupdict()
    if rule.role == TensorRole.LINEAR and g.get("P") in ("q", "k", "v"):
        return f"model.layers.{g['L']}.self_attn.qkv_proj"
    if rule.role == TensorRole.LINEAR and g.get("P") in ("gate", "up"):
        return f"model.layers.{g['L']}.mlp.gate_up_proj"
    if rule.role == TensorRole.EXPERT:
        return f"model.layers.{g['L']}.mlp.experts"
    return None
