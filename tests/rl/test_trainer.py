"""Trainer update: gradient accumulation over micro-batches gives the unsplit minibatch's loss, metrics and gradient."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_fp8.model import Qwen3, tiny_config
from jaxrl_fp8.precision import PrecisionPolicy
from jaxrl_fp8.rl.losses import PolicyLossConfig
from jaxrl_fp8.rl.trainer import Trainer, TrainerSettings

T, ROWS = 10, 8


def _minibatch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    k = cfg.num_experts_per_tok
    routed = rng.integers(0, cfg.num_experts, (ROWS, T, cfg.num_hidden_layers, k)).astype(np.int32)
    routed[ROWS // 2:] = -1  # half the rows replay routing (R3), half route with the trainer's router
    mask = (rng.random((ROWS, T - 1)) < 0.7).astype(np.float32)
    mask[3] = 0.0  # a row without a valid token (it must not count as a sequence)
    return dict(tokens=rng.integers(0, cfg.vocab_size, (ROWS, T)).astype(np.int32), routed=routed,
                old_logp=(-3 * rng.random((ROWS, T - 1))).astype(np.float32),
                rollout_logp=(-3 * rng.random((ROWS, T - 1))).astype(np.float32),
                ref_logp=(-3 * rng.random((ROWS, T - 1))).astype(np.float32),
                mask=mask, advantages=rng.normal(size=(ROWS,)).astype(np.float32))


def _trainer(micro: int, loss: PolicyLossConfig, logit_chunk: int = 0) -> Trainer:
    cfg = tiny_config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    settings = TrainerSettings(total_steps=1, prompts_per_step=2, n_samples=4, seq_len=T, temperature=1.0, top_p=1.0,
                               top_k=-1, max_new_tokens=4, routing_replay=True, advantage="grpo", std_normalize=True,
                               num_minibatches=1, loss=loss, backward="high_precision", compute_dtype=jnp.float32,
                               seed=0, micro_batch_rows=micro, logit_chunk_tokens=logit_chunk)
    model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    policy = PrecisionPolicy.for_format("bf16", num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
    return Trainer(model=model, settings=settings, optimizer=optax.sgd(1e-2), schedule=optax.constant_schedule(1e-2),
                   engine=None, tokenizer=None, loader=None, reward_fn=None, train_policy=policy,
                   push_weights=lambda *a: None)


LOSSES = {
    "token_mean_tis": PolicyLossConfig(use_tis=True),
    "seq_mean_kl_entropy": PolicyLossConfig(loss_agg="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_and_logit_chunks_equal_the_whole_minibatch(name):
    loss = LOSSES[name]
    whole = _trainer(0, loss)
    mb = {k: jnp.asarray(v) for k, v in _minibatch(whole.cfg).items()}
    num_tokens = jnp.float32(mb["mask"].sum())
    ref_loss, ref_metrics, ref_grads = jax.jit(whole._grads)(whole.params, mb, num_tokens)
    assert float(ref_loss) != 0.0
    # (micro-batch rows, logit chunk positions): accumulation alone, chunked logits alone (7 does not divide 8 x 9
    # positions), both together (the second loss: both together only, to keep compiles few)
    combos = ((1, 0), (4, 0), (0, 7), (2, 16)) if name == "token_mean_tis" else ((2, 16),)
    for micro, chunk in combos:
        t = _trainer(micro, loss, chunk)
        got_loss, got_metrics, got_grads = jax.jit(t._grads)(t.params, mb, num_tokens)
        np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5, err_msg=f"micro {micro}, chunk {chunk}")
        assert set(got_metrics) == set(ref_metrics)
        for key in ref_metrics:
            np.testing.assert_allclose(got_metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-7, err_msg=f"{key}, micro {micro}, chunk {chunk}")
        flat_ref, flat_got = jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads)
        assert len(flat_ref) == len(flat_got)
        # float32 summation order (and, on some hosts, XLA:CPU dot kernels that change with the row count): 5e-5 of
        # the largest gradient entry
        scale = max(float(jnp.max(jnp.abs(g))) for g in flat_ref)
        assert scale > 0
        for a, b in zip(flat_ref, flat_got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=5e-5 * scale, err_msg=f"micro {micro}, chunk {chunk}")


def test_update_with_micro_batches_steps_like_the_whole_minibatch():
    loss = LOSSES["token_mean_tis"]
    whole, split = _trainer(0, loss), _trainer(2, loss)
    mb = {k: jnp.asarray(v) for k, v in _minibatch(whole.cfg, seed=1).items()}
    nt = jnp.float32(mb["mask"].sum())
    p0, _, m0 = whole.apply_update(mb, nt)
    p1, _, m1 = split.apply_update(mb, nt)
    assert float(m0["finite"]) == float(m1["finite"]) == 1.0
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_non_finite_update_keeps_masters_and_optimizer_state():
    """A NaN advantage makes the loss NaN: the update is skipped (masters and optimizer state unchanged, bit for bit)
    and reported as `finite` 0; the next finite minibatch updates as usual."""
    t = _trainer(2, LOSSES["token_mean_tis"])
    t.optimizer = optax.adam(1e-2)  # state that moves on every update (moments, count)
    t.opt_state = t.optimizer.init(t.params)
    t._update_jit = jax.jit(t._update)  # not donated: the test keeps the old trees to compare
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg, seed=2).items()}
    nt = jnp.float32(mb["mask"].sum())
    params0, opt0 = t.params, t.opt_state
    bad = dict(mb, advantages=mb["advantages"].at[0].set(jnp.nan))
    p1, o1, m1 = t.apply_update(bad, nt)
    assert float(m1["finite"]) == 0.0 and not np.isfinite(float(m1["loss"]))
    for a, b in zip(jax.tree.leaves((params0, opt0)), jax.tree.leaves((p1, o1))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    p2, o2, m2 = t.apply_update(mb, nt)
    assert float(m2["finite"]) == 1.0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(p2)))
    assert int(jax.tree.leaves(o2)[0]) == 1  # adam's count: the skipped update did not count


@pytest.mark.parametrize("scale", [1e-3, 10.0])  # under and over the clip's norm
def test_clip_by_global_norm_gives_optaxs_bits_and_state(scale):
    """The trainer's clip (which takes the norm the update already computed) is optax's: same updates bit for bit,
    with the norm passed or not, and the same state tree (checkpoints written with optax's clip restore)."""
    from jaxrl_fp8.rl.trainer import clip_by_global_norm

    rng = np.random.default_rng(3)
    grads = {"a": jnp.asarray(rng.standard_normal((37, 5)) * scale, jnp.float32),
             "b": jnp.asarray(rng.standard_normal((11,)) * scale, jnp.float32)}
    ours, theirs = optax.chain(clip_by_global_norm(1.0), optax.adam(1e-2)), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    s_ours, s_theirs = ours.init(grads), theirs.init(grads)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    want, _ = jax.jit(theirs.update)(grads, s_theirs, grads)
    # the norm passed as the trainer computes it: in the same program, from the same gradient tree
    for pass_norm in (False, True):
        update = lambda g, s, p, n=pass_norm: ours.update(g, s, p, **({"global_norm": optax.tree.norm(g)} if n else {}))  # noqa: E731
        got, _ = jax.jit(update)(grads, s_ours, grads)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_old_logprobs_with_chunked_logits_match():
    loss = LOSSES["token_mean_tis"]
    whole, chunked = _trainer(0, loss), _trainer(0, loss, logit_chunk=5)
    mb = _minibatch(whole.cfg)
    tokens, routed = jnp.asarray(mb["tokens"]), jnp.asarray(mb["routed"])
    np.testing.assert_allclose(chunked.old_logprobs(chunked.params, tokens, routed),
                               whole.old_logprobs(whole.params, tokens, routed), rtol=1e-6, atol=1e-6)


def test_micro_batch_rows_must_divide_the_minibatch():
    t = _trainer(3, LOSSES["token_mean_tis"])
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg).items()}
    with pytest.raises(ValueError, match="micro_batch_rows=3"):
        t._grads(t.params, mb, jnp.float32(1.0))


