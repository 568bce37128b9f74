"""The unified low-precision RL loop (one step):

    prompts -> rollout engine (weights v, rollout format) -> rewards -> group advantages
    -> old log-probs recomputed in the training format with R3 replay (and mismatch metrics vs rollout)
    -> minibatch updates: PPO clip x TIS (+ KL, entropy), grads in the recipe's backward mode,
       optax AdamW on FP32 masters (non-finite steps skipped and counted)
    -> push weights through the contract to the engine (version v+1) -> metrics, checkpoint.

The trainer only sees the `RolloutEngine` protocol; which engine runs is `train.py`'s choice.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_fp8 import distributed
from jaxrl_fp8.model import loader
from jaxrl_fp8.ops.backends import prepare_fp8_weight
from jaxrl_fp8.ops.operands import PreparedWeight
from jaxrl_fp8.precision import formats as F
from jaxrl_fp8.rl import advantages as adv_lib
from jaxrl_fp8.rl.batch import TrainBatch, build_batch
from jaxrl_fp8.rl.losses import PolicyLossConfig, combine_micro_metrics, policy_loss
from jaxrl_fp8.rl.mismatch import mismatch_metrics
from jaxrl_fp8.rl.rewards import compute_rewards
from jaxrl_fp8.rl.routing_stats import decode_experts_touched
from jaxrl_fp8.rl.token_stats import chunked_token_stats, token_stats
# The rollout's log-prob convention (log_softmax(logits / T), row invariant): one definition for sampler and learner.
from jaxrl_fp8.rollout.types import SamplingParams, prompt_seed

__all__ = ["TrainerSettings", "Trainer", "apply_if_finite", "clip_by_global_norm", "make_optimizer"]


def apply_if_finite(optimizer, grads, params, opt_state, finite, global_norm=None):
    """(params, opt_state) after one `optimizer` step on `grads` where `finite`, else as they were, bit for bit.

    A `lax.cond`, not a `where` over the updated and the old trees: the `where` is one more pass over every master and
    moment (and keeps both trees alive: copies of the donated buffers), while the cond's identity branch returns the
    donated buffers untouched and its update branch writes them in place (experiments/benchmarks/optimizer_step.py
    times both). `global_norm`, the caller's norm of `grads`, reaches the optimizer as an extra argument
    (`clip_by_global_norm`): XLA does not share a computation across the cond's boundary, so the clip would otherwise
    read every gradient again inside the branch."""
    optimizer = optax.with_extra_args_support(optimizer)
    extra = {} if global_norm is None else {"global_norm": global_norm}

    def step(state):
        params, opt_state = state
        updates, new_opt = optimizer.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), new_opt

    return jax.lax.cond(finite, step, lambda state: state, (params, opt_state))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm`'s clip (the same ops, so the same bits, and the same empty state, so the same
    checkpoints) that takes the updates' global norm as the extra argument `global_norm` when the caller has it
    (`apply_if_finite`), else computes it."""

    def update_fn(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        g_norm = optax.tree.norm(updates) if global_norm is None else global_norm
        trigger = jnp.squeeze(g_norm < max_norm)
        clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    total_steps: int
    prompts_per_step: int
    n_samples: int
    seq_len: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    routing_replay: bool
    advantage: str
    std_normalize: bool
    num_minibatches: int
    loss: PolicyLossConfig
    backward: str
    compute_dtype: Any
    seed: int
    eval_every_steps: int = 0
    use_ref: bool = False
    # True: sampled responses run to max_new_tokens (no stop ids, SGLang's ignore_eos), e.g. for benchmarks whose
    # step must have a fixed token count
    ignore_eos: bool = False
    # > 0: the old (and reference) log-probs are recomputed in chunks of this many rows instead of the whole rollout
    # batch at once, so that pass's peak memory (B x T x vocab float32 logits) does not grow with the batch.
    # A row's log-probs do not depend on the rows beside it (row-invariant model), so the values are the same.
    # Single-process only (multi-host batches are global arrays: the whole batch at once, as with 0).
    logprob_chunk_rows: int = 0
    # > 0: each minibatch's gradient is accumulated over micro-batches of this many rows (a lax.scan inside the one
    # update program), then ONE optimizer update per minibatch. Only one micro-batch's activations are live at a
    # time, so a minibatch - and with it the optimizer steps per rollout batch - is no longer capped by memory.
    # Same loss (every micro-batch is normalised by the whole minibatch's token / sequence count); the gradient
    # differs from the unsplit one only in float32 summation order. 0: the whole minibatch at once.
    micro_batch_rows: int = 0
    # > 0: the head, log-softmax and entropy of the loss (and of the old-log-prob pass) run over chunks of this many
    # token positions, each recomputed in the backward (`rl.token_stats`): no [B, T, V] float32 logits in memory.
    # Same values (row-invariant head and reductions). 0: the whole batch's logits at once.
    logit_chunk_tokens: int = 0


def make_optimizer(rl_cfg, total_updates: int) -> tuple[optax.GradientTransformation, Callable]:
    lr = rl_cfg.learning_rate
    if rl_cfg.lr_schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(rl_cfg.warmup_steps, 1), max(total_updates, 2), end_value=0.1 * lr)
    elif rl_cfg.warmup_steps:
        schedule = optax.linear_schedule(0.0, lr, rl_cfg.warmup_steps)
    else:
        schedule = optax.constant_schedule(lr)
    chain = [clip_by_global_norm(rl_cfg.grad_clip)] if rl_cfg.grad_clip > 0 else []
    chain.append(optax.adamw(schedule, b1=rl_cfg.adam_b1, b2=rl_cfg.adam_b2, eps=rl_cfg.adam_eps, weight_decay=rl_cfg.weight_decay))
    return optax.chain(*chain), schedule


