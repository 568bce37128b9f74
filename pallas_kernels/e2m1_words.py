"""E2M1 codes of NVFP4, eight per 32-bit word, written over an operation table (scalar_ops.MlirOps / JnpOps).

Fewer instructions per value than the contract's threshold count, same codes: checked for all 2^32 float32 inputs
by experiments/checks/nvfp4_formulas.py (its quick subset in tests/pallas_kernels/test_nvfp4_formulas.py).
"""

from __future__ import annotations


# What `e2m1_magnitude_biased` adds to every magnitude; a word of eight carries it times 0x11111111 (mod 2^32).
E2M1_BIAS = 0x0B0000FE
E2M1_WORD_BIAS = (E2M1_BIAS * 0x11111111) & 0xFFFFFFFF


def e2m1_magnitude_biased(y, ops):
    """E2M1 magnitude code of min(|y|, 6), round-to-nearest-even, plus E2M1_BIAS (mod 2^32): 6 instructions.

    One magic add for every binade instead of a comparison per E2M1 threshold: with P = 2^max(e, 0) (e the
    exponent of a = min(|y|, 6); P in {1, 2, 4}), s = a + P * 2^22 rounds a to a multiple of P / 2, ties to even,
    which is the E2M1 grid spacing of a's binade (0.5 below 2, then 1, then 2). bits(s) - bits(P) is then
    bits(2^22) - bits(1) + n with n = a / (P / 2) rounded (0..4 for P = 1, 2..4 for P = 2, 2..3 for P = 4), and
    the code is n + 2e = n + (bits(P) >> 22) - 254; the constants are E2M1_BIAS, removed once per word.
    a = min(|y|, 6) with PTX min.f32 semantics: a NaN y (the Markstein quotient past float32 max) gives 6, code 7.
    """
    a = ops.fmin_num(ops.abs(y), 6.0)
    p = ops.and_(ops.bits(ops.fmax_num(a, 1.0)), 0x7F800000)
    s = ops.fma(ops.float(p), 4194304.0, a)  # P * 2^22 is exact; one rounding of the sum
    return ops.add(ops.sub(ops.bits(s), p), ops.shr(p, 22))


# ------------------------------------------------------------------------------------- NVFP4 v6 forms
# The v4 word with shorter dependency chains (the kernel is latency-bound, docs/decisions/0006): magnitudes summed
# as a tree instead of one running sum, and the eight signs gathered into one word apart from the magnitudes. For
# bfloat16 input the signs come straight from the raw bf16x2 registers with four byte permutes (PRMT's
# sign-replicate mode) instead of a shift and a masked OR per value. Same bits as `e2m1_word`: integer addition
# and OR are associative, and each sign lands on bit 4e + 3 either way.


def _tree(vals, combine):
    while len(vals) > 1:
        vals = [combine(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def e2m1_word_tree(ys, sign_word, ops):
    """`e2m1_word` of eight quotients with the signs given as a word (sign of value e on bit 4e + 3, nothing else)."""
    ms = [e2m1_magnitude_biased(y, ops) for y in ys]
    w = _tree([m if e == 0 else ops.shl(m, 4 * e) for e, m in enumerate(ms)], ops.add)
    return ops.or_(ops.sub(w, E2M1_WORD_BIAS), sign_word)


def sign_word_f32(sign_bits, ops):
    """Bit 31 of each of eight float32 bit patterns on bit 4e + 3 of one word (OR tree)."""
    parts = [ops.and_(ops.shr(sb, 28 - 4 * e) if e < 7 else sb, 8 << (4 * e)) for e, sb in enumerate(sign_bits)]
    return _tree(parts, ops.or_)


# prmt selectors: [a.b1, b.b1, a.b3, b.b3] sign-replicated; then the even / odd bytes of the two results
_PRMT_SIGNS, _PRMT_EVEN, _PRMT_ODD = 0xFBD9, 0x5410, 0x7632


def sign_word_bf16(raw_words, ops):
    """Signs of eight bfloat16 values held as four bf16x2 words (value 2i in the low half of word i) on bit 4e + 3.

    A = prmt(w0, w1) = [s0, s2, s1, s3] and B = prmt(w2, w3) = [s4, s6, s5, s7] as 0x00 / 0xFF bytes; their even and
    odd bytes give [s0, s2, s4, s6] and [s1, s3, s5, s7]; byte k of the word takes bit 3 from the first (value 2k)
    and bit 7 from the second (value 2k + 1).
    """
    w0, w1, w2, w3 = raw_words
    a, b = ops.prmt(w0, w1, _PRMT_SIGNS), ops.prmt(w2, w3, _PRMT_SIGNS)
    even, odd = ops.prmt(a, b, _PRMT_EVEN), ops.prmt(a, b, _PRMT_ODD)
    return ops.or_(ops.and_(even, 0x08080808), ops.and_(odd, 0x80808080))
