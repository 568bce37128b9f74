"""x . w^T with float32 accumulation outside the quantized kernels, and a row-invariant GPU form of it.

Used for the router and lm_head (float32 or BF16 operands; the contract never quantizes them) and for the dense
products of the BF16 format and of the emulated MXFP8 / NVFP4 formats (BF16 operands). Two implementations:

- "xla": `lax.dot_general` with float32 accumulation. Row invariant on CPU (tested). On the GPU it is a cuBLAS
  call whose algorithm, and with it the summation order, may change with M (float32 operands are computed in
  float32, not TF32: `xla_gemm` asks for HIGHEST); the rollout's decode step (M = batch) and the trainer's
  forward (M = B * T) then disagree in the last bits (H200: 0-35 % of tokens bit-identical, docs/mismatch_study.md).
  (The FP8 block format's dense and every expert product run on Pallas kernels, which are row invariant, and
  are not affected by this switch.)
- "split3": each operand split exactly into a bfloat16 head and a bfloat16 tail (a = hi + lo up to 2^-16 |a|),
  three BF16 products on the Pallas grouped BF16 kernel with one group (fixed tiles: a row's K-order never depends
  on M), float32 accumulation in the kernel, summed in a fixed order: hi.hi + (hi.lo + lo.hi). The dropped lo.lo
  term is below 2^-16 of the product. A BF16 operand has no tail: float32 x BF16 takes two products, BF16 x BF16
  one (exact). The backward splits the same way into XLA BF16 dots (`split_dot_general`: tensor cores, same error
  bound, not row invariant, which it need not be: it does not enter the rollout / trainer comparison). Measured on the H200 (mismatch study, 62M-3.7B): with it every unified recipe's rollout equals the
  trainer bit for bit; with "xla" none does.

`JAXRL_FP8_HIGH_PRECISION` selects the form: unset or "auto" (the default: "split3" on a Hopper GPU, where the
Mosaic kernel runs; "xla" everywhere else, where the XLA dot is already row invariant and cheaper), "xla",
"split3" (its products on the backend ops picks for any BF16 grouped GEMM: the Mosaic kernel on a Hopper GPU,
the XLA grouped path elsewhere), "split3-interpret" (the kernel in interpret mode; CPU tests).
Cost of split3: up to three tensor-core products instead of one (in two kernel calls: x's head and tail rows are
stacked into one), a float32 weight's split recomputed on every call,
and the grouped kernel's N / 128 CTAs on narrow decode GEMMs (decision record 0008 has the decode numbers;
experiments/benchmarks/decode.py records the form it ran under).
`block_dot` gives the XLA path of the FP8 block-scaled GEMMs (`ops.block_scaled`) its product of one K block in the
same form.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.ops import backends
from jaxrl_fp8.ops.xla_gemm import dot_nt_f32, xla_block_dot
from jaxrl_fp8.precision.arith import bf16_to_f32

F32 = jnp.float32
BF16 = jnp.bfloat16
ENV = "JAXRL_FP8_HIGH_PRECISION"
FORMS = ("auto", "xla", "split3", "split3-interpret")
_TILE_N = 128


def selected_form() -> str:
    """The form `ENV` asks for (unset: "auto")."""
    form = os.environ.get(ENV, "auto") or "auto"
    if form not in FORMS:
        raise ValueError(f"environment variable {ENV}={form!r}: expected one of {', '.join(FORMS)}")
    return form


def effective_form(form: str | None = None) -> str:
    """The form that runs on the default device: "auto" resolved to "split3" on a Hopper GPU, else "xla"."""
    form = selected_form() if form is None else form
    if form not in FORMS:
        raise ValueError(f"high_precision_dot: form {form!r}; expected one of {', '.join(FORMS)}")
    if form == "auto":
        return "split3" if backends.default_device_is_hopper() else "xla"
    return form


def split_bf16(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) bfloat16 with hi + lo == a up to the rounding of lo (2^-16 |a|); a - hi is exact in float32
    (hi decoded from its bits, so no pass can fold the float32 -> bf16 -> float32 round trip away)."""
    a = jnp.asarray(a, F32)
    hi = a.astype(BF16)
    return hi, (a - bf16_to_f32(hi)).astype(BF16)


def _backend(form: str, k: int) -> str | None:
    """The BF16 grouped GEMM backend of the split form; None: the XLA dot (the "xla" form, or a contraction the
    kernel does not take, under every form)."""
    from pallas_kernels import gemm_grouped_bf16

    if form == "xla" or not gemm_grouped_bf16.supports(_TILE_N, k):
        return None
    return backends.resolve_bf16_grouped("interpret" if form == "split3-interpret" else None, _TILE_N, k)


