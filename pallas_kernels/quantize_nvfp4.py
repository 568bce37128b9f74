"""NVFP4 quantization kernel: E2M1 codes packed two per byte, an E4M3 scale per 16 values, a given global scale.

Returns exactly what `jaxrl_fp8.precision.quantize_nvfp4` returns (four_over_six=False). The kernel views x as
rows of one 16-value block, [R, 16] (K zero-padded to 16 outside the kernel, as the contract pads; the default
v14 loads them as 128-byte rows of several blocks, see WIDE_IMPLS), and per block computes the contract's chain in
the contract's order:
    bs = cast_e4m3(min((amax / 6) / g, 448));  d = f32(bs) * g;  y = clamp(x / d, -6, 6) (0 if d == 0)
    code = threshold count of |y| (ties to the even code) | sign << 3
The codes of columns 2i and 2i+1 sit in one register of the wgmma layout, so the GPU packs them in
registers and writes one byte per pair to a flat SMEM buffer (inline Mosaic GPU code); interpret mode, which
cannot run inline Mosaic code, packs the same codes with jnp slicing.

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
from jaxrl_fp8.precision.nvfp4 import _E2M1_THRESHOLDS, nvfp4_global_amax
from pallas_kernels import quantize_common as C
from pallas_kernels.quantize_fp8 import _check_input
from pallas_kernels.kernel_cache import traced_once

E4M3 = jnp.float8_e4m3fn
# g = max(global_amax, 1e-10) / (6 * 448): computed in the kernel with div.rn.f32 (XLA:GPU's division is
# not IEEE: it lowers to the approximate div.full.f32 on this image, measured).
GLOBAL_DIVISOR = 6.0 * E4M3_MAX
RECIP_6 = float(np.float32(1.0 / 6.0))  # RN(1/6) in float32 (1/6 has no float32 tie, so no double rounding)


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


# ---------------------------------------------------------------------------------------------- v2
# impl="v2" (v3 = v2 plus branch-free row divisions, see _v2_gpu): the contract chain, fewer instructions per value
# (docs/decisions/0006):
#  - one row (16 values) per thread (C.row_layout): the block amax is 15 in-thread max instructions, and the
#    per-row chain (two div.rn, the E4M3 cast, d, div.rn(1, d)) runs once per row per thread instead of on 4 lanes;
#  - the E2M1 code comes from the float32 bits (C.e2m1_code: ~12 instructions instead of 7 compare+add pairs,
#    the clamp and the sign);
#  - the 16 codes of a row are packed into two 32-bit words in registers and stored as one 8-byte vector at
#    row * 8 (no per-register index arithmetic, no single-byte stores); blocks with d == 0 or NaN get their
#    words ANDed with 0 (the contract's "code 0 when d == 0");
#  - g = max(amax, 1e-10) / 2688 is one div.rn per thread per tile (a scalar), not one per row.


def _tile_scalars_gpu(amax, group, g_ref):
    """g = div.rn(amax, 2688) and RN(1/g) = div.rn(1, g) as splat values, g stored at g_ref[group]: once per tile."""
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=(splat, splat, plgpu.RefType()),
                       return_type=(plgpu.ShapeDtypeStruct((), F32, splat),) * 2)
    def scalars(ctx, amax, group, g_out):
        del ctx
        o = C.MlirOps()
        g = o.div_rn(C.splat_scalar(amax), GLOBAL_DIVISOR)
        memref.store(g, g_out, [arith.index_cast(ir.IndexType.get(), C.splat_scalar(group))])
        return tuple(mgpu_fa.FragmentedArray.splat(v, (), is_signed=None) for v in (g, o.div_rn(1.0, g)))

    return scalars(amax, group, g_ref)


def _v2_gpu(x, amax, group, packed_ref, bs_ref, g_ref, *, in_dtype, branch_free_rows: bool = False,
            value_form: str = "v2", scalars=None, table=None, blocks_per_row: int = 1):
    """GPU body of one tile: x [tr, 16] in C.row_layout, amax / group scalars; writes packed, bs and g.

    branch_free_rows (impl "v3"): the same bits with less latency per row. The per-row divisions amax / 6 and
    (amax / 6) / g use the Markstein sequence with reciprocals computed once (RN(1/6) a constant, RN(1/g) one
    div.rn per tile) instead of div.rn.f32, whose SASS is a fast path plus a branch to a slow-path subroutine:
    v2's 3 div.rn per row cut each row's chain into basic blocks that the scheduler cannot overlap (SASS,
    results/sass_h200.json). And every row's chain is emitted before any row's per-value work, so the rows'
    chains interleave. Only RN(1/d) per row stays a div.rn (d is per row and has any mantissa).
    Why the bits are the contract's: Markstein's corrections give RN(a/b) when r = RN(1/b) and the residuals
    do not underflow; where they could (amax / 6 below 2^-123), the block scale rounds to e4m3 0 whatever the
    float32 bits. A quotient past float32 max turns the corrections into inf - inf; any quotient with
    a * r > 1e30 is far above 448, so it is replaced by 448, which is all min(., 448) would keep. A given global
    amax of inf makes g = inf and RN(1/g) = 0: there the quotient is t6 * 0 (0, or NaN for a NaN block), as div.rn.

    value_form "v4" (impl "v4", with branch_free_rows): fewer instructions per value, same bits.
      - every division (x / d per value, amax / 6 and (amax / 6) / g per row) with one Markstein correction
        (C._MARKSTEIN_ONCE_PTX: RN(a / b) for every float32 a and b, shown in exact integer arithmetic:
        exhaustively for bfloat16 a, and for float32 a over every pair that can lie near a rounding midpoint,
        experiments/checks/nvfp4_v4_formulas.py). The checks are scale-free, so they hold where nothing under-
        or overflows: d = bs * g lies in [2^-9 * 1e-10 / 2688, 448 * f32max / 2688]
        (about 7e-17 .. 6e37), so RN(1/d) is a normal float; a quotient that can reach code 1 (|y| >= 0.25) has
        |x| >= 1.7e-17 and residuals near 2^-26 |x|, far above float32's normal minimum; smaller quotients code 0
        either way; an overflowing quotient is NaN (inf - inf), which codes as 6 like the contract's +-inf.
      - codes through C.e2m1_word: one magic add per value for every binade, magnitudes shift-added into the
        word, the bias removed once per word, signs moved from x's bit 31 (about 9 instructions per value
        instead of about 14). Where d could make the magnitudes' premises fail (d == 0 or NaN: masked rows) the
        word is ANDed with 0, as in v2.
    value_form "v5" (impl "v5"): v4 with RN(1/d) per row from C._RCP_RN_PTX (hardware estimate, a Newton step,
      a Markstein correction, the all-ones significand by its closed form) instead of div.rn.f32, so no row's
      chain has a branch: v3 removed two of the three per-row div.rn for that reason; this removes the third.
    value_form "v6" (impl "v6"): v5 with shorter dependency chains and fewer live registers, same bits. v4 and v5
      ran slower per instruction than v3 on the H200 (session 18: fewer instructions, no faster), i.e. they wait on
      dependent instructions with two warps per scheduler. So: each word's magnitudes are summed as a tree
      (C.e2m1_word_tree; depth 3 instead of a running sum of 8), its signs come as one word (bf16 input: four
      byte permutes of the raw bf16x2 registers, C.sign_word_bf16, instead of a shift and a masked OR per value),
      and the rows' chains run two rows at a time instead of all at once (meant to free registers for a third CTA;
      ptxas still allocated 158, as for v5).
    value_form "v7" (impl "v7"): v6 with the E2M1 magnitude mostly on the FMA pipe (C.e2m1_word_min3: three fmas and
      three float mins per value instead of five ALU instructions and one fma, codes put into the word by IMAD).
      Nsight Compute showed the ALU pipe as v5's busiest (66 %); it issues at half the FMA pipe's rate.
    scalars: (g, RN(1/g)) from `_tile_scalars_gpu` when the caller runs this body on slices of one tile (impl "v8");
      None: computed here (and g stored) from amax.
    table: the CTA's [128, 4] float32 SMEM table of `_build_scale_table_gpu` (impl "v12" / "v13"): each row's divisor,
      RN(1/divisor) and word mask are one 16-byte load at its scale byte instead of the e4m3 decode, d = bs * g, the
      d == 0 test and the reciprocal sequence (about 20 instructions and the row chain's longest latency).
    blocks_per_row (impl "v14" / "v15"): x is [tr / blocks_per_row, 16 * blocks_per_row], each thread's row holding
      that many consecutive 16-value blocks (`wide_blocks_per_row`); block b of tile row i is NVFP4 row
      i * blocks_per_row + b, so the outputs keep their order. A row's packed words leave in 16-byte stores.
    """
    layout = C.row_layout(NVFP4_BLOCK * blocks_per_row, in_dtype)
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(
        arg_types=(layout, splat, splat, plgpu.RefType(), plgpu.RefType(), plgpu.RefType())
        + ((splat, splat) if scalars is not None else ()) + ((plgpu.RefType(),) if table is not None else ()),
        return_type=None,
    )
    def body(ctx, x, amax, group, packed, bs_out, g_out, *given):
        del ctx
        o = C.MlirOps()
        index = ir.IndexType.get()
        table_ref = given[2] if table is not None else None
        given = given[:2]
        if given:
            g, r_g = (C.splat_scalar(v) for v in given)
        else:
            amax, group = C.splat_scalar(amax), C.splat_scalar(group)
            g = o.div_rn(amax, GLOBAL_DIVISOR)
            memref.store(g, g_out, [arith.index_cast(index, group)])  # every thread stores the same value
        if branch_free_rows:
            r_g = r_g if given else o.div_rn(1.0, g)
            r_6 = o.f(RECIP_6)
            # 1/g is 0 only for g = inf (a given global amax of inf): finite g <= f32 max / 2688 has a normal 1/g
            g_is_inf = o.arith.cmpf(o.arith.CmpFPredicate.OEQ, r_g, o.f(0.0))
        regs = x.registers
        n_rows, n_vec = regs.shape[0], regs.shape[-2]
        nvb = n_vec // blocks_per_row  # 16-byte vectors per 16-value block
        rows = [idx[0] for idx, _ in zip(x.layout.thread_idxs(x.shape), range(regs.size))]

        v4 = value_form in ("v4", "v5", "v6", "v7")
        v6 = value_form in ("v6", "v7")
        # v4 / v5: one Markstein correction is RN(a / b) for every float32 a and b (C._MARKSTEIN_ONCE_PTX)
        divide = o.markstein_once if v4 else o.markstein

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
            amx = o.fselect(o.fle(amx, C.F32_MAX), amx, float("nan"))  # NaN if the block held NaN or inf
            if branch_free_rows:
                t6 = divide(amx, o.f(6.0), r_6)
                q0 = o.mul(t6, r_g)  # the sequence's first estimate, for the two cases it cannot finish
                tg = divide(t6, g, r_g)
                tg = o.fselect(o.fgt(q0, 1.0e30), float(E4M3_MAX), tg)  # overflow: anything past 448 is 448
                tg = o.fselect(g_is_inf, q0, tg)  # t6 / inf = 0 (NaN stays NaN); Markstein gives NaN
            else:
                tg = o.div_rn(o.div_rn(amx, 6.0), g)
            byte = o.and_(o.cvt_f8x2(o.f(0.0), o.fmin(tg, float(E4M3_MAX)), "e4m3"), 0xFF)
            if table_ref is not None:  # tg <= 448 or NaN: the byte is 0x00 .. 0x7F
                entry = vector.load(ir.VectorType.get((4,), o.f32), table_ref,
                                    [arith.index_cast(index, byte), arith.constant(index, 0)])
                dd, r, mask = (vector.extract(entry, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                               for i in range(3))
                return vals, byte, o.bits(mask), dd, r
            mask, dd, r = _row_divisor(o, byte, g, branch_free_reciprocal=value_form in ("v5", "v6", "v7"))
            return vals, byte, mask, dd, r

        def block_words(j, b, vals, byte, mask, dd, r):
            """The two packed words of block b of row j (codes of values 0-7 and 8-15), masked."""
            words = []
            raw = raw_words(j, b) if v6 and in_dtype == jnp.bfloat16 else None
            for half in range(2):
                xs = vals[half * 8:(half + 1) * 8]
                if v6:
                    signs = (C.sign_word_bf16(raw[half * 4:(half + 1) * 4], o) if raw is not None
                             else C.sign_word_f32([o.bits(x_e) for x_e in xs], o))
                    word = C.e2m1_word_min3 if value_form == "v7" else C.e2m1_word_tree
                    w = word([divide(x_e, dd, r) for x_e in xs], signs, o)
                elif v4:
                    w = C.e2m1_word([divide(x_e, dd, r) for x_e in xs], [o.bits(x_e) for x_e in xs], o)
                else:
                    w = None
                    for e, x_e in enumerate(xs):
                        code = C.e2m1_code(o.bits(divide(x_e, dd, r)), o, sign_bits=o.bits(x_e))
                        code = code if e == 0 else o.shl(code, 4 * e)
                        w = code if w is None else o.or_(w, code)
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
        # blocks whose chains are emitted before their values
        in_flight = (2 if v6 else len(units)) if branch_free_rows else 1
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


def _row_divisor(o, byte, g, *, branch_free_reciprocal: bool):
    """(word mask, divisor, RN(1/divisor)) of a row with e4m3 scale byte `byte` (i32) and global scale g: the
    divisor is d = f32(bs) * g where d > 0, else 1 with mask 0 (the contract's code 0 for d == 0 or NaN); RN(1/d) by
    C._RCP_RN_PTX (no branch) or div.rn.f32. Shared by the per-row chain and the v12 / v13 table, so both give the
    same bits."""
    d = o.mul(o.e4m3_to_f32(byte), g)
    ok = o.fgt(d, 0.0)
    dd = o.fselect(ok, d, 1.0)
    r = o.rcp_rn(dd) if branch_free_reciprocal else o.div_rn(1.0, dd)
    return o.select(ok, 0xFFFFFFFF, 0), dd, r


def _build_scale_table_gpu(g, table_ref):
    """Thread t writes row t of the CTA's scale table: for the e4m3 byte t, (divisor, RN(1/divisor), word mask, 0)
    with divisor d = f32(byte) * g where d > 0, else 1 and mask 0 (the contract's code 0 for d == 0 or NaN): the same
    instructions the per-row chain of v6 / v7 runs, once per CTA; then a CTA barrier, before any row reads it."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT, plgpu.RefType()), return_type=None)
    def build(ctx, g, table):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

        o = C.MlirOps()
        index = ir.IndexType.get()
        t = mgpu_utils.thread_idx()  # 0 .. 127: one warpgroup, one byte each
        mask, dd, r = _row_divisor(o, t, C.splat_scalar(g), branch_free_reciprocal=True)
        entry = vector.from_elements(ir.VectorType.get((4,), o.f32), [dd, r, o.float(mask), o.f(0.0)])
        vector.store(entry, table, [arith.index_cast(index, t), arith.constant(index, 0)])
        mgpu_utils.warpgroup_barrier()

    build(g, table_ref)


def _v2_interpret(x, g, value_form: str = "v2", in_dtype=jnp.float32):
    """Interpret-mode body: the same steps as `_v2_gpu` in jnp (x [tr, 16] float32, g scalar). The divisions are
    XLA:CPU's IEEE ones (the GPU's Markstein forms are checked against them separately); value_form "v4" / "v5"
    runs C.e2m1_word, "v6" / "v7" C.e2m1_word_tree / C.e2m1_word_min3 with the same sign words, the formulas their
    GPU bodies run (in_dtype bfloat16: the signs gathered from bf16x2 words, as on the GPU)."""
    o = C.JnpOps
    bamax = jnp.max(C.abs_for_amax(x, C.INTERPRET), axis=1)
    bamax = jnp.where(bamax <= C.F32_MAX, bamax, jnp.nan)
    t6 = bamax / lax.optimization_barrier(jnp.full(bamax.shape, 6.0, F32))
    tg = lax.optimization_barrier(t6) / lax.optimization_barrier(jnp.broadcast_to(g, bamax.shape))  # no a/(b*c)
    bs = jnp.minimum(tg, F32(E4M3_MAX)).astype(E4M3)
    d = bs.astype(F32) * g
    ok = d > 0
    dd = jnp.where(ok, d, F32(1.0))
    y = x / lax.optimization_barrier(C.row_broadcast(dd, x.shape))
    if value_form in ("v6", "v7"):
        word = C.e2m1_word_min3 if value_form == "v7" else C.e2m1_word_tree
        xb = o.bits(x)  # bf16 -> f32 is exact: a bf16 value's bits are the top half of its float32 bits
        words = []
        for h in range(2):
            cols = range(h * 8, h * 8 + 8)
            if in_dtype == jnp.bfloat16:
                raw = [(xb[:, h * 8 + 2 * i] >> jnp.uint32(16)) | (xb[:, h * 8 + 2 * i + 1] & jnp.uint32(0xFFFF0000))
                       for i in range(4)]
                signs = C.sign_word_bf16(raw, o)
            else:
                signs = C.sign_word_f32([xb[:, c] for c in cols], o)
            words.append(word([y[:, c] for c in cols], signs, o))
        words = jnp.stack(words, axis=1)  # [tr, 2]
    elif value_form in ("v4", "v5"):
        words = jnp.stack([C.e2m1_word([y[:, h * 8 + e] for e in range(8)], [o.bits(x[:, h * 8 + e]) for e in range(8)], o)
                           for h in range(2)], axis=1)  # [tr, 2]
    else:
        codes = C.e2m1_code(o.bits(y), o, sign_bits=o.bits(x))  # [tr, 16] uint32; the sign from x, as on the GPU
        shifts = (jnp.arange(16, dtype=jnp.uint32) % 8) * 4
        shifted = (codes << shifts).reshape(x.shape[0], 2, 8)
        words = jnp.bitwise_or.reduce(shifted, axis=2)  # [tr, 2]
    words = jnp.where(ok[:, None], words, jnp.uint32(0))
    packed = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)  # little-endian: code 0 in the low nibble
    return packed, lax.bitcast_convert_type(bs, jnp.uint8)


def _nvfp4_body_v2(t, x_ref, packed_ref, bs_ref, amax_gmem, g_gmem, hoisted=None, *, rows_per_group, tr, mode,
                   in_dtype, branch_free_rows=False, value_form="v2", slab_loop=False, blocks_per_row=1):
    """One tile. hoisted: (g, RN(1/g)) computed once per CTA by `_hoisted_scalars_gpu` (impl v10 / v11, one global
    scale, GPU): then no tile loads the amax or divides for g, and nothing splits the tile's code at its start.
    blocks_per_row > 1 (v14 / v15): x_ref is the tile as [tr / blocks_per_row, 16 * blocks_per_row]."""
    if hoisted is not None:
        layout = C.row_layout(NVFP4_BLOCK * blocks_per_row, in_dtype)
        _v2_gpu(plgpu.load(x_ref, layout=layout), F32(0.0), jnp.int32(0), packed_ref, bs_ref, g_gmem,
                in_dtype=in_dtype, branch_free_rows=True, value_form=value_form, scalars=hoisted[:2],
                table=hoisted[2] if len(hoisted) > 2 else None, blocks_per_row=blocks_per_row)
        return
    group = (t * tr) // rows_per_group  # tiles never straddle two global scales
    amax = jnp.maximum(amax_gmem[group], F32(AMAX_FLOOR))
    half = NVFP4_BLOCK // 2
    if mode == C.INTERPRET:
        g = amax / lax.optimization_barrier(F32(GLOBAL_DIVISOR))
        g_gmem[group] = g
        if not slab_loop:
            packed, bs = _v2_interpret(x_ref[...].astype(F32).reshape(tr, NVFP4_BLOCK), g, value_form, in_dtype)
            packed_ref[...] = packed
            bs_ref[...] = bs
            return

        @pl.loop(0, tr // C.SLAB_ROWS)  # the GPU body's slab slices, so the CPU tests check their offsets
        def _slab_interpret(j):
            r0 = j * C.SLAB_ROWS
            packed, bs = _v2_interpret(x_ref.at[pl.ds(r0, C.SLAB_ROWS)][...].astype(F32), g, value_form, in_dtype)
            packed_ref.at[pl.ds(r0 * half, C.SLAB_ROWS * half)][...] = packed
            bs_ref.at[pl.ds(r0, C.SLAB_ROWS)][...] = bs

        return
    layout, group = C.row_layout(NVFP4_BLOCK * blocks_per_row, in_dtype), group.astype(jnp.int32)
    if not slab_loop:
        x = plgpu.load(x_ref, layout=layout)
        _v2_gpu(x, amax, group, packed_ref, bs_ref, g_gmem, in_dtype=in_dtype, branch_free_rows=branch_free_rows,
                value_form=value_form, blocks_per_row=blocks_per_row)
        return
    # impl "v8": one 128-row slab (one row per thread) per loop step, so only one row's values are live
    scalars = _tile_scalars_gpu(amax, group, g_gmem)

    @pl.loop(0, tr // C.SLAB_ROWS)
    def _slab(j):
        r0 = pl.multiple_of(j * C.SLAB_ROWS, C.SLAB_ROWS)
        xs = plgpu.load(x_ref.at[pl.ds(r0, C.SLAB_ROWS)], layout=layout)
        _v2_gpu(xs, amax, group, packed_ref.at[pl.ds(r0 * half, C.SLAB_ROWS * half)],
                bs_ref.at[pl.ds(r0, C.SLAB_ROWS)], g_gmem, in_dtype=in_dtype, branch_free_rows=True,
                value_form=value_form, scalars=scalars)


def _hoisted_scalars_gpu(amax_gmem, g_gmem, table_ref=None):
    """The kernel prologue of impl v10 - v15 (one global scale): g and RN(1/g) once per CTA, g stored; v12 - v15 also
    fill the CTA's scale table (`_build_scale_table_gpu`).

    Why: computed per tile (v6, v7), they cost each tile a GMEM load and two div.rn.f32, whose slow-path branches
    split the tile's code at its start, so no row's work could be scheduled before g was known."""
    g, r_g = _tile_scalars_gpu(jnp.maximum(amax_gmem[0], F32(AMAX_FLOOR)), jnp.int32(0), g_gmem)
    if table_ref is None:
        return g, r_g
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
    tr = C.tile_rows(cfg, NVFP4_BLOCK)
    rows_per_group = r // groups
    if groups > 1 and rows_per_group % tr:
        raise ValueError(f"per-group global scales need {rows_per_group} rows per group to be a multiple of {tr}")
    bpr = blocks_per_row(impl, x.dtype)
    rp = -(-r // (C.ROW_PAD * bpr)) * C.ROW_PAD * bpr  # tile rows (rp / bpr) stay a multiple of the TMA tiling's 8
    x2 = xp.reshape(r, NVFP4_BLOCK)
    if rp != r:
        x2 = jnp.pad(x2, [(0, rp - r), (0, 0)])
    x2 = x2.reshape(rp // bpr, NVFP4_BLOCK * bpr)
    gpad = (-groups) % 4  # >= 16 bytes
    amax = jnp.pad(global_amax.astype(F32), (0, gpad))
    ntiles = pl.cdiv(rp, tr)
    half = NVFP4_BLOCK // 2
    v2 = impl != "v1"  # every version but the first keeps one row per thread
    mode = C.div_mode(interpret, cfg)
    hoist = impl in ("v10", "v11", "v12", "v13", "v14", "v15") and groups == 1 and mode != C.INTERPRET
    table = hoist and impl in ("v12", "v13", "v14", "v15")
    if v2:
        if tr % tile_rows_multiple(impl, x.dtype):
            raise ValueError(f"nvfp4 impl={impl!r} keeps one row of {bpr} block(s) per thread in {C.SLAB_ROWS}-row slabs: "
                             f"TileConfig.rows must be a multiple of {tile_rows_multiple(impl, x.dtype)}, got {tr}")
        if mode not in (C.INTERPRET, C.MARKSTEIN):
            raise ValueError(f"nvfp4 impl={impl!r} divides with the Markstein sequence only (division={cfg.division!r}); use impl='v1'")
        body = functools.partial(_nvfp4_body_v2, rows_per_group=max(rows_per_group, 1), tr=tr, mode=mode,
                                 in_dtype=jnp.dtype(x.dtype),
                                 branch_free_rows=impl != "v2",
                                 value_form=_VALUE_FORMS.get(impl, "v2"), slab_loop=impl == "v8",
                                 blocks_per_row=bpr)
    else:
        body = functools.partial(_nvfp4_body, rows_per_group=max(rows_per_group, 1), tr=tr, mode=mode)
    bs_dtype = jnp.uint8 if v2 else E4M3  # v2 writes the scale bytes as integers (bitcast after the kernel)
    call = C.persistent_kernel(
        body,
        name="quantize_nvfp4" + (f"_{impl}" if v2 else ""),
        out_shapes=[jax.ShapeDtypeStruct((rp * half,), jnp.uint8), jax.ShapeDtypeStruct((rp,), bs_dtype)],
        in_tiles=[((tr // bpr, NVFP4_BLOCK * bpr), x.dtype, C.swizzle_transforms(NVFP4_BLOCK * bpr, x.dtype),
                   lambda gm, t: gm.at[pl.ds(t * (tr // bpr), tr // bpr)])],
        out_tiles=[
            ((tr * half,), jnp.uint8, (), lambda gm, t: gm.at[pl.ds(t * tr * half, tr * half)]),
            ((tr,), bs_dtype, (), lambda gm, t: gm.at[pl.ds(t * tr, tr)]),
        ],
        ntiles=ntiles,
        cfg=cfg,
        interpret=interpret,
        n_extra_in=1,
        extra_out=[jax.ShapeDtypeStruct((groups + gpad,), F32)],
        prologue=_hoisted_scalars_gpu if hoist else None,
        prologue_scratch=[plgpu.SMEM((C.SLAB_ROWS, 4), F32)] if table else (),
    )
    packed, bs, g = call(x2, amax)
    if v2:
        bs = lax.bitcast_convert_type(bs, E4M3)
    packed = packed[: r * half].reshape(*lead, kp // 2)
    return packed, bs[:r].reshape(*lead, kp // NVFP4_BLOCK), g[:groups]


# Every version returns the contract's bits; all are kept so one benchmark run times them side by side
# (experiments/benchmarks/quantize.py). v1: the first kernel (wgmma layout, threshold compares, byte stores); v2: row per
# thread, codes from the float bits, 8-byte stores; v3: v2 with branch-free per-row divisions; v4: one Markstein
# correction per division and the E2M1 word; v5: v4 with a branch-free per-row reciprocal; v6: v5 with tree sums and sign
# words; v7: v6 with the E2M1 magnitude on the FMA pipe; v8: v7 one 128-row slab per loop step (68 registers); v10 / v11:
# v6 / v7 with g and RN(1/g) computed once per CTA instead of per tile (one global scale; per-expert scales run as v6 / v7);
# v12 / v13: v10 / v11 with each row's divisor and reciprocal looked up in a per-CTA table by the row's scale byte.
IMPLS = ("v3", "v4", "v5", "v6", "v7", "v8", "v10", "v11", "v12", "v13", "v14", "v15", "v2", "v1")
# the per-value form of each version's tile body (v8, v10 - v15 change how tiles and rows run, not the values' formulas)
_VALUE_FORMS = {"v4": "v4", "v5": "v5", "v6": "v6", "v7": "v7", "v8": "v7", "v10": "v6", "v11": "v7", "v12": "v6",
                "v13": "v7", "v14": "v6", "v15": "v7"}
# v14 / v15: v12 / v13 with the input tile loaded as 128-byte rows of several blocks (`wide_blocks_per_row`).
# Why: the TMA load of [rows, 16] bfloat16 tiles (32-byte rows) alone ran at 75 % of an equal-bytes elementwise
# kernel on the H200 while the same bytes as 64-byte float32 rows ran at 97 % (results/nvfp4_floor_h200*.json,
# decision record 0006): the kernel's math was not what held bfloat16 back, its tile's row width was.
WIDE_IMPLS = ("v14", "v15")
WIDE_ROW_BYTES = 128


def wide_blocks_per_row(dtype) -> int:
    """Blocks of 16 values per tile row for the wide versions: 128-byte rows (bfloat16 4, float32 2)."""
    return max(1, WIDE_ROW_BYTES // (NVFP4_BLOCK * jnp.dtype(dtype).itemsize))


def blocks_per_row(impl: str, dtype) -> int:
    """Blocks per tile row of version `impl` on `dtype` input (1 but for the wide versions)."""
    return wide_blocks_per_row(dtype) if impl in WIDE_IMPLS else 1


def tile_rows_multiple(impl: str, dtype) -> int:
    """Tiles of `impl` hold a multiple of this many rows (blocks): one 128-row slab of tile rows per warpgroup."""
    return C.SLAB_ROWS * blocks_per_row(impl, dtype)


# The defaults, from the H200 runs of sessions 20 and 21 with five interleaved timing rounds (decision record 0006).
# Session 21: v14 (v12 with 128-byte tile rows) for both dtypes. Final run (results/quantize_nvfp4_h200.json), 256 MiB
# inputs: bfloat16 84.2 % of the same-run 1 GiB copy's bandwidth in wall clock (v12, same tiles: 72.0 %; v6, the
# default before session 20: 51.1 %) and 96.0 % of the 1 GiB elementwise kernel's bandwidth in GPU time; float32 84.5 %
# (v12 83.3 %) and 95.8 %. The tilings are session 20's: bfloat16 1024-row tiles, 2 CTAs per SM, dynamic schedule;
# float32 768 rows, 3 CTAs per SM, static.
DEFAULT_TILES = C.TileConfig(rows=1024, ctas_per_sm=2, schedule="dynamic")  # bfloat16 (and float16) input
DEFAULT_TILES_F32 = C.TileConfig(rows=768, ctas_per_sm=3)
DEFAULT_IMPL = "v14"


def default_tiles(dtype, groups: int = 1, rows_per_expert: int = 0, impl: str | None = None) -> C.TileConfig:
    """The measured tiling for input `dtype`, with shorter tiles when per-expert global scales need tiles that divide
    an expert's rows (a tile never straddles two global scales; otherwise each expert is quantized by its own
    launch). Shorter tiles stay a multiple of the rows `impl` keeps per 128-thread slab (wide versions: more)."""
    base = DEFAULT_TILES_F32 if jnp.dtype(dtype) == jnp.float32 else DEFAULT_TILES
    if groups == 1 or rows_per_expert % base.rows == 0:
        return base
    multiple = tile_rows_multiple(impl or DEFAULT_IMPL, dtype)
    rows = next((r for r in (768, 512, 384, 256, 128) if r < base.rows and r % multiple == 0 and rows_per_expert % r == 0),
                base.rows)
    return dataclasses.replace(base, rows=rows)


def default_impl(x, config: C.TileConfig | None = None) -> str:
    """The kernel version `nvfp4` uses when the caller names none: DEFAULT_IMPL, or v12 (same bits, 32-byte tile
    rows) when a given tiling's rows are not a multiple of the rows DEFAULT_IMPL keeps per 128-thread slab."""
    if config is not None and C.tile_rows(config, NVFP4_BLOCK) % tile_rows_multiple(DEFAULT_IMPL, x.dtype):
        return "v12"
    return DEFAULT_IMPL


@traced_once("four_over_six", "interpret", "config", "impl")
def nvfp4(x, *, global_amax=None, four_over_six: bool = False, interpret: bool = False,
          config: C.TileConfig | None = None, impl: str | None = None):
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
    interpret = C.resolve_interpret(interpret)
    shape = global_amax.shape
    rows_per_expert = math.prod(x.shape[1:-1]) * (-(-x.shape[-1] // NVFP4_BLOCK))
    cfg = config or default_tiles(x.dtype, groups, rows_per_expert, impl)
    with C.interpret_context(interpret):
        if groups > 1 and rows_per_expert % C.tile_rows(cfg, NVFP4_BLOCK):
            outs = [_quantize(x[i], global_amax[i].reshape(1), groups=1, cfg=cfg, interpret=interpret, impl=impl)
                    for i in range(groups)]
            return (jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs]),
                    jnp.concatenate([o[2] for o in outs]).reshape(shape))
        packed, bs, g = _quantize(x, global_amax.reshape(groups), groups=groups, cfg=cfg, interpret=interpret,
                                 impl=impl)
    return packed, bs, g.reshape(shape)

__all__ = ["nvfp4"]
