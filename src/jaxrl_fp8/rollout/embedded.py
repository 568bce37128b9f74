"""The embedded JAX rollout engine: the trainer's own model and ops, a KV cache, batched sampling.

Why it exists: on one machine (and in every test) rollout must run with nothing else installed, and in
unified recipes (BF16/BF16, FP8/FP8) its log-probs must equal the trainer's recomputation bit for bit. It
gets there by construction, not by tolerance:

- the forward is `model.Qwen3` itself under the recipe's ROLLOUT `PrecisionPolicy` (same `ops`, same
  contract functions); weights are prepared once per version into exactly the operands the trainer's ops
  build on the fly (`ops.backends.fp8_weight_operands` for fp8-block, on the trainer's backend;
  `quantize_weight` for MXFP8/NVFP4, a BF16 cast for bf16), or are the `QuantizedWeight`s of an FP8 checkpoint;
- prompts are RIGHT-padded, so a token's rotary position is its cache slot; the model's reductions and
  attention are row invariant (`model.numerics`; `model.attention` "exact" or the "flash" kernels, whose key
  blocks are the cache's pages), so decoding token t gives the bits the trainer's full forward gives at t,
  whatever the batch, its padding or the cache length;
- log-probs and sampling follow `rollout.sampling` (full tempered distribution, IEEE temperature division,
  per-row seeds folded with the response step).

Generation, continuous batching (`EngineConfig.scheduler="continuous"`, the default of the separate
placement; host side in `rollout/scheduler.py`, device programs in `rollout/programs.py`): `max_batch` decode slots over ONE paged KV pool (`model.cache.PagedKVCache`,
`kv_pages` pages) for the whole call. The device decodes many steps in a `lax.while_loop` (no host round trip
per token) until a slot frees while rows wait, `refill_every` steps ran, or all are done; then the host
collects finished rows, releases their pages and admits waiting rows into the free slots (a prefill into the
shared pool, response token 0 drawn, slot state set in place; shapes fixed per call, so no recompile). The n
samples of a prompt (and identical prompts across requests) prefill it once and share its full pages; each
sample gets its own copy of the prompt's last page (copy-on-write). Rows whose pages do not fit wait.

Generation, static chunks (`scheduler="static"`, and the collocated placement): samples are sorted by length
and cut into chunks of at most `max_batch` rows; each chunk is padded to bucketed shapes (rows, prompt length,
cache length: powers of two) so few programs compile, prefilled in one call and decoded with a fixed-shape
step until every row of the chunk stopped; each row owns the pages its prompt + max_new_tokens need and a chunk
holds `kv_pages` pages at most. The decode loop is a `lax.while_loop` inside the same jit ("while", default)
or a jitted step driven from Python ("python").

Either way a sample is a pure function of (weights version, prompt, sampling params, seed): the same bits
whatever scheduler, slot, neighbours or sharing it ran with. Weight versions are swapped atomically between
`generate` calls (a lock), never inside one.

Placement (`config.rollout.placement`): by default the engine computes on one device (weights of a sharded
trainer are copied there); with a `sharding.CollocatedPlacement` it runs on the training mesh with the trainer's
sharded weights, taken by reference (see `sharding/rollout.py`). On a multi-process job the collocated
engine is SPMD: each `generate` all-gathers every process's requests, all processes decode the union with
the same programs, and each returns the samples of its own requests (`_union_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_fp8.model import loader
from jaxrl_fp8.model.attention import resolve_impl
from jaxrl_fp8.model.cache import PAGE_SIZE, PagePool, pages_for
from jaxrl_fp8.model.config import ModelConfig
from jaxrl_fp8.model.policy import Policy, from_pretrained
from jaxrl_fp8.model.qwen3 import Qwen3
from jaxrl_fp8.ops import backends
from jaxrl_fp8.precision import PrecisionPolicy, QuantizedWeight, Recipe, detect_hardware, quantize_weight
from jaxrl_fp8.precision import formats as F
from jaxrl_fp8.precision.names import hf_to_trainer
from jaxrl_fp8.rollout.programs import (  # noqa: F401  (_Carry, _draw, _prefill, _decode_step: benchmarks, tests)
    _Carry,
    _decode_jit,
    _decode_step,
    _draw,
    _generate_while,
    _Pages,
    _prefill,
    _prefill_jit,
    _Rows,
)
from jaxrl_fp8.rollout.scheduler import ContinuousScheduler, _bucket
from jaxrl_fp8.rollout.types import MAX_SEED, ModelInfo, Sample, SamplingParams, per_prompt_sampling, sample_seed

__all__ = ["EmbeddedEngine", "EngineConfig", "prepare_rollout_params"]

DECODE_LOOPS = ("while", "python")
SCHEDULERS = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine limits and scheduling knobs (validated at construction)."""

    max_batch: int = 64  # sample rows decoded together (continuous: the decode slots; static: one chunk)
    max_seq_len: int = 2048  # prompt + response tokens of one row (the KV cache length)
    eos_token_ids: tuple[int, ...] = ()  # stop ids added to every request unless ignore_eos
    # static chunks: "while": lax.while_loop in one jit; "python": a jitted step per token
    decode_loop: str = "while"
    min_prompt_bucket: int = 8
    min_cache_bucket: int = 16
    # the response-buffer bucket's floor: chunks asking for fewer new tokens share the program of this many (the
    # loop still stops when every row is done); e.g. a 1-token and a 64-token request then compile once
    min_new_bucket: int = 1
    # True: every chunk runs at (max_batch rows, max_seq_len prompt/cache/response), so exactly one program
    # compiles (steady serving, tests); False: shapes are bucketed to powers of two per chunk. The continuous
    # scheduler then prefills max_batch x max_seq_len tokens per prefill call (max_prefill_tokens does not apply):
    # for tests and small engines.
    static_shapes: bool = False
    seed: int = 0  # draws the base seed of requests that bring none
    model_path: str = ""
    # KV page budget (0: max_batch rows of max_seq_len): the pool of one generate call (continuous) or of one
    # chunk (static); rows whose pages do not fit wait; a row that can never fit is rejected
    kv_pages: int = 0
    # slots per KV page (0: the flash kernel's key block, 128, when it runs, else 16); a row's pages hold its
    # prompt + max_new_tokens rounded up to a page
    page_size: int = 0
    # "continuous": decode slots refilled as rows finish (the separate placement); "static": chunks decoded until
    # their last row stops (always used by the collocated placement)
    scheduler: str = "continuous"
    refill_every: int = 64  # continuous: most decode steps on device between two host refills
    # continuous: while rows wait, the device stops for a refill once this many slots finished during its call (or
    # as many as rows wait, if fewer); 0: max(1, max_batch // 32). A refill is a host round trip of several
    # programs (collect, prefill, place): one at every finish is 770 refills in a 1024-row rollout of 256 slots and
    # 19 % fewer tokens/s than 152 (decision record 0008); the price of a larger batch is finished slots idling a few
    # steps in a weight-bound step
    refill_batch: int = 0
    max_prefill_tokens: int = 8192  # continuous: tokens (bucketed rows x prompt length) of one prefill call
    prefix_sharing: bool = True  # continuous: a prompt's samples share its KV pages (prefilled once)
    progress: bool = False  # continuous: a tqdm bar with rows done, tokens/s and active slots

    @property
    def effective_refill_batch(self) -> int:
        return self.refill_batch or max(1, self.max_batch // 32)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in ("max_batch", "max_seq_len", "min_prompt_bucket", "min_cache_bucket", "min_new_bucket",
                     "refill_every", "max_prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        for name in ("kv_pages", "page_size", "refill_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"EngineConfig.{name} must be an int >= 0 (0: the default), got {v!r}")
        if self.max_seq_len < 2:
            raise ValueError(f"EngineConfig.max_seq_len must be >= 2 (a prompt token and a response token), got {self.max_seq_len}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"EngineConfig.scheduler={self.scheduler!r}; expected one of {SCHEDULERS}")
        for name in ("prefix_sharing", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.decode_loop not in DECODE_LOOPS:
            raise ValueError(f"EngineConfig.decode_loop={self.decode_loop!r}; expected one of {DECODE_LOOPS}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"EngineConfig.seed must be in [0, {MAX_SEED}], got {self.seed}")


# ---------------------------------------------------------------------------------------------------------
# Weights: master / checkpoint parameters -> the operands the rollout format computes with


def rollout_operand(value, fmt: str | None):
    """A projection weight as the rollout format consumes it; bit-identical to what `ops` builds on the fly.

    fp8-block: `ops.backends.fp8_weight_operands` (the trainer's own quantizer, on the backend the trainer's GEMM
    picks: the Pallas kernel on Hopper) wrapped as a QuantizedWeight;
    mxfp8/nvfp4: `precision.quantize_weight`; bf16: a BF16 cast (ops casts to BF16 anyway); None: as is.
    A QuantizedWeight already in `fmt` (an FP8 checkpoint) is used as loaded.
    """
    if fmt is None:
        return value
    if isinstance(value, QuantizedWeight):
        if value.fmt == fmt:
            return value
        value = value.dequantize(jnp.float32)  # the model would do this on every call; do it once
    if fmt == F.BF16:
        return jnp.asarray(value).astype(jnp.bfloat16)
    if fmt == F.FP8_BLOCK:
        q, s = backends.fp8_weight_operands(value)
        return QuantizedWeight(q, s, None, F.FP8_BLOCK, int(value.shape[-1]))
    return quantize_weight(value, fmt)


def prepare_rollout_params(model: Qwen3, precision: PrecisionPolicy | None):
    """(graphdef, state) of `model` with every projection weight replaced by its rollout operand (traceable:
    the engine runs it as one program, `_prepare_one_device`)."""
    graphdef, state = nnx.split(model)
    items = []
    for path, var in nnx.to_flat_state(state):  # new Variables: the caller's model is never modified
        tp = loader.trainer_path(path)
        value = var.get_value()
        fmt = None if precision is None else precision.projection_format(tp)
        if fmt is not None:
            value = rollout_operand(value, fmt)
        items.append((path, var.replace(value)))
    return graphdef, nnx.from_flat_state(items)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _prepare_one_device(graphdef, state, precision: PrecisionPolicy):
    """The separate placement's weight push as ONE program: run eagerly, every quantizer was a string of small
    dispatches per tensor (fp8_block on the H200: 0.16-0.30 s a push for a 6-layer slice, bf16's casts 0.02 s).
    Same functions, same bits (the contract's quantizers are jit-invariant; tests/rollout/test_embedded.py)."""
    return prepare_rollout_params(nnx.merge(graphdef, state), precision)[1]


@dataclasses.dataclass(frozen=True)
class _Weights:
    """One immutable weight version: what a `generate` call snapshots at its start."""

    graphdef: Any
    state: Any
    version: str
    dtype: Any  # activation / KV-cache dtype (the embedding's)




def _on_one_device(model: Qwen3) -> Qwen3:
    """Separate placement: weights spread over several devices (a sharded trainer's) are copied to one device
    first, so the engine's programs run unsharded there (device to device; no host round trip)."""
    graphdef, state = nnx.split(model)
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    if all(len(x.sharding.device_set) == 1 for x in leaves):
        return model
    device = jax.local_devices()[0]
    return nnx.merge(graphdef, jax.device_put(state, device))


# ---------------------------------------------------------------------------------------------------------
# Scheduling helpers (host side)


@dataclasses.dataclass
class _Row:
    prompt_index: int
    sample_index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int


class EmbeddedEngine:
    """A `RolloutEngine` that runs the trainer's model in-process (see the module docstring).

    model_or_params: a `model.Policy`, a `model.Qwen3`, or a dict {trainer path: array | QuantizedWeight}
        (then `config` is the `ModelConfig`).
    recipe: the precision recipe; the engine computes in `recipe.rollout_format`. None: the parameters' dtype.
    policy: the training-side `PrecisionPolicy` (per-layer exceptions); its rollout twin is
        `policy.with_format(recipe.rollout_format)`. Default: from the Policy, else the recipe's plain policy.
    placement: None ("separate": the engine computes on one device; sharded weights it is handed are copied
        there) or a `sharding.CollocatedPlacement` ("collocated": on the training mesh with the trainer's
        sharded weights, expert-parallel MoE, rows split over the batch axes; see sharding/rollout.py).
    """

    def __init__(
        self,
        model_or_params,
        config: ModelConfig | None = None,
        *,
        recipe: Recipe | None = None,
        policy: PrecisionPolicy | None = None,
        max_batch: int = 64,
        max_seq_len: int = 2048,
        eos_token_ids: Sequence[int] = (),
        decode_loop: str = "while",
        static_shapes: bool = False,
        seed: int = 0,
        model_path: str = "",
        weight_version: str = "0",
        engine_config: EngineConfig | None = None,
        placement=None,
    ):
        self.config = engine_config or EngineConfig(
            max_batch=max_batch, max_seq_len=max_seq_len, eos_token_ids=tuple(eos_token_ids),
            decode_loop=decode_loop, static_shapes=static_shapes, seed=seed, model_path=model_path,
        )
        model, recipe, policy = self._resolve_model(model_or_params, config, recipe, policy)
        self.model_config: ModelConfig = model.cfg
        self.placement = placement
        if recipe is not None:
            try:
                hardware = detect_hardware()
            except ValueError as e:  # an accelerator the table does not know: run, but say so
                logging.getLogger(__name__).warning("not validating recipe %s for this device: %s", recipe.name, e)
            else:
                recipe.validate_for(hardware)
        self.recipe = recipe
        cfg = self.model_config
        if recipe is None:
            self.precision = None
        else:
            base = policy or PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
            self.precision = base.with_format(recipe.rollout_format).with_kv_cache(recipe.kv_cache)
        for t in self.config.eos_token_ids:
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"eos_token_ids holds {t}, outside the vocabulary [0, {cfg.vocab_size})")
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(self.config.seed)
        self._paused = False
        self._weights = self._prepare(model, str(weight_version))
        self.model_path = self.config.model_path
        self.last_stats: dict[str, float] = {}
        self._page_size, self._kv_pages = self._page_layout()

    @property
    def _attention(self) -> str:
        """The attention the current weights run (their dtype decides whether the flash kernels take them)."""
        cfg = self.model_config
        return resolve_impl(cfg.attention_impl, cfg.head_dim, self._weights.dtype)

    def _page_layout(self) -> tuple[int, int]:
        """(slots per page, pages of the pool) of the paged cache (the separate placement; collocated rows are split
        over devices and keep a dense cache). Pages are the flash kernels' key block wherever BF16 weights would
        run them (a trainer may hand FP32 weights first and BF16 later); other attention reads any page size. A
        budget smaller than one max_seq_len row is allowed: requests whose row cannot fit are rejected by `_rows`."""
        ec, cfg = self.config, self.model_config
        try:
            flash = resolve_impl(cfg.attention_impl, cfg.head_dim, jnp.bfloat16) == "flash"
        except ValueError:  # "flash" forced on a model the kernels do not take: the first forward says so
            flash = False
        ps = ec.page_size or (PAGE_SIZE if flash else 16)
        if flash and ps != PAGE_SIZE:
            raise ValueError(f"EngineConfig.page_size={ps}: the flash attention kernel reads pages of {PAGE_SIZE} slots "
                             "(its key block); use 0 or 128")
        return ps, ec.kv_pages or ec.max_batch * pages_for(ec.max_seq_len, ps)

    @property
    def paged(self) -> bool:
        return self.placement is None

    @property
    def scheduler(self) -> str:
        """The scheduler `generate` runs: EngineConfig.scheduler, except "static" for the collocated placement."""
        return self.config.scheduler if self.placement is None else "static"

    def _row_pages(self, row: "_Row") -> int:
        return pages_for(len(row.prompt) + row.params.max_new_tokens, self._page_size)

    # -------------------------------------------------------------------------------------- weights
    @staticmethod
    def _resolve_model(model_or_params, config, recipe, policy):
        if isinstance(model_or_params, Policy):
            p = model_or_params
            return p.model, recipe if recipe is not None else p.recipe, policy if policy is not None else p.train_precision
        if isinstance(model_or_params, Qwen3):
            return model_or_params, recipe, policy
        if isinstance(model_or_params, dict):
            if not isinstance(config, ModelConfig):
                raise ValueError("EmbeddedEngine(params_dict, config): config must be the ModelConfig of the params")
            dtype = jnp.asarray(model_or_params["embed.embedding"]).dtype if "embed.embedding" in model_or_params else jnp.bfloat16
            return loader.build_model(config, model_or_params, dtype=dtype), recipe, policy
        raise TypeError(f"EmbeddedEngine needs a model.Policy, a model.Qwen3 or a params dict; got {type(model_or_params).__name__}")

    def _prepare(self, model: Qwen3, version: str) -> _Weights:
        if model.cfg != self.model_config:
            raise ValueError(
                "new weights have a different model config than the engine was built with "
                f"(engine: {self.model_config}, new: {model.cfg}); start a new engine for another architecture"
            )
        if self.placement is not None:  # on the training mesh: by reference, quantized in one sharded program
            graphdef, state = nnx.split(model)
            state = self.placement.prepare(graphdef, state, self._prepare_state)
        else:
            model = _on_one_device(model)
            if self.precision is None:
                graphdef, state = prepare_rollout_params(model, None)
            else:
                graphdef, state = nnx.split(model)
                state = _prepare_one_device(graphdef, state, self.precision)
        jax.block_until_ready(state)
        return _Weights(graphdef, state, version, model.dtype)

    @functools.cached_property
    def _prepare_state(self):
        precision = self.precision

        def prepare(graphdef, state):
            return prepare_rollout_params(nnx.merge(graphdef, state), precision)[1]

        return prepare

    def _swap(self, weights: _Weights) -> None:
        with self._lock:  # waits for a running generate: a sample never mixes two versions
            self._weights = weights

    def update_params(self, model_or_params, weight_version: str) -> None:
        """In-process update from a `Policy`, a `Qwen3` or a {trainer path: array} dict (the fast path)."""
        model, _, _ = self._resolve_model(model_or_params, self.model_config, None, None)
        self._swap(self._prepare(model, str(weight_version)))

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]], weight_version: str) -> None:
        """Update from (HF name, array) pairs, e.g. `converters.export.export_weights` buckets.

        Float arrays are master / BF16 values; block-FP8 pairs (`X.weight` e4m3 + `X.weight_scale_inv`) become
        `QuantizedWeight`s used as sent (the exporter runs the contract's quantizer, so they equal what the
        trainer's ops compute from the masters). Tensors not named keep their current values; a subset of the
        experts of a layer updates only those experts. Nothing changes if any tensor is rejected.
        Note: high-precision tensors (norms, embeddings, router, lm_head) are used as sent, so export them in
        the trainer's dtype (not rounded to BF16) when rollout must match the trainer bit for bit.
        """
        if self.placement is not None and self.placement.multi_process:
            raise ValueError("update_weights: with config.rollout.placement='collocated' on a multi-process job the engine "
                             "takes weights from the trainer (update_params) or from disk (update_weights_from_disk), "
                             "not from host buckets")
        current = self._weights
        arrays: dict[str, Any] = {}
        scales: dict[str, Any] = {}
        for name, array in named_arrays:
            if name.endswith(".weight_scale_inv"):
                scales[name[: -len("_scale_inv")]] = array
            elif name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
                raise ValueError(f"update_weights: {name!r} belongs to an MXFP8/NVFP4 export; the embedded engine takes "
                                 "float or block-FP8 (weight + weight_scale_inv) tensors")
            else:
                arrays[name] = array
        for wname in scales:
            if wname not in arrays:
                raise ValueError(f"update_weights: {wname + '_scale_inv'!r} arrived without {wname!r}")
        updates: dict[str, dict[int | None, Any]] = {}
        hf_name_of: dict[str, str] = {}
        for name, array in arrays.items():
            try:
                tp, expert = hf_to_trainer(name)
            except KeyError as e:
                raise ValueError(f"update_weights: {e.args[0]}") from None
            updates.setdefault(tp, {})[expert] = self._incoming(name, array, scales.get(name))
            hf_name_of.setdefault(tp, name)
        flat = dict(nnx.to_flat_state(current.state))
        by_tp = {loader.trainer_path(p): p for p in flat}
        new_values = {}
        for tp, members in updates.items():
            if tp not in by_tp:
                raise ValueError(f"update_weights: {hf_name_of[tp]!r} is not a parameter of this model")
            old = flat[by_tp[tp]].get_value()
            fmt = None if self.precision is None else self.precision.projection_format(tp)
            new_values[tp] = self._updated_value(hf_name_of[tp], old, members, fmt, current.dtype)
        items = []
        for path, var in flat.items():
            tp = loader.trainer_path(path)
            items.append((path, var.replace(new_values[tp]) if tp in new_values else var))
        state = nnx.from_flat_state(items)
        if self.placement is not None:  # host buckets -> the mesh layout of the other rollout operands
            state = self.placement.place(state)
        jax.block_until_ready(state)
        self._swap(_Weights(current.graphdef, state, str(weight_version), current.dtype))

    @staticmethod
    def _incoming(name: str, array, scale):
        """One sent tensor as a float jax array, or a QuantizedWeight for a block-FP8 pair."""
        a = np.asarray(array)
        if a.dtype == np.dtype(jnp.float8_e4m3fn):
            if scale is None:
                raise ValueError(f"update_weights: {name!r} is FP8 but {name + '_scale_inv'!r} was not sent")
            s = np.asarray(scale, np.float32)
            want = (-(-a.shape[0] // 128), -(-a.shape[1] // 128)) if a.ndim == 2 else None
            if want is None or s.shape != want:
                raise ValueError(f"update_weights: {name + '_scale_inv'!r} has shape {list(s.shape)}; expected {list(want or ())} "
                                 f"(128x128 blocks of {list(a.shape)})")
            return QuantizedWeight(jnp.asarray(a), jnp.asarray(s), None, F.FP8_BLOCK, int(a.shape[-1]))
        if scale is not None:
            raise ValueError(f"update_weights: {name!r} has a weight_scale_inv but dtype {a.dtype}, not float8_e4m3fn")
        if not np.issubdtype(a.dtype, np.floating) and a.dtype != np.dtype(jnp.bfloat16):
            raise ValueError(f"update_weights: {name!r} must be a float array, got {a.dtype}")
        return jnp.asarray(a)

    def _updated_value(self, name, old, members: dict, fmt, dtype):
        """The new rollout value of one parameter (a whole stack, or some experts of it)."""
        old_shape = tuple(old.shape)
        # Without a rollout format, values are stored like the parameters (a kept-FP8 weight becomes dense).
        plain_dtype = dtype if isinstance(old, QuantizedWeight) else old.dtype

        def checked(v, shape):
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"update_weights: {name!r} expects shape {list(shape)}, got {list(v.shape)}")
            return v

        def prepare(v):  # sent values -> what the rollout format computes with
            if isinstance(v, QuantizedWeight):
                return rollout_operand(v, fmt) if fmt is not None else v.dequantize(plain_dtype)
            return v.astype(plain_dtype) if fmt is None else rollout_operand(v.astype(jnp.float32), fmt)

        if None in members:  # a plain (non-expert) tensor
            return prepare(checked(members[None], old_shape))
        e_total = old_shape[0]
        bad = [e for e in members if not 0 <= e < e_total]
        if bad:
            raise ValueError(f"update_weights: {name!r}: this layer has {e_total} experts; got expert {bad[0]}")
        for e in members:
            checked(members[e], old_shape[1:])
        kinds = {isinstance(v, QuantizedWeight) for v in members.values()}
        if len(kinds) > 1:
            raise ValueError(f"update_weights: the experts of {name!r}'s layer arrived partly FP8, partly float; "
                             "all experts of a layer share one format")
        if set(members) == set(range(e_total)):  # every expert: restack
            return prepare(jax.tree.map(lambda *xs: jnp.stack(xs), *[members[e] for e in range(e_total)]))
        if fmt is None and isinstance(old, QuantizedWeight):  # dense storage: merge into the dequantized stack
            current = old.dequantize(plain_dtype)
            return current.at[jnp.asarray(sorted(members))].set(jnp.stack([prepare(members[e]) for e in sorted(members)]))
        # a subset of experts: re-prepare those slices only (every format quantizes experts independently)
        out = old
        for e in sorted(members):
            piece = prepare(jax.tree.map(lambda x: x[None], members[e]))
            out = jax.tree.map(lambda full, new: full.at[e].set(new[0]), out, piece)
        return out

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Load an HF checkpoint directory (BF16/FP32 or block FP8) through `model.from_pretrained`."""
        keep = self.precision is not None and self.precision.fmt == F.FP8_BLOCK
        policy = from_pretrained(
            path, dtype=str(jnp.dtype(self._weights.dtype)), quantized="keep" if keep else "dequantize",
            attention_impl=self.model_config.attention_impl,
        )
        self._swap(self._prepare(policy.model, str(weight_version)))
        self.model_path = path

    def weight_nbytes(self) -> dict[str, int]:
        """Bytes the current version holds per trainer path, as the rollout format stores them (benchmarks)."""
        return {
            loader.trainer_path(path): sum(int(leaf.nbytes) for leaf in jax.tree.leaves(var.get_value()))
            for path, var in nnx.to_flat_state(self._weights.state)
        }

    # ------------------------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> str:
        return self._weights.version

    def set_weight_version(self, weight_version: str) -> None:
        with self._lock:
            self._weights = dataclasses.replace(self._weights, version=str(weight_version))

    def health(self) -> bool:
        return True

    def model_info(self) -> ModelInfo:
        cfg = self.model_config
        return ModelInfo(
            model_path=self.model_path,
            weight_version=self.weight_version,
            vocab_size=cfg.vocab_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_experts_per_tok=max(cfg.num_experts_per_tok, 1),
            max_total_tokens=self.config.max_seq_len,
            supports_routed_experts=True,
        )

    def flush_cache(self) -> None:
        """Nothing to flush: KV caches live only inside one `generate` call (no prefix cache)."""

    def pause(self) -> None:
        """Recorded only: a running `generate` completes; the HTTP server gates new work."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    # ------------------------------------------------------------------------------------ generate
    def _rows(self, prompts, sampling_params) -> list[_Row]:
        cfg = self.model_config
        rows = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            prompt = tuple(int(t) for t in prompt)
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
            if len(prompt) + sp.max_new_tokens > self.config.max_seq_len:
                raise ValueError(
                    f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens {sp.max_new_tokens} exceeds max_seq_len "
                    f"{self.config.max_seq_len}"
                )
            need = pages_for(len(prompt) + sp.max_new_tokens, self._page_size)
            if self.paged and need > self._kv_pages:
                raise ValueError(
                    f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens {sp.max_new_tokens} need {need} KV pages of "
                    f"{self._page_size} slots; EngineConfig.kv_pages={self._kv_pages} can never hold that row"
                )
            base = sp.seed if sp.seed is not None else int(self._rng.integers(0, MAX_SEED + 1))
            for j in range(sp.n):
                rows.append(_Row(i, j, prompt, sp, sample_seed(base, j)))
        return rows

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        params = per_prompt_sampling(sampling, len(prompts))
        t0 = time.perf_counter()
        with self._lock:
            if self.placement is not None and self.placement.multi_process:
                # every process runs the same programs over the union of all processes' requests
                rows, own, want_routed = self._union_rows(prompts, params, return_routed_experts)
            else:
                rows = self._rows(prompts, params)
                own, want_routed = range(len(rows)), return_routed_experts
            weights = self._weights
            stats: dict[str, float] = {}
            if self.scheduler == "continuous":
                run = ContinuousScheduler(self, weights, rows, [self._stop_ids(r.params) for r in rows], want_routed)
                results, stats = run.run(), run.stats
            else:
                order = sorted(range(len(rows)), key=lambda r: (len(rows[r].prompt) + rows[r].params.max_new_tokens, r))
                results: list[Sample | None] = [None] * len(rows)
                chunks = self._chunks(rows, order)
                for chunk_rows in chunks:
                    samples = self._run_chunk(weights, [rows[r] for r in chunk_rows], want_routed)
                    for r, s in zip(chunk_rows, samples):
                        results[r] = s
                stats["chunks"] = float(len(chunks))
        out = [results[r] for r in own]
        if want_routed and not return_routed_experts:  # another process asked for them
            for s in out:
                s.routed_experts = None
        elapsed = time.perf_counter() - t0
        tokens_out = sum(s.response_ids.size for s in out)
        self.last_stats = {"rows": float(len(out)), "response_tokens": float(tokens_out), "seconds": elapsed, **stats}
        if len(rows) != len(out):
            self.last_stats["union_rows"] = float(len(rows))
        return out

    def _chunks(self, rows: list[_Row], order: list[int]) -> list[list[int]]:
        """Consecutive rows of `order`, at most max_batch per chunk and (paged) at most kv_pages pages."""
        chunks: list[list[int]] = []
        current: list[int] = []
        used = 0
        for r in order:
            need = self._row_pages(rows[r]) if self.paged else 0
            if current and (len(current) == self.config.max_batch or used + need > self._kv_pages):
                chunks.append(current)
                current, used = [], 0
            current.append(r)
            used += need
        if current:
            chunks.append(current)
        return chunks

    def _union_rows(self, prompts, params, want_routed: bool) -> tuple[list[_Row], range, bool]:
        """Multi-process collocated: (rows of every process's requests in process order, the indices of this
        process's rows among them, whether any process wants routed experts). A collective (host all-gather):
        every process must call `generate` the same number of times.

        Each process validates its own requests and draws the base seeds of those without one (from its own
        engine rng, as a one-process engine would) BEFORE the gather, so the union carries explicit seeds and
        every process schedules bit-identical rows. A request rejected by any process fails the call on all."""
        from jaxrl_fp8 import distributed

        try:
            local = self._rows(prompts, params)
            payload: dict[str, Any] = {"routed": bool(want_routed), "requests": [
                [list(r.prompt), dataclasses.asdict(dataclasses.replace(r.params, seed=r.seed))]
                for r in local if r.sample_index == 0  # sample 0's seed is the prompt's base seed
            ]}
        except ValueError as e:
            local, payload = None, {"error": str(e)}
        everyone = distributed.allgather_json(payload)
        me = jax.process_index()
        errors = [(p, x["error"]) for p, x in enumerate(everyone) if "error" in x]
        if errors:
            if local is None:
                raise ValueError(payload["error"])
            p, msg = errors[0]
            raise ValueError(f"generate: process {p} rejected its request ({msg}); with config.rollout.placement="
                             "'collocated' every process runs the union of all processes' requests, so none ran")
        rows: list[_Row] = []
        own = range(0)
        for p, x in enumerate(everyone):
            if p == me:  # this process's own rows (the same rows the others rebuild from the JSON)
                own = range(len(rows), len(rows) + len(local))
                rows.extend(local)
                continue
            for i, (prompt, sp) in enumerate(x["requests"]):
                sp = SamplingParams(**sp)
                rows.extend(_Row(i, j, tuple(prompt), sp, sample_seed(sp.seed, j)) for j in range(sp.n))
        return rows, own, any(x["routed"] for x in everyone)

    def _run_chunk(self, weights: _Weights, chunk: list[_Row], want_routed: bool) -> list[Sample]:
        cfg = self.config
        n = len(chunk)
        plen = [len(r.prompt) for r in chunk]
        max_new = max(r.params.max_new_tokens for r in chunk)
        if cfg.static_shapes:
            b, p_b, s_b, n_b = cfg.max_batch, cfg.max_seq_len, cfg.max_seq_len, cfg.max_seq_len
        else:
            b = _bucket(n, 1, cfg.max_batch)
            p_b = _bucket(max(plen), cfg.min_prompt_bucket)
            s_b = _bucket(max(len(r.prompt) + r.params.max_new_tokens for r in chunk), cfg.min_cache_bucket)
            n_b = _bucket(max(max_new, 1), cfg.min_new_bucket)
        if self.placement is not None:  # >= 2 rows on every device of the batch axes (padding rows are done)
            b = self.placement.rows_for(b)
        pages = page_table = None
        if self.paged:
            ps = self._page_size
            s_b = pages_for(s_b, ps) * ps
            need = [self._row_pages(r) for r in chunk]
            num_pages = self._kv_pages if cfg.static_shapes else min(_bucket(sum(need), 1), self._kv_pages)
            pool = PagePool(num_pages)
            table = pool.table([pool.allocate(n) for n in need] + [[]] * (b - n), s_b // ps)
            pages, page_table = _Pages(num_pages, ps), jnp.asarray(table)
        elif self._attention == "flash":  # the dense cache is read as pages of the kernel's key block
            s_b = pages_for(s_b, PAGE_SIZE) * PAGE_SIZE
        stops = [self._stop_ids(r.params) for r in chunk]
        m = max(1, max(len(s) for s in stops))

        ids = np.zeros((b, p_b), np.int32)
        lens = np.ones((b,), np.int32)
        temp = np.zeros((b,), np.float32)
        top_k = np.full((b,), -1, np.int32)
        top_p = np.ones((b,), np.float32)
        seeds = np.zeros((b,), np.uint32)
        mnew = np.zeros((b,), np.int32)  # padding rows: 0 -> done from the start
        stop_ids = np.full((b, m), -1, np.int32)
        for i, r in enumerate(chunk):
            ids[i, : len(r.prompt)] = r.prompt
            lens[i] = len(r.prompt)
            temp[i] = r.params.temperature
            top_k[i] = r.params.top_k
            top_p[i] = r.params.top_p
            seeds[i] = r.seed
            mnew[i] = r.params.max_new_tokens
            stop_ids[i, : len(stops[i])] = stops[i]
        put = jnp.asarray if self.placement is None else self.placement.put_rows
        fetch = np.asarray if self.placement is None else self.placement.fetch  # multi-process: a collective
        rows = _Rows(put(temp), put(top_k), put(top_p), put(seeds), put(mnew), put(stop_ids))
        place = self.placement
        if cfg.decode_loop == "while":
            carry, prompt_routed = _generate_while(
                weights.graphdef, weights.state, put(ids), put(lens), rows, page_table,
                precision=self.precision, cache_len=s_b, max_new=n_b, dtype=weights.dtype, placement=place, pages=pages,
            )
        else:
            carry, prompt_routed = _prefill_jit(
                weights.graphdef, weights.state, self.precision, put(ids), put(lens), rows, s_b, n_b, weights.dtype, place,
                pages, page_table,
            )
            for _ in range(1, max_new):
                if bool(fetch(jnp.all(carry.done))):
                    break
                carry = _decode_jit(weights.graphdef, weights.state, rows, carry, precision=self.precision, placement=place)
        tokens, logprobs, count = fetch(carry.tokens), fetch(carry.logprobs), fetch(carry.count)
        routed = fetch(carry.routed) if want_routed else None
        p_routed = fetch(prompt_routed) if want_routed else None
        out = []
        for i, r in enumerate(chunk):
            t = int(count[i])
            resp = tokens[i, :t]
            finish = "stop" if t > 0 and int(resp[-1]) in stops[i] else "length"
            experts = None
            if want_routed:
                experts = np.concatenate([p_routed[i, : plen[i]], routed[i, : max(t - 1, 0)]], axis=0)
                experts = experts[: plen[i] + t - 1]
            out.append(Sample(
                prompt_ids=np.asarray(r.prompt, np.int32), response_ids=resp, rollout_logprobs=logprobs[i, :t],
                finish_reason=finish, weight_version=weights.version, routed_experts=experts,
                prompt_index=r.prompt_index, sample_index=r.sample_index, seed=r.seed,
            ))
        return out

    def _stop_ids(self, sp: SamplingParams) -> tuple[int, ...]:
        ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids += [t for t in self.config.eos_token_ids if t not in ids]
        return tuple(ids)
