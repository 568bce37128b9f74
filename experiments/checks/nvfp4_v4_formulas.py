"""Exhaustive CPU checks of the two shortcuts of the NVFP4 v4 kernel body (decision record 0006).

    PYTHONPATH=src:. python experiments/checks/nvfp4_v4_formulas.py [--part e2m1|markstein|all] [--out JSON]

1. e2m1: `quantize_common.e2m1_magnitude_biased` (one magic add for every binade) minus its bias equals the
   contract's threshold count (`jaxrl_fp8.precision.nvfp4.e2m1_codes` of clip(y, -6, 6)) for all 2^32 float32
   bit patterns y; a NaN y (the Markstein quotient past float32 max) gives magnitude 7, as the contract's
   saturated +-inf does. Runs the same function the interpret-mode kernel runs (JnpOps, XLA:CPU).
2. markstein: one Markstein correction q1 = RN(q0 + RN(x - q0 d) r), q0 = RN(x r), r = RN(1/d), equals RN(x / d)
   for every bfloat16 significand of x (2^7) and every float32 significand of d (2^23), in exact integer
   arithmetic (no floating point involved, so no double rounding in the check itself; an emulation through
   float64 would report false failures, e.g. x = 1, d = 2 - 2^-23, where float64 rounds q0 + e r onto a float32
   tie). Scale invariance covers every exponent pair while nothing overflows or underflows; the kernel's
   operands stay in that range wherever the code depends on the quotient (docstring of
   `quantize_nvfp4._v2_gpu`).
`--quick` checks a subset (what tests/pallas_kernels/test_nvfp4_v4_formulas.py runs in CI).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ONE = 1 << 23  # the implicit bit of a float32 significand


def _rne_div(num, den):
    """Round-half-even of num / den for int64 arrays (num >= 0, den > 0)."""
    q, rem = np.divmod(num, den)
    twice = 2 * rem
    return q + ((twice > den) | ((twice == den) & (q & 1 == 1)))


def _normalize(m, e):
    """(significand, exponent) with the significand in [2^23, 2^24): a rounding up to 2^24 moves the exponent."""
    up = m == (ONE << 1)
    return np.where(up, ONE, m), np.where(up, e + 1, e)


def _round_to_24_bits(v):
    """Round-half-even of int64 values to 24 significant bits (what a float32 result keeps)."""
    a = np.abs(v)
    bit_length = np.frexp(a.astype(np.float64))[1]  # exact: |v| < 2^53 converts exactly
    unit = np.left_shift(np.int64(1), np.maximum(bit_length - 24, 0).astype(np.int64))
    r = _rne_div(a, unit) * unit
    return np.where(v < 0, -r, r)


def markstein_once_fails(x_sig: int, d_sigs: np.ndarray) -> np.ndarray:
    """For one significand X of x (x = X 2^-23) and an array of significands D (d = D 2^-23): a bool per D, True
    where one Markstein correction differs from RN(x / d)."""
    (q0, eq), (q1, e1), (y, ey) = markstein_once_exact(x_sig, d_sigs)
    return (q1 != y) | (e1 != ey)


def markstein_once_exact(x_sig: int, d_sigs: np.ndarray):
    """(q0, q1, RN(x / d)) as (significand, exponent) int64 pairs, value = significand 2^exponent, computed with
    integers only."""
    X = np.int64(x_sig)
    D = d_sigs.astype(np.int64)
    # r = RN(1/d) = R 2^-24 (R = 2^24 for d = 1)
    R = np.where(D == ONE, np.int64(ONE << 1), _rne_div(np.int64(1) << 47, D))
    # q0 = RN(x r): x r = X R 2^-47 lies in [0.5, 2]
    N = X * R
    big = N >= (np.int64(1) << 47)
    Q = np.where(big, _rne_div(N, np.int64(1) << 24), _rne_div(N, np.int64(1) << 23))
    eq = np.where(big, -23, -24)
    Q, eq = _normalize(Q, eq)
    # e = RN(x - q0 d) (fma): 2^(eq - 23) (X 2^-eq - Q D), rounded to 24 significant bits where it has more
    E = _round_to_24_bits(X * np.left_shift(np.int64(1), (-eq).astype(np.int64)) - Q * D)
    # q1 = RN(q0 + e r) = 2^eq RN(Q + E R / 2^47) in the binade of the result
    T = E * R
    k = T >> 47
    f = T - (k << 47)
    half = np.int64(1) << 46
    W = Q + k
    Q1 = W + ((f > half) | ((f == half) & (W & 1 == 1)))
    e1 = eq.copy()
    lo = W < ONE  # result below 2^23 units: round in half units
    if np.any(lo):
        T2, Q2 = T[lo], Q[lo]
        k2 = T2 >> 46
        f2 = T2 - (k2 << 46)
        h2 = np.int64(1) << 45
        W2 = 2 * Q2 + k2
        Q1[lo] = W2 + ((f2 > h2) | ((f2 == h2) & (W2 & 1 == 1)))
        e1[lo] = eq[lo] - 1
    hi = W >= (ONE << 1)  # at or past 2^24 units: round in double units
    if np.any(hi):
        Wh, fh = W[hi], f[hi]
        hh = Wh >> 1
        rem = (Wh & 1) * (np.int64(1) << 47) + fh
        unit = np.int64(1) << 47
        Q1[hi] = hh + ((rem > unit) | ((rem == unit) & (hh & 1 == 1)))
        e1[hi] = eq[hi] + 1
    Q1, e1 = _normalize(Q1, e1)
    # y = RN(x / d)
    ge = X >= D
    Y = np.where(ge, _rne_div(X << 23, D), _rne_div(X << 24, D))
    ey = np.where(ge, -23, -24)
    Y, ey = _normalize(Y, ey)
    return (Q, eq), (Q1, e1), (Y, ey)


def check_markstein(quick: bool) -> dict:
    d_all = np.arange(ONE, ONE << 1, dtype=np.int64)
    if quick:  # every 97th significand plus the 4096 at each end of the binade
        d_all = np.unique(np.concatenate([d_all[::97], d_all[:4096], d_all[-4096:]]))
    x_sigs = [(s << 16) for s in range(128, 256)]  # bfloat16: 7 stored bits
    if quick:
        x_sigs = x_sigs[::9] + [x_sigs[-1]]
    failing_d = set()
    fails = 0
    for xs in x_sigs:
        bad = markstein_once_fails(xs, d_all)
        fails += int(bad.sum())
        failing_d.update(int(v) for v in d_all[bad])
    return {"pairs": len(x_sigs) * int(d_all.size), "x_significands": len(x_sigs), "d_significands": int(d_all.size),
            "failing_pairs": fails, "failing_d_significands": sorted(hex(v) for v in failing_d)}


def check_e2m1(quick: bool, chunk_bits: int = 24) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxrl_fp8.precision.nvfp4 import e2m1_codes
    from pallas_kernels import quantize_common as C

    @jax.jit
    def mismatches(bits_u32):
        y = lax.bitcast_convert_type(bits_u32, jnp.float32)
        got = (C.e2m1_magnitude_biased(y, C.JnpOps) - jnp.uint32(C.E2M1_BIAS)).astype(jnp.uint32)
        want = (e2m1_codes(jnp.clip(y, -6.0, 6.0)) & 7).astype(jnp.uint32)
        want = jnp.where(jnp.isnan(y), jnp.uint32(7), want)
        return jnp.sum(got != want), jnp.sum(jnp.isnan(y))

    n = 1 << chunk_bits
    starts = range(0, 1 << 32, n)
    if quick:  # the chunks holding [0, 6.5] and [-6.5, 0], and one of NaNs
        starts = [s for s in starts if s < 0x40D00000 and (s + n) > 0x3E000000] + [0x7F800000 - n // 2, 0xBF800000]
    bad = nans = total = 0
    base = jnp.arange(n, dtype=jnp.uint32)
    for s in starts:
        b, nn = mismatches(base + jnp.uint32(s))
        bad, nans, total = bad + int(b), nans + int(nn), total + n
    return {"values": total, "nan_values": nans, "mismatches": bad}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["e2m1", "markstein", "all"], default="all", help="which check to run")
    ap.add_argument("--quick", action="store_true", help="a subset (seconds), as in CI")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    res = {"quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.part in ("e2m1", "all"):
        t = time.time()
        res["e2m1"] = check_e2m1(args.quick) | {"seconds": round(time.time() - t, 1)}
        print("e2m1:", res["e2m1"], flush=True)
    if args.part in ("markstein", "all"):
        t = time.time()
        res["markstein_once_bf16"] = check_markstein(args.quick) | {"seconds": round(time.time() - t, 1)}
        print("markstein (one correction, bfloat16 x):", res["markstein_once_bf16"], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(args.out)
    ok = res.get("e2m1", {}).get("mismatches", 0) == 0
    ms = res.get("markstein_once_bf16")
    ok &= ms is None or ms["failing_pairs"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
