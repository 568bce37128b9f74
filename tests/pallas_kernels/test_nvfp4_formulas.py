"""The NVFP4 kernel's shortcuts: the E2M1 word formula with its sign words, one Markstein correction of the
quotient and of a reciprocal estimate, against the contract and against exact rational arithmetic. The full
exhaustive runs are experiments/checks/nvfp4_formulas.py (results/nvfp4_formulas_cpu.json); here their quick
subsets run."""

import importlib.util
from fractions import Fraction
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxrl_fp8 import precision as P
from pallas_kernels.e2m1_words import e2m1_word_tree, sign_word_bf16, sign_word_f32
from pallas_kernels.scalar_ops import JnpOps

_spec = importlib.util.spec_from_file_location(
    "nvfp4_formulas", Path(__file__).parents[2] / "experiments/checks/nvfp4_formulas.py")
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def _rn24(v: Fraction) -> Fraction:
    """Round-half-even of a rational to 24 significant bits (float32 without range limits)."""
    if v == 0:
        return Fraction(0)
    sign, a, e = (-1 if v < 0 else 1), abs(v), 0
    while a >= 2:
        a, e = a / 2, e + 1
    while a < 1:
        a, e = a * 2, e - 1
    m = a * 2**23
    fl = m.numerator // m.denominator
    rem = m - fl
    fl += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1)
    return sign * Fraction(fl) * Fraction(2) ** (e - 23)


def test_quick_exhaustive_subsets_pass():
    e2m1 = checks.check_e2m1(quick=True)
    assert e2m1["mismatches"] == 0 and e2m1["values"] >= 3 * (1 << 24) and e2m1["nan_values"] > 0
    mk = checks.check_markstein(quick=True)
    assert mk["failing_pairs"] == 0 and mk["pairs"] > 1_000_000
    rc = checks.check_reciprocal(quick=True)  # the all-ones significand fails: the kernel special-cases it
    assert rc["failing_d_significands"] == ["0xffffff"] and rc["estimates_checked"] > 200_000


def test_integer_markstein_check_equals_rational_arithmetic():
    """The checker's integer chain (q0, q1, RN(x / d)) equals the same chain in Fractions, and it does see
    q0 = RN(x r) alone miss RN(x / d) (so a wrong one-step division would be caught)."""
    rng = np.random.default_rng(0)
    one = 1 << 23
    ds = np.concatenate([rng.integers(one, 2 * one, 300), np.arange(2 * one - 20, 2 * one), np.arange(one, one + 20)])
    q0_misses = 0
    for xs in (128 << 16, 255 << 16, 200 << 16, int(rng.integers(one, 2 * one))):
        (q, eq), (q1, e1), (y, ey) = checks.markstein_once_exact(xs, ds)
        for j, d_sig in enumerate(ds):
            x, d = Fraction(xs, 2**23), Fraction(int(d_sig), 2**23)
            r = _rn24(1 / d)
            f_q0 = _rn24(x * r)
            f_q1 = _rn24(f_q0 + _rn24(x - f_q0 * d) * r)
            f_y = _rn24(x / d)
            assert Fraction(int(q[j])) * Fraction(2) ** int(eq[j]) == f_q0
            assert Fraction(int(q1[j])) * Fraction(2) ** int(e1[j]) == f_q1
            assert Fraction(int(y[j])) * Fraction(2) ** int(ey[j]) == f_y
            q0_misses += f_q0 != f_y
    assert q0_misses > 50


@pytest.mark.parametrize("sign_source", ["f32", "bf16"])
def test_e2m1_word_packs_the_contracts_codes_with_signs_from_x(sign_source):
    """The kernel's word (tree-summed magnitudes, a sign word from float32 bits or gathered from raw bf16x2 registers
    by byte permutes) packs the contract's codes with x's signs: ties, signed zeros, saturation, NaN quotients."""
    rng = np.random.default_rng(2)
    n = 4096
    y = rng.standard_normal((n, 8)).astype(np.float32) * np.exp2(rng.integers(-4, 4, (n, 1))).astype(np.float32)
    y[0] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]  # ties
    y[1] = [-0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -1e30]
    y[2] = [0.0, -0.0, 1e-45, -1e-40, 7.0, -np.inf, np.inf, 0.5]
    x = np.where(rng.random((n, 8)) < 0.5, -1.0, 1.0).astype(np.float32) * np.abs(y)
    x[:3] = y[:3]
    x = x.astype(jnp.bfloat16).astype(np.float32)  # bf16 values, so both sign sources see the same signs
    o = JnpOps
    yj, xb = jnp.asarray(y), o.bits(jnp.asarray(x))
    if sign_source == "f32":
        signs = sign_word_f32([xb[:, e] for e in range(8)], o)
    else:
        raw = [(xb[:, 2 * i] >> jnp.uint32(16)) | (xb[:, 2 * i + 1] & jnp.uint32(0xFFFF0000)) for i in range(4)]
        signs = sign_word_bf16(raw, o)
    w = np.asarray(e2m1_word_tree([yj[:, e] for e in range(8)], signs, o))
    mags = np.asarray(P.nvfp4.e2m1_codes(jnp.clip(yj, -6.0, 6.0))).astype(np.uint32) & 7
    codes = mags | (np.signbit(x).astype(np.uint32) << 3)
    want = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1)
    np.testing.assert_array_equal(w, want)
    # a NaN quotient (x / d overflowed on the GPU) codes as +-6 by the sign of x
    nan = lax.bitcast_convert_type(jnp.full((1,), 0xFFC00000, jnp.uint32), jnp.float32)
    neg = o.bits(jnp.full((1,), -3e38, jnp.float32))
    signs = sign_word_f32([neg] * 8, o)
    assert np.asarray(e2m1_word_tree([nan] * 8, signs, o))[0] == 0xFFFFFFFF


def test_prmt_emulation_follows_the_ptx_definition():
    """JnpOps.prmt (what interpret mode runs for the GPU's prmt.b32): byte selects from {b, a} and sign replication."""
    a, b = jnp.uint32(0x80112233), jnp.uint32(0x44556677)
    assert int(JnpOps.prmt(a, b, 0x3210)) == 0x80112233
    assert int(JnpOps.prmt(a, b, 0x7654)) == 0x44556677
    assert int(JnpOps.prmt(a, b, 0x0004)) == 0x33333377
    assert int(JnpOps.prmt(a, b, 0xB3B3)) == 0xFF80FF80  # byte 3 of a (0x80) sign-replicated, and as is


def test_hard_pairs_are_every_pair_near_a_midpoint():
    """The float32 proof enumerates (X, D) with |X 2^s - M D| <= HARD_N; brute force over all 2^23 X for a few D
    (odd, all-ones, and with 2-adic valuations 3 and 7) finds the same set, and the quick subset passes."""
    one = 1 << 23
    x = np.arange(one, 2 * one, dtype=np.int64)
    for d in (one + 1, 2 * one - 1, 0x8AF688, 0xC5A080):
        want = set()
        for s in (24, 25):
            num = x << s
            m_floor = num // d
            for m in (m_floor - 1, m_floor, m_floor + 1, m_floor + 2):
                near = (np.abs(num - m * d) <= checks.HARD_N) & (m % 2 == 1) & (m >= 1 << 24) & (m < 1 << 25)
                want |= set(x[near].tolist())
        got, _ = checks.hard_pairs(np.array([d]))
        assert set(got.tolist()) == want, hex(d)
    res = checks.check_markstein_f32(quick=True)
    assert res["failing_pairs"] == 0 and res["hard_pairs"] > 10_000
