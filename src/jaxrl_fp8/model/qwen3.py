"""Flax NNX Qwen3-MoE / Qwen3 decoder. Parameter paths are the trainer names of `precision.names.TABLE`.

The forward takes a `PrecisionPolicy` (or None) and resolves it, per projection, to a static format from the
projection's trainer path, so the same parameters run under the rollout format and the training format.
Weights stay in HF layout [out, in] ([E, out, in] for expert stacks). Every projection goes through
`model.matmul` -> `jaxrl_fp8.ops`; norms, embeddings, the router and lm_head stay high precision.
Parameters carry logical axis names (embed, heads, kv, mlp, expert, vocab) as NNX sharding metadata.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_fp8.model import fused, matmul, moe as moe_lib
from jaxrl_fp8.model.attention import cache_attention, resolve_impl, sequence_attention
from jaxrl_fp8.model.cache import KVCache, PagedKVCache
from jaxrl_fp8.model.config import ModelConfig
from jaxrl_fp8.model.numerics import rms_norm, silu
from jaxrl_fp8.model.rope import apply_rope, rope_cos_sin
from jaxrl_fp8.precision import formats as F
from jaxrl_fp8.precision.kv import fake_quantize_kv, kv_cache_of, quantize_kv

F32 = jnp.float32

__all__ = ["Qwen3", "ModelOutput", "segment_positions"]


def _param(value, axes):
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


INIT_STD = 0.02  # the std of every random weight Qwen3 draws (norm scales start at 1)


def _normal(rngs: nnx.Rngs, shape, dtype, std=INIT_STD):
    return (jax.random.normal(rngs.params(), shape, F32) * std).astype(dtype)


class Linear(nnx.Module):
    """weight [out, in] (HF layout). The matmul happens in the caller, which knows the format."""

    def __init__(self, out_features: int, in_features: int, axes, *, dtype, rngs: nnx.Rngs):
        self.weight = _param(_normal(rngs, (out_features, in_features), dtype), axes)


class ExpertStack(nnx.Module):
    """weight [E, out, in]: the experts of one projection stacked, each in HF layout."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, axes, *, dtype, rngs: nnx.Rngs):
        self.weight = _param(_normal(rngs, (num_experts, out_features, in_features), dtype), axes)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, axes, *, dtype):
        self.scale = _param(jnp.ones((size,), dtype), axes)


