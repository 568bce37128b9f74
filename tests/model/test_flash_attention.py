"""The model on the flash attention kernels (attention_impl "flash"; Mosaic GPU interpreter on CPU): the choice of
implementation, the training forward against the "exact" scan, and decoding over the paged cache bit for bit equal
to the full forward (the property rollout == trainer rests on)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.model.attention import resolve_impl
from jaxrl_fp8.model.cache import PAGE_SIZE, init_paged_cache
from jaxrl_fp8.ops.backends import default_device_is_hopper
from tests.isolation import in_fresh_process

CFG = M.tiny_config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_impl="flash")
B, T, PROMPT = 2, 10, 6


@pytest.fixture(scope="module")
def policy():
    return M.random_policy(CFG, seed=4, dtype="bfloat16")


def _ids(seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T))


def test_impl_choice():
    assert resolve_impl("exact", 64, jnp.bfloat16) == "exact" and resolve_impl("xla", 16, jnp.float32) == "xla"
    assert resolve_impl("flash", 128, jnp.bfloat16) == "flash"
    if not default_device_is_hopper():
        assert resolve_impl("auto", 128, jnp.bfloat16) == "exact"  # CPU: the bits stay those of the exact scan
    assert resolve_impl("auto", 16, jnp.bfloat16) == "exact"  # the kernel does not take head_dim 16
    with pytest.raises(ValueError, match=r"model.attention_impl='flash': dtype float32 is not bfloat16"):
        resolve_impl("flash", 64, jnp.float32)
    with pytest.raises(ValueError, match=r"head_dim 48 is not a multiple of 64"):
        resolve_impl("flash", 48, jnp.bfloat16)
    with pytest.raises(M.ConfigError, match="attention_impl"):
        M.tiny_config(attention_impl="fast")


def test_forward_close_to_exact(policy):
    """The kernels' gradients are checked against autodiff in tests/pallas_kernels/test_attention.py."""
    ids = _ids(1)
    exact = M.random_policy(dataclasses.replace(CFG, attention_impl="exact"), seed=4, dtype="bfloat16")  # same weights
    a = np.asarray(policy.logits(ids), np.float32)
    b = np.asarray(exact.logits(ids), np.float32)
    np.testing.assert_allclose(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.row_invariant_cpu
def test_paged_decode_equals_full_forward_bitwise(policy):
    ids = _ids(2)
    table = np.array([[2], [0]], np.int32)  # one page of 128 slots per row, pool order shuffled
    cache = init_paged_cache(CFG, table, 3, PAGE_SIZE, jnp.bfloat16)
    out = policy.forward(ids[:, :PROMPT], cache=cache, precision="rollout")
    cache = out.cache.with_lengths(np.full(B, PROMPT))
    logits = [np.asarray(out.logits)]
    for i in range(PROMPT, T):
        out = policy.forward(ids[:, i : i + 1], cache=cache, precision="rollout")
        cache = out.cache
        logits.append(np.asarray(out.logits))
    full = np.asarray(policy.forward(ids, precision="rollout").logits)
    np.testing.assert_array_equal(np.concatenate(logits, 1), full)


@in_fresh_process
def test_engine_on_flash_kernels_matches_trainer(policy):
    """The embedded engine on the paged kernels (prefill + decode over pages of 128): its log-probs are the trainer
    recomputation's (fused training kernel) — bit for bit where XLA:CPU's dots are row invariant, else within
    BF16 rounding of the surrounding GEMMs."""
    from jaxrl_fp8.ops.xla_gemm import cpu_dots_row_invariant
    from jaxrl_fp8.rollout import sampling
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine
    from jaxrl_fp8.rollout.types import SamplingParams

    engine = EmbeddedEngine(policy, max_batch=2, max_seq_len=24)
    assert engine.paged and engine._attention == "flash" and engine._page_size == PAGE_SIZE
    samples = engine.generate([[1, 2, 3, 4, 5], [7, 8, 9]],
                              SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=5))
    for s in samples:
        ids = s.token_ids[None].astype(np.int32)
        logits = policy.forward(ids, precision="train").logits
        lp = np.asarray(sampling.token_logprobs(logits, np.roll(ids, -1, axis=1), np.ones(ids.shape, np.float32)))
        p = s.prompt_ids.size
        trainer = lp[0, p - 1 : p - 1 + s.response_ids.size]
        assert s.response_ids.size == 4
        if jax.default_backend() == "gpu" or cpu_dots_row_invariant():
            np.testing.assert_array_equal(trainer, s.rollout_logprobs)
        else:
            np.testing.assert_allclose(trainer, s.rollout_logprobs, atol=2e-2)
