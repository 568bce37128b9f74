"""`Policy`: a Qwen3(-MoE) model plus the recipe it runs under; HF checkpoints in and out.

The same parameters serve both sides of an RL recipe: `precision="train"` resolves to the recipe's training
format, `precision="rollout"` to its rollout format (a `PrecisionPolicy` per side, same per-layer exceptions),
and None / no recipe computes in the parameters' dtype. Forward functions are jitted once per
(model structure, precision policy, backward mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_fp8.model import hf_io, loader
from jaxrl_fp8.model.cache import KVCache, init_cache
from jaxrl_fp8.model.config import ModelConfig, from_hf_config, to_hf_config
from jaxrl_fp8.model.numerics import log_softmax, pick_logprobs
from jaxrl_fp8.model.qwen3 import ModelOutput, Qwen3
from jaxrl_fp8.precision import PrecisionPolicy, Recipe

__all__ = ["Policy", "from_pretrained", "random_policy", "token_logprobs", "parse_dtype"]

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in [jnp.dtype(v) for v in _DTYPES.values()]:
        raise ValueError(f"dtype {dt} is not supported; expected one of {sorted(_DTYPES)}")
    return dt


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(targets[b, t]) under logits[b, t] (float32, row invariant). logits [B, T, V], targets [B, T]."""
    return pick_logprobs(log_softmax(logits), targets)


@functools.partial(jax.jit, static_argnames=("graphdef", "precision", "backward"))
def _forward(graphdef, state, input_ids, positions, segment_ids, routed_experts, cache, precision, backward):
    model = nnx.merge(graphdef, state)
    return model(
        input_ids,
        positions=positions,
        segment_ids=segment_ids,
        routed_experts=routed_experts,
        cache=cache,
        policy=precision,
        backward=backward,
    )