class Embed(nnx.Module):
    def __init__(self, vocab: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = _param(_normal(rngs, (vocab, hidden), dtype), ("vocab", "embed"))


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """Static per-call settings threaded through the layers."""

    policy: object  # PrecisionPolicy | None
    backward: str
    moe_impl: object = None  # expert-parallel MoE (sharding.make_moe_impl): (x, routing, gate, up, down, fmts, backward)

    def fmt(self, trainer_path: str) -> str | None:
        return None if self.policy is None else self.policy.format_for_trainer(trainer_path)

    @property
    def kv_fp8(self) -> bool:
        """The recipe's KV cache is FP8 (precision.kv): k/v are quantized where attention reads them."""
        return kv_cache_of(self.policy) == "fp8"


@dataclasses.dataclass(frozen=True)
class _Seq:
    """What attention needs to know about the tokens of one call: the resolved implementation, and either the
    packed-row segment ids (no cache) or the cache slots the tokens are written to."""

    impl: str
    segment_ids: jax.Array | None = None
    slots: jax.Array | None = None


def _shared_input_projections(module, prefix: str, names: tuple[str, ...], x, ctx: _Ctx) -> list[jax.Array]:
    """x times each named projection of `module`: one product when the decode loop stacked them
    (`fused.FusedWeight` in the first one's slot, same bits), else one product each."""
    first = getattr(module, names[0]).weight.get_value()
    if isinstance(first, fused.FusedWeight):
        fmts = {ctx.fmt(f"{prefix}.{n}.weight") for n in names}
        if len(fmts) != 1:
            raise ValueError(f"{prefix}: {', '.join(names)} are stacked into one weight but the precision policy gives "
                             f"them different formats {sorted(map(str, fmts))}")
        y = matmul.linear(x, first.weight, fmts.pop(), ctx.backward)
        return fused.split_outputs(y, first.widths)
    return [matmul.linear(x, getattr(module, n).weight.get_value(), ctx.fmt(f"{prefix}.{n}.weight"), ctx.backward)
            for n in names]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        h, kv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = Linear(h * d, e, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(kv * d, e, ("kv", "embed"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(kv * d, e, ("kv", "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(e, h * d, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, (None,), dtype=dtype)
        self.k_norm = RMSNorm(d, (None,), dtype=dtype)

    def _proj(self, name: str, x, ctx: _Ctx):
        w = getattr(self, name).weight.get_value()
        return matmul.linear(x, w, ctx.fmt(f"layers.{self.layer}.attn.{name}.weight"), ctx.backward)

    def __call__(self, x, cos, sin, seq: _Seq, ctx: _Ctx, cache: KVCache | PagedKVCache | None):
        cfg = self.cfg
        b, t, _ = x.shape
        d = cfg.head_dim
        q, k, v = _shared_input_projections(self, f"layers.{self.layer}.attn", ("q_proj", "k_proj", "v_proj"), x, ctx)
        q = q.reshape(b, t, cfg.num_attention_heads, d)
        k = k.reshape(b, t, cfg.num_key_value_heads, d)
        v = v.reshape(b, t, cfg.num_key_value_heads, d)
        q = rms_norm(q, self.q_norm.scale.get_value(), cfg.rms_norm_eps)
        k = rms_norm(k, self.k_norm.scale.get_value(), cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            if ctx.kv_fp8:  # the keys and values a cache would give back (gradient: straight through)
                k, v = fake_quantize_kv(k), fake_quantize_kv(v)
            out = sequence_attention(q, k, v, seq.segment_ids, scale=d**-0.5, impl=seq.impl)
        else:
            if ctx.kv_fp8:
                k, v = quantize_kv(k), quantize_kv(v)
            cache = cache.write(self.layer, k, v, seq.slots)
            out = cache_attention(q, cache, self.layer, seq.slots, scale=d**-0.5, impl=seq.impl)
        return self._proj("o_proj", out.reshape(b, t, -1), ctx), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.layer = layer
        i, e = cfg.intermediate_size, cfg.hidden_size
        self.gate_proj = Linear(i, e, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(i, e, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(e, i, ("embed", "mlp"), dtype=dtype, rngs=rngs)

    def _proj(self, name, x, ctx):
        w = getattr(self, name).weight.get_value()
        return matmul.linear(x, w, ctx.fmt(f"layers.{self.layer}.mlp.{name}.weight"), ctx.backward)

    def __call__(self, x, ctx: _Ctx):
        gate, up = _shared_input_projections(self, f"layers.{self.layer}.mlp", ("gate_proj", "up_proj"), x, ctx)
        h = silu(gate) * up
        return self._proj("down_proj", h, ctx)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        n, i, e = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.router = Linear(n, e, ("expert", "embed"), dtype=dtype, rngs=rngs)
        self.gate_proj = ExpertStack(n, i, e, ("expert", "mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = ExpertStack(n, i, e, ("expert", "mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = ExpertStack(n, e, i, ("expert", "embed", "mlp"), dtype=dtype, rngs=rngs)

    def _proj(self, name, x, gs, ctx, x_fp8=None):
        w = getattr(self, name).weight.get_value()
        return matmul.grouped_linear(x, w, gs, ctx.fmt(f"layers.{self.layer}.moe.{name}.weight"), ctx.backward, x_fp8=x_fp8)

    def _sorted_fp8_input(self, x, d, ctx):
        """The gate / up products' FP8 operands of the sorted rows, each token quantized once and its groups gathered
        to its k rows (a decode step quantized k = 8 copies of every row: 2,048 rows instead of 256); None unless both
        run fp8-block. Same bits as quantizing the sorted rows (a group's scale sees only its own row)."""
        if {ctx.fmt(f"layers.{self.layer}.moe.{p}.weight") for p in ("gate_proj", "up_proj")} != {F.FP8_BLOCK}:
            return None
        return matmul.grouped_fp8_input(x, self.gate_proj.weight.get_value()).take_rows(d.token_of_row)

    def __call__(self, x, ctx: _Ctx, replay=None):
        """x [N, H] -> (y [N, H], Routing)."""
        cfg = self.cfg
        # a float32 product; the weight keeps its dtype (BF16 weights have no tail for the split form to multiply)
        logits = matmul.high_precision_linear(x.astype(F32), self.router.weight.get_value())
        routing = moe_lib.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, replay)
        if ctx.moe_impl is not None:  # tokens travel to the devices holding their experts and back
            fmts = tuple(ctx.fmt(f"layers.{self.layer}.moe.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
            y = ctx.moe_impl(x, routing, self.gate_proj.weight.get_value(), self.up_proj.weight.get_value(),
                             self.down_proj.weight.get_value(), fmts, ctx.backward)
            return y.astype(x.dtype), routing
        d = moe_lib.dispatch(routing.experts, cfg.num_experts)
        xs = moe_lib.sorted_rows(x, d)
        xs_fp8 = self._sorted_fp8_input(x, d, ctx)
        h = silu(self._proj("gate_proj", xs, d.group_sizes, ctx, xs_fp8)) * self._proj("up_proj", xs, d.group_sizes, ctx, xs_fp8)
        y = self._proj("down_proj", h, d.group_sizes, ctx)
        return moe_lib.combine(y, d, routing.weights).astype(x.dtype), routing


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        self.input_norm = RMSNorm(cfg.hidden_size, ("embed",), dtype=dtype)
        self.attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, ("embed",), dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.moe = MoE(cfg, layer, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg, layer, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, seq, ctx, cache, replay):
        eps = self.cfg.rms_norm_eps
        a, cache = self.attn(rms_norm(x, self.input_norm.scale.get_value(), eps), cos, sin, seq, ctx, cache)
        x = x + a
        h = rms_norm(x, self.post_attn_norm.scale.get_value(), eps)
        routing = None
        if self.cfg.is_moe_layer(self.layer):
            b, t, e = h.shape
            flat_replay = None if replay is None else replay.reshape(b * t, -1)
            y, routing = self.moe(h.reshape(b * t, e), ctx, flat_replay)
            y = y.reshape(b, t, e)
        else:
            y = self.mlp(h, ctx)
        return x + y, cache, routing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    logits: jax.Array | None  # f32 [B, T, V]; None when called with head=False
    routed_experts: jax.Array  # int32 [B, T, num_hidden_layers, k]; -1 for dense layers (k = 1 without MoE)
    aux_loss: jax.Array  # f32 scalar, HF's load-balancing loss (0 without MoE layers)
    cache: KVCache | None = None
    hidden: jax.Array | None = None  # [B, T, H] final-normed states, what the head multiplies (head=False only)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions restarting at 0 at each segment start of a packed row (segments are contiguous runs)."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    return idx - start


class Qwen3(nnx.Module):
    """The whole causal LM. Call it with token ids; see `__call__`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, ("embed",), dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"), dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed.embedding.get_value().dtype

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        routed_experts: jax.Array | None = None,
        cache: KVCache | PagedKVCache | None = None,
        policy=None,
        backward: str = "high_precision",
        token_mask: jax.Array | None = None,
        moe_impl=None,
        logits_at: jax.Array | None = None,
        head: bool = True,
    ) -> ModelOutput:
        """Forward over input_ids [B, T].

        positions: [B, T] rotary positions (default: restart per segment, or the cache slots when decoding).
        segment_ids: [B, T] packed-sequence ids; a token attends to earlier tokens of its own segment only.
        routed_experts: [B, T, num_hidden_layers, k] expert ids to replay (R3); rows with -1 use the router.
        cache: a KVCache or PagedKVCache; the T tokens are written at slots lengths[b] + t and attend to the
            cache. The returned cache has lengths + T.
        policy: a precision.PrecisionPolicy (format per projection) or None (the parameters' dtype).
        backward: ops backward mode ("high_precision", "dequantized", "fp8").
        token_mask: [B, T] tokens counted by the load-balancing loss (default all).
        moe_impl: expert-parallel MoE from `jaxrl_fp8.sharding.make_moe_impl` (None: single-device dispatch).
        logits_at: [B] int, one position per row: logits only there ([B, 1, V]; a prefill needs only the last
            prompt position, not B * T * V floats). The values equal those of the full logits (row-invariant
            norm and head).
        head: False returns the final-normed hidden states (`hidden`) instead of the logits, for a caller that
            applies `head_weight()` itself in chunks (the trainer's loss: no [B, T, V] float32 array).
        """
        cfg = self.cfg
        b, t = input_ids.shape
        ctx = _Ctx(policy, backward, moe_impl)
        x = self.embed.embedding.get_value()[input_ids]
        impl = resolve_impl(cfg.attention_impl, cfg.head_dim, x.dtype)
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with a KV cache (one sequence per cache row)")
            seq = _Seq(impl, slots=cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :])
            if positions is None:
                positions = seq.slots
        else:
            seq = _Seq(impl, segment_ids=segment_ids)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if segment_ids is None else segment_positions(segment_ids)
        cos, sin = rope_cos_sin(cfg, positions, x.dtype)
        k = max(cfg.num_experts_per_tok, 1)
        routed, stats = [], []
        for i, layer in enumerate(self.layers):
            replay = None if routed_experts is None or not cfg.is_moe_layer(i) else routed_experts[:, :, i, :]
            x, cache, routing = layer(x, cos, sin, seq, ctx, cache, replay)
            if routing is None:
                routed.append(jnp.full((b, t, k), -1, jnp.int32))
            else:
                routed.append(routing.experts.reshape(b, t, k))
                stats.append(moe_lib.load_balancing_stats(routing, cfg.num_experts, token_mask))
        if logits_at is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
        x = rms_norm(x, self.final_norm.scale.get_value(), cfg.rms_norm_eps)
        logits = matmul.head_logits(x, self.head_weight(x.dtype), x.dtype) if head else None
        if cache is not None:
            cache = cache.with_lengths(cache.lengths + t)
        return ModelOutput(logits, jnp.stack(routed, axis=2), moe_lib.load_balancing_loss(stats, cfg.num_experts), cache,
                           hidden=None if head else x)

    def head_weight(self, dtype) -> jax.Array:
        """The [V, H] output projection (the embedding when tied) in `dtype`, as the forward multiplies it."""
        w = self.embed.embedding.get_value() if self.cfg.tie_word_embeddings else self.lm_head.weight.get_value()
        return w.astype(dtype)
