"""NVFP4 quantization kernel: E2M1 codes packed two per byte, an E4M3 scale per 16 values, a given global scale.

Returns exactly what `jaxrl_fp8.precision.quantize_nvfp4` returns (four_over_six=False). The kernel views x as
rows of one 16-value block, [R, 16] (K zero-padded to 16 outside the kernel, as the contract pads), and per
row computes the contract's chain in the contract's order:
    bs = cast_e4m3(min((amax / 6) / g, 448));  d = f32(bs) * g;  y = clamp(x / d, -6, 6) (0 if d == 0)
    code = threshold count of |y| (ties to the even code) | sign << 3
The codes of columns 2i and 2i+1 sit in one register of the wgmma layout, so the GPU packs them in
registers and writes one byte per pair to a flat SMEM buffer (inline Mosaic GPU code); interpret mode, which
cannot run inline Mosaic code, packs the same codes with jnp slicing.

Four-over-six is not implemented in the kernel: its choice compares sums of squared errors, whose
summation order the contract does not fix, so a bitwise match could not be promised.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from jaxrl_fp8.precision.arith import F32
from jaxrl_fp8.precision.formats import AMAX_FLOOR, E4M3_MAX, NVFP4_BLOCK
from jaxrl_fp8.precision.nvfp4 import _E2M1_THRESHOLDS, nvfp4_global_amax
from pallas_kernels import quantize_common as C
from pallas_kernels.quantize_fp8 import _check_input

E4M3 = jnp.float8_e4m3fn
# g = max(global_amax, 1e-10) / (6 * 448): computed in the kernel with div.rn.f32 (XLA:GPU's division is
# not IEEE: it lowers to the approximate div.full.f32 on this image, measured).
GLOBAL_DIVISOR = 6.0 * E4M3_MAX


def _codes(y):
    """E2M1 codes of y (already clamped to [-6, 6]) with the contract's threshold comparisons, as uint32."""
    a = jnp.abs(y)
    mag = None
    for threshold, inclusive in _E2M1_THRESHOLDS:
        step = ((a >= threshold) if inclusive else (a > threshold)).astype(jnp.uint32)
        mag = step if mag is None else mag + step
    sign = lax.bitcast_convert_type(y, jnp.uint32) >> jnp.uint32(31)
    return mag | (sign << jnp.uint32(3))


def _pack_store_gpu(codes, packed_ref):
    """packed[row * 8 + col // 2] = code[row, col] | code[row, col + 1] << 4, from wgmma-layout registers."""

    @plgpu.inline_mgpu(arg_types=(C.TILE, plgpu.RefType()), return_type=None)
    def pack(ctx, codes, ref):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        half_row = NVFP4_BLOCK // 2
        for reg, (row, col) in zip(codes.registers.flat, codes.layout.thread_idxs(codes.shape)):
            [width] = ir.VectorType(reg.type).shape
            assert width == 2, "wgmma layout registers hold column pairs"
            lo = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
            hi = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([1]))
            byte = arith.ori(
                arith.andi(lo, arith.constant(i32, 0xF)),
                arith.shli(arith.andi(hi, arith.constant(i32, 0xF)), arith.constant(i32, 4)),
            )
            pos = arith.addi(
                arith.muli(row, arith.constant(index, half_row)),
                arith.divui(col, arith.constant(index, 2)),
            )
            memref.store(arith.trunci(i8, byte), ref, [pos])

    pack(codes, packed_ref)


def _nvfp4_body(t, x_ref, packed_ref, bs_ref, amax_gmem, g_gmem, *, rows_per_group, tr, mode):
    group = (t * tr) // rows_per_group  # tiles never straddle two global scales
    amax = jnp.maximum(amax_gmem[group], F32(AMAX_FLOOR))
    if mode == C.INTERPRET:
        g = amax / lax.optimization_barrier(F32(GLOBAL_DIVISOR))
        g_rows = jnp.broadcast_to(g, (tr,))
    else:  # the global scale as a per-row vector, so every division below is a per-row div.rn.f32
        g_rows = C.ieee_div(plgpu.layout_cast(jnp.broadcast_to(amax, (tr,)), C.ROWS), GLOBAL_DIVISOR,
                            layout=C.ROWS, mode=C.row_mode(mode))
        g = jnp.max(g_rows, axis=0)  # all rows equal
    g_gmem[group] = g  # every tile of the group writes the same value
    row = C.row_mode(mode)
    x = C.load_tile(x_ref, mode).astype(F32)
    bamax = jnp.max(C.abs_for_amax(x, mode), axis=1)
    bamax = jnp.where(bamax <= C.F32_MAX, bamax, jnp.nan)  # block_amax with floor 0 (|x| >= 0 already)
    t6 = C.ieee_div(bamax, 6.0, layout=C.ROWS, mode=row)
    tg = C.ieee_div(t6, g_rows, layout=C.ROWS, mode=row)
    bs = jnp.minimum(tg, F32(E4M3_MAX)).astype(E4M3)
    d = bs.astype(F32) * g_rows
    ok = d > 0
    y = C.divide_by_rows(x, jnp.where(ok, d, F32(1.0)), mode=mode)
    y = jnp.where(C.row_broadcast(ok, x.shape), jnp.minimum(jnp.maximum(y, -6.0), 6.0), F32(0.0))
    codes = _codes(y)
    bs_ref[...] = bs
    if mode == C.INTERPRET:
        packed_ref[...] = (codes[:, 0::2] | (codes[:, 1::2] << jnp.uint32(4))).astype(jnp.uint8).reshape(-1)
    else:
        _pack_store_gpu(codes, packed_ref)