def test_reference_survives_the_donating_update_on_a_mesh():
    """On a mesh the update donates the masters' buffers; the frozen reference (kl_coef > 0) must not be them."""
    from jaxrl_fp8.sharding import ShardingPlan, make_mesh

    loss = PolicyLossConfig(kl_coef=0.1)
    t = _trainer(0, loss)
    model = nnx.merge(t.graphdef, t.params)
    plan = ShardingPlan(make_mesh(None, devices=jax.devices()[:1]))
    settings = dataclasses.replace(t.s, use_ref=True)
    t = Trainer(model=model, settings=settings, optimizer=optax.sgd(1e-2), schedule=optax.constant_schedule(1e-2),
                engine=None, tokenizer=None, loader=None, reward_fn=None, train_policy=t.train_policy,
                push_weights=lambda *a: None, plan=plan)
    # XLA:CPU does not honour donation, so the buffers themselves are checked: the reference owns its own
    pointers = lambda tree: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}
    assert not pointers(t.ref_params) & pointers(t.params)
    before = [np.asarray(x) for x in jax.tree.leaves(t.ref_params)]
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg).items()}
    t.params, t.opt_state, _ = t.apply_update(mb, jnp.float32(mb["mask"].sum()))
    after = [np.asarray(x) for x in jax.tree.leaves(t.ref_params)]  # on a GPU: raises if they were donated
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_single_device_update_donates_only_buffers_the_trainer_owns():
    """Without a mesh the update donates the masters and moments too: the float32 model handed in, the frozen
    reference and the model pushed to the engine (a float32 compute dtype: a cast that is a no-op) must each hold
    buffers of their own. XLA:CPU does not honour donation, so the buffers are compared."""
    loss = PolicyLossConfig(kl_coef=0.1)
    t = _trainer(0, loss)
    model = nnx.merge(t.graphdef, t.params)
    settings = dataclasses.replace(t.s, use_ref=True, compute_dtype=jnp.float32)
    t = Trainer(model=model, settings=settings, optimizer=optax.sgd(1e-2), schedule=optax.constant_schedule(1e-2),
                engine=None, tokenizer=None, loader=None, reward_fn=None, train_policy=t.train_policy,
                push_weights=lambda *a: None)
    pointers = lambda tree: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}  # noqa: E731
    masters = pointers(t.params)
    assert not masters & pointers(nnx.state(model))
    assert not masters & pointers(t.ref_params)
    assert not masters & pointers(nnx.state(t.current_model()))
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg).items()}
    lowered = t._update_jit.lower(t.params, t.opt_state, mb, jnp.float32(mb["mask"].sum()))
    donated = [leaf for leaf in jax.tree.leaves(lowered.args_info) if leaf.donated]
    assert len(donated) == len(jax.tree.leaves((t.params, t.opt_state)))


