"""Which implementation runs a GEMM: the Mosaic GPU kernel, the XLA path, or interpret mode; the BF16 grouped GEMMs
run on their choice here (the FP8 block-scaled ones in `ops.block_scaled`, above `ops.high_precision`, whose block
product they take).

`None` (auto) picks a Mosaic GPU kernel on a Hopper GPU when the shape fits one — the block-scaled FP8
kernels for fp8-block GEMMs, the BF16 grouped kernel for every BF16 expert GEMM (bf16 format, the
dequantized emulated formats, the BF16 backward) — and the XLA path everywhere else (dense BF16 GEMMs take no
backend: they run in the form `ops.high_precision` selects). "interpret" runs the Pallas kernel through Mosaic
GPU's CPU interpreter (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxrl_fp8.ops import grouping, operands
from jaxrl_fp8.precision import QuantizedWeight, formats as F

BACKENDS = ("xla", "mosaic", "interpret")


def check_backend(backend: str | None) -> str | None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"ops backend {backend!r} is unknown; expected None (auto) or one of {', '.join(BACKENDS)}")
    return backend


@functools.cache
def default_device_is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def kernel_supports(n: int, k: int) -> bool:
    return n % 128 == 0 and k % 128 == 0


def _choose(backend: str | None, fits, need: str) -> str:
    """None: the kernel on a Hopper GPU when the shape fits, else XLA; an explicit kernel backend must fit.
    `fits()` is only asked when a kernel is in question (it may import the kernel module)."""
    check_backend(backend)
    if backend is None:
        return "mosaic" if default_device_is_hopper() and fits() else "xla"
    if backend != "xla" and not fits():
        raise ValueError(f"backend {backend!r}: {need}; use backend='xla' (or None) for other shapes")
    return backend


def resolve(backend: str | None, fmt: str, n: int, k: int) -> str:
    """The backend one fp8-block GEMM of output width n and depth k runs on (other formats: always xla)."""
    check_backend(backend)
    if fmt != "fp8-block":
        return "xla"
    return _choose(backend, lambda: kernel_supports(n, k), f"the Pallas FP8 kernels need N and K multiples of 128, got N={n}, K={k}")


def resolve_bf16_grouped(backend: str | None, out_width: int, contraction: int) -> str:
    """The backend of one BF16 grouped GEMM with output width `out_width` contracting over `contraction`."""
    def fits():
        from pallas_kernels import gemm_grouped_bf16

        return gemm_grouped_bf16.supports(out_width, contraction)

    return _choose(backend, fits, "the Pallas BF16 grouped kernel needs the output width a multiple of 128 and the "
                                  f"contraction a multiple of 64, got {out_width} and {contraction}")


def resolve_bf16_grouped_wgrad(backend: str | None, n: int, k: int) -> str:
    """The backend of one BF16 grouped weight gradient [E, N, K]."""
    return _choose(backend, lambda: kernel_supports(n, k), f"the Pallas grouped wgrad kernel needs N and K multiples of 128, "
                                                   f"got N={n}, K={k}")


def bf16_grouped_wgrad(dy, x, group_sizes, num_groups: int, *, backend: str, out_dtype=jax.numpy.float32):
    """[E, N, K] = per expert dy[rows]^T . x[rows], BF16 operands, float32 sums rounded to out_dtype (in the kernel's
    store: the same values as XLA's convert)."""
    if backend == "xla":
        return grouping.grouped_wgrad(dy, x, group_sizes, num_groups).astype(out_dtype)
    from pallas_kernels import gemm_grouped_wgrad

    return gemm_grouped_wgrad.grouped_wgrad_bf16(dy, x, group_sizes, num_groups, interpret=backend == "interpret",
                                                 out_dtype=out_dtype)


def bf16_grouped_matmul(x, w, group_sizes, *, backend: str, layout: str = "nk", out_dtype=jax.numpy.float32):
    """[M, O] = x . w[g]^T ("nk", w [E, O, C]) or x . w[g] ("kn", w [E, C, O]), BF16 operands, float32 sums rounded
    to out_dtype (the kernel rounds as it stores, to nearest even like XLA's convert: the same values)."""
    bf16 = jax.numpy.bfloat16
    if backend == "xla":
        y = grouping.grouped_dot(x, w if layout == "nk" else jax.numpy.swapaxes(w, 1, 2), group_sizes)
        return y.astype(out_dtype)
    from pallas_kernels import gemm_grouped_bf16

    return gemm_grouped_bf16.grouped_matmul(
        x.astype(bf16), w.astype(bf16), group_sizes, layout=layout, out_dtype=out_dtype, interpret=backend == "interpret"
    )


def _kernel_scale_operand(scale, n: int, k: int, backend: str, rows: int | None = None):
    """A weight's block scales in the layout its Mosaic GEMM loads (None on the XLA path, which takes them as they are);
    rows: the batch a dense weight is multiplied with, where it is fixed (a decode loop), else None."""
    if backend == "xla":
        return None
    from pallas_kernels import gemm_dense, gemm_grouped

    if scale.ndim == 3:
        return gemm_grouped.weight_scale_operand(scale)
    return gemm_dense.weight_scale_operand(scale, n, k, rows=rows)


def fp8_weight_operands(w, backend: str | None = None, *, pow2_scale: bool = False):
    """(q, 128x128 scale_inv) of `w` [..., N, K] quantized where `ops` would quantize it for a GEMM of its shape: the
    Pallas kernel on the Mosaic backend, the contract's jnp function elsewhere. Whoever hands fp8-block operands to
    a GEMM (the trainer's prepared weights, the rollout engine's weights) must make them here: on the GPU the XLA
    fusion of the contract is not bitwise equal to the kernel for every BF16 input (decision record 0001), and the
    trainer's forward quantizes on the kernel. The SGLang export makes them here too (`backend_of_array`)."""
    n, k = w.shape[-2:] if isinstance(w, QuantizedWeight) else jax.numpy.shape(w)[-2:]
    return operands.fp8_weight(w, resolve(backend, F.FP8_BLOCK, n, k), pow2_scale=pow2_scale)


def backend_of_array(x) -> str | None:
    """The backend for quantizing a committed array where it lives: None (auto, the trainer's choice) on a GPU, "xla"
    anywhere else. Auto alone looks at the first device, which is the GPU even for an array put on the CPU (the
    converters' CPU path on a GPU host)."""
    devices = x.devices() if isinstance(x, jax.Array) else ()
    return None if devices and all(d.platform == "gpu" for d in devices) else "xla"


def prepare_fp8_weight(w, backend: str | None = None, *, dgrad: bool = False, rows: int | None = None):
    """`w` [..., N, K] with its 128x128-block FP8 operands made on the backend ops would pick for its shape: an
    `operands.PreparedWeight` (its quantization, and on the Mosaic backend the kernel's layout of its scales, then
    run once, not in every forward that multiplies it).
    w: a weight (the PreparedWeight keeps it as `value`, the gradient's target) or an fp8-block QuantizedWeight
    (operands only, value None: the rollout engine's decode loop).
    dgrad: also the transposed operands the fp8 backward's dgrad multiplies (`operands.fp8_dgrad_weight`).
    rows: the rows every product with `w` has (a decode loop's slots): the scale layout of the GEMM tiling for that
    batch (`gemm_dense.default_config`); None for batches of any size."""
    quantized = isinstance(w, QuantizedWeight)
    if quantized and w.fmt != F.FP8_BLOCK:
        raise ValueError(f"ops.prepare_fp8_weight: a QuantizedWeight in {w.fmt!r}; only fp8-block operands are prepared")
    n, k = w.shape[-2:] if quantized else jax.numpy.shape(w)[-2:]
    be = resolve(backend, F.FP8_BLOCK, n, k)
    q, scale = fp8_weight_operands(w, be)
    value = None if quantized else w
    prepared = operands.PreparedWeight(value, q, scale, scale_op=_kernel_scale_operand(scale, n, k, be, rows))
    if not dgrad:
        return prepared
    q_t, scale_t = operands.fp8_dgrad_weight(w, q, scale)
    be_t = resolve(backend, F.FP8_BLOCK, k, n)
    return dataclasses.replace(prepared, q_t=q_t, scale_t=scale_t, scale_t_op=_kernel_scale_operand(scale_t, k, n, be_t))
