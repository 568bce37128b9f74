"""Quantization kernels == jaxrl_fp8.precision, bit for bit: interpret mode on CPU, and on the H200 (-m gpu).

Bitwise means: same shape, same dtype, same bits, except that every NaN compares equal to every NaN (the GPU
writes the canonical NaN where XLA:CPU may keep a sign or payload; a NaN block is NaN either way).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import precision as P
from pallas_kernels import quantize as Q
from pallas_kernels.interpret import reset_after_error
from pallas_kernels.quantize_nvfp4 import IMPLS

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    reset_after_error()


def _bits(a):
    a = np.asarray(a)
    if a.dtype.itemsize == 1:
        return a.view(np.uint8)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _nan_mask(a):
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return np.zeros(a.shape, bool)
    return np.isnan(a.astype(np.float32))


def assert_same(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    nan_a, nan_e = _nan_mask(actual), _nan_mask(expected)
    np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{what}: NaN positions differ")
    a, e = _bits(actual), _bits(expected)
    bad = (a != e) & ~nan_a
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.size} differ, first at {np.argwhere(bad)[0].tolist()}: {a[bad][:4]} vs {e[bad][:4]}"


def rand(shape, seed, dtype=F32, spread=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:  # groups of very different magnitude: every per-group scale differs
        x *= np.exp2(rng.integers(-20, 20, size=shape[:-1] + (1,))).astype(np.float32)
    return jnp.asarray(x, dtype)


def edge_cases(rows=8, k=256):
    """One tensor holding every special case, each in its own 16-wide block (so NVFP4 sees them alone too)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :] = 0.0  # all-zero row: finite scale, q = 0
    x[1, :16] = -0.0  # negative zeros keep their sign
    x[1, 16:32] = np.float32(1e-42)  # subnormals
    x[1, 32] = np.float32(-3e-39)
    x[2, 5] = np.inf  # +inf: its group / block becomes NaN, nothing else
    x[2, 200] = -np.inf
    x[3, 7] = np.nan
    x[4, :] *= np.float32(3e38) / np.abs(x[4]).max()  # near float32 max: the largest scales
    x[5, :] = np.float32(448.0)  # exactly the format maximum
    x[5, 130:140] = -np.float32(448.0)
    x[6, ::3] = np.float32(1e-8)  # tiny values in a group with a normal amax
    x[7, :] = np.float32(1e-12)  # amax under the 1e-10 floor
    return jnp.asarray(x)


# ---- per-token group ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,in_dtype,dtype,pow2",
    [
        ((1, 128), BF16, E4M3, False),  # M = 1
        ((3, 300), F32, E4M3, False),  # K not a multiple of 128 (zero-padded last group)
        ((2, 5, 257), BF16, E4M3, True),  # 3-D, partial group, power-of-two scales
        ((70, 256), F32, E5M2, False),  # rows span two tiles; E5M2
        ((1, 1), F32, E4M3, False),
    ],
)
def test_per_token_group_interpret(shape, in_dtype, dtype, pow2):
    x = rand(shape, sum(shape), in_dtype)
    q, s = Q.fp8_per_token_group(x, 128, dtype=dtype, pow2_scale=pow2, interpret=True)
    rq, rs = P.quantize_fp8_per_token_group(x, 128, dtype=dtype, pow2_scale=pow2)
    assert_same(s, rs, "scale")
    assert_same(q, rq, "q")


def test_per_token_group_edge_cases_interpret():
    x = edge_cases()
    for pow2 in (False, True):
        q, s = Q.fp8_per_token_group(x, interpret=True, pow2_scale=pow2)
        rq, rs = P.quantize_fp8_per_token_group(x, pow2_scale=pow2)
        assert_same(s, rs, "scale")
        assert_same(q, rq, "q")
    s = np.asarray(s)
    assert np.isfinite(s[0]).all() and not np.asarray(q)[0].astype(np.float32).any()  # all-zero group
    assert np.isnan(s[2]).all() and np.isnan(s[3, 0]) and np.isfinite(s[3, 1])  # NaN confined to its group