class Trainer:
    """Owns the FP32 masters and optimizer state; drives rollout, scoring and updates."""

    # `_update`'s arguments donated to its program: the masters and Adam's moments, updated in place (without
    # donation the program holds the old and the new state at once: 12 B a parameter more, 37 GB of a
    # 3.1B-parameter slice on the H200)
    UPDATE_DONATED = (0, 1)

    def __init__(self, *, model, settings: TrainerSettings, optimizer, schedule, engine, tokenizer, loader, reward_fn,
                 train_policy, push_weights: Callable[[Any, str], None], rollout_version_prefix: str = "v", plan=None):
        self.s = settings
        self.graphdef, params = nnx.split(model)
        # FP32 masters in buffers of their own (a float32 model's arrays would otherwise be the masters, and the
        # update donates them: the caller's model would be left with deleted arrays)
        self.params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
        self.optimizer = optimizer
        self.schedule = schedule
        # Scale-out (jaxrl_fp8.sharding): state in its storage layout on the mesh, experts on their devices.
        # Masters are sharded before optimizer.init, so Adam's moments are created sharded (a 30B model's
        # moments do not fit on the one device the unsharded masters were initialised on).
        self.plan = plan
        if plan is not None:
            self.params = plan.shard(self.params)
        self.opt_state = optimizer.init(self.params)
        self.moe_impl = None
        self._sharded_update = None
        if plan is not None:
            from jaxrl_fp8.sharding import make_moe_impl

            self.opt_state = plan.shard(self.opt_state)
            if plan.mesh.size > 1 and model.cfg.is_moe:
                self.moe_impl = make_moe_impl(plan.mesh)
        # the frozen reference: its own buffers, as the update program donates (deletes) the masters' buffers
        self.ref_params = jax.tree.map(jnp.copy, self.params) if settings.use_ref else None
        self.engine = engine
        self.tokenizer = tokenizer
        self.loader = loader
        self.reward_fn = reward_fn
        self.train_policy = train_policy
        self.cfg = model.cfg
        self.step = 0
        self.skipped_updates = 0
        self._push = push_weights
        self._version_prefix = rollout_version_prefix
        self._cast_jit = jax.jit(lambda p: self._prepared(self._cast(p)))
        self._logprob_jit = jax.jit(self._logprobs)
        self._update_jit = jax.jit(self._update, donate_argnums=self.UPDATE_DONATED)

    @functools.cached_property
    def _mismatch_fn(self):
        """Multi-host: the mismatch metrics of the global batch, replicated to every process (built once)."""
        if jax.process_count() == 1:
            return mismatch_metrics
        return jax.jit(mismatch_metrics, static_argnums=(3, 4), out_shardings=self.plan.replicated())

    # -- pure pieces (jitted) -----------------------------------------------------------------------
    def compute_params(self, params):
        """The values the forward multiplies: masters cast to the compute dtype (quantization happens in ops), on a
        mesh with their FSDP splits gathered."""
        return self._constrain(self._cast(params))

    def _cast(self, params):
        """Masters in the compute dtype (weights already prepared, `_prepared`, pass through)."""
        cast = lambda x: x if isinstance(x, PreparedWeight) else x.astype(self.s.compute_dtype)  # noqa: E731
        return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, PreparedWeight))

    def _prepared(self, compute):
        """`compute` (the masters cast, `_cast`) with every fp8-block weight quantized once
        (`ops.operands.PreparedWeight`), so the update's micro-batch forwards and the log-prob phase's chunks reuse one quantization of the weights instead of each
        making its own (XLA does not hoist it out of the scan); with the fp8 backward also the transposed copies its
        dgrad multiplies (held for the whole update: 1 B a projection parameter that per-backward copies would free). The same quantizer on the same values: the same
        bits. Single device: a sharding plan constrains plain arrays, and there ops quantize in place."""
        if self.plan is not None:
            return compute
        items = []
        for path, var in nnx.to_flat_state(compute):
            value = var.get_value()
            if self.train_policy is not None and self.train_policy.projection_format(loader.trainer_path(path)) == F.FP8_BLOCK:
                value = prepare_fp8_weight(value, dgrad=self.s.backward == "fp8")
            items.append((path, var.replace(value)))
        return nnx.from_flat_state(items)

    @staticmethod
    def _unprepared(grads):
        """Gradients with respect to prepared weights -> with respect to their values (the operands' are zero)."""
        return jax.tree.map(lambda g: g.value if isinstance(g, PreparedWeight) else g, grads,
                            is_leaf=lambda x: isinstance(x, PreparedWeight))

    def _constrain(self, compute):
        return compute if self.plan is None else self.plan.constrain_compute(compute)

    def _forward_stats(self, params, tokens, routed, with_entropy: bool = True):
        """(log-probs, entropies or None) of `tokens[:, 1:]`, float32 [B, T - 1], under `params` (R3 replay): masters,
        or masters already cast to the compute dtype (`_cast`; casting them again is a no-op)."""
        model = nnx.merge(self.graphdef, self.compute_params(params))
        chunk, temp = self.s.logit_chunk_tokens, self.s.temperature
        out = model(tokens, routed_experts=routed, policy=self.train_policy, backward=self.s.backward,
                    moe_impl=self.moe_impl, head=chunk <= 0)
        if chunk > 0:
            hidden = out.hidden[:, :-1]
            return chunked_token_stats(hidden, model.head_weight(hidden.dtype), tokens[:, 1:], temp, chunk,
                                       with_entropy=with_entropy)
        return token_stats(out.logits[:, :-1], tokens[:, 1:], temp, with_entropy)

    def _logprobs(self, params, tokens, routed):
        return self._forward_stats(params, tokens, routed, with_entropy=False)[0]

    def _loss(self, params, mb, num_tokens, num_sequences=None):
        # the entropy is logged always; it enters the loss only with entropy_coef > 0
        logp, ent = self._forward_stats(params, mb["tokens"], mb.get("routed"))
        return policy_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], self.s.loss,
                           rollout_logp=mb["rollout_logp"] if self.s.loss.use_tis else None,
                           ref_logp=mb.get("ref_logp"), entropy=ent, num_tokens=num_tokens, num_sequences=num_sequences)

    def _grads(self, params, mb, num_tokens):
        """(loss, metrics, grads) of minibatch `mb`: at once, or summed over `micro_batch_rows`-row micro-batches.

        The masters are cast to the compute dtype once, outside the micro-batch loop (XLA does not hoist the casts
        out of the scan: on the H200 they were rerun for every micro-batch); the gradient with respect to a master
        is its cast's (the transpose of a cast is the cast back), so it is the same as differentiating the cast."""
        rows, micro = int(mb["tokens"].shape[0]), self.s.micro_batch_rows
        compute = self._prepared(self._cast(params))
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        to_masters = lambda g: jax.tree.map(lambda gc, p: gc.astype(p.dtype), self._unprepared(g), params)  # noqa: E731
        if micro <= 0 or micro >= rows:
            (loss, metrics), grads = grad_fn(compute, mb, num_tokens)
            return loss, metrics, to_masters(grads)
        if rows % micro:
            raise ValueError(f"rl.micro_batch_rows={micro} must divide the minibatch's {rows} rows")
        n = rows // micro
        # micro-batch j = rows j, j + n, j + 2n, ...: the reshape keeps the row axis where a mesh splits it
        split = lambda x: jnp.swapaxes(x.reshape((micro, n) + x.shape[1:]), 0, 1)
        micros = {k: split(v) for k, v in mb.items()}
        valid = mb["mask"] > 0
        num_sequences = jnp.sum(jnp.any(valid, axis=1).astype(jnp.float32))

        def body(acc, one):
            (loss, metrics), g = grad_fn(compute, one, num_tokens, num_sequences)
            count = jnp.sum((one["mask"] > 0).astype(jnp.float32))
            return jax.tree.map(jnp.add, acc, to_masters(g)), (loss, metrics, count)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, per_micro, counts) = jax.lax.scan(body, zeros, micros)
        return jnp.sum(losses), combine_micro_metrics(per_micro, counts), grads

    def _update(self, params, opt_state, mb, num_tokens):
        """One optimizer update; a non-finite loss or gradient leaves the masters and the optimizer state as they were
        (`apply_if_finite`)."""
        loss, metrics, grads = self._grads(params, mb, num_tokens)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_params, new_opt = apply_if_finite(self.optimizer, grads, params, opt_state, finite, grad_norm)
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite.astype(jnp.float32))
        return new_params, new_opt, metrics

    def apply_update(self, mb, num_tokens):
        """One optimizer update of the current masters on minibatch `mb` (multi-host: this process's rows), the loss
        normalised by `num_tokens` (the minibatch's global token count). Returns (params, opt_state, metrics); the
        caller stores them (the old state buffers are donated: `self.params` / `self.opt_state` are deleted)."""
        if self.plan is None:
            return self._update_jit(self.params, self.opt_state, mb, num_tokens)
        mb, num_tokens = self._sharded_inputs(mb, num_tokens)
        return self._sharded_update(self.params, self.opt_state, mb, num_tokens)

    def compiled_update(self, mb, num_tokens):
        """The sharded step compiled for `mb`'s shapes (`memory_analysis()`, `as_text()`). Once `apply_update` has run
        on these shapes it is the executable that ran (from jit's cache, no second compile)."""
        if self.plan is None:
            raise ValueError("compiled_update describes the sharded step: the Trainer needs a ShardingPlan")
        mb, num_tokens = self._sharded_inputs(mb, num_tokens)
        return self._sharded_update.lower(self.params, self.opt_state, mb, num_tokens).compile()

    def _sharded_inputs(self, mb, num_tokens):
        """The minibatch split by rows over the mesh, the token count replicated; the step jitted at first use."""
        mb = self.plan.put_batch(mb, process_local=jax.process_count() > 1)  # multi-host: each process its rows
        num_tokens = jax.device_put(jnp.float32(num_tokens), self.plan.replicated())
        if self._sharded_update is None:
            self._sharded_update = self.plan.jit_train_step(self._update, self.params, self.opt_state, mb)
        return mb, num_tokens

    # -- one RL step ----------------------------------------------------------------------------------
    def sampling(self, step: int, greedy: bool = False) -> SamplingParams:
        """The step's sampling parameters; `seed` is the step's base seed (`prompt_sampling` gives each prompt its own)."""
        stop = () if self.s.ignore_eos else tuple(self.tokenizer.stop_ids)
        return SamplingParams(temperature=0.0 if greedy else self.s.temperature, top_p=self.s.top_p, top_k=self.s.top_k,
                              max_new_tokens=self.s.max_new_tokens, stop_token_ids=stop, ignore_eos=self.s.ignore_eos,
                              n=1 if greedy else self.s.n_samples, seed=(self.s.seed * 1_000_003 + step) % (2**31 - 1))

    def prompt_sampling(self, step: int, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt of this process's batch, each with its own base seed (`rollout.prompt_seed` of
        the prompt's index in the global batch: processes hold equal batches): with one seed for the batch, sample j of
        every prompt would draw the same random stream."""
        sp = self.sampling(step)
        first = jax.process_index() * num_prompts
        return [dataclasses.replace(sp, seed=prompt_seed(sp.seed, first + i)) for i in range(num_prompts)]

    def rollout(self, batch, step: int):
        prompts = [list(map(int, ids)) for ids in batch.prompt_ids]
        samples = self.engine.generate(prompts, self.prompt_sampling(step, len(prompts)),
                                       return_routed_experts=self.s.routing_replay)
        responses = [self.tokenizer.decode(list(map(int, s.response_ids))) for s in samples]
        n = self.s.n_samples
        rewards = compute_rewards(self.reward_fn, [batch.prompts[i // n] for i in range(len(samples))], responses,
                                  [batch.answers[i // n] for i in range(len(samples))])
        return samples, rewards

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        if self.s.advantage == "grpo":
            return np.asarray(adv_lib.grpo_advantages(rewards, self.s.n_samples, std_normalize=self.s.std_normalize))
        if self.s.advantage == "rloo":
            return np.asarray(adv_lib.rloo_advantages(rewards, self.s.n_samples))
        return np.asarray(adv_lib.reinforce_advantages(rewards))

    def old_logprobs(self, params, tokens, routed):
        """Log-probs of `tokens` under `params` (training format, R3 replay), in chunks of `logprob_chunk_rows` rows."""
        n, chunk = int(tokens.shape[0]), self.s.logprob_chunk_rows
        compute = self._cast_jit(params)  # cast and fp8-block weights quantized once for all chunks
        if chunk <= 0 or chunk >= n or jax.process_count() > 1:
            return self._logprob_jit(compute, tokens, routed)
        parts = []
        for start in range(0, n, chunk):  # a shorter last chunk compiles its own program (once per run)
            sl = slice(start, min(start + chunk, n))
            parts.append(self._logprob_jit(compute, tokens[sl], None if routed is None else routed[sl]))
        return jnp.concatenate(parts, axis=0)

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        step = self.step
        prompt_batch = next(self.loader)
        samples, rewards = self.rollout(prompt_batch, step)
        t_rollout = time.perf_counter() - t0

        t1 = time.perf_counter()
        tb: TrainBatch = build_batch(samples, rewards, self.s.seq_len, self.tokenizer.pad_id, num_layers=self.cfg.num_hidden_layers,
                                     top_k=max(self.cfg.num_experts_per_tok, 1), with_routing=self.s.routing_replay)
        adv = self.advantages(tb.rewards)
        # Multi-host: each process holds its own samples; the global batch is their concatenation in process
        # order (old log-probs and mismatch metrics are computed over it), while minibatches are cut from each
        # process's own rows with the same permutation, so minibatch m = every process's local minibatch m.
        multi = jax.process_count() > 1
        put = (lambda x: jnp.asarray(x)) if not multi else (lambda x: self.plan.put_batch({"x": x}, process_local=True)["x"])
        tokens = put(tb.tokens)
        routed = put(tb.routed_experts) if tb.routed_experts is not None else None
        old_logp = self.old_logprobs(self.params, tokens, routed)
        mask = put(tb.response_mask)
        rollout_logp = put(tb.rollout_logp)
        mm = self._mismatch_fn(old_logp, rollout_logp, mask, self.s.loss.tis_clip_low, self.s.loss.tis_clip)
        data = {"tokens": tokens, "old_logp": old_logp, "rollout_logp": rollout_logp, "mask": mask, "advantages": jnp.asarray(adv)}
        if routed is not None:
            data["routed"] = routed
        if self.ref_params is not None:
            data["ref_logp"] = self.old_logprobs(self.ref_params, tokens, routed)
        jax.block_until_ready((mm, data))  # the phase timers below (logprob vs update) measure finished work
        t_logprob = time.perf_counter() - t1
        if multi:
            data = {k: distributed.local_rows(v) for k, v in data.items()}
        per_mb = len(samples) // self.s.num_minibatches
        order = np.random.default_rng(self.s.seed + step).permutation(len(samples))
        mb_metrics = []
        for m in range(self.s.num_minibatches):
            idx = order[m * per_mb : (m + 1) * per_mb]
            mb = {k: v[idx] for k, v in data.items()}
            # every minibatch normalises by its own token count so the step size does not depend on the split;
            # the count is global (all processes' rows of minibatch m), as the loss sums over the global batch
            nt = jnp.float32(max(float(distributed.global_count(tb.response_mask[idx].sum())), 1.0))
            self.params, self.opt_state, met = self.apply_update(mb, nt)
            mb_metrics.append(jax.device_get(met))
        skipped = sum(1 for m in mb_metrics if m["finite"] < 1)
        self.skipped_updates += skipped
        t_train = time.perf_counter() - t1
        t_update = t_train - t_logprob

        t2 = time.perf_counter()
        self.step += 1
        self.push_weights()
        t_sync = time.perf_counter() - t2

        avg = {k: float(np.mean([m[k] for m in mb_metrics])) for k in mb_metrics[0] if k != "finite"}
        all_rewards, lengths, truncated = (distributed.allgather_rows(x) for x in (tb.rewards, tb.response_lengths, tb.truncated))
        n_tokens = int(lengths.sum())
        total = time.perf_counter() - t0
        metrics = {
            **avg,
            **{k: float(v) for k, v in mm.items()},
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()),
            "response_length": float(lengths.mean()),
            "truncated_frac": float(truncated.mean()),
            "tis_mean": avg.get("tis", float("nan")),
            "learning_rate": float(self.schedule(max(self.step * self.s.num_minibatches - 1, 0))),
            "skipped_updates": float(skipped),
            "skipped_updates_total": float(self.skipped_updates),
            "rollout_seconds": t_rollout,
            "train_seconds": t_train,  # = logprob_seconds + update_seconds
            "logprob_seconds": t_logprob,  # batch layout, old (and reference) log-probs, mismatch metrics
            "update_seconds": t_update,  # the minibatch forward / backward / optimizer updates
            "sync_seconds": t_sync,
            "step_seconds": total,
            "tokens_per_second": n_tokens / max(total, 1e-9),
            "weight_version": float(self.step),
        }
        if tb.routed_experts is not None and self.cfg.num_experts:  # after the timers: host work on the R3 routing
            metrics["rollout_experts_touched"] = decode_experts_touched(tb.routed_experts, tb.prompt_lengths,
                                                                        tb.response_lengths, self.cfg.num_experts)
        return metrics

    def current_model(self):
        """The model at the current masters, cast to the compute dtype (what the engine should serve)."""
        return nnx.merge(self.graphdef, jax.tree.map(self._detached_cast, self.params))

    def _detached_cast(self, x):
        """x in the compute dtype, in a buffer of its own (a cast to x's own dtype returns x, whose buffer the next
        update donates)."""
        return jnp.copy(x) if x.dtype == jnp.dtype(self.s.compute_dtype) else x.astype(self.s.compute_dtype)

    def push_weights(self) -> None:
        """Hand the new weights to the engine (version v+1); it quantizes them through the same contract."""
        self._push(self.current_model(), f"{self._version_prefix}{self.step}")

    # -- checkpoint state -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state}

    def load_state(self, state: dict, meta: dict) -> None:
        self.params = state["params"]
        self.opt_state = state["opt_state"]
        self.step = int(meta["step"])
        self.skipped_updates = int(meta.get("skipped_updates", 0))
        data = meta["data"]
        if isinstance(data, dict) and "iterator" not in data:  # {process index: state} (multi-host checkpoints)
            from jaxrl_fp8.distributed import own_process_state

            data = own_process_state(data)
        self.loader.set_state(data)