def test_masters_are_cast_once_outside_the_micro_batch_loop():
    """With micro-batches the cast of the FP32 masters to the compute dtype happens once per update, before the
    scan: XLA does not hoist it out of the loop by itself (on the H200 every micro-batch re-cast every expert weight).
    So the loop closes over the BF16 compute parameters and never over a float32 master."""
    t = _trainer(2, LOSSES["token_mean_tis"])
    t.s = dataclasses.replace(t.s, compute_dtype=jnp.bfloat16)
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg).items()}
    closed = jax.make_jaxpr(t._grads)(t.params, mb, jnp.float32(mb["mask"].sum()))
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    masters = [leaf for leaf in jax.tree.leaves(t.params) if leaf.ndim >= 2]
    shapes = {m.shape for m in masters}
    operands = [v.aval for v in scan.invars if v.aval.shape in shapes]
    # float32 operands of the masters' shapes: only the gradient accumulator (one per master), no master itself
    assert sum(a.dtype == jnp.float32 for a in operands) == len(masters), [(a.shape, a.dtype) for a in operands]
    assert sum(a.dtype == jnp.bfloat16 for a in operands) >= len(masters)
    # the gradient comes back to the masters in float32
    _, _, grads = jax.jit(t._grads)(t.params, mb, jnp.float32(mb["mask"].sum()))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("backward", ["fp8", "high_precision"])
