"""Fused transpose + 1x128 FP8 quantization (the wgrad operands), bitwise equal to the contract's composition.

    fp8_transposed_per_token_group(x [M, K])
        == precision.quantize_fp8_per_token_group(pad_rows(x, 128).T, 128)
        -> (q [K, Mp] e4m3, scale [K, Mp / 128] float32),  Mp = M rounded up to 128

i.e. each column of x is quantized in groups of 128 consecutive rows (zero rows pad the last group), and the
result is laid out transposed, as the wgrad GEMM dW = g^T x needs it (FP8 wgmma takes K-major operands only,
and the contraction axis of wgrad is M). The transpose is never materialised in HBM: each CTA reads a
[128 (m), 64 (k)] tile of x with TMA (rows past M read as zeros: the contract's zero padding), loads it from
shared memory through its transposed view in the WGMMA_TRANSPOSED register layout, converts it to the WGMMA
layout in registers (one shuffle + byte permute per register: Mosaic's `to_layout`), and from there runs the
same arithmetic as `quantize_fp8.fp8_per_token_group`: row amax (a row of the [64 (k), 128 (m)] view is one
group), floor, s = amax / fmax with div.rn.f32, x / s with the Markstein sequence, clamp, RNE cast.

Scales are produced as s_t [Mp / 128, K] (each tile's 64 scales are contiguous there) and returned as s_t.T.
The GEMM kernel consumes scales transposed again (`gemm_dense` passes a_scale.T, and column-mode b scales are
swapped), so inside one jit XLA cancels the two transposes.

Interpret mode (CPU tests) reads the tile and transposes it with jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_fp8.precision.formats import AMAX_FLOOR, fp8_max
from pallas_kernels.exact_arith import (
    abs_for_amax, ceil_pow2_bits, div_mode, divide_by_rows, finite_or_nan, ieee_div, INTERPRET, rdiv, row_broadcast,
    row_mode,
)
from pallas_kernels.tile_schedules import persistent_kernel
from pallas_kernels.tiling import (
    interpret_context, resolve_interpret, ROW_PAD, ROWS, swizzle_transforms, TILE, TileConfig,
)
from pallas_kernels.kernel_cache import traced_once

F32 = jnp.float32
GROUP = 128  # rows of x per group (the contract's 1x128 along M)
TILE_K = 64  # columns of x per tile: a [64, 128] transposed tile, 8192 values, as the row kernels use
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _body(t, x_ref, q_ref, s_ref, *, fmax, out_dtype, pow2, mode):
    del t
    if mode == INTERPRET:
        x = x_ref[...].T.astype(F32)
    else:
        # x_ref is the [128 (m), 64 (k)] tile; its transposed view is [64 (k), 128 (m)] with k contiguous,
        # which is WGMMA_TRANSPOSED's vector axis. to_layout(WGMMA) is a register shuffle (16/32-bit types).
        x = plgpu.load(x_ref.T, layout=plgpu.Layout.WGMMA_TRANSPOSED)
        x = plgpu.layout_cast(x, TILE).astype(F32)
    amax = finite_or_nan(jnp.max(abs_for_amax(x, mode), axis=1), AMAX_FLOOR)
    s = ieee_div(amax, fmax, layout=ROWS, mode=row_mode(mode))
    if pow2:
        s = ceil_pow2_bits(s)
        inv = rdiv(1.0, s, layout=ROWS, mode=row_mode(mode))  # s is 2^e: x * (1/s) == x / s exactly
        y = x * row_broadcast(inv, x.shape)
    else:
        y = divide_by_rows(x, s, mode=mode)
    q_ref[...] = jnp.minimum(jnp.maximum(y, -fmax), fmax).astype(out_dtype)
    s_ref[...] = s


@functools.partial(jax.jit, static_argnames=("out_dtype", "pow2", "cfg", "interpret"))
def _quantize_transposed(x, *, out_dtype, pow2, cfg, interpret):
    m, k = x.shape
    mb = -(-m // GROUP)
    mp = mb * GROUP
    m16 = -(-m // ROW_PAD) * ROW_PAD
    if m16 != m:  # only for M not a multiple of 16 (the TMA view's row granularity); zeros = contract padding
        x = jnp.pad(x, [(0, m16 - m), (0, 0)])
    kt = k // TILE_K
    ntiles = mb * kt

    # tile t = (row block t // kt, column block t % kt): consecutive tiles of a CTA share input rows
    def x_view(g, t):
        return g.at[pl.ds((t // kt) * GROUP, GROUP), pl.ds((t % kt) * TILE_K, TILE_K)]

    def q_view(g, t):
        return g.at[pl.ds((t % kt) * TILE_K, TILE_K), pl.ds((t // kt) * GROUP, GROUP)]

    def s_view(g, t):  # s_t flat [mb * K]: row block major, so a tile's 64 scales are contiguous
        return g.at[pl.ds((t // kt) * k + (t % kt) * TILE_K, TILE_K)]

    body = functools.partial(_body, fmax=fp8_max(out_dtype), out_dtype=out_dtype, pow2=pow2,
                             mode=div_mode(interpret, cfg))
    call = persistent_kernel(
        body,
        name="quantize_fp8_transposed_g128",
        out_shapes=[jax.ShapeDtypeStruct((k, mp), out_dtype), jax.ShapeDtypeStruct((mb * k,), F32)],
        in_tiles=[((GROUP, TILE_K), x.dtype, swizzle_transforms(TILE_K, x.dtype), x_view)],
        out_tiles=[
            ((TILE_K, GROUP), out_dtype, swizzle_transforms(GROUP, out_dtype), q_view),
            ((TILE_K,), F32, (), s_view),
        ],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
    )
    q, s_t = call(x)
    return q, s_t.reshape(mb, k).T


def supports(x) -> bool:
    """Shapes and dtypes the kernel takes: x [M, K], M >= 1, K a multiple of 64, bf16 / f16 / f32."""
    x_shape, dtype = jnp.shape(x), jnp.dtype(x.dtype)
    return (len(x_shape) == 2 and x_shape[0] >= 1 and x_shape[1] >= TILE_K and x_shape[1] % TILE_K == 0
            and dtype in [jnp.dtype(d) for d in INPUT_DTYPES])


@traced_once("group_size", "dtype", "pow2_scale", "interpret", "config")
def fp8_transposed_per_token_group(x, group_size: int = GROUP, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False,
                                   interpret: bool = False, config: TileConfig | None = None):
    """quantize_fp8_per_token_group(pad_rows(x, 128).T, 128) without the transposed copy (see module doc).

    x [M, K] bfloat16 / float16 / float32, K a multiple of 64. Returns (q [K, Mp] dtype, scale [K, Mp/128] f32).
    `config` takes TileConfig's stages, ctas_per_sm and division (its rows are fixed: 64 columns of x per tile).
    """
    x = jnp.asarray(x)
    if group_size != GROUP:
        raise ValueError(f"fp8_transposed_per_token_group: only 128-row groups, got {group_size}")
    if x.ndim != 2:
        raise ValueError(f"fp8_transposed_per_token_group needs x [M, K]; got shape {x.shape}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in INPUT_DTYPES]:
        raise TypeError(f"fp8_transposed_per_token_group: input dtype {x.dtype} not supported; use bfloat16, float16 or float32")
    if not supports(x):
        raise ValueError(f"fp8_transposed_per_token_group: x {x.shape} needs M >= 1 and K a multiple of {TILE_K}")
    fp8_max(dtype)  # validates dtype
    interpret = resolve_interpret(interpret)
    with interpret_context(interpret):
        return _quantize_transposed(x, out_dtype=jnp.dtype(dtype), pow2=pow2_scale, cfg=config or TileConfig(),
                                    interpret=interpret)


def reference(x, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False):
    """The composition the kernel replaces (the contract on the padded transpose)."""
    from jaxrl_fp8.precision.fp8 import quantize_fp8_per_token_group  # noqa: PLC0415

    x = jnp.asarray(x)
    pad = (-x.shape[0]) % GROUP
    xp = jnp.pad(x, [(0, pad), (0, 0)]) if pad else x
    return quantize_fp8_per_token_group(xp.T, GROUP, dtype=dtype, pow2_scale=pow2_scale)
