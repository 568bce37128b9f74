"""TileConfig(schedule="dynamic"): CTAs take tiles from an atomic counter after their first `stages` tiles; and
TileConfig(auto_barriers=False): only the pipeline's own CTA barriers, none of Pallas' automatic ones.

CPU: the GPU form is lowered for CUDA (Mosaic GPU's lowering runs here; the inline atomic, the SMEM tile ring and the
counter's aliasing are built), and interpret mode, which always walks the static order, still gives the contract's
bits. GPU (-m gpu): every kernel's output is bitwise the contract's over tile counts below, at and far above the
grid, on repeated calls (a fresh counter per call) and with two calls in one program.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.pallas_kernels.test_quantize import BF16, F32, _cpu_reference, assert_same, edge_cases, rand

from jaxrl_fp8 import precision as P
from pallas_kernels import quantize as Q
from pallas_kernels.interpret import reset_after_error

DYN = Q.TileConfig(schedule="dynamic")
NVFP4_DYN = Q.TileConfig(rows=768, ctas_per_sm=3, schedule="dynamic")

# (name, kernel call with a config, the contract)
KERNELS = [
    ("fp8_per_token_group", lambda x, cfg, **kw: Q.fp8_per_token_group(x, config=cfg, **kw), P.quantize_fp8_per_token_group),
    ("fp8_per_block", lambda x, cfg, **kw: Q.fp8_per_block(x, config=cfg, **kw), P.quantize_fp8_per_block),
    ("mxfp8", lambda x, cfg, **kw: Q.mxfp8(x, config=cfg, **kw), P.quantize_mxfp8),
    ("nvfp4", lambda x, cfg, **kw: Q.nvfp4(x, config=cfg, **kw), P.quantize_nvfp4),
]


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    reset_after_error()


def _mosaic_calls(fn, *avals):
    """The Mosaic GPU custom calls of fn lowered for CUDA: (operand aliases, kernel names) per call."""
    txt = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in txt.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    return [(re.findall(r"output_operand_alias<[^>]*>", line), line) for line in calls]


@pytest.mark.parametrize("name,kernel,_", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_explicit_barriers_lower_for_cuda(name, kernel, _, schedule):
    x = jax.ShapeDtypeStruct((2048, 1024), BF16)
    cfg = Q.TileConfig(rows=768 if name == "nvfp4" else None, schedule=schedule, auto_barriers=False)
    (aliases, _line), = _mosaic_calls(lambda a: kernel(a, cfg), x)
    assert len(aliases) == (schedule == "dynamic")


@pytest.mark.parametrize("name,kernel,_", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dynamic_schedule_lowers_for_cuda(name, kernel, _, dtype):
    x = jax.ShapeDtypeStruct((2048, 1024), dtype)
    cfg = NVFP4_DYN if name == "nvfp4" else DYN
    (aliases, _line), = _mosaic_calls(lambda a: kernel(a, cfg), x)
    assert len(aliases) == 1, "the tile counter is one mutable operand aliased into the kernel"
    static = dataclasses.replace(cfg, schedule="static")
    (static_aliases, _), = _mosaic_calls(lambda a: kernel(a, static), x)
    assert static_aliases == [], "the static schedule takes no counter"


def test_two_dynamic_calls_in_one_program_get_two_counters():
    x = jax.ShapeDtypeStruct((1024, 512), BF16)

    def two(a):
        return Q.nvfp4(a, config=NVFP4_DYN), Q.fp8_per_token_group(a, config=DYN)

    calls = _mosaic_calls(two, x)
    assert len(calls) == 2 and all(len(a) == 1 for a, _ in calls)


@pytest.mark.parametrize("name,kernel,contract", KERNELS, ids=[k[0] for k in KERNELS])
def test_dynamic_schedule_interpret_equals_contract(name, kernel, contract):
    x = jnp.concatenate([edge_cases(8, 256), rand((120, 256), 2)], axis=0)
    cfg = Q.TileConfig(rows=128 if name == "nvfp4" else None, schedule="dynamic", auto_barriers=False)
    got = kernel(x, cfg, interpret=True)
    for a, b in zip(got, contract(x)):
        assert_same(a, b, name)


@pytest.mark.parametrize("bad,match", [({"schedule": "work_stealing"}, "schedule must be one of"),
                                       ({"schedule": "dynamic", "stages": 1}, "needs stages >= 2"),
                                       ({"auto_barriers": "no"}, "auto_barriers must be True or False")])
def test_bad_schedule_fails_clearly(bad, match):
    with pytest.raises(ValueError, match=match):
        Q.TileConfig(**bad)


# ---- on the H200 --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name,kernel,contract", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize(
    "shape,in_dtype",
    [((1, 64), BF16),  # one tile: the loop ends at the first published index
     ((700, 1000), F32),  # fewer tiles than stages x CTAs: some CTAs publish only indices past the end
     ((16384, 4096), BF16),  # many tiles per CTA
     ((4, 512, 768), BF16)],  # an expert stack
)
def test_gpu_dynamic_schedule_equals_contract(name, kernel, contract, shape, in_dtype):
    x = rand(shape, 11, in_dtype, spread=name != "nvfp4")
    want = _cpu_reference(contract, x)
    fn = jax.jit(lambda a: kernel(a, NVFP4_DYN if name == "nvfp4" else DYN))
    for call in range(3):  # a fresh zeroed counter each call: no call sees another's tickets
        for a, b in zip(fn(x), want):
            assert_same(a, b, f"{name} {shape} call {call}")


@pytest.mark.gpu
@pytest.mark.parametrize("name,kernel,contract", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_gpu_explicit_barriers_equal_contract(name, kernel, contract, schedule):
    """Without Pallas' automatic barriers the pipeline's own must order every SMEM hazard: bits on many tiles per CTA
    (where a missing barrier would let a slot be overwritten while read), edge cases, and a partial last tile."""
    for shape, dtype, seed in (((16384, 4096), BF16, 13), ((3000, 1000), F32, 14)):
        x = rand(shape, seed, dtype, spread=name != "nvfp4")
        x = jnp.concatenate([edge_cases(8, shape[1]).astype(dtype), x], axis=0)
        cfg = Q.TileConfig(rows=768 if name == "nvfp4" else None, ctas_per_sm=3 if name == "nvfp4" else 2,
                           schedule=schedule, auto_barriers=False)
        for a, b in zip(kernel(x, cfg), _cpu_reference(contract, x)):
            assert_same(a, b, f"{name} {shape} {schedule}")


@pytest.mark.gpu
def test_gpu_dynamic_schedule_edges_and_per_expert_nvfp4():
    x = jnp.concatenate([edge_cases(8, 512), rand((1016, 512), 9)], axis=0)
    for name, kernel, contract in KERNELS:
        for a, b in zip(kernel(x, NVFP4_DYN if name == "nvfp4" else DYN), _cpu_reference(contract, x)):
            assert_same(a, b, f"{name} edge cases")
    w = rand((8, 768, 2048), 8, BF16, spread=False)
    gam = jnp.max(jnp.abs(w.astype(F32)).reshape(8, -1), axis=1)
    got = Q.nvfp4(w, global_amax=gam, config=Q.TileConfig(rows=768, ctas_per_sm=3, schedule="dynamic"))
    for a, b in zip(got, _cpu_reference(P.quantize_nvfp4, w, global_amax=gam)):
        assert_same(a, b, "nvfp4 per expert")


@pytest.mark.gpu
def test_gpu_two_dynamic_calls_in_one_program():
    x = rand((8192, 2048), 12, BF16, spread=False)
    both = jax.jit(lambda a: (Q.nvfp4(a, config=NVFP4_DYN), Q.nvfp4(a * 2, config=NVFP4_DYN)))
    first, second = both(x)
    for got, xin in ((first, x), (second, x * 2)):
        for a, b in zip(got, _cpu_reference(P.quantize_nvfp4, np.asarray(xin))):
            assert_same(a, b, "nvfp4 in one program")


def test_dynamic_schedule_lowers_under_grad_with_checkpoint_and_scan():
    """The training stack differentiates through custom_vjp linears inside jax.checkpoint inside lax.scan; partial
    evaluation there must not separate the counter's creation from its kernel (a ref can't be a residual)."""

    @jax.custom_vjp
    def qlin(x, w):
        q, s = Q.fp8_per_token_group(x, config=DYN)
        return (q.astype(F32) * jnp.repeat(s, 128, axis=-1)) @ w

    def fwd(x, w):
        return qlin(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        gq, gs = Q.fp8_per_token_group(g, config=DYN)
        return (gq.astype(F32) * jnp.repeat(gs, 128, axis=-1)) @ w.T, x.T @ g

    qlin.defvjp(fwd, bwd)

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(lambda h: jnp.tanh(qlin(h, w)))(h), None), x, ws)
        return jnp.sum(h)

    ws, x = jax.ShapeDtypeStruct((3, 256, 256), F32), jax.ShapeDtypeStruct((256, 256), F32)
    calls = _mosaic_calls(jax.grad(loss), ws, x)
    assert len(calls) >= 2 and all(len(aliases) == 1 for aliases, _ in calls)
