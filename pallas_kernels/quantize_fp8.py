"""FP8 quantization kernels: per-token group (1 x G), MXFP8 (1 x 32, UE8M0 scales) and per-block (128 x 128).

Each returns exactly what the matching `jaxrl_fp8.precision` function returns (same shapes, dtypes, bits).

Group kernels view x as rows of one group each, [R, G] with R = prod(x.shape[:-1]) * K / G (a free
reshape), and stream [rows, G] tiles: the group amax is a row reduction and the scale output is one
contiguous float32 (or byte) per row. K not a multiple of G is zero-padded outside the kernel, exactly the
contract's padded semantics (and cropped after). The last row tile may overhang R: TMA reads zeros there
and clips the writes.

The block kernel streams 128 x 128 blocks of [E, N, K] (N and K zero-padded to 128 outside the kernel when
needed); each block's scale is stored straight from registers to GMEM.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_fp8.precision.formats import AMAX_FLOOR, MXFP8_BLOCK, fp8_max
from pallas_kernels.exact_arith import (
    abs_for_amax, ceil_pow2_bits, div_mode, divide_by_rows, e8m0_byte, finite_or_nan, ieee_div, INTERPRET, load_tile,
    pow2_reciprocal_bits, rdiv, row_broadcast, row_mode,
)
from pallas_kernels.tile_schedules import persistent_kernel
from pallas_kernels.tiling import (
    interpret_context, resolve_interpret, ROW_MULTIPLE, ROW_PAD, ROWS, swizzle_transforms, tile_rows, TileConfig,
)
from pallas_kernels.kernel_cache import traced_once

F32 = jnp.float32
WEIGHT_BLOCK = 128
HALF = 64  # the block kernel works on 64-row halves of a 128 x 128 block (64 f32 registers per thread)
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_input(x, what):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in INPUT_DTYPES]:
        raise TypeError(f"{what}: input dtype {x.dtype} not supported; use one of bfloat16, float16, float32")


# ---------------------------------------------------------------------------------------------- groups


def _group_body(t, x_ref, q_ref, s_ref, *, fmax, out_dtype, pow2, e8m0, mode, pow2_inv="div"):
    del t
    x = load_tile(x_ref, mode).astype(F32)
    amax = finite_or_nan(jnp.max(abs_for_amax(x, mode), axis=1), AMAX_FLOOR)
    s = ieee_div(amax, fmax, layout=ROWS, mode=row_mode(mode))
    if pow2:
        s = ceil_pow2_bits(s)
        # s is a power of two, so x * (1/s) is the same real number as x / s, rounded once: identical bits.
        if pow2_inv == "bits":  # mxfp8 impl v2: 1/s from the exponent (exact), no div.rn per row
            inv = pow2_reciprocal_bits(s)
        else:
            inv = rdiv(1.0, s, layout=ROWS, mode=row_mode(mode))
        y = x * row_broadcast(inv, x.shape)
    else:
        y = divide_by_rows(x, s, mode=mode)
    q_ref[...] = jnp.minimum(jnp.maximum(y, -fmax), fmax).astype(out_dtype)
    s_ref[...] = e8m0_byte(s) if e8m0 else s


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "pow2", "e8m0", "cfg", "interpret", "pow2_inv"))
def _quantize_rows(x, *, group, out_dtype, pow2, e8m0, cfg, interpret, pow2_inv="div"):
    """x [..., K] -> (q [..., K] out_dtype, scale [..., ceil(K/group)] f32 or uint8)."""
    lead, k = x.shape[:-1], x.shape[-1]
    pad = (-k) % group
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)]) if pad else x
    groups = (k + pad) // group
    r = math.prod(lead) * groups
    r8 = -(-r // ROW_PAD) * ROW_PAD  # see ROW_PAD
    x2 = xp.reshape(r, group)
    if r8 != r:
        x2 = jnp.pad(x2, [(0, r8 - r), (0, 0)])
    tr = tile_rows(cfg, group)
    ntiles = pl.cdiv(r8, tr)
    s_dtype = jnp.uint8 if e8m0 else F32
    rows = lambda g, t: g.at[pl.ds(t * tr, tr)]
    body = functools.partial(
        _group_body, fmax=fp8_max(out_dtype), out_dtype=out_dtype, pow2=pow2, e8m0=e8m0,
        mode=div_mode(interpret, cfg), pow2_inv=pow2_inv,
    )
    call = persistent_kernel(
        body,
        name=f"quantize_{'mx' if e8m0 else 'fp8'}_g{group}",
        out_shapes=[jax.ShapeDtypeStruct((r8, group), out_dtype), jax.ShapeDtypeStruct((r8,), s_dtype)],
        in_tiles=[((tr, group), x.dtype, swizzle_transforms(group, x.dtype), rows)],
        out_tiles=[
            ((tr, group), out_dtype, swizzle_transforms(group, out_dtype), rows),
            ((tr,), s_dtype, (), rows),
        ],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
    )
    q2, s = call(x2)
    q = q2[:r].reshape(*lead, groups * group)[..., :k]
    return q, s[:r].reshape(*lead, groups)


SUPPORTED_GROUPS = (32, 64, 128, 256)  # fp8 rows of >= 32 bytes (a TMA swizzle), <= 256 to bound registers


def _check_group(group, what):
    if group not in SUPPORTED_GROUPS:
        raise ValueError(f"{what}: group size {group} not supported by the kernel (use one of {SUPPORTED_GROUPS})")


@traced_once("group_size", "dtype", "pow2_scale", "interpret", "config")
def fp8_per_token_group(x, group_size: int = 128, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False,
                        interpret: bool = False, config: TileConfig | None = None):
    """Kernel form of `jaxrl_fp8.precision.quantize_fp8_per_token_group` (same outputs, bit for bit)."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("fp8_per_token_group needs at least one axis")
    _check_input(x, "fp8_per_token_group")
    fp8_max(dtype)  # validates dtype
    _check_group(group_size, "fp8_per_token_group")
    interpret = resolve_interpret(interpret)
    with interpret_context(interpret):
        return _quantize_rows(x, group=group_size, out_dtype=jnp.dtype(dtype), pow2=pow2_scale, e8m0=False,
                              cfg=config or TileConfig(), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "cfg", "interpret", "rows_multiple"))
