"""The flash-attention family against its float64 reference, its gradients against autodiff of a float32 reference,
and the invariance the kernels are built for (paged prefill / decode == the training forward, bit for bit).

CPU: Mosaic GPU's interpreter (small shapes). The bitwise checks compare products of tiles whose other rows differ,
so on CPU they rest on XLA:CPU's dots being row invariant (marker row_invariant_cpu); on the GPU they rest on wgmma.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention as A

BF16 = jnp.bfloat16


def _qkv(b, t, h, hkv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, h, d)).astype(BF16), jax.random.normal(ks[1], (b, t, hkv, d)).astype(BF16),
            jax.random.normal(ks[2], (b, t, hkv, d)).astype(BF16))


def _pages(k, v, n_pages, pool, seed=0):
    """The rows' keys in pages of a pool, in a random page order (a page table per row)."""
    b, t, hkv, d = k.shape
    table = np.random.default_rng(seed).permutation(pool)[: b * n_pages].reshape(b, n_pages)
    kp = np.zeros((pool, A.BLOCK_KV, hkv, d), np.float32)
    vp = np.zeros_like(kp)
    pad = ((0, 0), (0, n_pages * A.BLOCK_KV - t), (0, 0), (0, 0))
    kk, vv = (np.pad(np.asarray(x.astype(jnp.float32)), pad) for x in (k, v))
    for i in range(b):
        for j in range(n_pages):
            kp[table[i, j]] = kk[i, j * A.BLOCK_KV:(j + 1) * A.BLOCK_KV]
            vp[table[i, j]] = vv[i, j * A.BLOCK_KV:(j + 1) * A.BLOCK_KV]
    return jnp.asarray(kp, BF16), jnp.asarray(vp, BF16), jnp.asarray(table, jnp.int32)


def _interpret():
    return not any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (4, 1, 64), (8, 1, 128)])
def test_forward_matches_float64_reference(h, hkv, d):
    b, t = 1, 200  # not a multiple of the block; three segments, one of a single token
    q, k, v = _qkv(b, t, h, hkv, d)
    seg = jnp.array([[0] * 70 + [1] * 1 + [2] * 129])
    out = A.flash_attention(q, k, v, seg, scale=d**-0.5, interpret=_interpret())
    ref = A.reference_attention(q, k, v, A.segment_starts(seg, b, t), scale=d**-0.5)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("segments", [None, [0] * 100 + [1] * 300 + [2] * 112])
def test_unmasked_blocks_keep_the_bits(segments):
    """The unmasked path of fully visible key blocks changes no bit of out or lse."""
    from pallas_kernels.attention_fwd import forward

    b, t, h, hkv, d = 1, 512, 2, 1, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=3)
    seg = None if segments is None else jnp.array([segments])
    starts = A.segment_starts(seg, b, t)
    run = lambda **kw: forward(q, k, v, starts, scale=d**-0.5, stages=2, interpret=_interpret(), **kw)
    for got, want in zip(run(), run(mask_all_blocks=True)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_one_token_rows():
    q, k, v = _qkv(2, 1, 4, 2, 64)
    out = A.flash_attention(q, k, v, scale=0.125, interpret=_interpret())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.repeat(v, 2, axis=2)))  # softmax of one key is 1


@pytest.mark.parametrize("dq_keys", [64, 128])
def test_gradients_match_autodiff_of_reference(dq_keys):
    """Both key steps of the dq kernel (FlashConfig.bwd_dq_keys); the dk/dv kernel does not see the choice."""
    b, t, h, hkv, d = 1, 150, 4, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=1)
    g = jax.random.normal(jax.random.key(9), (b, t, h, d)).astype(BF16)
    seg = jnp.array([[0] * 60 + [1] * 90])
    sc = d**-0.5
    starts = A.segment_starts(seg, b, t)

    def ref(q, k, v):
        qg = q.reshape(b, t, hkv, h // hkv, d)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k) * sc
        key = jnp.arange(t)[None, None, :]
        vis = ((key <= jnp.arange(t)[None, :, None]) & (key >= starts[:, :, None]))[:, :, None, None, :]
        p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), -1)
        return jnp.einsum("btkgs,bskd->btkgd", p, v).reshape(b, t, h, d)

    grads = lambda cfg: jax.vjp(lambda q, k, v: A.flash_attention(q, k, v, seg, scale=sc, config=cfg,
                                                                  interpret=_interpret()), q, k, v)[1](g)
    got = grads(A.FlashConfig(bwd_dq_keys=dq_keys))
    _, rvjp = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, mine, want in zip("qkv", got, rvjp(g.astype(jnp.float32))):
        err = np.abs(np.asarray(mine, np.float32) - np.asarray(want)).max()
        assert err < 2e-2 * np.abs(np.asarray(want)).max(), (name, err)
    if dq_keys != A.FlashConfig().bwd_dq_keys:  # dk, dv do not depend on the dq kernel's step
        default = grads(A.FlashConfig())
        for mine, base in zip(got[1:], default[1:]):
            np.testing.assert_array_equal(np.asarray(mine, np.float32), np.asarray(base, np.float32))