def test_per_token_group_rejects_bad_input():
    with pytest.raises(TypeError, match="int32"):
        Q.fp8_per_token_group(jnp.ones((2, 128), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="group size 48"):
        Q.fp8_per_token_group(jnp.ones((2, 128)), 48, interpret=True)
    with pytest.raises(ValueError, match="unsupported FP8 dtype"):
        Q.fp8_per_token_group(jnp.ones((2, 128)), dtype=jnp.bfloat16, interpret=True)


# ---- per-token group, scales in the GEMM kernels' layout ----------------------------------------------------------


def assert_gemm_operand(x, rows_multiple, *, interpret):
    """fp8_gemm_operand(x) == (the contract's codes, its scales transposed), the padding columns finite."""
    q, scale_t = Q.fp8_gemm_operand(x, rows_multiple=rows_multiple, interpret=interpret)
    rq, rs = (P.quantize_fp8_per_token_group(x, 128) if interpret else _cpu_reference(P.quantize_fp8_per_token_group, x, 128))
    m = x.shape[0]
    mp = -(-m // rows_multiple) * rows_multiple
    assert scale_t.shape == (x.shape[1] // 128, mp) and scale_t.dtype == F32
    assert_same(q, rq, "q")
    assert_same(np.asarray(scale_t)[:, :m], np.asarray(rs).T, "scale_t")
    assert np.isfinite(np.asarray(scale_t)[:, m:]).all()


@pytest.mark.parametrize("shape,in_dtype,rows_multiple", [
    ((1, 128), BF16, 128),  # M = 1: one row of 128 padding columns
    ((37, 256), F32, 64),  # M off the 16-row TMA multiple; a 64-row block
    ((130, 384), BF16, 128),  # three row bands, three groups
    ((256, 2048), BF16, 128),  # a decode step's activation
])
def test_gemm_operand_interpret(shape, in_dtype, rows_multiple):
    assert_gemm_operand(rand(shape, sum(shape), in_dtype), rows_multiple, interpret=True)


def test_gemm_operand_edge_cases_interpret():
    assert_gemm_operand(edge_cases(), 128, interpret=True)


def test_gemm_operand_rejects_bad_input_and_lowers_for_cuda():
    with pytest.raises(ValueError, match="multiple of 128"):
        Q.fp8_gemm_operand(jnp.ones((2, 300), BF16), interpret=True)
    with pytest.raises(ValueError, match="rows_multiple"):
        Q.fp8_gemm_operand(jnp.ones((2, 128), BF16), rows_multiple=96, interpret=True)
    with pytest.raises(TypeError, match="int32"):
        Q.fp8_gemm_operand(jnp.ones((2, 128), jnp.int32), interpret=True)
    x = jax.ShapeDtypeStruct((2048, 768), BF16)
    txt = jax.jit(lambda a: Q.fp8_gemm_operand(a)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape,in_dtype", [((256, 2048), BF16), ((2048, 768), BF16), ((1, 4096), BF16), ((777, 1024), F32)])
def test_gpu_gemm_operand(shape, in_dtype):
    assert_gemm_operand(rand(shape, 4, in_dtype), 128, interpret=False)
    assert_gemm_operand(jnp.concatenate([edge_cases(8, shape[1]), rand((40, shape[1]), 9)]).astype(in_dtype), 128,
                        interpret=False)


# ---- MXFP8 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["v2", "v1"])
@pytest.mark.parametrize("shape,in_dtype", [((3, 100), F32), ((2, 4, 256), BF16)])
def test_mxfp8_interpret(shape, in_dtype, impl):
    x = rand(shape, 11, in_dtype)
    q, e = Q.mxfp8(x, interpret=True, impl=impl)
    rq, re = P.quantize_mxfp8(x)
    assert_same(e, re, "scale byte")
    assert_same(q, rq, "q")


@pytest.mark.parametrize("impl", ["v2", "v1"])
def test_mxfp8_edge_cases_interpret(impl):
    x = edge_cases()
    q, e = Q.mxfp8(x, interpret=True, impl=impl)
    rq, re = P.quantize_mxfp8(x)
    assert_same(e, re, "scale byte")
    assert_same(q, rq, "q")
    assert (np.asarray(e)[2] == 255).any()  # the inf group's scale is the NaN byte


# ---- per block (weights) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,in_dtype,pow2",
    [
        ((200, 300), F32, False),  # partial blocks on both axes
        ((3, 130, 129), BF16, False),  # expert stack with partial blocks
        ((2, 128, 256), BF16, True),
        ((1, 1), F32, False),
    ],
)
def test_per_block_interpret(shape, in_dtype, pow2):
    w = rand(shape, 7 + len(shape), in_dtype)
    q, s = Q.fp8_per_block(w, pow2_scale=pow2, interpret=True)
    rq, rs = P.quantize_fp8_per_block(w, pow2_scale=pow2)
    assert_same(s, rs, "scale_inv")
    assert_same(q, rq, "q")


def test_per_block_edge_cases_interpret():
    w = jnp.concatenate([edge_cases(), jnp.zeros((128, 256), F32)], axis=0)  # plus an all-zero block row
    q, s = Q.fp8_per_block(w, interpret=True)
    rq, rs = P.quantize_fp8_per_block(w)
    assert_same(s, rs, "scale_inv")
    assert_same(q, rq, "q")
    s = np.asarray(s)
    assert np.isnan(s[0]).all() and np.isfinite(s[1]).all()  # the NaN/inf blocks only


def test_per_block_rejects_other_blocks():
    with pytest.raises(ValueError, match="128x128"):
        Q.fp8_per_block(jnp.ones((128, 128)), (1, 128), interpret=True)


# ---- NVFP4 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,in_dtype,global_amax",
    [
        ((3, 50), F32, None),  # K not a multiple of 16, tensor amax computed first
        ((2, 64, 256), BF16, "per_expert"),  # expert stack, one global scale per expert, one kernel call
        ((4, 64), BF16, 2.5),  # a given global amax smaller than the data: saturating block scales
    ],
)
def test_nvfp4_interpret(shape, in_dtype, global_amax):
    x = rand(shape, 21, in_dtype, spread=False) * 3
    if global_amax == "per_expert":
        global_amax = jnp.max(jnp.abs(x.astype(F32)).reshape(shape[0], -1), axis=1)
    packed, bs, g = Q.nvfp4(x, global_amax=global_amax, interpret=True)
    rp, rbs, rg = P.quantize_nvfp4(x, global_amax=global_amax)
    assert_same(g, rg, "global scale")
    assert_same(bs, rbs, "block scale")
    assert_same(packed, rp, "packed")


def _bench_pattern(shape, seed):
    """The benchmark's input: normals with one power of two per row, 2^-8 .. 2^7 (experiments/benchmarks/quantize.py)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-8, 8, shape[:-1] + (1,))).astype(np.float32)
    return jnp.asarray(x)


def test_nvfp4_f32_saturating_many_tiles_interpret():
    """The float32 benchmark case (given global amax 4.0: most block scales saturate), K = 8192, several tiles."""
    x = _bench_pattern((64, 8192), 0)
    for a, b, n in zip(Q.nvfp4(x, global_amax=4.0, interpret=True), P.quantize_nvfp4(x, global_amax=4.0),
                       ("packed", "block scale", "global")):
        assert_same(a, b, n)


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_edge_cases_interpret(impl):
    x = edge_cases()
    packed, bs, g = Q.nvfp4(x, interpret=True, impl=impl)
    rp, rbs, rg = P.quantize_nvfp4(x)
    assert_same(g, rg, "global scale")
    assert_same(bs, rbs, "block scale")
    assert_same(packed, rp, "packed")


def test_nvfp4_default_tiles_divide_each_experts_rows():
    """The default tiles (1024 rows for bfloat16, 768 for float32) shrink to a divisor of an expert's rows when each
    expert has its own global scale (a tile never straddles two scales), so a stack stays one launch; the bits are
    the contract's either way."""
    from pallas_kernels import quantize_nvfp4 as N

    assert N.default_tiles(BF16).rows == 1024 and N.default_tiles(F32).rows == 768
    assert N.default_tiles(BF16, 1, 1000).rows == 1024 and N.default_tiles(BF16, 8, 1024 * 5).rows == 1024
    assert N.default_tiles(BF16, 8, 768 * 5, "v12").rows == 768 and N.default_tiles(F32, 8, 768 * 5).rows == 768
    assert N.default_tiles(BF16, 8, 768 * 5).rows == 1024  # the default v14 keeps 512 rows per slab: no divisor
    xb, xf = jnp.zeros((4, 16), BF16), jnp.zeros((4, 16), F32)
    assert N.default_impl(xb) == N.default_impl(xf) == N.default_impl(xb, Q.TileConfig(rows=512)) == "v14"
    assert N.default_impl(xb, Q.TileConfig(rows=768)) == "v12" and N.default_impl(xf, Q.TileConfig(rows=768)) == "v14"
    assert N.default_tiles(F32, 8, 256 * 7).rows == 256 and N.default_tiles(F32, 8, 384 * 5, "v14").rows == 768
    assert N.default_tiles(F32, 8, 4096 * 448).rows == 512 and N.default_tiles(BF16, 8, 512 * 5).rows == 512
    assert N.default_tiles(F32, 2, 256).rows == 256 and N.default_tiles(BF16, 8, 4096 * 448).rows == 1024
    assert N.default_tiles(BF16, 8, 64 * 7).rows == 1024  # no divisor: each expert gets its own launch
    assert N.default_tiles(BF16, 8, 768 * 5).schedule == "dynamic" and N.default_tiles(F32).schedule == "static"
    x = rand((2, 64, 64), 5, BF16, spread=False) * 3
    gam = jnp.max(jnp.abs(x.astype(F32)).reshape(2, -1), axis=1)
    for a, b, n in zip(Q.nvfp4(x, global_amax=gam, interpret=True), P.quantize_nvfp4(x, global_amax=gam),
                       ("packed", "block scale", "global")):
        assert_same(a, b, n)


@pytest.mark.parametrize("in_dtype", [BF16, F32])
@pytest.mark.parametrize("per_expert", [False, True])
def test_nvfp4_every_version_lowers_for_cuda(in_dtype, per_expert):
    """Each version's GPU form (inline PTX, row layouts, the per-CTA prologue) builds a verified Mosaic GPU module here
    on the CPU: a GPU-only code path can't break unnoticed between GPU runs."""
    x = jax.ShapeDtypeStruct((4, 768, 256) if per_expert else (1536, 512), in_dtype)
    gam = jax.ShapeDtypeStruct((4,), F32) if per_expert else None
    for impl in IMPLS:
        fn = (lambda a, g, impl=impl: Q.nvfp4(a, global_amax=g, impl=impl)) if per_expert else (
            lambda a, impl=impl: Q.nvfp4(a, impl=impl))
        txt = jax.jit(fn).trace(*((x, gam) if per_expert else (x,))).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("stablehlo.custom_call @mosaic_gpu") == 1, impl


def test_nvfp4_unsupported_options_fail_clearly():
    x = jnp.ones((2, 32))
    with pytest.raises(NotImplementedError, match="four_over_six"):
        Q.nvfp4(x, four_over_six=True, interpret=True)
    with pytest.raises(ValueError, match="global_amax shape"):
        Q.nvfp4(x, global_amax=jnp.ones((2, 1)), interpret=True)


def e2m1_boundary_values():
    """Every E2M1 grid point and midpoint (tie), its float32 neighbours, saturation, zeros, subnormals, +-inf."""
    pts = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30]
    vals = []
    for p in pts:
        b = np.array([p], np.float32).view(np.uint32)[0].astype(np.int64)
        vals.extend(np.arange(max(b - 2, 0), b + 3).astype(np.uint32).view(np.float32).tolist())
    vals += [1e-45, 1e-40, 1.1754942e-38, np.inf]
    v = np.array(vals, np.float32)
    return np.concatenate([v, -v])


def _nvfp4_boundary_input(rows=48):
    """Blocks whose x / d hit every E2M1 boundary exactly (and as float32 neighbours): amax 6 so bs*g = 1."""
    v = e2m1_boundary_values()
    v = v[np.isfinite(v)]
    v = np.clip(v, -6.0, 6.0)
    rng = np.random.default_rng(3)
    x = np.zeros((rows, 64), np.float32)
    flat = np.resize(v, (rows * 4, 15))
    blocks = np.concatenate([np.full((rows * 4, 1), 6.0, np.float32), flat], axis=1)  # amax 6 per block
    blocks = blocks[:, rng.permutation(16)]
    x[:] = blocks.reshape(rows, 64)
    x[-1, :16] = 0.0  # an all-zero block (d == 0)
    x[-1, 16:32] = -0.0
    x[-2, 5] = np.nan
    x[-2, 40] = np.inf
    return jnp.asarray(x)


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_e2m1_boundaries_interpret(impl):
    """With global amax 6 * 448 the block scale of an amax-6 block is 448 and d = 448 * g = 1: x / d is x itself,
    so every tie and float32 neighbour of the E2M1 grid reaches the code step exactly."""
    x = _nvfp4_boundary_input()
    for gam in (6.0 * 448.0, None, 3.0):  # d = 1 exactly; the tensor amax; saturating scales
        got = Q.nvfp4(x, global_amax=gam, interpret=True, impl=impl)
        want = P.quantize_nvfp4(x, global_amax=gam)
        for a, b, n in zip(got, want, ("packed", "block scale", "global")):
            assert_same(a, b, f"{n} (global_amax={gam}, impl={impl})")


def _near_midpoint_blocks(blocks=4096, seed=21, exact_ties=False):
    """bfloat16 blocks whose values sit at and next to every E2M1 midpoint times their block's d = bs * g, for
    random block scales: where any shortcut for RN(x / d) (a product with RN(1/d), one correction too few) would
    fall on the wrong side of a midpoint.
    exact_ties: g a power of two, so d = bs * g has at most 4 significant bits and midpoint * d is a bfloat16: x / d
    hits the midpoints exactly (the ties) while RN(1/d) is inexact for most bs; else a random g (values within a
    bfloat16 ulp of the midpoints). Each block's first value is its amax (about 6 d), which keeps its scale."""
    rng = np.random.default_rng(seed)
    gam = np.float32(2688.0 * 2.0 ** int(rng.integers(-20, 20))) if exact_ties else np.float32(rng.uniform(1.0, 1e3))
    amax = (np.exp2(rng.uniform(-6, 8, blocks)) * gam / 448 * 6).astype(np.float32)  # block scales over e4m3's range
    amax = np.asarray(jnp.asarray(amax).astype(BF16).astype(F32))
    x = np.zeros((blocks, 16), np.float32)
    x[:, 0] = amax
    _, bs, g = P.quantize_nvfp4(jnp.asarray(x).astype(BF16), global_amax=gam)
    d = np.asarray(bs).astype(np.float32).reshape(-1) * np.float32(g)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    target = (mids[rng.integers(0, 7, (blocks, 15))] * d[:, None]).astype(np.float32)
    near = target.astype(BF16).astype(np.float32).view(np.uint32).astype(np.int64)  # nearest bf16, then +-1 ulp
    near += (rng.integers(-1, 2, near.shape) << 16)
    vals = near.astype(np.uint32).view(np.float32)
    signs = np.where(rng.random(vals.shape) < 0.5, -1.0, 1.0).astype(np.float32)
    x[:, 1:] = np.minimum(vals, amax[:, None]) * signs
    return jnp.asarray(x.reshape(-1, 256)).astype(BF16), gam


@pytest.mark.parametrize("exact_ties", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_near_midpoints_interpret(impl, exact_ties):
    x, gam = _near_midpoint_blocks(512, exact_ties=exact_ties)
    for a, b, n in zip(Q.nvfp4(x, global_amax=gam, interpret=True, impl=impl), P.quantize_nvfp4(x, global_amax=gam),
                       ("packed", "block scale", "global")):
        assert_same(a, b, n)


@pytest.mark.parametrize("shape,in_dtype,global_amax", [((1, 16), BF16, None), ((2, 3, 40), F32, "per_expert"),
                                                        ((5, 33), BF16, 0.5)])
def test_nvfp4_small_and_per_expert_shapes_interpret(shape, in_dtype, global_amax):
    """Both versions equal the contract on M = 1, a 3-D stack with per-expert scales and a partial block."""
    x = rand(shape, 2, in_dtype, spread=False) * 2
    if global_amax == "per_expert":
        global_amax = jnp.max(jnp.abs(x.astype(F32)).reshape(shape[0], -1), axis=1)
    for impl in IMPLS:
        got = Q.nvfp4(x, global_amax=global_amax, interpret=True, impl=impl)
        for a, b, n in zip(got, P.quantize_nvfp4(x, global_amax=global_amax), ("packed", "block scale", "global")):
            assert_same(a, b, f"{n} impl={impl}")


def test_divide_rows_interpret_is_ieee():
    from tests.pallas_kernels.division_probes import divide_rows

    x = rand((64, 128), 1) * np.float32(3.0)
    s = jnp.asarray(np.abs(np.asarray(rand((64, 1), 2)))[:, 0] + np.float32(1e-3))
    assert_same(divide_rows(x, s, interpret=True), np.asarray(x) / np.asarray(s)[:, None], "x / s")


# ---- on the H200 --------------------------------------------------------------------------------------


def _cpu_reference(fn, *args, **kwargs):
    """The contract evaluated by XLA:CPU (the backend its numpy statement was checked on)."""
    cpu = jax.devices("cpu")[0]
    move = lambda a: jax.device_put(np.asarray(a), cpu) if isinstance(a, (jax.Array, np.ndarray)) else a
    args = [move(a) for a in args]
    kwargs = {k: move(v) for k, v in kwargs.items()}
    with jax.default_device(cpu):
        return jax.tree.map(np.asarray, fn(*args, **kwargs))


@pytest.mark.gpu
def test_gpu_branch_free_reciprocal_equals_div_rn_on_every_significand():
    """exact_arith._RCP_RN_PTX (NVFP4's per-row RN(1/d): estimate, Newton step, Markstein correction, all-ones closed
    form) == div.rn.f32(1, d) for all 2^23 float32 significands at exponents across NVFP4's range of d."""
    from tests.pallas_kernels.division_probes import reciprocals

    sig = np.arange(1 << 23, dtype=np.uint32)
    for e in (-54, -30, -1, 0, 1, 40, 125):
        d = (sig | np.uint32((127 + e) << 23)).view(np.float32).reshape(-1, 128)
        fast, rn = reciprocals(jnp.asarray(d))
        assert_same(fast, rn, f"branch-free vs div.rn at 2^{e}")


@pytest.mark.gpu
def test_gpu_markstein_division_equals_div_rn():
    """The per-value division (mul + 2 FMA corrections by RN(1/s)) == div.rn.f32 == numpy, on 50M quotients."""
    from tests.pallas_kernels.division_probes import divide_rows

    rng = np.random.default_rng(0)
    rows = 1 << 16
    # divisors: random mantissas, all-ones / all-zeros mantissas (reciprocal worst cases), huge exponent range
    s = np.exp2(rng.uniform(-60, 100, rows)).astype(np.float32)
    s[::7] = np.float32(1.9999999) * np.exp2(rng.integers(-40, 90, s[::7].shape)).astype(np.float32)
    s[::11] = np.exp2(rng.integers(-40, 90, s[::11].shape)).astype(np.float32)
    for seed in range(6):
        # dividends: random bits within 2^-30 .. 2^9 times the divisor (so |x/s| spans what fp8 can see)
        mant = rng.integers(0, 1 << 23, (rows, 128), dtype=np.uint32)
        exp = rng.integers(-30, 10, (rows, 128))
        x = ((mant | np.uint32(0x3F800000)).view(np.float32) * np.exp2(exp) * s[:, None]).astype(np.float32)
        x *= np.where(rng.random((rows, 128)) < 0.5, -1, 1).astype(np.float32)
        x[0, :4] = [0.0, -0.0, 1e-40, -1e-40]
        got = np.asarray(divide_rows(jnp.asarray(x), jnp.asarray(s)))
        rn = np.asarray(divide_rows(jnp.asarray(x), jnp.asarray(s), division="div_rn"))
        expect = x / s[:, None]
        assert_same(rn, expect, f"div.rn vs numpy, seed {seed}")
        assert_same(got, expect, f"markstein vs numpy, seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,in_dtype,dtype,pow2",
    [
        ((4096, 4096), BF16, E4M3, False),
        ((3, 1000, 2048), F32, E4M3, False),
        ((1, 7168), BF16, E4M3, True),
        ((777, 1000), BF16, E5M2, False),
        ((8, 8, 384), F32, E4M3, True),
    ],
)
def test_gpu_per_token_group(shape, in_dtype, dtype, pow2):
    x = rand(shape, 3, in_dtype)
    q, s = Q.fp8_per_token_group(x, 128, dtype=dtype, pow2_scale=pow2)
    rq, rs = _cpu_reference(P.quantize_fp8_per_token_group, x, 128, dtype=dtype, pow2_scale=pow2)
    assert_same(s, rs, "scale")
    assert_same(q, rq, "q")


@pytest.mark.gpu
def test_gpu_edge_cases_all_kernels():
    x = jnp.concatenate([edge_cases(8, 512), rand((248, 512), 9)], axis=0)
    for pow2 in (False, True):
        got = Q.fp8_per_token_group(x, pow2_scale=pow2)
        want = _cpu_reference(P.quantize_fp8_per_token_group, x, pow2_scale=pow2)
        for a, b, n in zip(got, want, ("q", "scale")):
            assert_same(a, b, f"token group pow2={pow2} {n}")
        got = Q.fp8_per_block(x, pow2_scale=pow2)
        want = _cpu_reference(P.quantize_fp8_per_block, x, pow2_scale=pow2)
        for a, b, n in zip(got, want, ("q", "scale_inv")):
            assert_same(a, b, f"block pow2={pow2} {n}")
    for a, b, n in zip(Q.mxfp8(x), _cpu_reference(P.quantize_mxfp8, x), ("q", "scale byte")):
        assert_same(a, b, f"mxfp8 {n}")
    for a, b, n in zip(Q.nvfp4(x), _cpu_reference(P.quantize_nvfp4, x), ("packed", "block scale", "global")):
        assert_same(a, b, f"nvfp4 {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,in_dtype", [((4096, 4096), BF16), ((128, 768, 256), BF16), ((1000, 1000), F32), ((1, 64), F32)])
def test_gpu_per_block(shape, in_dtype):
    w = rand(shape, 4, in_dtype)
    q, s = Q.fp8_per_block(w)
    rq, rs = _cpu_reference(P.quantize_fp8_per_block, w)
    assert_same(s, rs, "scale_inv")
    assert_same(q, rq, "q")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["v2", "v1"])
@pytest.mark.parametrize("shape,in_dtype", [((4096, 4096), BF16), ((5, 333, 96), F32), ((1, 32), BF16)])
def test_gpu_mxfp8(shape, in_dtype, impl):
    x = rand(shape, 6, in_dtype)
    q, e = Q.mxfp8(x, impl=impl)
    rq, re = _cpu_reference(P.quantize_mxfp8, x)
    assert_same(e, re, "scale byte")
    assert_same(q, rq, "q")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,in_dtype,per_expert",
    [((4096, 4096), BF16, False), ((8, 768, 2048), BF16, True), ((3, 40, 48), F32, True), ((1000, 1000), F32, False)],
)
@pytest.mark.parametrize("impl", [*IMPLS, None],
                         ids=lambda v: v or "default")
