"""Paged KV cache: the page allocator, writes through the page table, and decoding over pages bit for bit equal
to decoding over the dense cache (so the engine's paged cache keeps the trainer's bits)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.model.cache import KVCache, PagedKVCache, PagePool, init_cache, init_paged_cache, pages_for

CFG = M.tiny_config(num_hidden_layers=2)
B, T, PROMPT = 2, 12, 5
PAGE = 4


def test_page_pool_allocates_shares_and_releases():
    pool = PagePool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and pool.free_pages == 1
    pool.share(a)  # a second row holds a's pages
    pool.release(a)
    assert pool.free_pages == 1  # still held once
    pool.release(a)
    assert pool.free_pages == 3
    assert not pool.can_allocate(4)
    with pytest.raises(MemoryError, match="4 pages asked, 3 of 6 free"):
        pool.allocate(4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([a[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([a[0]])
    table = pool.table([b, []], 4)
    np.testing.assert_array_equal(table, [b + [-1], [-1] * 4])
    with pytest.raises(ValueError, match="row 0 holds 3 pages, the table is 2 wide"):
        pool.table([b], 2)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PagePool(0)
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2 and pages_for(9, 4) == 3


def test_writes_go_through_the_table_and_unowned_slots_drop():
    table = np.array([[3, 0, -1], [1, -1, -1]], np.int32)  # row 0: slots 0-7 in pages 3, 0; row 1: slots 0-3 in page 1
    cache = init_paged_cache(CFG, table, 5, PAGE, jnp.float32)
    hkv, d = CFG.num_key_value_heads, CFG.head_dim
    slots = jnp.asarray([[2, 5, 9], [1, 4, 11]], jnp.int32)  # 9 (row 0) and 4, 11 (row 1) have no page
    vals = jnp.arange(1, 7, dtype=jnp.float32).reshape(B, 3, 1, 1) * jnp.ones((1, 1, hkv, d))
    cache = cache.write(0, vals, -vals, slots)
    k = np.asarray(cache.k[0])
    assert (k[3, 2] == 1).all() and (k[0, 1] == 2).all() and (k[1, 1] == 4).all()
    assert np.count_nonzero(k) == 3 * hkv * d  # the unowned slots wrote nothing (page 2 and 4 untouched)
    np.testing.assert_array_equal(np.asarray(cache.v[0]), -k)
    dense_k, _ = cache.dense(0)
    assert dense_k.shape == (B, 3 * PAGE, hkv, d)
    np.testing.assert_array_equal(np.asarray(dense_k)[0, 2], k[3, 2])
    np.testing.assert_array_equal(np.asarray(dense_k)[1, 1], k[1, 1])
    with pytest.raises(ValueError, match="pages of 4 slots"):
        cache.pages(0)


def test_dense_cache_reads_as_consecutive_pages():
    cache = init_cache(CFG, B, 8, jnp.float32)
    k = jnp.arange(B * 8 * CFG.num_key_value_heads * CFG.head_dim, dtype=jnp.float32).reshape(cache.k[0].shape)
    cache = KVCache((k,) + cache.k[1:], cache.v, cache.lengths)
    kp, _, table = cache.pages(0, 4)
    np.testing.assert_array_equal(np.asarray(kp[np.asarray(table)]).reshape(k.shape), np.asarray(k))
    with pytest.raises(ValueError, match="not whole pages of 3"):
        cache.pages(0, 3)


def _decode(policy, ids, cache, precision="rollout"):
    prompt = np.array(ids[:, :PROMPT])
    out = policy.forward(prompt, cache=cache, precision=precision)
    cache = out.cache.with_lengths(np.full(B, PROMPT))
    logits = [np.asarray(out.logits)]
    for i in range(PROMPT, T):
        out = policy.forward(np.asarray(ids[:, i : i + 1]), cache=cache, precision=precision)
        cache = out.cache
        logits.append(np.asarray(out.logits))
    return np.concatenate(logits, 1), cache


@pytest.mark.parametrize("recipe", [None, "fp8_block"])
def test_paged_decode_equals_dense_decode_and_full_forward_bitwise(recipe):
    from jaxrl_fp8.precision import get_recipe

    policy = M.random_policy(CFG, seed=3, dtype="float32", recipe=None if recipe is None else get_recipe(recipe))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T))
    dense, _ = _decode(policy, ids, policy.init_cache(B, 16))
    # pages in shuffled pool order, a spare page never used, rows of 3 pages (12 slots) in a 4-wide table
    table = np.array([[5, 0, 3, -1], [2, 6, 1, -1]], np.int32)
    paged, cache = _decode(policy, ids, init_paged_cache(CFG, table, 7, PAGE, jnp.float32))
    assert isinstance(cache, PagedKVCache) and cache.max_len == 16
    np.testing.assert_array_equal(paged, dense)
    full = np.asarray(policy.forward(ids, precision="rollout").logits)
    np.testing.assert_array_equal(paged, full)
    assert not np.asarray(cache.k[0])[4].any()  # the spare page stayed zero


def test_fp8_pool_stores_values_and_scales_and_reads_them_dequantized():
    from jaxrl_fp8.precision.kv import quantize_kv

    table = np.array([[2, 0, -1], [1, -1, -1]], np.int32)
    cache = init_paged_cache(CFG, table, 3, PAGE, kv_cache="fp8")
    assert cache.fp8 and cache.k[0].dtype == jnp.float8_e4m3fn
    assert cache.k_scales[0].shape == (3, CFG.num_key_value_heads, PAGE)
    x = np.random.default_rng(1).normal(size=(B, 6, CFG.num_key_value_heads, CFG.head_dim)).astype(np.float32) * 7
    kq, vq = quantize_kv(jnp.asarray(x)), quantize_kv(jnp.asarray(-x))
    slots = np.broadcast_to(np.arange(6), (B, 6))  # row 1 owns one page: its slots 4, 5 are dropped
    cache = cache.write(1, kq, vq, jnp.asarray(slots))
    k, v = cache.dense(1)
    np.testing.assert_array_equal(np.asarray(k)[0, :6], np.asarray(kq.dequantize())[0])
    np.testing.assert_array_equal(np.asarray(v)[1, :4], np.asarray(vq.dequantize())[1, :4])
    assert not np.asarray(k)[1, 4:PAGE].any()  # the unowned slots of row 1 were dropped (page 0 read back: zeros)
    np.testing.assert_array_equal(np.asarray(cache.k_scales[1])[2, :, 1], np.asarray(kq.scales)[0, 1])
    ks, vs = cache.scales(1)
    assert ks is cache.k_scales[1] and init_cache(CFG, B, 8).scales(0) == (None, None)
    copied = cache.map_pages(lambda a: a.at[jnp.asarray([0])].set(a[jnp.asarray([2])]))
    np.testing.assert_array_equal(np.asarray(copied.k_scales[1])[0], np.asarray(cache.k_scales[1])[2])
    np.testing.assert_array_equal(np.asarray(copied.v[1])[0].view(np.uint8), np.asarray(cache.v[1])[2].view(np.uint8))
    with pytest.raises(ValueError, match="kv_cache must be 'fp8'"):
        cache.write(0, jnp.asarray(x), jnp.asarray(x), jnp.asarray(slots))
    # a plain pool (or the dense cache) given FP8 pairs stores their values: the same numbers, no saving
    plain = init_paged_cache(CFG, table, 3, PAGE, jnp.float32).write(1, kq, vq, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(plain.dense(1)[0]), np.asarray(k))


@pytest.mark.parametrize("recipe", ["fp8_block_kv"])
def test_fp8_kv_decode_over_fp8_pages_equals_full_forward_bitwise(recipe):
    """kv_cache='fp8': decoding over FP8 pages == decoding over a dense cache of the dequantized values == the full
    forward over fake-quantized keys, bit for bit; and the contract changes the numbers (the keys are rounded)."""
    from jaxrl_fp8.precision import get_recipe

    policy = M.random_policy(CFG, seed=3, dtype="float32", recipe=get_recipe(recipe))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T))
    table = np.array([[5, 0, 3, -1], [2, 6, 1, -1]], np.int32)
    paged, cache = _decode(policy, ids, init_paged_cache(CFG, table, 7, PAGE, kv_cache="fp8"))
    assert cache.fp8
    dense, _ = _decode(policy, ids, policy.init_cache(B, 16))
    np.testing.assert_array_equal(paged, dense)
    full = np.asarray(policy.forward(ids, precision="rollout").logits)
    np.testing.assert_array_equal(paged, full)
    plain = M.random_policy(CFG, seed=3, dtype="float32", recipe=get_recipe("fp8_block"))
    assert not np.array_equal(np.asarray(plain.forward(ids, precision="rollout").logits), full)
