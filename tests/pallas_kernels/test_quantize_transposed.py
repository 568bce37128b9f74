"""Fused transpose + quantize kernel == quantize_fp8_per_token_group(pad_rows(x, 128).T, 128), bit for bit.

Interpret mode on CPU; the same checks on the H200 with -m gpu (there the kernel's transposed shared-memory
load, register relayout and Markstein division run for real). "Bitwise" as in test_quantize.py: same shape,
dtype and bits, any NaN equal to any NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import operands as O
from jaxrl_fp8.precision import quantize_fp8_per_token_group
from pallas_kernels.tiling import TileConfig
from pallas_kernels import quantize_transposed as T
from pallas_kernels.interpret import reset_after_error


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(actual, expected, what=""):
    """Same shape, dtype and bits; any NaN equals any NaN (as in test_quantize.py)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    nan_a, nan_e = np.isnan(actual.astype(np.float32)), np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{what}: NaN positions differ")
    a, e = _bits(actual), _bits(expected)
    bad = (a != e) & ~nan_a
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.size} differ, first at {np.argwhere(bad)[0].tolist()}: {a[bad][:4]} vs {e[bad][:4]}"

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    reset_after_error()


def contract(x, dtype=E4M3, pow2=False):
    """The composition the ops used before the kernel: pad rows with zeros to 128, transpose, quantize."""
    x = jnp.asarray(x)
    pad = (-x.shape[0]) % 128
    xp = jnp.pad(x, [(0, pad), (0, 0)]) if pad else x
    return quantize_fp8_per_token_group(xp.T, 128, dtype=dtype, pow2_scale=pow2)


def rand(shape, seed, dtype=F32):
    """Columns of very different magnitude (every per-group scale differs), plus row-block variation."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    lo, hi = (-12, 4) if jnp.dtype(dtype) == jnp.float16 else (-20, 20)  # float16 overflows past 65504
    x *= np.exp2(rng.integers(lo, hi, size=(1, shape[1]))).astype(np.float32)
    x *= np.exp2(rng.integers(-3, 3, size=(-(-shape[0] // 128), 1))).repeat(128, 0)[: shape[0]].astype(np.float32)
    return jnp.asarray(x, dtype)


def edge_cases(m=200, k=128):
    """Special values, each confined to its own column (a column of 128 rows is one group)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 0] = 0.0  # all-zero groups: finite (floored) scale, q = 0
    x[:, 1] = -0.0  # negative zeros keep their sign
    x[:, 2] = np.float32(1e-42)  # subnormal inputs
    x[3, 3] = np.float32(-3e-39)
    x[5, 4] = np.inf  # +inf: only its group becomes NaN (rows 0..127 of column 4)
    x[150, 5] = -np.inf  # -inf in the second row block of column 5
    x[7, 6] = np.nan
    x[:, 7] *= np.float32(3e38) / np.abs(x[:, 7]).max()  # near float32 max: the largest scales
    x[:, 8] = np.float32(448.0)  # exactly the format maximum
    x[40:60, 8] = -np.float32(448.0)
    x[::3, 9] = np.float32(1e-8)  # tiny values in a group with a normal amax
    x[:, 10] = np.float32(1e-12)  # amax under the 1e-10 floor
    x[:, 11] = np.float32(1e-12)
    x[130, 11] = np.float32(2.0)  # floor in the first row block, normal in the second
    return jnp.asarray(x)


def check(x, dtype=E4M3, pow2=False, interpret=True, config=None):
    q, s = T.fp8_transposed_per_token_group(x, dtype=dtype, pow2_scale=pow2, interpret=interpret, config=config)
    rq, rs = contract(x, dtype, pow2)
    assert_same(s, rs, f"scale {x.shape} {x.dtype}")
    assert_same(q, rq, f"q {x.shape} {x.dtype}")
    return q, s


@pytest.mark.parametrize(
    "shape,in_dtype",
    [
        ((200, 128), BF16),  # M not a multiple of 128: zero rows pad the second group
        ((1, 64), F32),  # M = 1, one column tile
        ((256, 192), F32),  # three column tiles, two row blocks
        ((130, 64), F16),  # M not a multiple of 16 (padded for the TMA view), float16
        ((384, 256), BF16),  # more tiles (12) than the interpreter's CTAs: several tiles per CTA
    ],
)
def test_transposed_interpret(shape, in_dtype):
    check(rand(shape, sum(shape), in_dtype))


def test_transposed_edge_cases_interpret():
    x = edge_cases()
    for pow2 in (False, True):
        q, s = check(x, pow2=pow2)
    s, q = np.asarray(s), np.asarray(q).astype(np.float32)
    assert np.isfinite(s[0]).all() and not q[0].any()  # all-zero groups
    assert np.isnan(s[4, 0]) and np.isfinite(s[4, 1]) and np.isfinite(s[5, 0]) and np.isnan(s[5, 1])
    assert np.isnan(s[6, 0])
    for in_dtype in (BF16, F16):  # the same pattern, rounded (inf stays inf; 3e38 overflows f16 to inf)
        check(x.astype(in_dtype))


