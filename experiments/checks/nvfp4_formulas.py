"""Exhaustive CPU checks of the NVFP4 kernel's arithmetic shortcuts (decision record 0006).

    PYTHONPATH=src:. python experiments/checks/nvfp4_formulas.py [--part NAME|all] [--quick] [--out JSON]

1. e2m1: `e2m1_words.e2m1_magnitude_biased` (one magic add for every binade) minus its bias equals the
   contract's threshold count (`jaxrl_fp8.precision.nvfp4.e2m1_codes` of clip(y, -6, 6)) for all 2^32 float32
   bit patterns y; a NaN y (the Markstein quotient past float32 max) gives magnitude 7, as the contract's
   saturated +-inf does. Runs the same function the interpret-mode kernel runs (JnpOps, XLA:CPU).
2. markstein: one Markstein correction q1 = RN(q0 + RN(x - q0 d) r), q0 = RN(x r), r = RN(1/d), equals RN(x / d)
   for every bfloat16 significand of x (2^7) and every float32 significand of d (2^23), in exact integer
   arithmetic (no floating point involved, so no double rounding in the check itself; an emulation through
   float64 would report false failures, e.g. x = 1, d = 2 - 2^-23, where float64 rounds q0 + e r onto a float32
   tie). Scale invariance covers every exponent pair while nothing overflows or underflows; the kernel's
   operands stay in that range wherever the code depends on the quotient (docstring of
   `quantize_nvfp4._tile_gpu`).
3. markstein_f32: the same for float32 x, whose 2^46 significand pairs cannot be enumerated: a failure needs a
   rounding midpoint within 2^-22 ulp of x / d, which bounds |X 2^s - M D| (comment above `hard_pairs`); all
   such pairs of every float32 significand of d are enumerated and run through the exact chain.
4. reciprocal: one Markstein correction of a reciprocal estimate, e = RN(1 - d r), r' = RN(r + e r), gives
   RN(1/d) from every estimate r within 1 ulp of 1/d, for all 2^23 float32 significands of d except the
   all-ones one (the NVFP4 kernel's per-row reciprocal, `exact_arith._RCP_RN_PTX`, which gives that one its closed
   form and reaches 1 ulp with a Newton step from the hardware estimate; the GPU test compares it with div.rn).
`--quick` checks a subset (what tests/pallas_kernels/test_nvfp4_formulas.py runs in CI).
"""

from __future__ import annotations

import argparse
import os
import platform
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


def _rne_units(W, f, frac_bits):
    """Round-half-even of W + f / 2^frac_bits (W, f int64 arrays, 0 <= f < 2^frac_bits) to an integer."""
    half = np.int64(1) << (frac_bits - 1)
    return W + ((f > half) | ((f == half) & (W & 1 == 1)))


def _round_half_units(W, f):
    """Round-half-even of (W + f / 2^47) / 2: a sum past the binade's top rounded at twice the spacing."""
    return _rne_units(W >> 1, (W & 1) * (np.int64(1) << 47) + f, 48)


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
    X = np.asarray(x_sig, dtype=np.int64)
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
    W = Q + k
    Q1 = _rne_units(W, f, 47)
    e1 = eq.copy()
    lo = W < ONE  # result below 2^23 units: round in half units
    if np.any(lo):
        k2 = T[lo] >> 46
        Q1[lo] = _rne_units(2 * Q[lo] + k2, T[lo] - (k2 << 46), 46)
        e1[lo] = eq[lo] - 1
    hi = W >= (ONE << 1)  # at or past 2^24 units: round in double units
    if np.any(hi):
        Q1[hi] = _round_half_units(W[hi], f[hi])
        e1[hi] = eq[hi] + 1
    Q1, e1 = _normalize(Q1, e1)
    # y = RN(x / d)
    ge = X >= D
    Y = np.where(ge, _rne_div(X << 23, D), _rne_div(X << 24, D))
    ey = np.where(ge, -23, -24)
    Y, ey = _normalize(Y, ey)
    return (Q, eq), (Q1, e1), (Y, ey)