def test_paged_matches_reference_with_shuffled_pages():
    b, t, h, hkv, d = 2, 300, 8, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=2)
    kp, vp, table = _pages(k, v, 3, 8)
    pos = jnp.broadcast_to(jnp.arange(200, 264, dtype=jnp.int32), (b, 64))
    out = A.paged_attention(q[:, 200:264], kp, vp, table, pos, scale=d**-0.5, interpret=_interpret())
    ref = A.reference_paged_attention(q[:, 200:264], kp, vp, table, pos, scale=d**-0.5)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=2e-2, rtol=2e-2)


def test_decode_gives_the_training_forward_bits():
    """One query per row over a paged cache (random page order, rows of different lengths) == the full forward, with
    the G query rows loaded into part of one tile."""
    b, t, h, hkv, d = 2, 300, 8, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=3)
    full = np.asarray(A.flash_attention(q, k, v, scale=d**-0.5, interpret=_interpret()).astype(jnp.float32))
    kp, vp, table = _pages(k, v, 3, 8, seed=3)
    pos = np.array([299, 130])
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    out = np.asarray(A.paged_attention(qd, kp, vp, table, jnp.asarray(pos)[:, None], scale=d**-0.5,
                                       interpret=_interpret()).astype(jnp.float32))
    for i in range(b):
        np.testing.assert_array_equal(out[i, 0], full[i, pos[i]])