def test_fp8_block_weights_are_quantized_once_per_update(backward):
    """fp8-block: the trainer quantizes each projection weight once per update (`Trainer._prepared`), outside the
    micro-batch scan, and once for all log-prob chunks; the loss, metrics, gradients and log-probs keep the bits of
    quantizing inside every forward (ops' own quantizer on the same values)."""
    from jaxrl_fp8.ops.operands import PreparedWeight

    t = _trainer(2, LOSSES["token_mean_tis"])
    cfg = t.cfg
    t.train_policy = PrecisionPolicy.for_format("fp8-block", num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
    t.s = dataclasses.replace(t.s, compute_dtype=jnp.bfloat16, backward=backward, logprob_chunk_rows=3)
    mb = {k: jnp.asarray(v) for k, v in _minibatch(t.cfg).items()}
    n = jnp.float32(mb["mask"].sum())
    prepared = t._prepared(t._cast(t.params))
    kinds = {loader_path: isinstance(v, PreparedWeight) for loader_path, v in _flat(prepared)}
    assert kinds["layers.0.attn.q_proj.weight"] and kinds["layers.0.moe.gate_proj.weight"]
    assert not kinds["layers.0.moe.router.weight"] and not kinds["lm_head.weight"] and not kinds["embed.embedding"]
    gate = dict(_flat(prepared))["layers.0.moe.gate_proj.weight"]
    assert (gate.q_t is not None) == (backward == "fp8")  # the dgrad's transposed operands, made once too
    closed = jax.make_jaxpr(t._grads)(t.params, mb, n)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert any(v.aval.dtype == jnp.float8_e4m3fn for v in scan.invars)  # the loop closes over the quantized weights
    got = jax.jit(t._grads)(t.params, mb, n)
    got_logp = t.old_logprobs(t.params, mb["tokens"], mb["routed"])
    t._prepared = lambda compute: compute  # ops quantize inside every forward, as without the preparation
    t._cast_jit = jax.jit(t._cast)
    want = jax.jit(t._grads)(t.params, mb, n)
    want_logp = t.old_logprobs(t.params, mb["tokens"], mb["routed"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_logp).view(np.uint32), np.asarray(want_logp).view(np.uint32))


def _flat(state):
    from jaxrl_fp8.model import loader

    return [(loader.trainer_path(path), var.get_value()) for path, var in nnx.to_flat_state(state)]


def test_rollout_gives_every_prompt_its_own_seed():
    """One seed for the whole batch gave sample j of every prompt the same random stream (from a random init: the same
    token in every row, and the yardstick's routing collapsed onto a few experts). Each prompt now has its own base
    seed, a pure function of (run seed, step, prompt index)."""
    from types import SimpleNamespace

    from jaxrl_fp8.rollout.types import Sample, prompt_seed, sample_seed

    trainer = _trainer(0, PolicyLossConfig())
    trainer.tokenizer = SimpleNamespace(stop_ids=[0], decode=lambda ids: "")
    trainer.reward_fn = lambda *a, **k: 0.0
    asked = []

    def generate(prompts, sampling, return_routed_experts=False):
        asked.append(sampling)
        return [Sample(np.asarray(p, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32), "length", "0")
                for p in prompts for _ in range(trainer.s.n_samples)]

    trainer.engine = SimpleNamespace(generate=generate)
    batch = SimpleNamespace(prompt_ids=[[1, 2], [1, 2], [3]], prompts=["a", "a", "b"], answers=["", "", ""])
    trainer.rollout(batch, step=3)
    trainer.rollout(batch, step=3)
    trainer.rollout(batch, step=4)
    first, again, later = asked
    assert first == again  # reproducible
    base = trainer.sampling(3).seed
    assert [sp.seed for sp in first] == [prompt_seed(base, i) for i in range(3)]  # identical prompts, distinct seeds
    assert len({sample_seed(sp.seed, j) for sp in first for j in range(sp.n)}) == 3 * trainer.s.n_samples
    assert not {sp.seed for sp in first} & {sp.seed for sp in later}
