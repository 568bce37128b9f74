"""XLA reference path of the block-scaled GEMMs: the same block math as the Pallas kernels, on any backend.

Block math (the one the kernels implement):
    partial_kb[m, n] = sum_{k in block kb} float32(a_q[m, k]) * float32(b_q[n, k])      (float32 accumulation)
    acc[m, n]        = acc[m, n] + partial_kb[m, n] * (sa[m, kb] * sb[n // g, kb])     (kb = 0, 1, ... in order)
with `g` = 128 for 128x128 weight blocks and 1 for per-row (1x128) scales on the right operand (wgrad).

Row invariance: every product is a fixed-shape dot over one 128-wide K block and the K blocks are
accumulated in a fixed sequential order (a scan), so one row's result never depends on the other rows.
XLA:CPU's matrix-vector path (M == 1) sums in another order than its matrix-matrix path, so a lone row is
padded to two rows (measured: M >= 2 gives identical rows for every M tried, M == 1 does not).
This module's own products stayed row invariant on every host tried, but XLA:CPU's dots in general are a property of
the host: on an AVX2-only AMD EPYC a plain float32 [M, K] . [K, N] dot of fewer than about 61 rows gives other last
bits than the same rows in a larger product (turning off XLA's YNNPACK dot fusion changed which cases differ, so
kernel choice by size is the likely cause; not established). `cpu_dots_row_invariant` measures the host; the four CPU
tests that compare such products across M run only where it holds (marker `row_invariant_cpu`).

Reference math of the ops layers (with `grouping` and the float64 `reference`): it chooses no backend. The product
of one K block is a parameter, `block_dot`; `ops.block_scaled` passes the high-precision form's (an XLA dot on CPU,
the Pallas BF16 kernel under split3 on Hopper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 128
F32 = jnp.float32


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def pad_rows_min2(x: jax.Array) -> jax.Array:
    """Give XLA:CPU at least two rows so it takes its (row-invariant) matrix-matrix path."""
    return jnp.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1)) if x.shape[0] == 1 else x


def _precision(a: jax.Array, b: jax.Array):
    """HIGHEST when an operand is float32: XLA's DEFAULT lets a GPU round float32 operands to TF32 (10 mantissa bits),
    and the contract's float32 products (router, lm_head, float32 parameters) mean float32. XLA:CPU computes the same
    bits either way (checked). BF16 operands keep DEFAULT (their products are exact; HIGHEST could upcast them)."""
    return lax.Precision.HIGHEST if jnp.dtype(F32) in (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) else None


def dot_nt_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T with float32 accumulation; row invariant (see module doc)."""
    m = a.shape[0]
    out = lax.dot_general(pad_rows_min2(a), b, (((1,), (1,)), ((), ())), precision=_precision(a, b),
                          preferred_element_type=F32)
    return out[:m]


def dot_tn_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, N]^T . b [M, K] -> [N, K] with float32 accumulation (the wgrad shape)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b), preferred_element_type=F32)


def expand_b_scale(b_scale: jax.Array, n: int, b_rows_per_scale: int) -> jax.Array:
    """[N // g, KB] block scales -> [N, KB] per-row scales (exact: a copy of each block's scale)."""
    if b_rows_per_scale == 1:
        return b_scale[:n]
    return jnp.repeat(b_scale, b_rows_per_scale, axis=0)[:n]


def xla_block_dot(ab: jax.Array, bb: jax.Array) -> jax.Array:
    """The float32 product ab [M, 128] . bb [N, 128]^T of one K block (e4m3 values as float32): an XLA dot."""
    return lax.dot_general(ab, bb, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, b_rows_per_scale: int = BLOCK, out_dtype=F32,
                        block_dot=xla_block_dot):
    """C[M, N] = A[M, K] . B[N, K]^T with 1x128 scales on A and 128x128 (or 1x128) scales on B.

    a_q e4m3 [M, K], a_scale f32 [M, ceil(K/128)]; b_q e4m3 [N, K], b_scale f32 [ceil(N/g), ceil(K/128)].
    `block_dot(ab, bb)`: the float32 product of one K block (see module doc).
    """
    m, k = a_q.shape
    n = b_q.shape[0]
    if b_q.shape[1] != k:
        raise ValueError(f"block_scaled_matmul: A has K={k} but B has K={b_q.shape[1]}")
    kb = -(-k // BLOCK)
    if a_scale.shape != (m, kb):
        raise ValueError(f"block_scaled_matmul: a_scale shape {a_scale.shape}, expected {(m, kb)}")
    exp_b = (-(-n // b_rows_per_scale), kb)
    if b_scale.shape != exp_b:
        raise ValueError(f"block_scaled_matmul: b_scale shape {b_scale.shape}, expected {exp_b}")
    a = _pad_axis(pad_rows_min2(a_q.astype(F32)), 1, BLOCK)
    b = _pad_axis(b_q.astype(F32), 1, BLOCK)
    mp = a.shape[0]
    a_blocks = a.reshape(mp, kb, BLOCK).transpose(1, 0, 2)  # [KB, M, 128]
    b_blocks = b.reshape(n, kb, BLOCK).transpose(1, 0, 2)  # [KB, N, 128]
    sa = jnp.pad(a_scale.astype(F32), [(0, mp - m), (0, 0)]).T  # [KB, M]
    sb = expand_b_scale(b_scale.astype(F32), n, b_rows_per_scale).T  # [KB, N]

    def step(acc, xs):
        ab, bb, sak, sbk = xs
        partial = block_dot(ab, bb)
        return acc + partial * (sak[:, None] * sbk[None, :]), None

    acc, _ = lax.scan(step, jnp.zeros((mp, n), F32), (a_blocks, b_blocks, sa, sb))
    return acc[:m].astype(out_dtype)


@functools.cache
def cpu_dots_row_invariant() -> bool:
    """Whether this host's XLA:CPU gives every row of a dot the same bits whatever the other rows are.

    Checks `dot_nt_f32` and a plain [M, K] . [K, N] dot (the layout of the interpreted kernels' tile products and
    of XLA paths outside this module), float32 and bfloat16 operands, two shapes: rows 0-1, 0-2, 3-19 and 1-129
    against the same rows of a 130-row product. Where XLA:CPU switches kernels with M, or a kernel's remainder
    path sums in another order, one of these differs (measured on an AVX2-only AMD EPYC: plain float32 dots of
    fewer than about 61 rows). A few small compilations, once per process.
    """
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    nt = jax.jit(dot_nt_f32)
    nn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32))
    with jax.default_device(cpu):
        for dtype in (F32, jnp.bfloat16):
            for k, n in ((256, 200), (2048, 64)):
                x = jnp.asarray(rng.standard_normal((130, k)), dtype)
                w_nk = rng.standard_normal((n, k))
                for dot, w in ((nt, jnp.asarray(w_nk, dtype)), (nn, jnp.asarray(np.ascontiguousarray(w_nk.T), dtype))):
                    full = np.asarray(dot(x, w))
                    for rows in (slice(0, 2), slice(0, 3), slice(3, 20), slice(1, 130)):
                        if np.asarray(dot(x[rows], w)).tobytes() != full[rows].tobytes():
                            return False
    return True