def test_each_decode_row_gets_the_bits_it_gets_alone():
    """Five decode rows of different lengths (4, 1, 2, 2, 3 pages) x 2 key/value heads: every row has the bits it
    has when decoded alone, whatever its neighbours' lengths, and stays close to the float64 reference."""
    b, t, h, hkv, d = 5, 400, 4, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=7)
    kp, vp, table = _pages(k, v, 4, 24, seed=7)
    pos = np.array([399, 5, 128, 255, 300])  # 4, 1, 2, 2, 3 pages
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    run = lambda rows: np.asarray(A.paged_attention(qd[rows], kp, vp, table[rows], jnp.asarray(pos[rows])[:, None],
                                                    scale=d**-0.5, interpret=_interpret()).astype(jnp.float32))
    together = run(slice(None))
    for i in range(b):
        np.testing.assert_array_equal(run(slice(i, i + 1))[0], together[i])
    ref = A.reference_paged_attention(qd, kp, vp, table, pos[:, None], scale=d**-0.5)
    np.testing.assert_allclose(together, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_unmasked_blocks_keep_the_bits(fp8, monkeypatch):
    """The paged kernel's key blocks visible to a whole tile skip the mask (`full_blocks`): decode rows and a prefill
    tile, BF16 pages and FP8 pages (the converter's path), have the bits of the kernel masking every block."""
    b, t, h, hkv, d = 2, 300, 8, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=9)
    kp, vp, table = _pages(k, v, 3, 8, seed=9)
    scales = {}
    if fp8:
        kp, vp, ks, vs, _, _ = _fp8_pages(kp, vp)
        scales = dict(k_scales=ks, v_scales=vs)
    pos = np.array([299, 130])
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    pre = jnp.broadcast_to(jnp.arange(200, 264, dtype=jnp.int32), (b, 64))
    seen = []

    def run():
        decode = A.paged_attention(qd, kp, vp, table, jnp.asarray(pos)[:, None], scale=d**-0.5, interpret=_interpret(), **scales)
        prefill = A.paged_attention(q[:, 200:264], kp, vp, table, pre, scale=d**-0.5, interpret=_interpret(), **scales)
        return [np.asarray(x.astype(jnp.float32)) for x in (decode, prefill)]

    kernel = A.paged_rows_attention

    def recording(q_rows, row_pos, row_start, n_blocks, full_blocks, *rest, **kw):
        seen.append(np.asarray(full_blocks))
        return kernel(q_rows, row_pos, row_start, n_blocks, full_blocks, *rest, **kw)

    monkeypatch.setattr(A, "paged_rows_attention", recording)
    skipping = run()
    assert [x[..., 1].ravel().tolist() for x in seen] == [[2, 1], [1] * 8]  # blocks [0, hi) skip the mask
    monkeypatch.setattr(A, "paged_rows_attention", lambda qr, rp, rs, nb, full, *rest, **kw: kernel(
        qr, rp, rs, nb, jnp.zeros_like(full), *rest, **kw))
    for got, want in zip(skipping, run()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.row_invariant_cpu
def test_prefill_and_batch_give_the_training_forward_bits():
    b, t, h, hkv, d = 2, 300, 8, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=4)
    full = np.asarray(A.flash_attention(q, k, v, scale=d**-0.5, interpret=_interpret()).astype(jnp.float32))
    alone = np.asarray(A.flash_attention(q[1:, :180], k[1:, :180], v[1:, :180], scale=d**-0.5,
                                         interpret=_interpret()).astype(jnp.float32))
    np.testing.assert_array_equal(alone[0], full[1, :180])
    kp, vp, table = _pages(k, v, 3, 8, seed=4)
    pos = jnp.broadcast_to(jnp.arange(200, 264, dtype=jnp.int32), (b, 64))
    out = A.paged_attention(q[:, 200:264], kp, vp, table, pos, scale=d**-0.5, interpret=_interpret())
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), full[:, 200:264])


def _fp8_pages(kp, vp):
    """FP8 pages of the contract (precision.kv) and their scales [P, Hkv, page], plus the dequantized BF16 pages."""
    from jaxrl_fp8.precision.kv import quantize_kv

    kq, vq = quantize_kv(kp), quantize_kv(vp)
    return (kq.values, vq.values, kq.scales.transpose(0, 2, 1), vq.scales.transpose(0, 2, 1),
            kq.dequantize(BF16), vq.dequantize(BF16))


def _fp8_paged_case(stages, converters=1):
    """Decode rows and a 64-row prefill tile of the paged kernel over FP8 pages, with the inputs of its references."""
    b, t, h, hkv, d = 2, 300, 8, 2, 64
    q, k, v = _qkv(b, t, h, hkv, d, seed=8)
    k, v = k * 5, v * 0.01  # scales far from 1
    kp, vp, table = _pages(k, v, 3, 8, seed=8)
    k8, v8, ks, vs, kd, vd = _fp8_pages(kp, vp)
    pos = np.array([299, 130])
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    cfg = A.FlashConfig(paged_stages=stages, paged_fp8_converters=converters)
    run = lambda *pages, **kw: np.asarray(A.paged_attention(qd, *pages, table, jnp.asarray(pos)[:, None], scale=d**-0.5,
                                                            interpret=_interpret(), **kw).astype(jnp.float32))
    got = run(k8, v8, k_scales=ks, v_scales=vs, config=cfg)
    pre = jnp.broadcast_to(jnp.arange(200, 264, dtype=jnp.int32), (b, 64))
    prefill = lambda *pages, **kw: np.asarray(A.paged_attention(q[:, 200:264], *pages, table, pre, scale=d**-0.5,
                                                                interpret=_interpret(), **kw).astype(jnp.float32))
    out = prefill(k8, v8, k_scales=ks, v_scales=vs, config=cfg)
    return dict(q=q, k=k, v=v, d=d, pos=pos, got=got, bf16_decode=run(kd, vd), out=out, bf16_prefill=prefill(kd, vd))


