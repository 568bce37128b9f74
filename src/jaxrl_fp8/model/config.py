"""Model configuration: the fields of an HF Qwen3 / Qwen3-MoE `config.json` that change the numerics.

Why a separate frozen dataclass instead of the HF dict: the forward is traced with the config as a static
argument (it must be hashable), and every field here is validated once at load, so a checkpoint the model
cannot run exactly fails at `from_hf_config` with the name of the offending field, never silently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

__all__ = ["ModelConfig", "RopeScaling", "ConfigError", "from_hf_config", "to_hf_config", "tiny_config", "ARCHITECTURES"]

MOE_ARCH = "Qwen3MoeForCausalLM"
DENSE_ARCH = "Qwen3ForCausalLM"
ARCHITECTURES = {MOE_ARCH: "qwen3_moe", DENSE_ARCH: "qwen3"}
# Rope types whose frequencies depend only on the config (not on the sequence being run), so decode and the
# full forward see the same rotation. `dynamic` / `longrope` switch frequencies with the batch's length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
ATTENTION_IMPLS = ("auto", "exact", "flash", "xla")


class ConfigError(ValueError):
    """A config.json field has a value this model cannot run exactly. The message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Normalized `rope_scaling` / `rope_parameters` (HF key names)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 32768
    router_aux_loss_coef: float = 0.001
    architecture: str = MOE_ARCH
    # "auto": the flash kernel on a Hopper GPU when it takes the model, else "exact"; "exact": the row-invariant
    # scan (bitwise decode == full forward, docs/decisions/0003-model.md); "flash": the Mosaic GPU kernels (row
    # invariant, docs/decisions/0012-flash-attention.md); "xla": plain einsum (fast, not row invariant).
    attention_impl: str = "auto"

    def __post_init__(self):
        _validate(self)

    @property
    def is_moe(self) -> bool:
        return self.architecture == MOE_ARCH and self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as HF's Qwen3MoeDecoderLayer."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def _fail(field: str, value: Any, why: str) -> None:
    raise ConfigError(f"config field {field!r} = {value!r}: {why}")