def _quantize_rows_gemm_layout(x, *, group, out_dtype, cfg, interpret, rows_multiple):
    """x [M, K] -> (q [M, K], scale_t [K/group, Mp]): the group kernel's body on [rows, group] tiles cut from the 2-D
    x (tile t: row band t // (K/group), group t % (K/group)), so each tile's scales are a contiguous run of one row of
    scale_t. Mp = M rounded up to rows_multiple; rows past M are read as zeros (q 0, the floor's scale)."""
    m, k = x.shape
    kb = k // group
    tr = tile_rows(cfg, group)
    mp = -(-m // rows_multiple) * rows_multiple
    bands = pl.cdiv(mp, tr)
    m16 = -(-m // ROW_PAD) * ROW_PAD  # see ROW_PAD: a copy only for a row count off the multiple
    if m16 != m:
        x = jnp.pad(x, [(0, m16 - m), (0, 0)])
    cells = lambda g, t: g.at[pl.ds((t // kb) * tr, tr), pl.ds((t % kb) * group, group)]
    scale_run = lambda g, t: g.at[t % kb, pl.ds((t // kb) * tr, tr)]
    body = functools.partial(_group_body, fmax=fp8_max(out_dtype), out_dtype=out_dtype, pow2=False, e8m0=False,
                             mode=div_mode(interpret, cfg))
    call = persistent_kernel(
        body,
        name=f"quantize_fp8_g{group}_t",
        out_shapes=[jax.ShapeDtypeStruct((m16, k), out_dtype), jax.ShapeDtypeStruct((kb, bands * tr), F32)],
        in_tiles=[((tr, group), x.dtype, swizzle_transforms(group, x.dtype), cells)],
        out_tiles=[
            ((tr, group), out_dtype, swizzle_transforms(group, out_dtype), cells),
            ((tr,), F32, (), scale_run),
        ],
        ntiles=bands * kb,
        cfg=cfg,
        interpret=interpret,
    )
    q, scale_t = call(x)
    return q[:m] if m16 != m else q, scale_t[:, :mp] if bands * tr != mp else scale_t


@traced_once("rows_multiple", "interpret", "config")
def fp8_gemm_operand(x, *, rows_multiple: int = 128, interpret: bool = False, config: TileConfig | None = None):
    """x [M, K] (K a multiple of 128) -> (q [M, K] e4m3, scale_t [K/128, Mp] float32): `fp8_per_token_group(x, 128)`'s
    codes and its scales transposed, in the layout the FP8 GEMM kernels load (K-block major, M padded to
    `rows_multiple`, the GEMM's row block), written so by the kernel itself: the GEMM needs no transpose of the
    scales (a kernel launch per product) and no pad of them. scale_t[j, m] == fp8_per_token_group(x)[1][m, j] bit
    for bit for m < M; the columns past M hold the floor's scale (zero rows), which only padding rows multiply."""
    x = jnp.asarray(x)
    _check_input(x, "fp8_gemm_operand")
    if x.ndim != 2 or x.shape[1] % 128:
        raise ValueError(f"fp8_gemm_operand: x must be [M, K] with K a multiple of 128; got shape {x.shape}")
    if rows_multiple % ROW_MULTIPLE and ROW_MULTIPLE % rows_multiple:
        raise ValueError(f"fp8_gemm_operand: rows_multiple {rows_multiple} must divide or be a multiple of {ROW_MULTIPLE}")
    interpret = resolve_interpret(interpret)
    with interpret_context(interpret):
        return _quantize_rows_gemm_layout(x, group=128, out_dtype=jnp.dtype(jnp.float8_e4m3fn), cfg=config or TileConfig(),
                                          interpret=interpret, rows_multiple=rows_multiple)


MXFP8_IMPLS = ("v2", "v1")


@traced_once("block", "dtype", "interpret", "config", "impl")
def mxfp8(x, block: int = MXFP8_BLOCK, *, dtype=jnp.float8_e4m3fn, interpret: bool = False,
          config: TileConfig | None = None, impl: str = "v2"):
    """Kernel form of `jaxrl_fp8.precision.quantize_mxfp8`: (q, UE8M0 scale bytes [..., ceil(K/block)]).

    impl "v2" (default) takes the power-of-two reciprocal 1/s from s's exponent bits (exact) instead of a
    per-row div.rn.f32; "v1" is the first kernel. Same bits either way.
    """
    if impl not in MXFP8_IMPLS:
        raise ValueError(f"mxfp8: impl must be one of {MXFP8_IMPLS}, got {impl!r}")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("mxfp8 needs at least one axis")
    _check_input(x, "mxfp8")
    fp8_max(dtype)
    _check_group(block, "mxfp8")
    interpret = resolve_interpret(interpret)
    with interpret_context(interpret):
        return _quantize_rows(x, group=block, out_dtype=jnp.dtype(dtype), pow2=True, e8m0=True,
                              cfg=config or TileConfig(), interpret=interpret,
                              pow2_inv="bits" if impl == "v2" else "div")


# ---------------------------------------------------------------------------------------------- blocks


def _block_body(t, x_ref, q_ref, s_gmem, *, nb, kb, fmax, out_dtype, pow2, mode):
    halves = [x_ref.at[pl.ds(h * HALF, HALF)] for h in range(WEIGHT_BLOCK // HALF)]
    row_max = None
    for half in halves:
        m = jnp.max(abs_for_amax(load_tile(half, mode).astype(F32), mode), axis=1)
        row_max = m if row_max is None else jnp.maximum(row_max, m)
    amax = finite_or_nan(jnp.max(row_max, axis=0), AMAX_FLOOR)  # the block's scalar amax
    if mode == INTERPRET:
        s = amax / lax.optimization_barrier(F32(fmax))
        if pow2:
            s = ceil_pow2_bits(s)
        s_rows = jnp.broadcast_to(s, (HALF,))
    else:
        # every row of the half-block carries the block's scale: divisions stay per-row vectors
        s_rows = ieee_div(plgpu.layout_cast(jnp.broadcast_to(amax, (HALF,)), ROWS), fmax, layout=ROWS,
                            mode=row_mode(mode))
        if pow2:
            s_rows = ceil_pow2_bits(s_rows)
        s = jnp.max(s_rows, axis=0)  # all equal (NaN propagates): the scalar to store
    for h, half in enumerate(halves):
        x = load_tile(half, mode).astype(F32)
        y = divide_by_rows(x, s_rows, mode=mode)
        q_ref.at[pl.ds(h * HALF, HALF)][...] = jnp.minimum(jnp.maximum(y, -fmax), fmax).astype(out_dtype)
    e, rest = t // (nb * kb), t % (nb * kb)
    s_gmem[e, rest // kb, rest % kb] = s


@functools.partial(jax.jit, static_argnames=("out_dtype", "pow2", "cfg", "interpret"))
def _quantize_blocks(w, *, out_dtype, pow2, cfg, interpret):
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    bs = WEIGHT_BLOCK
    pn, pk = (-n) % bs, (-k) % bs
    w3 = w.reshape(-1, n, k)
    if pn or pk:
        w3 = jnp.pad(w3, [(0, 0), (0, pn), (0, pk)])
    e = w3.shape[0]
    nb, kb = (n + pn) // bs, (k + pk) // bs
    ntiles = e * nb * kb

    def block(g, t):
        ei, rest = t // (nb * kb), t % (nb * kb)
        return g.at[ei, pl.ds((rest // kb) * bs, bs), pl.ds((rest % kb) * bs, bs)]

    body = functools.partial(_block_body, nb=nb, kb=kb, fmax=fp8_max(out_dtype), out_dtype=out_dtype, pow2=pow2,
                             mode=div_mode(interpret, cfg))
    call = persistent_kernel(
        body,
        name="quantize_fp8_block128",
        out_shapes=[jax.ShapeDtypeStruct(w3.shape, out_dtype)],
        in_tiles=[((bs, bs), w.dtype, swizzle_transforms(bs, w.dtype), block)],
        out_tiles=[((bs, bs), out_dtype, swizzle_transforms(bs, out_dtype), block)],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
        extra_out=[jax.ShapeDtypeStruct((e, nb, kb), F32)],
    )
    q3, s = call(w3)
    q = q3[:, :n, :k].reshape(*lead, n, k)
    return q, s.reshape(*lead, nb, kb)


@traced_once("block", "dtype", "pow2_scale", "interpret", "config")
def fp8_per_block(w, block=(WEIGHT_BLOCK, WEIGHT_BLOCK), *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False,
                  interpret: bool = False, config: TileConfig | None = None):
    """Kernel form of `jaxrl_fp8.precision.quantize_fp8_per_block` for 128 x 128 blocks ([N, K] or [..., N, K])."""
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"fp8_per_block needs [..., N, K]; got shape {w.shape}")
    if tuple(block) != (WEIGHT_BLOCK, WEIGHT_BLOCK):
        raise ValueError(f"fp8_per_block: the kernel handles 128x128 blocks only, got {tuple(block)}")
    _check_input(w, "fp8_per_block")
    fp8_max(dtype)
    interpret = resolve_interpret(interpret)
    with interpret_context(interpret):
        return _quantize_blocks(w, out_dtype=jnp.dtype(dtype), pow2=pow2_scale, cfg=config or TileConfig(),
                                interpret=interpret)