def test_gpu_nvfp4(shape, in_dtype, per_expert, impl):
    x = rand(shape, 8, in_dtype, spread=False)
    gam = jnp.max(jnp.abs(x.astype(F32)).reshape(shape[0], -1), axis=1) if per_expert else None
    got = Q.nvfp4(x, global_amax=gam, impl=impl)
    want = _cpu_reference(P.quantize_nvfp4, x, global_amax=gam)
    for a, b, n in zip(got, want, ("packed", "block scale", "global")):
        assert_same(a, b, n)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stages", [2, 4])
def test_gpu_nvfp4_f32_saturating_many_tiles(impl, stages):
    """The benchmark's float32 case at a quarter of its size: many tiles per CTA, saturated block scales (it
    once differed from the contract, whose jitted scale chain XLA had rewritten; see decision record 0001)."""
    x = _bench_pattern((4096, 4096), 0)
    got = Q.nvfp4(x, global_amax=4.0, impl=impl, config=Q.TileConfig(stages=stages))
    want = _cpu_reference(P.quantize_nvfp4, x, global_amax=4.0)
    for a, b, n in zip(got, want, ("packed", "block scale", "global")):
        assert_same(a, b, f"{n} (impl={impl}, stages={stages})")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_gpu_nvfp4_boundaries_and_edges(in_dtype, impl):
    """The E2M1 boundary blocks, the edge-case rows, M = 1 and a 3-D per-expert stack, and blocks whose
    (amax / 6) / g overflows float32 (the Markstein guard) while x / d does not."""
    x = _nvfp4_boundary_input(256).astype(in_dtype)
    for gam in (6.0 * 448.0, None, 3.0):
        got = Q.nvfp4(x, global_amax=gam, impl=impl)
        want = _cpu_reference(P.quantize_nvfp4, x, global_amax=gam)
        for a, b, n in zip(got, want, ("packed", "block scale", "global")):
            assert_same(a, b, f"{n} (global_amax={gam})")
    e = jnp.concatenate([edge_cases(8, 512), rand((120, 512), 9)], axis=0).astype(in_dtype)
    for a, b, n in zip(Q.nvfp4(e, impl=impl), _cpu_reference(P.quantize_nvfp4, e), ("packed", "block scale", "global")):
        assert_same(a, b, f"edge cases {n}")
    huge = (rand((64, 512), 13, F32, spread=False) * jnp.float32(5e36)).astype(in_dtype)  # amax / 6 / g > f32 max at g = 1/2688; x / d is not
    for a, b, n in zip(Q.nvfp4(huge, global_amax=1.0, impl=impl), _cpu_reference(P.quantize_nvfp4, huge, global_amax=1.0),
                       ("packed", "block scale", "global")):
        assert_same(a, b, f"overflowing block scale {n}")
    for gam in (float("inf"), 1e-30):  # g = inf (every block scale 0), and the floored g (every scale 448)
        for a, b, n in zip(Q.nvfp4(e, global_amax=gam, impl=impl), _cpu_reference(P.quantize_nvfp4, e, global_amax=gam),
                           ("packed", "block scale", "global")):
            assert_same(a, b, f"edge cases, global_amax={gam}: {n}")
    for shape in ((1, 48), (3, 40, 48), (4, 256, 1024)):
        x = rand(shape, 12, in_dtype, spread=False) * 5
        gam = jnp.max(jnp.abs(x.astype(F32)).reshape(shape[0], -1), axis=1) if len(shape) == 3 else None
        got = Q.nvfp4(x, global_amax=gam, impl=impl)
        for a, b, n in zip(got, _cpu_reference(P.quantize_nvfp4, x, global_amax=gam), ("packed", "block scale", "global")):
            assert_same(a, b, f"{shape} {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_nvfp4_near_midpoints(impl):
    """Values at and next to every E2M1 midpoint of their block (random and power-of-two g, 2^18 blocks), bfloat16:
    ties x / d = midpoint exactly where RN(1/d) is inexact, where a quotient one correction short would miss."""
    for seed, exact_ties in ((21, False), (22, True), (23, True)):
        x, gam = _near_midpoint_blocks(1 << 18, seed, exact_ties)
        for a, b, n in zip(Q.nvfp4(x, global_amax=gam, impl=impl), _cpu_reference(P.quantize_nvfp4, x, global_amax=gam),
                           ("packed", "block scale", "global")):
            assert_same(a, b, f"seed {seed} {n}")