def _validate(c: ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(name, v, "must be a positive integer")
    if c.architecture not in ARCHITECTURES:
        _fail("architectures", c.architecture, f"unsupported; expected one of {sorted(ARCHITECTURES)}")
    if c.num_attention_heads % c.num_key_value_heads:
        _fail("num_key_value_heads", c.num_key_value_heads, f"must divide num_attention_heads={c.num_attention_heads}")
    if c.head_dim % 2:
        _fail("head_dim", c.head_dim, "must be even for rotary embeddings")
    if not (c.rms_norm_eps > 0 and math.isfinite(c.rms_norm_eps)):
        _fail("rms_norm_eps", c.rms_norm_eps, "must be a positive finite number")
    if not (c.rope_theta > 0 and math.isfinite(c.rope_theta)):
        _fail("rope_theta", c.rope_theta, "must be a positive finite number")
    if c.attention_impl not in ATTENTION_IMPLS:
        _fail("attention_impl", c.attention_impl, f"expected one of {ATTENTION_IMPLS}")
    if c.architecture == MOE_ARCH and c.num_experts > 0:
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            _fail("num_experts_per_tok", c.num_experts_per_tok, f"must be in [1, num_experts={c.num_experts}]")
        if c.moe_intermediate_size <= 0:
            _fail("moe_intermediate_size", c.moe_intermediate_size, "must be a positive integer")
        if c.decoder_sparse_step <= 0:
            _fail("decoder_sparse_step", c.decoder_sparse_step, "must be a positive integer")
    elif c.num_experts < 0:
        _fail("num_experts", c.num_experts, "must be >= 0")
    for layer in c.mlp_only_layers:
        if not 0 <= layer < c.num_hidden_layers:
            _fail("mlp_only_layers", c.mlp_only_layers, f"layer {layer} outside [0, {c.num_hidden_layers})")
    rs = c.rope_scaling
    if rs.rope_type not in SUPPORTED_ROPE_TYPES:
        _fail("rope_scaling.rope_type", rs.rope_type, f"unsupported; supported: {SUPPORTED_ROPE_TYPES} "
              "(dynamic/longrope change frequencies with the batch length, which breaks decode == forward)")
    if rs.rope_type != "default" and not (rs.factor and rs.factor > 0):
        _fail("rope_scaling.factor", rs.factor, "must be a positive number")
    if rs.rope_type == "llama3" and (rs.low_freq_factor is None or rs.high_freq_factor is None):
        _fail("rope_scaling.low_freq_factor/high_freq_factor", (rs.low_freq_factor, rs.high_freq_factor), "required for llama3 rope")


# --------------------------------------------------------------------------------------------------------
# HF config.json <-> ModelConfig


def _get(d: Mapping, key: str, default: Any = dataclasses.MISSING):
    if key in d and d[key] is not None:
        return d[key]
    if default is dataclasses.MISSING:
        raise ConfigError(f"config field {key!r} is missing")
    return default


def _rope_from_hf(d: Mapping) -> tuple[float, RopeScaling]:
    """Accepts both the transformers-5 `rope_parameters` dict and the older `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling")
    if legacy:
        if not isinstance(legacy, Mapping):
            _fail("rope_scaling", legacy, "must be a mapping")
        params = {**legacy, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        _fail("partial_rotary_factor", prf, "only full rotary embeddings (1.0) are supported")
    known = {f.name for f in dataclasses.fields(RopeScaling)} | {"rope_theta", "type", "partial_rotary_factor"}
    unknown = sorted(set(params) - known)
    if unknown:
        _fail(f"rope_scaling.{unknown[0]}", params[unknown[0]], "unknown rope parameter")
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and orig is None:
        orig = d.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    factor = params.get("factor", 1.0)
    if rope_type == "yarn" and factor is None:
        factor = d["max_position_embeddings"] / orig
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        original_max_position_embeddings=None if orig is None else int(orig),
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
    )
    return float(theta), scaling


def from_hf_config(d: Mapping, *, attention_impl: str = "auto") -> ModelConfig:
    """Validate an HF config dict (as read from config.json) and return a ModelConfig.

    Raises ConfigError naming the field for unknown architectures and for any setting whose numerics this
    model does not reproduce (attention bias, sliding windows, non-SiLU activations, dynamic rope, ...).
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        if archs:
            _fail("architectures", archs, f"unsupported; expected one of {sorted(ARCHITECTURES)}")
        arch = {v: k for k, v in ARCHITECTURES.items()}.get(model_type)
        if arch is None:
            _fail("model_type", model_type, f"unsupported; expected one of {sorted(ARCHITECTURES.values())}")
    if model_type is not None and model_type != ARCHITECTURES[arch]:
        _fail("model_type", model_type, f"does not match architecture {arch} (expected {ARCHITECTURES[arch]!r})")
    if _get(d, "hidden_act", "silu") != "silu":
        _fail("hidden_act", d["hidden_act"], "only 'silu' is supported")
    if _get(d, "attention_bias", False):
        _fail("attention_bias", d["attention_bias"], "q/k/v/o biases are not supported")
    if _get(d, "use_sliding_window", False):
        _fail("use_sliding_window", d["use_sliding_window"], "sliding-window attention is not supported")
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        _fail("layer_types", layer_types, "only 'full_attention' layers are supported")
    if d.get("attention_dropout", 0.0):
        _fail("attention_dropout", d["attention_dropout"], "must be 0 (RL recomputes logprobs deterministically)")
    hidden = int(_get(d, "hidden_size"))
    heads = int(_get(d, "num_attention_heads"))
    head_dim = d.get("head_dim") or (hidden // heads)
    theta, scaling = _rope_from_hf(d)
    is_moe = arch == MOE_ARCH
    num_experts = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0) if is_moe else 0
    return ModelConfig(
        vocab_size=int(_get(d, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=int(_get(d, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(_get(d, "num_key_value_heads", heads)),
        head_dim=int(head_dim),
        intermediate_size=int(_get(d, "intermediate_size")),
        moe_intermediate_size=int(_get(d, "moe_intermediate_size", 0)) if is_moe else 0,
        num_experts=num_experts,
        num_experts_per_tok=int(_get(d, "num_experts_per_tok", 0)) if is_moe else 0,
        norm_topk_prob=bool(_get(d, "norm_topk_prob", False)) if is_moe else False,
        decoder_sparse_step=int(_get(d, "decoder_sparse_step", 1)) if is_moe else 1,
        mlp_only_layers=tuple(int(x) for x in (d.get("mlp_only_layers") or ())) if is_moe else (),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(_get(d, "max_position_embeddings", 32768)),
        router_aux_loss_coef=float(_get(d, "router_aux_loss_coef", 0.001)),
        architecture=arch,
        attention_impl=attention_impl,
    )


def to_hf_config(c: ModelConfig, *, dtype: str = "float32", base: Mapping | None = None) -> dict:
    """An HF config.json dict for `c` (transformers 5 layout). Keys of `base` not set here are kept."""
    out = dict(base or {})
    for stale in ("rope_theta", "rope_scaling", "torch_dtype", "num_local_experts"):
        out.pop(stale, None)
    rope = {"rope_type": c.rope_scaling.rope_type, "rope_theta": c.rope_theta}
    if c.rope_scaling.rope_type != "default":
        for f in dataclasses.fields(RopeScaling):
            v = getattr(c.rope_scaling, f.name)
            if f.name != "rope_type" and v is not None:
                rope[f.name] = v
    out.update(
        architectures=[c.architecture],
        model_type=ARCHITECTURES[c.architecture],
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=rope,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        dtype=dtype,
    )
    if c.architecture == MOE_ARCH:
        out.update(
            moe_intermediate_size=c.moe_intermediate_size,
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
            router_aux_loss_coef=c.router_aux_loss_coef,
        )
    return out


def tiny_config(**overrides) -> ModelConfig:
    """A small random-init Qwen3-MoE config for tests and the CPU training default.

    Vocab 259 (not a multiple of 128), GQA 4:2, 4 layers with layer 1 dense, 8 experts top-2.
    """
    base = dict(
        vocab_size=259,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
        max_position_embeddings=512,
    )
    base.update(overrides)
    if "mlp_only_layers" in base:
        base["mlp_only_layers"] = tuple(base["mlp_only_layers"])
    return ModelConfig(**base)
