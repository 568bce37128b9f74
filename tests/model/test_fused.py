"""Stacked projections of one input (`model.fused`): the stack, the kernels' column independence, same samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.model import fused, random_policy, tiny_config
from jaxrl_fp8.ops.backends import prepare_fp8_weight
from jaxrl_fp8.precision import QuantizedWeight, get_recipe
from jaxrl_fp8.rollout.embedded import EmbeddedEngine
from jaxrl_fp8.rollout.programs import loop_operands
from jaxrl_fp8.rollout.types import SamplingParams

CFG = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,), head_dim=64, intermediate_size=128)  # fp8 stacks: 128-row blocks
KW = dict(max_batch=4, max_seq_len=24)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [100], [33, 44], [250, 251, 252, 253, 254]]


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_fp8_kernel_columns_do_not_depend_on_the_stack():
    """The FP8 dense kernel (interpret mode) gives a stacked weight's columns the bits of each projection alone, also
    at one row and at rows not a multiple of the tile."""
    key = jax.random.key(0)
    widths = (256, 128, 128)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n, 256), jnp.float32).astype(jnp.bfloat16) * 0.05
          for i, n in enumerate(widths)]
    stacked = prepare_fp8_weight(jnp.concatenate(ws), backend="interpret")
    for m in (1, 70):
        x = jax.random.normal(jax.random.fold_in(key, 9 + m), (m, 256), jnp.float32).astype(jnp.bfloat16)
        parts = fused.split_outputs(ops.linear(x, stacked, fmt="fp8-block", backend="interpret"), widths)
        for w, got in zip(ws, parts):
            want = ops.linear(x, prepare_fp8_weight(w, backend="interpret"), fmt="fp8-block", backend="interpret")
            np.testing.assert_array_equal(_bits(got), _bits(want))


def test_bf16_kernel_columns_do_not_depend_on_the_stack():
    from pallas_kernels import gemm_grouped_bf16 as g

    key = jax.random.key(1)
    widths = (256, 128, 128)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n, 192), jnp.float32).astype(jnp.bfloat16) for i, n in enumerate(widths)]
    x = jax.random.normal(key, (40, 192), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.asarray([40], jnp.int32)
    parts = fused.split_outputs(g.grouped_matmul(x, jnp.concatenate(ws)[None], sizes, interpret=True), widths)
    for w, got in zip(ws, parts):
        np.testing.assert_array_equal(_bits(got), _bits(g.grouped_matmul(x, w[None], sizes, interpret=True)))


def test_stack_layout_and_what_is_left_alone():
    policy = random_policy(CFG, seed=0, dtype="float32", recipe=get_recipe("fp8_block"))
    state = EmbeddedEngine(policy, **KW)._weights.state
    out = loop_operands(state, fuse=True)
    attn = out["layers"][0]["attn"]
    q = attn["q_proj"]["weight"].get_value()
    assert isinstance(q, fused.FusedWeight)
    assert q.widths == (CFG.num_attention_heads * CFG.head_dim, CFG.num_key_value_heads * CFG.head_dim,
                        CFG.num_key_value_heads * CFG.head_dim)
    assert attn["k_proj"]["weight"].get_value() == fused.FusedPart(1)
    assert attn["v_proj"]["weight"].get_value() == fused.FusedPart(2)
    raw = [state["layers"][0]["attn"][n]["weight"].get_value() for n in ("q_proj", "k_proj", "v_proj")]
    np.testing.assert_array_equal(np.asarray(q.weight.q).view(np.uint8),
                                  np.concatenate([np.asarray(r.data).view(np.uint8) for r in raw]))
    mlp = out["layers"][1]["mlp"]  # the dense layer's gate and up
    assert isinstance(mlp["gate_proj"]["weight"].get_value(), fused.FusedWeight)
    experts = out["layers"][0]["moe"]["gate_proj"]["weight"].get_value()  # the MoE layer's expert stacks stay apart
    assert not isinstance(experts, (fused.FusedWeight, fused.FusedPart))
    # kinds that cannot share a product stay apart
    assert fused._stack([raw[0], jnp.zeros((128, raw[0].k), jnp.bfloat16)]) is None
    assert fused._stack([QuantizedWeight(raw[1].data[:64], raw[1].scale[:1], None, raw[1].fmt, raw[1].k), raw[2]]) is None


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_stacked_decode_gives_the_same_samples(recipe, scheduler, monkeypatch):
    """Generation with the decode loop's projections stacked gives the unstacked bits (tokens, log-probs, routing)
    on this backend's products: the XLA path of these shapes, where XLA:CPU keeps a column's K order."""
    from jaxrl_fp8.rollout.embedded import EngineConfig

    policy = random_policy(CFG, seed=0, dtype="float32", recipe=get_recipe(recipe))
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    split, traced = fused.split_outputs, []
    monkeypatch.setattr(fused, "split_outputs", lambda y, widths: traced.append(widths) or split(y, widths))
    runs = []
    for enabled in (False, True):
        jax.clear_caches()  # the programs decide at trace time
        monkeypatch.setattr(fused, "enabled_here", lambda enabled=enabled: enabled)
        eng = EmbeddedEngine(policy, engine_config=EngineConfig(scheduler=scheduler, **KW))
        runs.append(eng.generate(PROMPTS, sp, return_routed_experts=True))
        assert bool(traced) == enabled  # the stacked product was traced in the second run only
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.rollout_logprobs.view(np.uint32), b.rollout_logprobs.view(np.uint32))
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_stacked_projections_refuse_differing_formats():
    """A stack multiplies in one format: a policy that gives its projections different ones is an error that names
    them (the engine stacks only same-kind weights, so this guards a policy changed under a stacked state)."""
    import types

    from jaxrl_fp8.model import qwen3

    slot = lambda v: types.SimpleNamespace(weight=types.SimpleNamespace(get_value=lambda: v))  # noqa: E731
    module = types.SimpleNamespace(q_proj=slot(fused.FusedWeight(jnp.zeros((384, 64), jnp.bfloat16), (256, 64, 64))),
                                   k_proj=slot(fused.FusedPart(1)), v_proj=slot(fused.FusedPart(2)))
    policy = types.SimpleNamespace(format_for_trainer=lambda path: "fp8-block" if "k_proj" in path else "bf16")
    ctx = qwen3._Ctx(policy=policy, backward="high_precision")
    with pytest.raises(ValueError, match="layers.0.attn: q_proj, k_proj, v_proj are stacked"):
        qwen3._shared_input_projections(module, "layers.0.attn", ("q_proj", "k_proj", "v_proj"),
                                        jnp.zeros((2, 64), jnp.bfloat16), ctx)