@pytest.mark.parametrize("stages,converters", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_fp8_pages_give_the_bits_of_their_dequantized_values(stages, converters):
    """FP8 pages (e4m3 + a power-of-two scale per token and head, dequantized by one converter warpgroup or by one
    for the keys and one for the values, through 1 or 2 pipeline stages: a block's FP8 slot is released before or
    after the next is converted) == the BF16 kernel over the dequantized pages, bit for bit, for decode rows and a
    prefill tile."""
    c = _fp8_paged_case(stages, converters)
    np.testing.assert_array_equal(c["got"], c["bf16_decode"])
    np.testing.assert_array_equal(c["out"], c["bf16_prefill"])


@pytest.mark.row_invariant_cpu
@pytest.mark.parametrize("stages", [1, 2])
def test_fp8_pages_give_the_training_forwards_bits(stages):
    """... and == the training forward over the fake-quantized keys (what the trainer attends over under
    kv_cache='fp8'). Interpreted on the CPU, two kernels agree bit for bit only where XLA:CPU's dots do whatever the
    surrounding program (conftest's row_invariant_cpu: a host with AVX but no AVX2 differed in 3 of 65,536 prefill
    values); on the GPU the property is the -m gpu tests'."""
    from jaxrl_fp8.precision.kv import fake_quantize_kv

    c = _fp8_paged_case(stages)
    full = np.asarray(A.flash_attention(c["q"], fake_quantize_kv(c["k"]), fake_quantize_kv(c["v"]), scale=c["d"]**-0.5,
                                        interpret=_interpret()).astype(jnp.float32))
    for i in range(2):
        np.testing.assert_array_equal(c["got"][i, 0], full[i, c["pos"][i]])
    np.testing.assert_array_equal(c["out"], full[:, 200:264])


def test_fp8_pages_bad_arguments_name_themselves():
    q, k, v = _qkv(1, 130, 4, 2, 64)
    kp, vp, table = _pages(k, v, 2, 2)
    k8, v8, ks, vs, _, _ = _fp8_pages(kp, vp)
    pos = jnp.asarray([[129]], jnp.int32)
    with pytest.raises(ValueError, match="both k_scales and v_scales"):
        A.paged_attention(q[:, :1], k8, v8, table, pos, scale=1.0, k_scales=ks, interpret=True)
    with pytest.raises(ValueError, match="FlashConfig.paged_fp8_converters=3 is not 1 or 2"):
        A.paged_attention(q[:, :1], k8, v8, table, pos, scale=1.0, k_scales=ks, v_scales=vs, interpret=True,
                          config=A.FlashConfig(paged_fp8_converters=3))
    with pytest.raises(ValueError, match="are not \\[P, Hkv"):
        A.paged_attention(q[:, :1], k8, v8, table, pos, scale=1.0, k_scales=ks[:, :1], v_scales=vs, interpret=True)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        A.paged_attention(q[:, :1], kp, vp, table, pos, scale=1.0, k_scales=ks, v_scales=vs, interpret=True)


def test_bad_shapes_name_themselves():
    q, k, v = _qkv(1, 8, 4, 3, 64)
    with pytest.raises(ValueError, match="do not divide"):
        A.flash_attention(q, k, v, scale=1.0, interpret=True)
    q, k, v = _qkv(1, 8, 4, 2, 96)
    with pytest.raises(ValueError, match="head_dim 96"):
        A.flash_attention(q, k, v, scale=1.0, interpret=True)


@pytest.mark.gpu
def test_gpu_long_rows_bits_and_accuracy():
    """4k tokens, Qwen3-30B-A3B heads (32 / 4 of 128): paged decode / prefill == forward bits; forward accurate."""
    b, t, h, hkv, d = 2, 4096, 32, 4, 128
    q, k, v = _qkv(b, t, h, hkv, d, seed=5)
    sc = d**-0.5
    full = np.asarray(A.flash_attention(q, k, v, scale=sc).astype(jnp.float32))
    ref = A.reference_attention(q[:, :512], k[:, :512], v[:, :512], np.zeros((b, 512), np.int32), scale=sc)
    np.testing.assert_allclose(full[:, :512], ref, atol=2e-2, rtol=2e-2)
    n_pages = t // A.BLOCK_KV
    kp, vp, table = _pages(k, v, n_pages, 2 * n_pages + 3, seed=5)
    pos = np.array([4095, 1000])
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    out = np.asarray(A.paged_attention(qd, kp, vp, table, jnp.asarray(pos)[:, None], scale=sc).astype(jnp.float32))
    for i in range(b):
        np.testing.assert_array_equal(out[i, 0], full[i, pos[i]])
    pre = jnp.broadcast_to(jnp.arange(0, 256, dtype=jnp.int32), (b, 256))
    out = A.paged_attention(q[:, :256], kp, vp, table, pre, scale=sc)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), full[:, :256])
    alone = np.asarray(A.flash_attention(q[1:, :3000], k[1:, :3000], v[1:, :3000], scale=sc).astype(jnp.float32))
    np.testing.assert_array_equal(alone[0], full[1, :3000])


