"""ops.grouped_linear on the XLA path: ragged groups (empty experts, padding rows), invariance, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import grouping
from jaxrl_fp8.ops import reference as R
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group


def _data(seed, m, e, n, k, xdtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1)), xdtype)
    w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.05, jnp.float32)
    return x, w


GROUPS = [
    [10, 0, 20, 5],  # empty expert, 5 padding rows
    [0, 0, 40, 0],  # one expert takes all
    [1, 1, 1, 1],  # tiny groups, 36 padding rows
    [13, 9, 0, 18],
]


def test_work_items_cover_every_row_once():
    rng = np.random.default_rng(0)
    for _ in range(20):
        e, m, t = int(rng.integers(1, 9)), int(rng.integers(1, 300)), int(rng.choice([8, 16, 128]))
        cuts = np.sort(rng.integers(0, m + 1, e - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [int(rng.integers(cuts[-1] if e > 1 else 0, m + 1))]]))
        sizes = np.maximum(sizes, 0)
        items = grouping.work_items(jnp.asarray(sizes, jnp.int32), m, t)
        owner = np.full(items.num_tiles * t, -1)
        masks = np.asarray(jax.vmap(items.row_mask)(jnp.arange(items.group.shape[0])))
        for i in range(items.group.shape[0]):
            rows = int(items.tile[i]) * t + np.arange(t)
            mask = masks[i]
            assert np.all(owner[rows[mask]] == -1), "row covered twice"
            owner[rows[mask]] = int(items.group[i])
        expect = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(items.num_tiles * t, -1)])[: items.num_tiles * t]
        np.testing.assert_array_equal(owner[:m], expect[:m])


@pytest.mark.parametrize("gs", GROUPS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_forward_vs_float64(gs, fmt):
    x, w = _data(sum(gs), 40, 4, 128, 256)
    gs = jnp.asarray(gs, jnp.int32)
    y = ops.grouped_linear(x, w, gs, fmt=fmt, backend="xla")
    if fmt == "bf16":
        ref = R.grouped_dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs)
    else:
        xq, sa = quantize_fp8_per_token_group(x, 128)
        wq, sb = quantize_fp8_per_block(w, (128, 128))
        ref = R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)
    assert R.rel_err(y, ref) < 2e-6
    assert np.all(np.asarray(y)[int(gs.sum()) :] == 0)


def test_matches_dense_linear_per_expert_bitwise():
    """A grouped row equals ops.linear on the same row with its expert's weight (same block math)."""
    x, w = _data(7, 40, 4, 128, 256)
    gs = jnp.asarray([10, 0, 20, 5], jnp.int32)
    y = np.asarray(ops.grouped_linear(x, w, gs, fmt="fp8-block", backend="xla"))
    np.testing.assert_array_equal(y[10:30], np.asarray(ops.linear(x[10:30], w[2], fmt="fp8-block", backend="xla")))


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_row_invariance_bitwise(fmt):
    x, w = _data(8, 64, 4, 128, 256)
    f = jax.jit(lambda x, gs: ops.grouped_linear(x, w, gs, fmt=fmt, backend="xla"))
    full = np.asarray(f(x, jnp.asarray([16, 0, 40, 8], jnp.int32)))
    # row 20 belongs to expert 2: alone, and inside smaller batches with other group layouts
    np.testing.assert_array_equal(np.asarray(f(x[20:21], jnp.asarray([0, 0, 1, 0], jnp.int32)))[0], full[20])
    np.testing.assert_array_equal(np.asarray(f(x[16:30], jnp.asarray([0, 0, 14, 0], jnp.int32))), full[16:30])
    np.testing.assert_array_equal(np.asarray(f(x[:24], jnp.asarray([16, 0, 8, 0], jnp.int32))), full[:24])


def test_bad_group_sizes():
    x, w = _data(9, 8, 4, 128, 128)
    with pytest.raises(ValueError, match="group_sizes"):
        ops.grouped_linear(x, w, jnp.asarray([4, 4], jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        ops.grouped_linear(x, w, jnp.asarray([4.0, 4, 0, 0]))


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "fp8"])
def test_gradients_vs_per_expert_dense(fmt, backward):
    """Grouped gradients equal ops.linear's per expert (same mode), except fp8 wgrad's shared 128-row tiles."""
    x, w = _data(10, 40, 4, 128, 256)
    gs_list = [10, 0, 20, 5]
    gs = jnp.asarray(gs_list, jnp.int32)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((40, 128)), jnp.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(ops.grouped_linear(x, w, gs, fmt=fmt, backward=backward, backend="xla") * c), argnums=(0, 1))(x, w)
    assert float(jnp.abs(gx[35:]).max()) == 0.0 and float(jnp.abs(gw[1]).max()) == 0.0
    start = 0
    for g, size in enumerate(gs_list):
        if size == 0:
            continue
        sl = slice(start, start + size)
        rx, rw = jax.grad(lambda x, w: jnp.sum(ops.linear(x, w, fmt=fmt, backward=backward, backend="xla") * c[sl]), argnums=(0, 1))(x[sl], w[g])
        if backward == "fp8":  # dgrad is per-row exact; wgrad's M-quantization groups differ (global 128-row tiles)
            np.testing.assert_array_equal(np.asarray(gx[sl]), np.asarray(rx))
            assert R.rel_err(gw[g], rw) < 6e-2
        else:
            assert R.rel_err(gx[sl], rx) < 1e-6 and R.rel_err(gw[g], rw) < 1e-6
        start += size


