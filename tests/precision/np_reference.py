"""An independent numpy statement of the contract (IEEE float32 numpy ops + ml_dtypes casts).

Written separately from jaxrl_fp8.precision on purpose: if both agree bitwise on random and edge-case
inputs, the JAX implementation (and every kernel tested against it) computes the documented rule.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
FLOOR = F32(1e-10)


def amax_blocks(xb, axes):
    a = np.max(np.abs(xb), axis=axes).astype(F32)
    finite = np.all(np.isfinite(xb), axis=axes)
    return np.where(finite, np.maximum(a, FLOOR), np.nan).astype(F32)


def pow2_ceil(s):
    s = np.asarray(s, F32)
    m, e = np.frexp(s.astype(np.float64))  # s = m * 2^e, m in [0.5, 1)
    out = np.where(m == 0.5, s, np.ldexp(1.0, e)).astype(F32)
    return np.where(np.isfinite(s), out, s).astype(F32)


def fp8_group(x, g, dtype, pow2=False):
    x = np.asarray(x, F32)
    fmax = F32(ml_dtypes.finfo(dtype).max)
    k = x.shape[-1]
    pad = (-k) % g
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, g)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (amax_blocks(xp, -1) / fmax).astype(F32)
        if pow2:
            s = pow2_ceil(s)
        y = (xp / s[..., None]).astype(F32)
    q = np.clip(y, -fmax, fmax).astype(dtype)
    return q.reshape(*x.shape[:-1], -1)[..., :k], s


def fp8_block(w, bn, bk, dtype, pow2=False):
    w = np.asarray(w, F32)
    fmax = F32(ml_dtypes.finfo(dtype).max)
    n, k = w.shape[-2:]
    wp = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, (-n) % bn), (0, (-k) % bk)])
    nb, kb = wp.shape[-2] // bn, wp.shape[-1] // bk
    wb = wp.reshape(*w.shape[:-2], nb, bn, kb, bk)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (amax_blocks(wb, (-3, -1)) / fmax).astype(F32)
        if pow2:
            s = pow2_ceil(s)
        y = (wb / s[..., :, None, :, None]).astype(F32)
    q = np.clip(y, -fmax, fmax).astype(dtype)
    return q.reshape(*w.shape[:-2], nb * bn, kb * bk)[..., :n, :k], s


def nvfp4(x, global_amax=None, four_over_six=False):
    """Returns (codes uint8 [..., Kp] one per element, block_scale e4m3 [..., Kp/16], global f32)."""
    x = np.asarray(x, F32)
    if global_amax is None:
        fin = np.where(np.isfinite(x), np.abs(x), 0).astype(F32)
        global_amax = F32(fin.max())
    emax = F32(256.0 if four_over_six else 448.0)
    g = (np.maximum(np.asarray(global_amax, F32), FLOOR) / (F32(6.0) * emax)).astype(F32)
    k = x.shape[-1]
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (-k) % 16)]).reshape(*x.shape[:-1], -1, 16)
    g_b = np.reshape(g, np.shape(g) + (1,) * (xp.ndim - 1 - np.ndim(g)))
    bamax = np.where(np.all(np.isfinite(xp), -1), np.max(np.abs(xp), -1), np.nan).astype(F32)

    def enc(target):
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            t = (bamax / F32(target)).astype(F32)
            bs = np.minimum((t / g_b).astype(F32), F32(448)).astype(ml_dtypes.float8_e4m3fn)
            d = (bs.astype(F32) * g_b).astype(F32)
            ok = d > 0
            y = (xp / np.where(ok, d, F32(1))[..., None]).astype(F32)
        y = np.where(ok[..., None], np.clip(y, -6, 6), F32(0)).astype(F32)
        codes = np.asarray(y.astype(ml_dtypes.float4_e2m1fn)).view(np.uint8) & 0xF
        deq = (codes_to_values(codes) * d[..., None]).astype(F32)
        return bs, codes, deq

    bs, codes, deq = enc(6.0)
    if four_over_six:
        bs4, codes4, deq4 = enc(4.0)
        use4 = np.sum((deq4 - xp) ** 2, -1) < np.sum((deq - xp) ** 2, -1)
        bs = np.where(use4, bs4, bs)
        codes = np.where(use4[..., None], codes4, codes)
    return codes.reshape(*x.shape[:-1], -1), bs, g


GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)


def codes_to_values(codes):
    codes = np.asarray(codes).astype(np.int64)
    mag = GRID[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(F32)
