"""x . w^T with float32 accumulation outside the quantized kernels, and a row-invariant GPU form of it.

Used for the router and lm_head (float32 or BF16 operands; the contract never quantizes them) and for the dense
products of the BF16 format and of the emulated MXFP8 / NVFP4 formats (BF16 operands). Two implementations:

- "xla" (the default everywhere): `lax.dot_general` with float32 accumulation. Row invariant on CPU (tested). On
  the GPU it is a cuBLAS call whose algorithm, and with it the summation order, may change with M (float32
  operands are computed in float32, not TF32: `xla_gemm` asks for HIGHEST); the rollout's decode step (M = batch) and the trainer's forward (M = B * T) can then
  disagree in the last bits (docs/mismatch_study.md, H200). (The FP8 block format's dense and every expert
  product run on Pallas kernels, which are row invariant, and are not affected by this switch.)
- "split3": each operand split exactly into a bfloat16 head and a bfloat16 tail (a = hi + lo up to 2^-16 |a|),
  three BF16 products on the Pallas grouped BF16 kernel with one group (fixed tiles: a row's K-order never depends
  on M), float32 accumulation in the kernel, summed in a fixed order: hi.hi + (hi.lo + lo.hi). The dropped lo.lo
  term is below 2^-16 of the product. BF16 operands (BF16 parameters) need only hi.hi: one product, exact.
  The backward is the float32 XLA product either way (it does not enter the rollout / trainer comparison). On the
  GPU it runs on tensor cores, where the float32 XLA form (HIGHEST) does not.

Cost not yet measured: three tensor-core products instead of one, and the weight's split is recomputed on every
call (for a float32 lm_head at decode about twice its bytes of extra traffic per step; caching the split with the
prepared rollout weights would remove that).

`JAXRL_FP8_HIGH_PRECISION` selects the form: unset or "xla", "split3" (its three products on the backend ops picks
for any BF16 grouped GEMM: the Mosaic kernel on a Hopper GPU, the XLA grouped path elsewhere), "split3-interpret"
(the kernel in interpret mode; CPU tests). Experimental until the H200 shows that split3 is row
invariant there and what it costs (experiments/checks/row_invariance.py measures both forms).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.ops import backends
from jaxrl_fp8.ops.xla_gemm import dot_nt_f32, dot_tn_f32
from jaxrl_fp8.precision.arith import bf16_to_f32

F32 = jnp.float32
BF16 = jnp.bfloat16
ENV = "JAXRL_FP8_HIGH_PRECISION"
FORMS = ("xla", "split3", "split3-interpret")
_TILE_N = 128


def selected_form() -> str:
    form = os.environ.get(ENV, "xla") or "xla"
    if form not in FORMS:
        raise ValueError(f"environment variable {ENV}={form!r}: expected one of {', '.join(FORMS)}")
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


def _split3_forward(x, w, backend: str):
    """float32 [M, N]: the three-product form (one product for BF16 operands), N padded to the kernel's tile."""
    m, k = x.shape
    n = w.shape[0]
    pad = (-n) % _TILE_N
    w = jnp.pad(w, ((0, pad), (0, 0))) if pad else w
    sizes = jnp.asarray([m], jnp.int32)

    def mm(a, b):
        return backends.bf16_grouped_matmul(a, b[None], sizes, backend=backend)

    if jnp.dtype(x.dtype) == jnp.dtype(BF16) and jnp.dtype(w.dtype) == jnp.dtype(BF16):
        y = mm(x, w)
    else:
        xh, xl = split_bf16(x)
        wh, wl = split_bf16(w)
        y = mm(xh, wh) + (mm(xh, wl) + mm(xl, wh))
    return y[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _split3(x, w, backend):
    return _split3_forward(x, w, backend)


def _split3_fwd(x, w, backend):
    return _split3_forward(x, w, backend), (x, w)


def _split3_bwd(backend, res, g):
    x, w = res
    dx = lax.dot_general(g, w.astype(F32), (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=F32)
    dw = dot_tn_f32(g, x.astype(F32))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_split3.defvjp(_split3_fwd, _split3_bwd)


def high_precision_dot(x: jax.Array, w: jax.Array, form: str | None = None) -> jax.Array:
    """float32 [M, N] = x [M, K] . w [N, K]^T (x, w float32 or bfloat16) in the selected form (see module doc).
    A shape the kernel does not take (K not a multiple of 64) uses "xla" under every form."""
    form = selected_form() if form is None else form
    if form not in FORMS:
        raise ValueError(f"high_precision_dot: form {form!r}; expected one of {', '.join(FORMS)}")
    backend = _backend(form, x.shape[1])
    if backend is None or x.shape[0] == 0:
        return dot_nt_f32(x, w)
    return _split3(x, w, backend)