# Float32 x: the 2^46 significand pairs cannot be enumerated, but one correction can only fail next to a rounding
# boundary. With e = x - q0 d, the corrected value is v = q0 + RN(e) r and v - x/d = e (r - 1/d) + (RN(e) - e) r.
# |x/d - q0| <= 2 ulp(q) (ulp(q): float32 spacing at x/d), |r - 1/d| <= 2^-24 / d and |RN(e) - e| <= 2^-24 |e|,
# so |v - x/d| <= 2^-22 ulp(q) (with margin). RN(v) != RN(x/d) needs a midpoint m between them. Writing
# x = X 2^a, d = D 2^b (X, D 24-bit integers) and m = M 2^(a-b-s) (M odd, in [2^24, 2^25); s = 24 when x/d has
# the significand of X/D >= 1, else 25): x/d - m = (X 2^s - M D) / D * ulp(q) / 2 with N = X 2^s - M D a nonzero
# integer, so a failure needs |N| <= 2^-21 D < 8. Those (X, D) are enumerated below (M from t = N mod 2^s and the
# inverse of D's odd part) and run through the exact chain; `HARD_N` = 15 leaves a factor of two.
HARD_N = 15


def _odd_inverse(a, bits):
    """Inverse of odd uint64 a modulo 2^bits (Newton: each step doubles the correct low bits)."""
    a = a.astype(np.uint64)
    inv = a.copy()  # correct to 3 bits for odd a
    for _ in range(6):
        inv = inv * (np.uint64(2) - a * inv)
    return inv & np.uint64((1 << bits) - 1)


def hard_pairs(d_sigs: np.ndarray, n_max: int = HARD_N):
    """All (X, D) with 24-bit X and |X 2^s - M D| <= n_max for an odd M in [2^24, 2^25), s in {24, 25}:
    the only float32 x significands for which one Markstein correction could differ from RN(x / d)."""
    D = d_sigs.astype(np.int64)
    j = np.zeros_like(D)
    while True:  # 2-adic valuation of D (at most 23)
        even = ((D >> j) & 1) == 0
        if not even.any():
            break
        j = j + even
    d_odd = D >> j
    xs, ds = [], []
    for s_ in (24, 25):
        for t in range(-n_max, n_max + 1):
            if t == 0:
                continue
            ok = (np.abs(t) % (np.int64(1) << j)) == 0  # 2^j must divide t for M D + t = X 2^s
            if not ok.any():
                continue
            Dk, jk, dok = D[ok], j[ok], d_odd[ok]
            bits = s_ - jk
            mod = np.int64(1) << bits
            tj = np.int64(t) >> jk if t > 0 else -((-np.int64(t)) >> jk)
            # M * d_odd = -tj (mod 2^bits)  =>  M = -tj * inv(d_odd)
            inv = np.zeros_like(dok, dtype=np.uint64)
            for b in np.unique(bits):
                sel = bits == b
                inv[sel] = _odd_inverse(dok[sel], int(b))
            m0 = ((-tj) % mod).astype(np.uint64) * inv % mod.astype(np.uint64)
            m0 = m0.astype(np.int64)
            base = (np.int64(1) << 24)
            first = base + (m0 - base) % mod  # smallest M >= 2^24 in the class
            for k in range(1 << max(0, 24 - s_ + int(jk.max()))):  # members of the class in [2^24, 2^25)
                M = first + k * mod
                inside = (M < (np.int64(1) << 25)) & ((M & 1) == 1)
                if not inside.any():
                    continue
                num = M[inside] * Dk[inside] + t
                X = num >> s_
                good = ((num & ((np.int64(1) << s_) - 1)) == 0) & (X >= ONE) & (X < (ONE << 1))
                xs.append(X[good])
                ds.append(Dk[inside][good])
    if not xs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(xs), np.concatenate(ds)