@pytest.mark.gpu
@pytest.mark.parametrize("converters", [1, 2])
def test_gpu_fp8_pages_bits_at_4k(converters):
    """4k-token rows, Qwen3-30B-A3B heads: the FP8-page kernel (dequantized in shared memory by one or two converter
    warpgroups) == the BF16 kernel over the dequantized pages == the training forward over the fake-quantized keys,
    bit for bit (decode and prefill)."""
    from jaxrl_fp8.precision.kv import fake_quantize_kv

    b, t, h, hkv, d = 2, 4096, 32, 4, 128
    q, k, v = _qkv(b, t, h, hkv, d, seed=6)
    sc = d**-0.5
    n_pages = t // A.BLOCK_KV
    kp, vp, table = _pages(k, v, n_pages, 2 * n_pages + 3, seed=6)
    k8, v8, ks, vs, kd, vd = _fp8_pages(kp, vp)
    full = np.asarray(A.flash_attention(q, fake_quantize_kv(k), fake_quantize_kv(v), scale=sc).astype(jnp.float32))
    pos = np.array([4095, 1000])
    qd = jnp.stack([q[i, pos[i]] for i in range(b)])[:, None]
    deq = np.asarray(A.paged_attention(qd, kd, vd, table, jnp.asarray(pos)[:, None], scale=sc).astype(jnp.float32))
    pre = jnp.broadcast_to(jnp.arange(0, 256, dtype=jnp.int32), (b, 256))
    cfg = A.FlashConfig(paged_fp8_converters=converters)
    got = np.asarray(A.paged_attention(qd, k8, v8, table, jnp.asarray(pos)[:, None], scale=sc, k_scales=ks,
                                       v_scales=vs, config=cfg).astype(jnp.float32))
    np.testing.assert_array_equal(got, deq)
    for i in range(b):
        np.testing.assert_array_equal(got[i, 0], full[i, pos[i]])
    out = A.paged_attention(q[:, :256], k8, v8, table, pre, scale=sc, k_scales=ks, v_scales=vs, config=cfg)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), full[:, :256])


@pytest.mark.gpu
@pytest.mark.parametrize("dq_keys", [64, 128])
def test_gpu_gradients(dq_keys):
    b, t, h, hkv, d = 1, 1024, 32, 4, 128
    q, k, v = _qkv(b, t, h, hkv, d, seed=6)
    g = jax.random.normal(jax.random.key(7), (b, t, h, d)).astype(BF16)
    seg = jnp.array([[0] * 300 + [1] * 724])
    cfg = A.FlashConfig(bwd_dq_keys=dq_keys)
    _, vjp = jax.vjp(lambda q, k, v: A.flash_attention(q, k, v, seg, scale=d**-0.5, config=cfg), q, k, v)
    starts = A.segment_starts(seg, b, t)

    def ref(q, k, v):
        qg = q.reshape(b, t, hkv, h // hkv, d)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k, precision="highest") * d**-0.5
        key = jnp.arange(t)[None, None, :]
        vis = ((key <= jnp.arange(t)[None, :, None]) & (key >= starts[:, :, None]))[:, :, None, None, :]
        p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), -1)
        return jnp.einsum("btkgs,bskd->btkgd", p, v, precision="highest").reshape(b, t, h, d)

    _, rvjp = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, got, want in zip("qkv", vjp(g), rvjp(g.astype(jnp.float32))):
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max()
        assert err < 2e-2 * np.abs(np.asarray(want)).max(), (name, err)
