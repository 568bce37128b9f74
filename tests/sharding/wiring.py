"""Stand-in for the model/trainer wiring the lead adds (docs/decisions/0009-sharding.md, "Wiring").

Until `Qwen3.__call__` takes `moe_impl=` and the Trainer takes a ShardingPlan, the tests run the very code of
that proposal: `MoE.__call__` with a `moe_impl` hook (patched for the test process) and `ShardedTrainer`, a
Trainer subclass whose overrides are the lines the lead moves into trainer.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jaxrl_fp8.model import matmul, moe as moe_lib, qwen3

F32 = jnp.float32
_IMPL = [None]
_ORIGINAL_CALL = qwen3.MoE.__call__


def _moe_call(self, x, ctx, replay=None):
    impl = _IMPL[0]
    if impl is None:
        return _ORIGINAL_CALL(self, x, ctx, replay)
    cfg = self.cfg
    logits = matmul.high_precision_linear(x.astype(F32), self.router.weight.get_value().astype(F32))
    routing = moe_lib.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, replay)
    fmts = tuple(ctx.fmt(f"layers.{self.layer}.moe.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    y = impl(x, routing, self.gate_proj.weight.get_value(), self.up_proj.weight.get_value(),
             self.down_proj.weight.get_value(), fmts, ctx.backward)
    return y.astype(x.dtype), routing


@contextlib.contextmanager
def moe_impl(impl):
    """Run the model's MoE layers through `impl` (None: the single-device dispatch) while tracing."""
    qwen3.MoE.__call__ = _moe_call
    _IMPL[0] = impl
    try:
        yield
    finally:
        _IMPL[0] = None
        qwen3.MoE.__call__ = _ORIGINAL_CALL


def make_sharded_trainer(plan, *, process_local=False, **trainer_kwargs):
    """A Trainer whose state lives on `plan.mesh` and whose step is jitted with explicit shardings."""
    from jaxrl_fp8.rl.trainer import Trainer
    from jaxrl_fp8.sharding import make_moe_impl

    class ShardedTrainer(Trainer):
        # --- the lines proposed for Trainer (see docs/decisions/0009-sharding.md) -----------------------
        def __init__(self, **kw):
            super().__init__(**kw)
            self.plan = plan
            self.moe_impl = make_moe_impl(plan.mesh) if plan.mesh.size > 1 else None
            self.params = plan.shard(self.params)
            self.opt_state = plan.shard(self.opt_state)
            self._sharded_update = None  # the compiled step (memory_analysis / as_text for the tests)
            self.process_local = process_local

        def compute_params(self, params):
            return self.plan.constrain_compute(super().compute_params(params))

        def _forward_logprobs(self, params, tokens, routed):
            with moe_impl(self.moe_impl):  # stands in for model(..., moe_impl=self.moe_impl)
                return super()._forward_logprobs(params, tokens, routed)

        def update(self, params, opt_state, mb, num_tokens):
            """What `self._update_jit(...)` becomes: a step with explicit in/out shardings, batch split by rows."""
            mb = self.plan.put_batch({k: v for k, v in mb.items() if v is not None}, process_local=self.process_local)
            num_tokens = jax.device_put(jnp.float32(num_tokens), self.plan.replicated())
            if self._sharded_update is None:
                jitted = self.plan.jit_train_step(self._update, params, opt_state, mb)
                self._sharded_update = jitted.lower(params, opt_state, mb, num_tokens).compile()
            return self._sharded_update(params, opt_state, mb, num_tokens)

    return ShardedTrainer(**trainer_kwargs)
