"""Shared pieces of the multi-device scripts: a small FP8-block-compatible Qwen3-MoE, a minibatch, a trainer.

The model's dimensions are multiples of 128 where a tensor-parallel split lands (q/k/v/o heads x head_dim,
MLP and expert intermediate at tensor=2), so all five test meshes keep the 128x128 blocks whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_fp8.model import Qwen3, tiny_config
from jaxrl_fp8.precision import PrecisionPolicy

T = 8  # tokens per row


def fp8_test_config(**kw):
    base = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                intermediate_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, mlp_only_layers=(1,))
    base.update(kw)
    return tiny_config(**base)


def fp8_policy(cfg):
    return PrecisionPolicy.for_format("fp8-block", num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)


def minibatch(cfg, rows: int, seed: int = 0, tokens=None) -> dict[str, np.ndarray]:
    """A PPO minibatch with R3 replay on half of the rows (the other half routes with the trainer's router)."""
    rng = np.random.default_rng(seed)
    if tokens is None:
        tokens = rng.integers(0, cfg.vocab_size, (rows, T))
    tokens = np.asarray(tokens, np.int32)
    k = cfg.num_experts_per_tok
    routed = rng.integers(0, cfg.num_experts, (rows, T, cfg.num_hidden_layers, k)).astype(np.int32)
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            routed[:, :, layer] = -1
    routed[rows // 2:] = -1
    return dict(tokens=tokens, routed=routed, old_logp=(-3 * rng.random((rows, T - 1))).astype(np.float32),
                rollout_logp=(-3 * rng.random((rows, T - 1))).astype(np.float32),
                mask=(rng.random((rows, T - 1)) < 0.8).astype(np.float32), advantages=rng.normal(size=(rows,)).astype(np.float32))


class GradCapture(NamedTuple):
    grads: Any


def capture_grads() -> optax.GradientTransformation:
    """Identity transform that keeps the step's raw gradients in the optimizer state (so one compiled step
    yields loss, gradients and the updated state)."""
    return optax.GradientTransformation(lambda p: GradCapture(jax.tree.map(jnp.zeros_like, p)),
                                        lambda g, s, p=None: (g, GradCapture(g)))


def settings(backward="high_precision"):
    from jaxrl_fp8.rl.losses import PolicyLossConfig
    from jaxrl_fp8.rl.trainer import TrainerSettings

    return TrainerSettings(total_steps=3, prompts_per_step=4, n_samples=4, seq_len=T, temperature=1.0, top_p=1.0, top_k=-1,
                           max_new_tokens=4, routing_replay=True, advantage="grpo", std_normalize=True, num_minibatches=1,
                           loss=PolicyLossConfig(), backward=backward, compute_dtype=jnp.float32, seed=0)


def build_trainer(plan, cfg, *, seed=0, lr=1e-3):
    """The RL Trainer on `plan`'s mesh (state sharded, step jitted with explicit shardings, expert-parallel MoE on a
    mesh of more than one device); `trainer.apply_update(mb, nt)` runs one step of its sharded path."""
    from jaxrl_fp8.config import base_config
    from jaxrl_fp8.rl.trainer import Trainer, make_optimizer

    rl = base_config().rl
    rl.learning_rate = lr
    opt, schedule = make_optimizer(rl, 4)
    model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    return Trainer(model=model, settings=settings(), optimizer=optax.chain(capture_grads(), opt), schedule=schedule,
                   engine=None, tokenizer=None, loader=None, reward_fn=None, train_policy=fp8_policy(cfg),
                   push_weights=lambda *a: None, plan=plan)


def flat_numpy(tree) -> dict[str, np.ndarray]:
    from jaxrl_fp8.sharding.rules import leaf_name

    return {leaf_name(p): np.asarray(jax.device_get(v)) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