def test_fp8_grouped_wgrad_block_math():
    x, w = _data(11, 200, 3, 128, 256)
    gs_list = [70, 0, 100]
    gs = jnp.asarray(gs_list, jnp.int32)
    c = jnp.asarray(np.random.default_rng(2).standard_normal((200, 128)), jnp.float32)
    _, gw = jax.grad(lambda x, w: jnp.sum(ops.grouped_linear(x, w, gs, fmt="fp8-block", backward="fp8") * c), argnums=(0, 1))(x, w)
    live = (np.arange(200) < 170)[:, None]
    cm, xm = np.where(live, np.asarray(c), 0), np.where(live, np.asarray(x), 0)
    pad = lambda a: np.pad(a, [(0, 56), (0, 0)]).T
    ctq, sct = quantize_fp8_per_token_group(jnp.asarray(pad(cm)), 128)
    xtq, sxt = quantize_fp8_per_token_group(jnp.asarray(pad(xm)), 128)
    ctq, xtq = np.asarray(ctq.astype(jnp.float32)), np.asarray(xtq.astype(jnp.float32))
    start = 0
    for g, size in enumerate(gs_list):
        keep = np.zeros(256, bool)
        keep[start : start + size] = True
        ref = R.block_scaled_matmul(np.where(keep, ctq, 0), sct, np.where(keep, xtq, 0), sxt, b_rows_per_scale=1)
        assert R.rel_err(gw[g], ref) < 2e-6 if size else float(jnp.abs(gw[g]).max()) == 0
        start += size


@pytest.mark.parametrize("backend, backward", [("xla", "high_precision"), ("xla", "dequantized"), ("xla", "fp8"),
                                               ("interpret", "dequantized")])
def test_fp8_input_quantized_before_the_gather_gives_the_same_bits(backend, backward):
    """x_fp8: tokens quantized once and their groups gathered to the sorted rows give the bits (forward and both
    gradients) of quantizing the gathered rows themselves; rows repeat, as a token's k expert rows do."""
    tokens, w = _data(11, 12, 4, 128, 256, jnp.bfloat16)
    token_of_row = jnp.asarray(np.random.default_rng(2).integers(0, 12, 40), jnp.int32)
    gs = jnp.asarray([10, 0, 20, 5], jnp.int32)
    c = jnp.asarray(np.random.default_rng(3).standard_normal((40, 128)), jnp.float32)

    def loss(tokens, w, pre_quantized):
        rows = tokens[token_of_row]
        x_fp8 = None
        if pre_quantized:
            x_fp8 = ops.grouped.fp8_input(tokens, w, backend=backend).take_rows(token_of_row)
        y = ops.grouped_linear(rows, w, gs, fmt="fp8-block", backward=backward, backend=backend, x_fp8=x_fp8)
        return jnp.sum(y.astype(jnp.float32) * c), y

    (_, y_pre), g_pre = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(tokens, w, True)
    (_, y_ref), g_ref = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(tokens, w, False)
    np.testing.assert_array_equal(np.asarray(y_pre, np.float32), np.asarray(y_ref, np.float32))
    for a, b in zip(g_pre, g_ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bad_fp8_input():
    from jaxrl_fp8.ops.operands import FP8Act

    x, w = _data(12, 8, 4, 128, 256)
    gs = jnp.asarray([8, 0, 0, 0], jnp.int32)
    q, scale = quantize_fp8_per_token_group(x, 128)
    for bad in (FP8Act(q[:4], scale[:4]), FP8Act(q.astype(jnp.float32), scale), FP8Act(q), FP8Act(q, None, scale.T[:, :4])):
        with pytest.raises(ValueError, match="x_fp8"):
            ops.grouped_linear(x, w, gs, fmt="fp8-block", backend="xla", x_fp8=bad)
    # other formats ignore it
    ops.grouped_linear(x, w, gs, fmt="bf16", backend="xla", x_fp8=FP8Act(q[:4], scale[:4]))