def check_markstein_f32(quick: bool) -> dict:
    """One correction for float32 x: every hard pair (above) of every float32 significand of d."""
    d_all = np.arange(ONE, ONE << 1, dtype=np.int64)
    if quick:
        d_all = np.unique(np.concatenate([d_all[::4099], d_all[:256], d_all[-256:]]))
    pairs = fails = 0
    bad_examples = []
    for chunk in np.array_split(d_all, max(1, d_all.size // (1 << 18))):
        X, D = hard_pairs(chunk)
        (_, _), (q1, e1), (y, ey) = markstein_once_exact(X, D)
        bad = (q1 != y) | (e1 != ey)
        pairs += int(X.size)
        fails += int(bad.sum())
        bad_examples += [(hex(int(a)), hex(int(b))) for a, b in zip(X[bad][:4], D[bad][:4])]
    return {"d_significands": int(d_all.size), "hard_pairs": pairs, "n_max": HARD_N, "failing_pairs": fails,
            "examples": bad_examples[:8]}


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


def reciprocal_step_exact(d_sigs: np.ndarray, r_units: np.ndarray):
    """One Markstein correction of a reciprocal estimate, in integers: d = D 2^-23 (D in [2^23, 2^24)), the
    estimate r = F 2^-24 (F near 2^47 / D); e = RN(1 - d r) (fma), r' = RN(r + e r) (fma). Returns (r' in units
    of 2^-24, RN(1/d) in units of 2^-24); values at or above 1 are multiples of 2 units (float32's spacing there)."""
    D, F = d_sigs.astype(np.int64), r_units.astype(np.int64)
    E = _round_to_24_bits((np.int64(1) << 47) - D * F)  # 1 - d r in units of 2^-47
    T = E * F  # e r in units of 2^-71 = 2^-24 * 2^-47
    k = T >> 47
    W = F + k
    f = T - (k << 47)
    R = _rne_units(W, f, 47)
    hi = R >= (np.int64(1) << 24)  # at or past 1.0: round again to even units of 2 (exact from W, f)
    if np.any(hi):
        R[hi] = 2 * _round_half_units(W[hi], f[hi])
    Y = _rne_div(np.int64(1) << 47, D)  # 1/d in (0.5, 1]: units of 2^-24, the spacing there
    return R, Y


def check_reciprocal(quick: bool) -> dict:
    """For every float32 significand of d, every estimate r within 1 ulp of 1/d (inclusive: the 2 or 3
    floats there), does one Markstein correction give RN(1/d)?"""
    D = np.arange(ONE, ONE << 1, dtype=np.int64)
    if quick:
        D = np.unique(np.concatenate([D[::61], D[:2048], D[-2048:]]))
    q = (np.int64(1) << 47) // D  # floor of 2^47 / D, in units of 2^-24
    exact = q * D == (np.int64(1) << 47)
    fails, checked, fail_d = 0, 0, set()
    for off in (-1, 0, 1, 2):
        F = q + off
        # |F - 2^47 / D| <= 1 unit, i.e. |F D - 2^47| <= D; 1.0 and above are spaced by 2 units: skip odd F there
        ok = (np.abs(F * D - (np.int64(1) << 47)) <= D) & ((F < (ONE << 1)) | (F % 2 == 0)) & (F >= ONE)
        R, Y = reciprocal_step_exact(D[ok], F[ok])
        bad = R != Y
        fails += int(bad.sum())
        checked += int(ok.sum())
        fail_d.update(hex(int(v)) for v in D[ok][bad])
    return {"d_significands": int(D.size), "estimates_checked": checked, "failing": fails,
            "failing_d_significands": sorted(fail_d)[:16], "n_failing_d": len(fail_d),
            "exact_powers_of_two": int(exact.sum())}


def check_e2m1(quick: bool, chunk_bits: int = 24) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxrl_fp8.precision.nvfp4 import e2m1_codes
    from pallas_kernels.e2m1_words import E2M1_BIAS, e2m1_magnitude_biased
    from pallas_kernels.scalar_ops import JnpOps

    @jax.jit
    def mismatches(bits_u32):
        """(formula misses, NaN inputs) in one chunk of float32 bit patterns."""
        y = lax.bitcast_convert_type(bits_u32, jnp.float32)
        want = (e2m1_codes(jnp.clip(y, -6.0, 6.0)) & 7).astype(jnp.uint32)
        want = jnp.where(jnp.isnan(y), jnp.uint32(7), want)
        got = (e2m1_magnitude_biased(y, JnpOps) - jnp.uint32(E2M1_BIAS)).astype(jnp.uint32)
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


# --part name -> (JSON key, check, printed label, whether its result passes)
PARTS = {
    "e2m1": ("e2m1", check_e2m1, "e2m1", lambda r: r["mismatches"] == 0),
    "markstein": ("markstein_once_bf16", check_markstein, "markstein (one correction, bfloat16 x)",
                  lambda r: r["failing_pairs"] == 0),
    "markstein_f32": ("markstein_once_f32", check_markstein_f32, "markstein (one correction, float32 x, hard pairs)",
                      lambda r: r["failing_pairs"] == 0),
    "reciprocal": ("reciprocal_step", check_reciprocal, "reciprocal (one correction of an estimate within 1 ulp)",
                   lambda r: set(r["failing_d_significands"]) <= {hex((ONE << 1) - 1)}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which check to run")
    ap.add_argument("--quick", action="store_true", help="a subset (seconds), as in CI")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    import jax

    res = {"quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
           "jax": jax.__version__}
    for name, (key, check, label, passed) in PARTS.items():
        if args.part in (name, "all"):
            t = time.time()
            res[key] = check(args.quick) | {"seconds": round(time.time() - t, 1)}
            print(f"{label}:", res[key], flush=True)
    if args.out:
        from jaxrl_fp8.model.hf_io import write_json_atomic

        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(str(args.out), res)
    ok = all(passed(res[key]) for key, _, _, passed in PARTS.values() if key in res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