def _head_tail(a: jax.Array):
    """(hi, lo) of a float32 operand; (a, None) for a BF16 one: it has no tail, so its cross product is skipped (a
    float32 router over BF16 parameters takes two products, BF16 by BF16 one)."""
    return (a, None) if jnp.dtype(a.dtype) == jnp.dtype(BF16) else split_bf16(a)


def _sum_split(hh, hl, lh):
    """The split form's one summation order, hi.hi + (hi.lo + lo.hi), without the terms that are absent (None)."""
    cross = [t for t in (hl, lh) if t is not None]
    if not cross:
        return hh
    return hh + (cross[0] + cross[1] if len(cross) == 2 else cross[0])


def _split3_forward(x, w, backend: str):
    """float32 [M, N]: the split products (three, fewer when an operand is BF16), N padded to the kernel's tile."""
    m, k = x.shape
    n = w.shape[0]
    pad = (-n) % _TILE_N
    w = jnp.pad(w, ((0, pad), (0, 0))) if pad else w

    def mm(a, b):  # one group: every row of a
        return backends.bf16_grouped_matmul(a, b[None], jnp.asarray([a.shape[0]], jnp.int32), backend=backend)

    xh, xl = _head_tail(x)
    wh, wl = _head_tail(w)
    if xl is None:
        hh, lh = mm(xh, wh), None
    else:
        # x's head and tail share the weight's head: one kernel call on their stacked rows (the kernel is row
        # invariant, so each row has the bits it would have alone) instead of two; at decode's M the products are
        # latency-bound and the call count is what costs
        both = mm(jnp.concatenate([xh, xl], axis=0), wh)
        hh, lh = both[:m], both[m:]
    hl = mm(xh, wl) if wl is not None else None
    return _sum_split(hh, hl, lh)[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _split3(x, w, backend):
    return _split3_forward(x, w, backend)


def _split3_fwd(x, w, backend):
    return _split3_forward(x, w, backend), (x, w)


def split_dot_general(a: jax.Array, b: jax.Array, dimension_numbers) -> jax.Array:
    """float32 `lax.dot_general(a, b, dimension_numbers)` from the operands' BF16 heads and tails, hi.hi + (hi.lo +
    lo.hi), each an XLA dot of BF16 operands with float32 accumulation; a BF16 operand has no tail (fewer products).

    The backward of the split form (the router's and the dense BF16 products'; the lm_head's backward is one BF16
    product per gradient, `model.matmul.head_logits`). Why not the float32 dot: on a GPU a HIGHEST float32 x float32
    product is a SIMT kernel (cutlass simt sgemm), ~14x slower than the BF16 tensor-core products. The error stays inside
    the split's bound (2^-15 of |a|.|b|), as the forward's does. Not row invariant on a GPU (cuBLAS), which the
    gradient need not be: it enters no rollout / trainer comparison.
    """
    ah, al = _head_tail(a)
    bh, bl = _head_tail(b)

    def dot(p, q):
        return lax.dot_general(p, q, dimension_numbers, preferred_element_type=F32)

    return _sum_split(dot(ah, bh), dot(ah, bl) if bl is not None else None, dot(al, bh) if al is not None else None)


def _split3_bwd(backend, res, g):
    x, w = res
    dx = split_dot_general(g, w, (((1,), (0,)), ((), ())))
    dw = split_dot_general(g, x, (((0,), (0,)), ((), ())))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_split3.defvjp(_split3_fwd, _split3_bwd)


def high_precision_dot(x: jax.Array, w: jax.Array, form: str | None = None) -> jax.Array:
    """float32 [M, N] = x [M, K] . w [N, K]^T (x, w float32 or bfloat16, possibly mixed: a float32 x BF16 pair
    is the float32 product) in the selected form (see module doc).
    A shape the kernel does not take (K not a multiple of 64) uses "xla" under every form."""
    backend = _backend(effective_form(form), x.shape[1])
    if backend is None or x.shape[0] == 0:
        common = jnp.promote_types(x.dtype, w.dtype)  # a float32 x BF16 pair is a float32 product
        return dot_nt_f32(x.astype(common), w.astype(common))
    return _split3(x, w, backend)


def block_dot(form: str | None = None):
    """The product of one K block of e4m3 values in the XLA path of the block-scaled GEMMs (`ops.block_scaled`).
    Under the "xla" form (CPU) an XLA dot; under split3 (Hopper: the form that makes every product outside the
    kernels row invariant) the values, exact in bfloat16, go to the row-invariant Pallas BF16 kernel: a cuBLAS dot's
    summation order may change with M, which made the unified fp8-block recipe differ from its rollout by ~1e-9 on
    layers too narrow for the FP8 kernels (H200, tiny config: key / value projections of width 64)."""
    form = effective_form(form)
    if form == "xla":
        return xla_block_dot
    return lambda ab, bb: high_precision_dot(ab.astype(BF16), bb.astype(BF16), form)