def test_transposed_e5m2_interpret():
    check(rand((140, 128), 3), dtype=E5M2)


def test_transposed_rejects_bad_input():
    with pytest.raises(TypeError, match="int32"):
        T.fp8_transposed_per_token_group(jnp.ones((4, 128), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        T.fp8_transposed_per_token_group(jnp.ones((4, 100)), interpret=True)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        T.fp8_transposed_per_token_group(jnp.ones((2, 4, 128)), interpret=True)
    with pytest.raises(ValueError, match="128-row groups"):
        T.fp8_transposed_per_token_group(jnp.ones((4, 128)), 64, interpret=True)


def test_ops_operand_is_the_composition():
    """operands.fp8_act_transposed off the Mosaic backend is the composition pad + transpose + row quantizer (and shapes off the kernel's)."""
    for x in (rand((70, 128), 1, BF16), rand((3, 100), 2)):
        for be in ("xla", "interpret", None):
            q, s = O.fp8_act_transposed(x, be)
            rq, rs = contract(x)
            assert_same(s, rs, "scale")
            assert_same(q, rq, "q")


# ---- GPU (H200) ---------------------------------------------------------------------------------------


def _gpu(fn):
    return pytest.mark.gpu(fn)


def _cpu_contract(x, dtype=E4M3, pow2=False):
    """The reference on XLA:CPU (XLA:GPU's division is approximate: docs/decisions/0006)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return contract(jax.device_put(np.asarray(x), cpu), dtype, pow2)


def _gpu_check(x, **kw):
    q, s = T.fp8_transposed_per_token_group(x, **kw)
    rq, rs = _cpu_contract(x, kw.get("dtype", E4M3), kw.get("pow2_scale", False))
    assert_same(np.asarray(s), np.asarray(rs), f"scale {x.shape} {x.dtype}")
    assert_same(np.asarray(q), np.asarray(rq), f"q {x.shape} {x.dtype}")


@_gpu
@pytest.mark.parametrize(
    "shape,in_dtype",
    [((8192, 1024), BF16), ((4096, 2048), F32), ((1000, 512), BF16), ((1, 128), F32), ((130, 64), F16), ((16384, 256), BF16)],
)
def test_gpu_transposed(shape, in_dtype):
    _gpu_check(rand(shape, sum(shape), in_dtype))


@_gpu
def test_gpu_transposed_edge_cases_and_variants():
    x = edge_cases(m=1000, k=256)
    for pow2 in (False, True):
        _gpu_check(x, pow2_scale=pow2)
    _gpu_check(x.astype(BF16))
    _gpu_check(rand((512, 256), 9), dtype=E5M2)
    for cfg in (TileConfig(stages=4, ctas_per_sm=1), TileConfig(division="div_rn")):
        _gpu_check(rand((2048, 512), 10, BF16), config=cfg)


@_gpu
def test_gpu_linear_fp8_backward_unchanged():
    """ops.linear's fp8 backward on the Mosaic backend (kernel) equals the same math with the composition."""
    m, n, k = 1000, 256, 384
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, F32)
    c = jnp.asarray(rng.standard_normal((m, n)), BF16)
    loss = lambda x, w: jnp.sum((ops.linear(x, w, fmt="fp8-block", backward="fp8", backend="mosaic") * c).astype(F32))
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    # the same wgrad composed by hand (pad, transpose, row quantizer), through the same GEMM kernel
    from jaxrl_fp8.ops import block_scaled

    g = c
    gtq, sgt = O.fp8_act(jnp.pad(g, [(0, 24), (0, 0)]).T, "mosaic")
    xtq, sxt = O.fp8_act(jnp.pad(x, [(0, 24), (0, 0)]).T, "mosaic")
    dw_ref = block_scaled.block_scaled_matmul(gtq, sgt, xtq, sxt, b_rows_per_scale=1, backend="mosaic")
    np.testing.assert_array_equal(np.asarray(dw).view(np.uint32), np.asarray(dw_ref).view(np.uint32))
    assert np.isfinite(np.asarray(dx, np.float32)).all()


# ---- ops.linear's forward writes its output dtype from the GEMM (same bits as float32 + cast) ----------


def _forward_bits_equal(backend, m=200, n=256, k=384):
    from jaxrl_fp8.ops import block_scaled

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp2(rng.integers(-30, 30, size=(m, 1))), BF16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, F32)
    y = jax.jit(lambda x, w: ops.linear(x, w, fmt="fp8-block", backend=backend))(x, w)
    xq, sa = O.fp8_act(x, backend)
    wq, sb = O.fp8_weight(w, backend)
    ref = block_scaled.block_scaled_matmul(xq, sa, wq, sb, backend=backend).astype(BF16)  # float32 GEMM, then cast
    assert y.dtype == BF16
    assert_same(y, ref, f"linear forward ({backend})")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_linear_forward_out_dtype_is_float32_then_cast(backend):
    _forward_bits_equal(backend, m=40 if backend == "interpret" else 200)


@_gpu
def test_gpu_linear_forward_out_dtype_is_float32_then_cast():
    _forward_bits_equal("mosaic", m=1000)