class Policy:
    """A causal LM ready for RL: logits, per-token log-probs, KV-cache decoding, HF save."""

    def __init__(self, model: Qwen3, *, recipe: Recipe | None = None, hf_config: dict | None = None, precision: PrecisionPolicy | None = None):
        self.model = model
        self.recipe = recipe
        self.hf_config = dict(hf_config) if hf_config else to_hf_config(model.cfg)
        cfg = model.cfg
        if precision is None and recipe is not None:
            precision = PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
        if recipe is not None:
            precision = precision.with_kv_cache(recipe.kv_cache)  # the recipe's contract holds on both sides
        self.train_precision = precision
        self.rollout_precision = None
        if recipe is not None:
            self.rollout_precision = precision.with_format(recipe.rollout_format)

    # -------------------------------------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def resolve_precision(self, precision) -> PrecisionPolicy | None:
        if precision == "train":
            return self.train_precision
        if precision == "rollout":
            return self.rollout_precision
        if precision is None or isinstance(precision, PrecisionPolicy):
            return precision
        raise ValueError(f"precision={precision!r}; expected 'train', 'rollout', None or a PrecisionPolicy")

    def _backward(self, backward):
        if backward is not None:
            return backward
        return self.recipe.backward if self.recipe is not None else "high_precision"

    def forward(self, input_ids, *, positions=None, segment_ids=None, routed_experts=None, cache=None, precision="train", backward=None) -> ModelOutput:
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {input_ids.shape}")
        if routed_experts is not None:
            routed_experts = self._check_replay(routed_experts, input_ids.shape)
        graphdef, state = nnx.split(self.model)
        return _forward(
            graphdef, state, input_ids,
            None if positions is None else jnp.asarray(positions, jnp.int32),
            None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32),
            routed_experts, cache, self.resolve_precision(precision), self._backward(backward),
        )

    def _check_replay(self, routed, shape):
        cfg = self.config
        routed = jnp.asarray(routed)
        want = (*shape, cfg.num_hidden_layers, max(cfg.num_experts_per_tok, 1))
        if routed.shape != want:
            raise ValueError(f"routed_experts must be [B, T, num_hidden_layers, k] = {list(want)}; got {list(routed.shape)}")
        if not jnp.issubdtype(routed.dtype, jnp.integer):
            raise ValueError(f"routed_experts must be integers; got {routed.dtype}")
        if not isinstance(routed, jax.core.Tracer) and bool(jnp.any(routed >= max(cfg.num_experts, 1))):
            raise ValueError(f"routed_experts holds expert ids >= num_experts={cfg.num_experts}")
        return routed.astype(jnp.int32)

    def logits(self, input_ids, *, segment_ids=None, positions=None, routed_experts=None, precision="train") -> jax.Array:
        """float32 [B, T, V]."""
        return self.forward(input_ids, segment_ids=segment_ids, positions=positions, routed_experts=routed_experts, precision=precision).logits

    def token_logprobs(self, input_ids, targets, *, segment_ids=None, positions=None, routed_experts=None, precision="train") -> jax.Array:
        """float32 [B, T]: log p(targets[b, t] | tokens <= t). For next-token log-probs pass targets = ids shifted left."""
        out = self.forward(input_ids, segment_ids=segment_ids, positions=positions, routed_experts=routed_experts, precision=precision)
        return token_logprobs(out.logits, jnp.asarray(targets))

    # ------------------------------------------------------------------------------------------ decoding
    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return init_cache(self.config, batch, max_len, self.model.dtype)

    def prefill(self, input_ids, lengths, cache: KVCache, *, precision="rollout"):
        """Write right-padded prompts [B, T] (real lengths [B]) into an empty cache.

        Returns (ModelOutput with logits [B, T, V] and routed experts, cache with lengths = `lengths`).
        The next-token logits of row b are logits[b, lengths[b] - 1].
        """
        out = self.forward(input_ids, cache=cache, precision=precision)
        return out, KVCache(out.cache.k, out.cache.v, jnp.asarray(lengths, jnp.int32))

    def decode_step(self, tokens, cache: KVCache, *, precision="rollout"):
        """One token per row [B] at slot cache.lengths[b]. Returns (logits [B, V], routed [B, layers, k], cache)."""
        out = self.forward(jnp.asarray(tokens, jnp.int32)[:, None], cache=cache, precision=precision)
        return out.logits[:, 0], out.routed_experts[:, 0], out.cache

    # ------------------------------------------------------------------------------------------------ I/O
    def save_pretrained(self, path: str, *, dtype=None, max_shard_size="5GB") -> None:
        """Sharded HF safetensors + index + config.json that transformers loads (kept-FP8 weights dequantized)."""
        dt = parse_dtype(dtype) if dtype is not None else None
        tensors = loader.hf_tensors_of(self.model, dt)
        save_dtype = str(jnp.dtype(dt or self.model.dtype))
        base = {k: v for k, v in self.hf_config.items() if k != "quantization_config"}
        config = to_hf_config(self.config, dtype=save_dtype, base=base)
        hf_io.save_sharded(path, tensors, config=config, max_shard_size=max_shard_size)


def from_pretrained(path: str, *, dtype="bfloat16", recipe: Recipe | None = None, quantized: str = "dequantize", precision: PrecisionPolicy | None = None, attention_impl: str = "auto") -> Policy:
    """Load an HF Qwen3-MoE / Qwen3 checkpoint directory (BF16/FP16/FP32 or block FP8).

    quantized: "dequantize" (FP8 weights become master weights in `dtype`) or "keep" (FP8 weights stay
    `QuantizedWeight` for an FP8 forward). Fails with a CheckpointError / ConfigError naming the tensor or
    field; nothing is half-loaded.
    """
    dt = parse_dtype(dtype)
    hf_config = hf_io.read_config(path)
    cfg = from_hf_config(hf_config, attention_impl=attention_impl)
    params = loader.load_params(path, cfg, hf_config, dtype=dt, quantized=quantized)
    model = loader.build_model(cfg, params, dtype=dt)
    return Policy(model, recipe=recipe, hf_config=hf_config, precision=precision)


def random_policy(cfg: ModelConfig, *, seed: int = 0, dtype="float32", recipe: Recipe | None = None) -> Policy:
    """Randomly initialized policy (normal(0, 0.02) weights, unit norms), e.g. for the CPU training default."""
    model = Qwen3(cfg, dtype=parse_dtype(dtype), rngs=nnx.Rngs(seed))
    return Policy(model, recipe=recipe)
