"""NVFP4 quantization kernel: E2M1 codes packed two per byte, an E4M3 scale per 16 values, a given global scale.

Returns exactly what `jaxrl_fp8.precision.quantize_nvfp4` returns (four_over_six=False). The kernel views x as
rows of 16-value blocks (K zero-padded to 16 outside the kernel, as the contract pads) and per block computes the
contract's chain in the contract's order:
    bs = cast_e4m3(min((amax / 6) / g, 448));  d = f32(bs) * g;  y = clamp(x / d, -6, 6) (0 if d == 0)
    code = E2M1 round-to-nearest-even of |y| (ties to the even code) | sign << 3
Each thread owns whole rows (`row_layout`), so a block's amax and its per-row chain run in one thread; the codes of
a row are packed into 32-bit words in registers and leave in 8- or 16-byte stores.

Two versions, same bits (docs/decisions/0006-quantize-kernels.md has the measurements):
  "v14" (the default): tile rows of 128 bytes, i.e. several blocks per thread row (bfloat16 4, float32 2). The TMA
         load of 32-byte bfloat16 rows alone ran at 75 % of an equal-bytes elementwise kernel on the H200, 128-byte
         rows at 97 %: the row width, not the math, held bfloat16 back.
  "v12" (the fallback): one block per tile row, for a tiling whose rows are not a multiple of v14's slab.
Both divide with Markstein sequences (one correction each, `exact_arith`), compute g and RN(1/g) once per CTA, and look
each row's divisor and reciprocal up in a per-CTA table indexed by its scale byte (one global scale; with one scale
per expert each tile computes them itself).

Four-over-six is not implemented in the kernel: its choice compares sums of squared errors, whose
summation order the contract does not fix, so a bitwise match could not be promised.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jaxlib.mlir.dialects import arith, memref, vector

from jaxrl_fp8.precision.arith import F32
from jaxrl_fp8.precision.formats import AMAX_FLOOR, E4M3_MAX, NVFP4_BLOCK
from jaxrl_fp8.precision.nvfp4 import nvfp4_global_amax
from pallas_kernels.e2m1_words import e2m1_word_tree, sign_word_bf16, sign_word_f32
from pallas_kernels.exact_arith import abs_for_amax, div_mode, F32_MAX, INTERPRET, MARKSTEIN, row_broadcast
from pallas_kernels.scalar_ops import JnpOps, MlirOps, splat_scalar
from pallas_kernels.tile_schedules import persistent_kernel
from pallas_kernels.tiling import (
    interpret_context, resolve_interpret, row_layout, ROW_PAD, SLAB_ROWS, swizzle_transforms, tile_rows, TileConfig,
)
from pallas_kernels.quantize_fp8 import _check_input
from pallas_kernels.kernel_cache import traced_once

E4M3 = jnp.float8_e4m3fn
# g = max(global_amax, 1e-10) / (6 * 448): computed in the kernel with div.rn.f32 (XLA:GPU's division is
# not IEEE: it lowers to the approximate div.full.f32 on this image, measured).
GLOBAL_DIVISOR = 6.0 * E4M3_MAX
RECIP_6 = float(np.float32(1.0 / 6.0))  # RN(1/6) in float32 (1/6 has no float32 tie, so no double rounding)


def _tile_scalars_gpu(amax, group, g_ref):
    """g = div.rn(amax, 2688) and RN(1/g) = div.rn(1, g) as splat values, g stored at g_ref[group]: once per tile."""
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=(splat, splat, plgpu.RefType()),
                       return_type=(plgpu.ShapeDtypeStruct((), F32, splat),) * 2)
    def scalars(ctx, amax, group, g_out):
        del ctx
        o = MlirOps()
        g = o.div_rn(splat_scalar(amax), GLOBAL_DIVISOR)
        memref.store(g, g_out, [arith.index_cast(ir.IndexType.get(), splat_scalar(group))])
        return tuple(mgpu_fa.FragmentedArray.splat(v, (), is_signed=None) for v in (g, o.div_rn(1.0, g)))

    return scalars(amax, group, g_ref)


def _tile_gpu(x, amax, group, packed_ref, bs_ref, g_ref, *, in_dtype, scalars=None, table=None,
              blocks_per_row: int = 1):
    """GPU body of one tile: x [tr / blocks_per_row, 16 * blocks_per_row] in row_layout; writes packed, bs and g.

    Block b of tile row i is NVFP4 row i * blocks_per_row + b, so the outputs keep their order.
    scalars: (g, RN(1/g)) from the CTA prologue (one global scale), or None: computed here from amax, g stored.
    table: the CTA's [128, 4] float32 SMEM table of `_build_scale_table_gpu`: each row's divisor, RN(1/divisor) and
      word mask are one 16-byte load at its scale byte instead of the e4m3 decode, d = bs * g, the d == 0 test and
      the reciprocal sequence (about 20 instructions and the row chain's longest latency). None: computed per row.

    Why the bits are the contract's:
    - the per-row divisions amax / 6 and (amax / 6) / g and the per-value x / d are one Markstein correction each
      (exact_arith._MARKSTEIN_ONCE_PTX) with reciprocals computed once (RN(1/6) a constant, RN(1/g) once per tile or CTA,
      RN(1/d) per row by exact_arith._RCP_RN_PTX): RN(a / b) for every float32 a and b while nothing over- or underflows,
      shown in exact integer arithmetic by experiments/checks/nvfp4_formulas.py. div.rn.f32 would return the same
      bits, but its slow-path branch cuts each row's chain into basic blocks the scheduler cannot overlap.
    - where residuals could underflow (amax / 6 below 2^-123) the block scale rounds to e4m3 0 whatever the float32
      bits; d = bs * g lies in [2^-9 * 1e-10 / 2688, 448 * f32max / 2688] (about 7e-17 .. 6e37), so RN(1/d) is
      normal; a quotient that can reach code 1 (|y| >= 0.25) has |x| >= 1.7e-17, far above float32's minimum.
    - a quotient (amax / 6) / g past float32 max turns the corrections into inf - inf; any with a * r > 1e30 is far
      above 448, so it is replaced by 448, all min(., 448) would keep. A given global amax of inf makes g = inf and
      RN(1/g) = 0: there the quotient is t6 * 0 (0, or NaN for a NaN block), as div.rn gives. An overflowing x / d is
      NaN, which codes as 6 like the contract's +-inf (e2m1_word_tree).
    - blocks with d == 0 or NaN get their words ANDed with 0 (the contract's "code 0 when d == 0").
    Latency: the kernel waits on dependent instructions, so each word's magnitudes are summed as a tree, its signs
    come as one word (bfloat16: four byte permutes of the raw bf16x2 registers), and two blocks' chains are emitted
    before their values, so they interleave.
    """
    layout = row_layout(NVFP4_BLOCK * blocks_per_row, in_dtype)
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(
        arg_types=(layout, splat, splat, plgpu.RefType(), plgpu.RefType(), plgpu.RefType())
        + ((splat, splat) if scalars is not None else ()) + ((plgpu.RefType(),) if table is not None else ()),
        return_type=None,
    )
    def body(ctx, x, amax, group, packed, bs_out, g_out, *given):
        del ctx
        o = MlirOps()
        index = ir.IndexType.get()
        table_ref = given[2] if table is not None else None
        given = given[:2]
        if given:
            g, r_g = (splat_scalar(v) for v in given)
        else:
            amax, group = splat_scalar(amax), splat_scalar(group)
            g = o.div_rn(amax, GLOBAL_DIVISOR)
            memref.store(g, g_out, [arith.index_cast(index, group)])  # every thread stores the same value
            r_g = o.div_rn(1.0, g)
        r_6 = o.f(RECIP_6)
        # 1/g is 0 only for g = inf (a given global amax of inf): finite g <= f32 max / 2688 has a normal 1/g
        g_is_inf = o.arith.cmpf(o.arith.CmpFPredicate.OEQ, r_g, o.f(0.0))
        regs = x.registers
        n_rows, n_vec = regs.shape[0], regs.shape[-2]
        nvb = n_vec // blocks_per_row  # 16-byte vectors per 16-value block
        rows = [idx[0] for idx, _ in zip(x.layout.thread_idxs(x.shape), range(regs.size))]
        divide = o.markstein_once

        def raw_words(j, b):
            """Block b of row j as bf16x2 words (value 2i in the low half of word i), four per vector of 8 bf16."""
            words = []
            for k in range(b * nvb, (b + 1) * nvb):
                w4 = vector.bitcast(ir.VectorType.get((4,), o.i32), regs[(j, 0, 0, 0, 0, k, 0)])
                words += [vector.extract(w4, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                          for i in range(4)]
            return words

        def row_chain(j, b):
            vals = []
            for k in range(b * nvb, (b + 1) * nvb):
                reg = regs[(j, 0, 0, 0, 0, k, 0)]
                [width] = ir.VectorType(reg.type).shape
                for e in range(width):
                    v = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
                    vals.append(v if in_dtype == jnp.float32 else arith.extf(o.f32, v))
            amx = o.abs(vals[0])
            for v in vals[1:]:
                amx = o.fmax(amx, o.abs(v))
            amx = o.fselect(o.fle(amx, F32_MAX), amx, float("nan"))  # NaN if the block held NaN or inf
            t6 = divide(amx, o.f(6.0), r_6)
            q0 = o.mul(t6, r_g)  # the sequence's first estimate, for the two cases it cannot finish
            tg = divide(t6, g, r_g)
            tg = o.fselect(o.fgt(q0, 1.0e30), float(E4M3_MAX), tg)  # overflow: anything past 448 is 448
            tg = o.fselect(g_is_inf, q0, tg)  # t6 / inf = 0 (NaN stays NaN); Markstein gives NaN
            byte = o.and_(o.cvt_f8x2(o.f(0.0), o.fmin(tg, float(E4M3_MAX)), "e4m3"), 0xFF)
            if table_ref is not None:  # tg <= 448 or NaN: the byte is 0x00 .. 0x7F
                entry = vector.load(ir.VectorType.get((4,), o.f32), table_ref,
                                    [arith.index_cast(index, byte), arith.constant(index, 0)])
                dd, r, mask = (vector.extract(entry, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                               for i in range(3))
                return vals, byte, o.bits(mask), dd, r
            mask, dd, r = _row_divisor(o, byte, g)
            return vals, byte, mask, dd, r

        def block_words(j, b, vals, byte, mask, dd, r):
            """The two packed words of block b of row j (codes of values 0-7 and 8-15), masked."""
            words = []
            raw = raw_words(j, b) if in_dtype == jnp.bfloat16 else None
            for half in range(2):
                xs = vals[half * 8:(half + 1) * 8]
                signs = (sign_word_bf16(raw[half * 4:(half + 1) * 4], o) if raw is not None
                         else sign_word_f32([o.bits(x_e) for x_e in xs], o))
                w = e2m1_word_tree([divide(x_e, dd, r) for x_e in xs], signs, o)
                words.append(arith.andi(w, mask))
            return words

        def store_row(j, words, scale_bytes):
            """Row j's packed words (2 per block) at its first block's byte offset, in 8- or 16-byte stores; one scale
            byte per block. rows[j * n_vec] is this thread's row of register (j, ..., 0)."""
            row = rows[j * n_vec]
            first = arith.muli(row, arith.constant(index, blocks_per_row)) if blocks_per_row > 1 else row
            per_store = 4 if len(words) % 4 == 0 else 2
            for s0 in range(0, len(words), per_store):
                vec = vector.from_elements(ir.VectorType.get((per_store,), o.i32), words[s0:s0 + per_store])
                vec = vector.bitcast(ir.VectorType.get((4 * per_store,), o.i8), vec)
                offset = arith.addi(arith.muli(first, arith.constant(index, NVFP4_BLOCK // 2)),
                                    arith.constant(index, 4 * s0))
                vector.store(vec, packed, [offset])
            for b, byte in enumerate(scale_bytes):
                memref.store(arith.trunci(o.i8, byte), bs_out, [arith.addi(first, arith.constant(index, b))])

        units = [(j, b) for j in range(n_rows) for b in range(blocks_per_row)]
        in_flight = 2  # blocks whose chains are emitted before their values
        words, scale_bytes = {}, {}
        for u0 in range(0, len(units), in_flight):
            group_units = units[u0:u0 + in_flight]
            chains = [row_chain(j, b) for j, b in group_units]
            for (j, b), chain in zip(group_units, chains):
                words.setdefault(j, []).extend(block_words(j, b, *chain))
                scale_bytes.setdefault(j, []).append(chain[1])
                if b == blocks_per_row - 1:
                    store_row(j, words.pop(j), scale_bytes.pop(j))

    body(x, amax, group, packed_ref, bs_ref, g_ref, *(scalars or ()), *(() if table is None else (table,)))


def _row_divisor(o, byte, g):
    """(word mask, divisor, RN(1/divisor)) of a row with e4m3 scale byte `byte` (i32) and global scale g: the
    divisor is d = f32(bs) * g where d > 0, else 1 with mask 0 (the contract's code 0 for d == 0 or NaN); RN(1/d) by
    exact_arith._RCP_RN_PTX (no branch). Shared by the per-row chain and the per-CTA table, so both give the same bits."""
    d = o.mul(o.e4m3_to_f32(byte), g)
    ok = o.fgt(d, 0.0)
    dd = o.fselect(ok, d, 1.0)
    return o.select(ok, 0xFFFFFFFF, 0), dd, o.rcp_rn(dd)


def _build_scale_table_gpu(g, table_ref):
    """Thread t writes row t of the CTA's scale table: for the e4m3 byte t, (divisor, RN(1/divisor), word mask, 0)
    from `_row_divisor`, the instructions of the per-row chain, once per CTA; then a warpgroup barrier, before any
    row reads it."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT, plgpu.RefType()), return_type=None)
    def build(ctx, g, table):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

        o = MlirOps()
        index = ir.IndexType.get()
        t = mgpu_utils.thread_idx()  # 0 .. 127: one warpgroup, one byte each
        mask, dd, r = _row_divisor(o, t, splat_scalar(g))
        entry = vector.from_elements(ir.VectorType.get((4,), o.f32), [dd, r, o.float(mask), o.f(0.0)])
        vector.store(entry, table, [arith.index_cast(index, t), arith.constant(index, 0)])
        mgpu_utils.warpgroup_barrier()

    build(g, table_ref)


def _tile_interpret(x, g, in_dtype=jnp.float32):
    """Interpret-mode body: the same steps as `_tile_gpu` in jnp (x [tr, 16] float32, g scalar). The divisions are
    XLA:CPU's IEEE ones (the GPU's Markstein forms are checked against them separately); the words come from the
    formulas the GPU body runs, with the same sign words (bfloat16: gathered from bf16x2 words, as on the GPU)."""
    o = JnpOps
    bamax = jnp.max(abs_for_amax(x, INTERPRET), axis=1)
    bamax = jnp.where(bamax <= F32_MAX, bamax, jnp.nan)
    t6 = bamax / lax.optimization_barrier(jnp.full(bamax.shape, 6.0, F32))
    tg = lax.optimization_barrier(t6) / lax.optimization_barrier(jnp.broadcast_to(g, bamax.shape))  # no a/(b*c)
    bs = jnp.minimum(tg, F32(E4M3_MAX)).astype(E4M3)
    d = bs.astype(F32) * g
    ok = d > 0
    dd = jnp.where(ok, d, F32(1.0))
    y = x / lax.optimization_barrier(row_broadcast(dd, x.shape))
    xb = o.bits(x)  # bf16 -> f32 is exact: a bf16 value's bits are the top half of its float32 bits
    words = []
    for h in range(2):
        cols = range(h * 8, h * 8 + 8)
        if in_dtype == jnp.bfloat16:
            raw = [(xb[:, h * 8 + 2 * i] >> jnp.uint32(16)) | (xb[:, h * 8 + 2 * i + 1] & jnp.uint32(0xFFFF0000))
                   for i in range(4)]
            signs = sign_word_bf16(raw, o)
        else:
            signs = sign_word_f32([xb[:, c] for c in cols], o)
        words.append(e2m1_word_tree([y[:, c] for c in cols], signs, o))
    words = jnp.where(ok[:, None], jnp.stack(words, axis=1), jnp.uint32(0))  # [tr, 2]
    packed = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)  # little-endian: code 0 in the low nibble
    return packed, lax.bitcast_convert_type(bs, jnp.uint8)


def _nvfp4_tile(t, x_ref, packed_ref, bs_ref, amax_gmem, g_gmem, hoisted=None, *, rows_per_group, tr, mode,
                in_dtype, blocks_per_row=1):
    """One tile; x_ref is the tile as [tr / blocks_per_row, 16 * blocks_per_row]. hoisted: (g, RN(1/g), table) from
    the CTA prologue `_hoisted_scalars_gpu` (one global scale, GPU): then no tile loads the amax or divides for g."""
    layout = row_layout(NVFP4_BLOCK * blocks_per_row, in_dtype)
    if hoisted is not None:
        _tile_gpu(plgpu.load(x_ref, layout=layout), F32(0.0), jnp.int32(0), packed_ref, bs_ref, g_gmem,
                  in_dtype=in_dtype, scalars=hoisted[:2], table=hoisted[2], blocks_per_row=blocks_per_row)
        return
    group = (t * tr) // rows_per_group  # tiles never straddle two global scales
    amax = jnp.maximum(amax_gmem[group], F32(AMAX_FLOOR))
    if mode == INTERPRET:
        g = amax / lax.optimization_barrier(F32(GLOBAL_DIVISOR))
        g_gmem[group] = g
        packed, bs = _tile_interpret(x_ref[...].astype(F32).reshape(tr, NVFP4_BLOCK), g, in_dtype)
        packed_ref[...] = packed
        bs_ref[...] = bs
        return
    _tile_gpu(plgpu.load(x_ref, layout=layout), amax, group.astype(jnp.int32), packed_ref, bs_ref, g_gmem,
              in_dtype=in_dtype, blocks_per_row=blocks_per_row)


def _hoisted_scalars_gpu(amax_gmem, g_gmem, table_ref):
    """The kernel prologue with one global scale: g and RN(1/g) once per CTA, g stored, and the CTA's scale table
    filled (`_build_scale_table_gpu`).

    Why: computed per tile, they cost each tile a GMEM load and two div.rn.f32, whose slow-path branches split the
    tile's code at its start, so no row's work could be scheduled before g was known."""
    g, r_g = _tile_scalars_gpu(jnp.maximum(amax_gmem[0], F32(AMAX_FLOOR)), jnp.int32(0), g_gmem)
    _build_scale_table_gpu(g, table_ref)
    return g, r_g, table_ref


@functools.partial(jax.jit, static_argnames=("groups", "cfg", "interpret", "impl"))
def _quantize(x, global_amax, *, groups, cfg, interpret, impl):
    """x [..., K]; global_amax float32 [groups] (one per leading slice of x.shape[:-1]) -> packed, bs, g."""
    lead, k = x.shape[:-1], x.shape[-1]
    pad = (-k) % NVFP4_BLOCK
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)]) if pad else x
    kp = k + pad
    r = math.prod(lead) * kp // NVFP4_BLOCK
    tr = tile_rows(cfg, NVFP4_BLOCK)
    rows_per_group = r // groups
    if groups > 1 and rows_per_group % tr:
        raise ValueError(f"per-group global scales need {rows_per_group} rows per group to be a multiple of {tr}")
    bpr = blocks_per_row(impl, x.dtype)
    rp = -(-r // (ROW_PAD * bpr)) * ROW_PAD * bpr  # tile rows (rp / bpr) stay a multiple of the TMA tiling's 8
    x2 = xp.reshape(r, NVFP4_BLOCK)
    if rp != r:
        x2 = jnp.pad(x2, [(0, rp - r), (0, 0)])
    x2 = x2.reshape(rp // bpr, NVFP4_BLOCK * bpr)
    gpad = (-groups) % 4  # >= 16 bytes
    amax = jnp.pad(global_amax.astype(F32), (0, gpad))
    ntiles = pl.cdiv(rp, tr)
    half = NVFP4_BLOCK // 2
    mode = div_mode(interpret, cfg)
    hoist = groups == 1 and mode != INTERPRET
    if tr % tile_rows_multiple(impl, x.dtype):
        raise ValueError(f"nvfp4 impl={impl!r} keeps one row of {bpr} block(s) per thread in {SLAB_ROWS}-row slabs: "
                         f"TileConfig.rows must be a multiple of {tile_rows_multiple(impl, x.dtype)}, got {tr}")
    if mode not in (INTERPRET, MARKSTEIN):
        raise ValueError(f"the nvfp4 kernel divides with the Markstein sequence only (division={cfg.division!r})")
    body = functools.partial(_nvfp4_tile, rows_per_group=max(rows_per_group, 1), tr=tr, mode=mode,
                             in_dtype=jnp.dtype(x.dtype), blocks_per_row=bpr)
    call = persistent_kernel(
        body,
        name=f"quantize_nvfp4_{impl}",
        out_shapes=[jax.ShapeDtypeStruct((rp * half,), jnp.uint8), jax.ShapeDtypeStruct((rp,), jnp.uint8)],
        in_tiles=[((tr // bpr, NVFP4_BLOCK * bpr), x.dtype, swizzle_transforms(NVFP4_BLOCK * bpr, x.dtype),
                   lambda gm, t: gm.at[pl.ds(t * (tr // bpr), tr // bpr)])],
        out_tiles=[
            ((tr * half,), jnp.uint8, (), lambda gm, t: gm.at[pl.ds(t * tr * half, tr * half)]),
            ((tr,), jnp.uint8, (), lambda gm, t: gm.at[pl.ds(t * tr, tr)]),  # scale bytes, bitcast to e4m3 below
        ],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
        n_extra_in=1,
        extra_out=[jax.ShapeDtypeStruct((groups + gpad,), F32)],
        prologue=_hoisted_scalars_gpu if hoist else None,
        prologue_scratch=[plgpu.SMEM((SLAB_ROWS, 4), F32)] if hoist else (),
    )
    packed, bs, g = call(x2, amax)
    bs = lax.bitcast_convert_type(bs, E4M3)
    packed = packed[: r * half].reshape(*lead, kp // 2)
    return packed, bs[:r].reshape(*lead, kp // NVFP4_BLOCK), g[:groups]


# The kernel versions (module docstring): "v14" loads 128-byte tile rows of several blocks, "v12" one block per row.
# The names are those of the measurements (results/quantize_nvfp4_h200.json, decision record 0006).
IMPLS = ("v14", "v12")
WIDE_ROW_BYTES = 128


def blocks_per_row(impl: str, dtype) -> int:
    """Blocks of 16 values per tile row of version `impl` on `dtype` input: v14 128-byte rows (bfloat16 4,
    float32 2), v12 one."""
    if impl != "v14":
        return 1
    return max(1, WIDE_ROW_BYTES // (NVFP4_BLOCK * jnp.dtype(dtype).itemsize))


def tile_rows_multiple(impl: str, dtype) -> int:
    """Tiles of `impl` hold a multiple of this many rows (blocks): one 128-row slab of tile rows per warpgroup."""
    return SLAB_ROWS * blocks_per_row(impl, dtype)


# The defaults, from the H200 runs with five interleaved timing rounds (decision record 0006,
# results/quantize_nvfp4_h200.json), 256 MiB inputs: bfloat16 at 84.2 % of the same-run 1 GiB copy's bandwidth in
# wall clock (v12, same tiles: 72.0 %) and 96.0 % of the 1 GiB elementwise kernel's bandwidth in GPU time; float32
# 84.5 % (v12 83.3 %) and 95.8 %. bfloat16: 1024-row tiles, 2 CTAs per SM, dynamic schedule; float32: 768 rows,
# 3 CTAs per SM, static.
DEFAULT_TILES = TileConfig(rows=1024, ctas_per_sm=2, schedule="dynamic")  # bfloat16 (and float16) input
DEFAULT_TILES_F32 = TileConfig(rows=768, ctas_per_sm=3)
DEFAULT_IMPL = "v14"


def default_tiles(dtype, groups: int = 1, rows_per_expert: int = 0, impl: str | None = None) -> TileConfig:
    """The measured tiling for input `dtype`, with shorter tiles when per-expert global scales need tiles that divide
    an expert's rows (a tile never straddles two global scales; otherwise each expert is quantized by its own
    launch). Shorter tiles stay a multiple of the rows `impl` keeps per 128-thread slab (v14: more)."""
    base = DEFAULT_TILES_F32 if jnp.dtype(dtype) == jnp.float32 else DEFAULT_TILES
    if groups == 1 or rows_per_expert % base.rows == 0:
        return base
    multiple = tile_rows_multiple(impl or DEFAULT_IMPL, dtype)
    rows = next((r for r in (768, 512, 384, 256, 128) if r < base.rows and r % multiple == 0 and rows_per_expert % r == 0),
                base.rows)
    return dataclasses.replace(base, rows=rows)


def default_impl(x, config: TileConfig | None = None) -> str:
    """The kernel version `nvfp4` uses when the caller names none: DEFAULT_IMPL, or v12 (same bits, 32-byte tile
    rows) when a given tiling's rows are not a multiple of the rows DEFAULT_IMPL keeps per 128-thread slab."""
    if config is not None and tile_rows(config, NVFP4_BLOCK) % tile_rows_multiple(DEFAULT_IMPL, x.dtype):
        return "v12"
    return DEFAULT_IMPL


@traced_once("four_over_six", "interpret", "config", "impl")
def nvfp4(x, *, global_amax=None, four_over_six: bool = False, interpret: bool = False,
          config: TileConfig | None = None, impl: str | None = None):
    """Kernel form of `jaxrl_fp8.precision.quantize_nvfp4`: (packed uint8 [..., Kp/2], e4m3 [..., Kp/16], g).

    global_amax: None (the tensor's finite amax, one XLA reduction before the kernel), a scalar, or an
    array of shape x.shape[:1] (one per expert of a stack). Per-token scales are not supported here.
    impl / config: a kernel version of IMPLS and its tiling; None picks the measured defaults (`default_impl`,
    `default_tiles`). Every version returns the contract's bits.
    """
    x = jnp.asarray(x)
    impl = impl or default_impl(x, config)
    if impl not in IMPLS:
        raise ValueError(f"nvfp4: impl must be one of {IMPLS}, got {impl!r}")
    if four_over_six:
        raise NotImplementedError(
            "nvfp4 kernel: four_over_six is not implemented (its error comparison has no fixed summation order); "
            "use jaxrl_fp8.precision.quantize_nvfp4"
        )
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
    interpret = resolve_interpret(interpret)
    shape = global_amax.shape
    rows_per_expert = math.prod(x.shape[1:-1]) * (-(-x.shape[-1] // NVFP4_BLOCK))
    cfg = config or default_tiles(x.dtype, groups, rows_per_expert, impl)
    with interpret_context(interpret):
        if groups > 1 and rows_per_expert % tile_rows(cfg, NVFP4_BLOCK):
            outs = [_quantize(x[i], global_amax[i].reshape(1), groups=1, cfg=cfg, interpret=interpret, impl=impl)
                    for i in range(groups)]
            return (jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs]),
                    jnp.concatenate([o[2] for o in outs]).reshape(shape))
        packed, bs, g = _quantize(x, global_amax.reshape(groups), groups=groups, cfg=cfg, interpret=interpret,
                                 impl=impl)
    return packed, bs, g.reshape(shape)

__all__ = ["nvfp4"]