@functools.partial(jax.jit, static_argnames=("groups", "cfg", "interpret"))
def _quantize(x, global_amax, *, groups, cfg, interpret):
    """x [..., K]; global_amax float32 [groups] (one per leading slice of x.shape[:-1]) -> packed, bs, g."""
    lead, k = x.shape[:-1], x.shape[-1]
    pad = (-k) % NVFP4_BLOCK
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)]) if pad else x
    kp = k + pad
    r = math.prod(lead) * kp // NVFP4_BLOCK
    tr = C.tile_rows(cfg, NVFP4_BLOCK)
    rows_per_group = r // groups
    if groups > 1 and rows_per_group % tr:
        raise ValueError(f"per-group global scales need {rows_per_group} rows per group to be a multiple of {tr}")
    rp = -(-r // C.ROW_PAD) * C.ROW_PAD
    x2 = xp.reshape(r, NVFP4_BLOCK)
    if rp != r:
        x2 = jnp.pad(x2, [(0, rp - r), (0, 0)])
    gpad = (-groups) % 4  # >= 16 bytes
    amax = jnp.pad(global_amax.astype(F32), (0, gpad))
    ntiles = pl.cdiv(rp, tr)
    half = NVFP4_BLOCK // 2
    call = C.persistent_kernel(
        functools.partial(_nvfp4_body, rows_per_group=max(rows_per_group, 1), tr=tr, mode=C.div_mode(interpret, cfg)),
        name="quantize_nvfp4",
        out_shapes=[jax.ShapeDtypeStruct((rp * half,), jnp.uint8), jax.ShapeDtypeStruct((rp,), E4M3)],
        in_tiles=[((tr, NVFP4_BLOCK), x.dtype, C.swizzle_transforms(NVFP4_BLOCK, x.dtype),
                   lambda gm, t: gm.at[pl.ds(t * tr, tr)])],
        out_tiles=[
            ((tr * half,), jnp.uint8, (), lambda gm, t: gm.at[pl.ds(t * tr * half, tr * half)]),
            ((tr,), E4M3, (), lambda gm, t: gm.at[pl.ds(t * tr, tr)]),
        ],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
        n_extra_in=1,
        extra_out=[jax.ShapeDtypeStruct((groups + gpad,), F32)],
    )
    packed, bs, g = call(x2, amax)
    packed = packed[: r * half].reshape(*lead, kp // 2)
    return packed, bs[:r].reshape(*lead, kp // NVFP4_BLOCK), g[:groups]


def nvfp4(x, *, global_amax=None, four_over_six: bool = False, interpret: bool = False,
          config: C.TileConfig | None = None):
    """Kernel form of `jaxrl_fp8.precision.quantize_nvfp4`: (packed uint8 [..., Kp/2], e4m3 [..., Kp/16], g).

    global_amax: None (the tensor's finite amax, one XLA reduction before the kernel), a scalar, or an
    array of shape x.shape[:1] (one per expert of a stack). Per-token scales are not supported here.
    """
    if four_over_six:
        raise NotImplementedError(
            "nvfp4 kernel: four_over_six is not implemented (its error comparison has no fixed summation order); "
            "use jaxrl_fp8.precision.quantize_nvfp4"
        )
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("nvfp4 needs at least one axis")
    _check_input(x, "nvfp4")
    if global_amax is None:
        global_amax = nvfp4_global_amax(x)
    global_amax = jnp.asarray(global_amax, F32)
    if global_amax.ndim == 0:
        groups = 1
    elif global_amax.ndim == 1 and x.ndim >= 2 and global_amax.shape[0] == x.shape[0]:
        groups = x.shape[0]
    else:
        raise ValueError(
            f"nvfp4 kernel: global_amax shape {global_amax.shape} not supported for x {x.shape}; "
            "use a scalar or one value per leading slice (x.shape[:1])"
        )
    interpret = C.resolve_interpret(interpret)
    cfg = config or C.TileConfig()
    shape = global_amax.shape
    with C.interpret_context(interpret):
        rows_per_expert = math.prod(x.shape[1:-1]) * (-(-x.shape[-1] // NVFP4_BLOCK))
        if groups > 1 and rows_per_expert % C.tile_rows(cfg, NVFP4_BLOCK):
            outs = [_quantize(x[i], global_amax[i].reshape(1), groups=1, cfg=cfg, interpret=interpret)
                    for i in range(groups)]
            return (jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs]),
                    jnp.concatenate([o[2] for o in outs]).reshape(shape))
        packed, bs, g = _quantize(x, global_amax.reshape(groups), groups=groups, cfg=cfg, interpret=interpret)
    return packed, bs, g.reshape(shape)

__all__ = ["nvfp4"]
