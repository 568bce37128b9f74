"""Float64 NumPy references of the block-scaled GEMM math (tests, benchmarks' correctness checks).

Each K block's partial sum of e4m3 products is exact in float64 (products are multiples of 2^-18 below
2^18; 128 of them need < 53 bits), so these references are exact up to the final scaling: the kernels and
the XLA path differ from them only by float32 accumulation rounding.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def block_scaled_matmul(a_q, a_scale, b_q, b_scale, b_rows_per_scale: int = BLOCK) -> np.ndarray:
    """C = sum_kb (A_kb . B_kb^T) * sa[:, kb] * sb[n // g, kb] in float64."""
    a, b = _f64(a_q), _f64(b_q)
    sa, sb = _f64(a_scale), _f64(b_scale)
    m, k = a.shape
    n = b.shape[0]
    sb_rows = np.repeat(sb, b_rows_per_scale, axis=0)[:n]
    out = np.zeros((m, n))
    for kb in range(-(-k // BLOCK)):
        sl = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        out += (a[:, sl] @ b[:, sl].T) * sa[:, kb : kb + 1] * sb_rows[None, :, kb]
    return out


def grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes) -> np.ndarray:
    """Rows of group g use expert g's weight; rows past sum(group_sizes) are 0."""
    m = np.asarray(a_q).shape[0]
    n = np.asarray(b_q).shape[1]
    out = np.zeros((m, n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + int(size), m)
        if end > start:
            out[start:end] = block_scaled_matmul(np.asarray(a_q)[start:end], np.asarray(a_scale)[start:end], np.asarray(b_q)[g], np.asarray(b_scale)[g])
        start = end
    return out


def grouped_dot(x, w, group_sizes) -> np.ndarray:
    x, w = _f64(x), _f64(w)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + int(size), x.shape[0])
        out[start:end] = x[start:end] @ w[g].T
        start = end
    return out


def grouped_wgrad(dy, x, group_sizes, num_groups: int) -> np.ndarray:
    dy, x = _f64(dy), _f64(x)
    out = np.zeros((num_groups, dy.shape[1], x.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + int(size), x.shape[0])
        out[g] = dy[start:end].T @ x[start:end]
        start = end
    return out


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| (NaN anywhere fails)."""
    out, ref = _f64(out), _f64(ref)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))
