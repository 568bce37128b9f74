"""How each format turns (activation, weight) into GEMM operands, through the precision contract only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.precision import formats as F
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
from jaxrl_fp8.precision.quantized import QuantizedWeight, dequantize_weight, quantize_dequantize_activation, quantize_weight

BACKWARD_MODES = ("high_precision", "dequantized", "fp8")
BF16 = jnp.bfloat16
F32 = jnp.float32


def check_args(fmt: str, backward: str, where: str) -> None:
    F.check_format(fmt, what=f"{where} fmt")
    if backward not in BACKWARD_MODES:
        raise ValueError(f"{where}: backward mode {backward!r} is unknown; expected one of {', '.join(BACKWARD_MODES)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """A compute weight together with its fp8-block operands, made once by `backends.prepare_fp8_weight`.

    Why: ops quantize a weight inside every forward, and a trainer's update runs one forward per micro-batch (its
    log-prob phase one per chunk of rows) on the same weights, which XLA does not hoist out of the loop. Handing
    ops a PreparedWeight makes the quantization once per update: ops take (q, scale) as they are, and the
    gradient flows to `value` as it would to the plain weight (straight through the quantizer); q and scale get
    zero cotangents. Same bits as quantizing in place (the same `fp8_weight` call on the same values)."""

    value: jax.Array | None  # [..., N, K] the compute weight (BF16 in training); None: operands only (rollout engine)
    q: jax.Array  # e4m3 [..., N, K]
    scale: jax.Array  # float32 [..., N/128, K/128]
    # for the fp8 backward's dgrad (FP8 wgmma takes K-major operands only, so W^T is a copy): q and scale transposed
    q_t: jax.Array | None = None
    scale_t: jax.Array | None = None
    # scale (scale_t) in the layout the Mosaic GEMM loads (`pallas_kernels.gemm_*.weight_scale_operand`), on that
    # backend only: every kernel call otherwise broadcasts its weight's scales again (a decode step: 7 XLA kernels
    # a layer)
    scale_op: jax.Array | None = None
    scale_t_op: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype if self.value is None else self.value.dtype


def check_weight(w, fmt: str, k: int, weight_ndim: int, where: str) -> tuple[int, ...]:
    """Validates w against x's K and the format; returns w's logical shape."""
    if isinstance(w, PreparedWeight):
        if fmt != F.FP8_BLOCK:
            raise ValueError(f"{where}: weight is prepared for fp8-block but fmt={fmt!r}")
        shape = w.shape
    elif isinstance(w, QuantizedWeight):
        if w.fmt != fmt:
            raise ValueError(f"{where}: weight is a QuantizedWeight in {w.fmt!r} but fmt={fmt!r}; pass fmt={w.fmt!r}")
        shape = w.shape
    else:
        shape = tuple(jnp.shape(w))
    if len(shape) != weight_ndim:
        want = "[N, K]" if weight_ndim == 2 else "[E, N, K]"
        raise ValueError(f"{where}: weight must be {want} (HF [out, in] layout); got shape {shape}")
    if shape[-1] != k:
        raise ValueError(f"{where}: x has K={k} but weight {shape} has K={shape[-1]} (weights are [out, in])")
    return shape


# Input dtypes the Pallas quantization kernels take; others go through the contract's jnp functions.
_KERNEL_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _use_kernel(x, backend: str | None) -> bool:
    """On the Mosaic GPU backend, quantize with the Pallas kernels: bitwise equal to the contract (tested on
    CPU and on the H200) and about 4x faster than the XLA fusion of the same math (quantize_h200.json)."""
    return backend == "mosaic" and jnp.dtype(x.dtype) in _KERNEL_INPUTS


def fp8_act(x, backend: str | None = None):
    """1x128 per-token FP8 groups along the last axis."""
    if _use_kernel(x, backend):
        from pallas_kernels import quantize as K

        return K.fp8_per_token_group(x, F.FP8_ACT_GROUP)
    return quantize_fp8_per_token_group(x, F.FP8_ACT_GROUP)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Act:
    """An activation's 1x128 FP8 operands for the FP8 GEMMs (`fp8_act_gemm`): q [M, K] e4m3 with its scales as
    [M, K/128] (`scale`, the contract's layout) or as the GEMM kernels load them (`scale_op` [K/128, Mp], M padded
    to `gemm_dense.A_ROW_BLOCK`), one of the two or both."""

    q: jax.Array
    scale: jax.Array | None = None
    scale_op: jax.Array | None = None

    def scales(self) -> jax.Array:
        """[M, K/128] (a transpose of scale_op's first M columns when only that layout is held)."""
        return self.scale if self.scale is not None else self.scale_op[:, : self.q.shape[0]].T

    def take_rows(self, rows: jax.Array) -> "FP8Act":
        """The operands of x[rows] (each row's groups are its own: the same bits as quantizing the gathered rows)."""
        scale_op = None
        if self.scale_op is not None:
            from pallas_kernels.gemm_dense import A_ROW_BLOCK

            pad = (-rows.shape[0]) % A_ROW_BLOCK
            scale_op = jnp.pad(self.scale_op[:, rows], [(0, 0), (0, pad)])
        return FP8Act(self.q[rows], None if self.scale is None else self.scale[rows], scale_op)

    def check(self, x, where: str) -> "FP8Act":
        want = (x.shape[0], -(-x.shape[1] // F.FP8_ACT_GROUP))
        ok = self.q.shape == x.shape and self.q.dtype == jnp.float8_e4m3fn and (self.scale is not None or self.scale_op is not None)
        ok = ok and (self.scale is None or self.scale.shape == want)
        ok = ok and (self.scale_op is None or (self.scale_op.shape[0] == want[1] and self.scale_op.shape[1] >= want[0]))
        if not ok:
            got = {k: None if v is None else f"{v.dtype}{list(v.shape)}" for k, v in vars(self).items()}
            raise ValueError(f"{where}: expected q {list(x.shape)} float8_e4m3fn with scale {list(want)} or scale_op "
                             f"[{want[1]}, >= {want[0]}]; got {got}")
        return self


def fp8_act_gemm(x, backend: str) -> FP8Act:
    """x [M, K]'s 1x128 FP8 operands for one FP8 GEMM on `backend`.

    On the Mosaic backend the quantization kernel writes the scales in the GEMM kernels' layout (`scale_op`, via
    `quantize.fp8_gemm_operand`): no transpose kernel per product. In interpret mode scale_op is the contract's
    scales padded and transposed (the layout the kernel writes; tests). On the XLA path the contract's (q, scale)."""
    if backend == "xla" or jnp.dtype(x.dtype) not in _KERNEL_INPUTS or x.ndim != 2 or x.shape[-1] % F.FP8_ACT_GROUP:
        return FP8Act(*fp8_act(x, backend))
    from pallas_kernels import gemm_dense

    rows = gemm_dense.A_ROW_BLOCK
    if backend == "mosaic":
        from pallas_kernels import quantize as K

        q, scale_op = K.fp8_gemm_operand(x, rows_multiple=rows)
        return FP8Act(q, None, scale_op)
    q, scale = fp8_act(x, backend)
    mp = -(-x.shape[0] // rows) * rows
    return FP8Act(q, scale, gemm_dense.a_scale_operand(scale, None, x.shape[0], scale.shape[1], mp, "ops.operands.fp8_act_gemm"))


def fp8_act_transposed(x, backend: str | None = None):
    """x [M, K] -> 1x128 FP8 groups of pad_rows(x, 128).T along M: (q [K, Mp], scale [K, Mp/128]) (wgrad operands).

    Exactly `quantize_fp8_per_token_group(pad_rows(x, 128).T, 128)`; on the Mosaic backend one Pallas kernel
    that never writes the transpose to HBM (pallas_kernels/quantize_transposed.py, bitwise equal).
    """
    if _use_kernel(x, backend):
        from pallas_kernels import quantize_transposed as KT

        if KT.supports(x):
            return KT.fp8_transposed_per_token_group(x, F.FP8_ACT_GROUP)
    pad = (-x.shape[0]) % F.FP8_ACT_GROUP
    xp = jnp.pad(x, [(0, pad), (0, 0)]) if pad else x
    return fp8_act(xp.T, backend)


def fp8_weight(w, backend: str | None = None, *, pow2_scale: bool = False):
    """(q, 128x128 scale_inv) of a master weight, a PreparedWeight or an fp8-block QuantizedWeight.
    pow2_scale: scales rounded up to powers of two (a rollout-only option of the export; the trainer's GEMMs never
    ask for it, and a recipe whose trainer runs fp8-block refuses it)."""
    if isinstance(w, PreparedWeight):
        return w.q, w.scale
    if isinstance(w, QuantizedWeight):
        if w.fmt == F.FP8_BLOCK:
            return w.data, w.scale
        w = dequantize_weight(w, F32)
    if _use_kernel(w, backend):
        from pallas_kernels import quantize as K

        return K.fp8_per_block(w, F.FP8_BLOCK_WEIGHT, pow2_scale=pow2_scale)
    return quantize_fp8_per_block(w, F.FP8_BLOCK_WEIGHT, pow2_scale=pow2_scale)


def weight_scale_operand(w, *, transposed: bool = False):
    """A PreparedWeight's scales in the GEMM kernel's layout (`scale_op`; `scale_t_op` for the dgrad), else None (the
    kernel wrapper lays them out itself)."""
    if not isinstance(w, PreparedWeight):
        return None
    return w.scale_t_op if transposed else w.scale_op


def fp8_dgrad_weight(w, wq, sb):
    """dgrad's B operand (dx = g . W): W^T's e4m3 data and scales, the forward's 128x128 blocks transposed. A
    PreparedWeight made for the fp8 backward carries them, so the transpose is not copied again in every backward."""
    if isinstance(w, PreparedWeight) and w.q_t is not None:
        return w.q_t, w.scale_t
    return jnp.swapaxes(wq, -1, -2), jnp.swapaxes(sb, -1, -2)


def emulated_operands(x, w, fmt: str):
    """MXFP8 / NVFP4 on hardware without them: the exact dequantized values, as BF16 GEMM operands."""
    xd = quantize_dequantize_activation(x, fmt, dtype=F32)
    wd = w.dequantize(F32) if isinstance(w, QuantizedWeight) else dequantize_weight(quantize_weight(w, fmt), F32)
    return xd.astype(BF16), wd.astype(BF16)


def weight_values(w):
    """The weight as float32 values: the master itself, or a QuantizedWeight's dequantized values."""
    if isinstance(w, PreparedWeight):
        if w.value is None:  # operands only: their values are the dequantized blocks
            return dequantize_weight(QuantizedWeight(w.q, w.scale, None, F.FP8_BLOCK, int(w.q.shape[-1])), F32)
        return w.value
    return w.dequantize(F32) if isinstance(w, QuantizedWeight) else jnp.asarray(w)


def zero_cotangent(w):
    """Zero cotangent of a weight input (float0 for integer leaves, e.g. packed NVFP4 data)."""

    def z(a):
        a = jnp.asarray(a)
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)

    return jax.tree.map(z, w)


def wgrad_dtype(w):
    """The dtype a weight-gradient kernel stores w's gradient in: BF16 where `master_cotangent` rounds it to BF16
    anyway (the trainer's compute weights; the kernel rounds as it stores, the same values without a float32 copy in
    memory), else float32 (a QuantizedWeight's cotangent is zeros: nothing to round)."""
    if isinstance(w, PreparedWeight):
        dtype = F32 if w.value is None else w.value.dtype
    elif isinstance(w, QuantizedWeight):
        dtype = F32
    else:
        dtype = jnp.asarray(w).dtype
    return jnp.bfloat16 if dtype == jnp.bfloat16 else F32


def master_cotangent(w, dw):
    """dW for the master weight (straight-through the quantizer); QuantizedWeight inputs get zeros, a
    PreparedWeight dW for its value and zeros for its operands."""
    if isinstance(w, PreparedWeight):
        return dataclasses.replace(zero_cotangent(w), value=dw.astype(w.value.dtype))  # every operand field zero
    if isinstance(w, QuantizedWeight):
        return zero_cotangent(w)
    return dw.astype(jnp.asarray(w).dtype)


def backward_operands(backward: str, fmt: str, x, w, kept):
    """The (activation, weight) values the BF16 backward GEMMs use: the dequantized forward operands in
    "dequantized" mode (when the forward quantized them), else the original operands ("high_precision")."""
    if backward == "dequantized" and kept is not None:
        if fmt == F.FP8_BLOCK:
            from jaxrl_fp8.precision.fp8 import dequantize_fp8_per_block, dequantize_fp8_per_token_group

            xa, wq, sb = kept  # the forward's FP8Act and weight operands
            return (dequantize_fp8_per_token_group(xa.q, xa.scales(), F.FP8_ACT_GROUP),
                    dequantize_fp8_per_block(wq, sb, F.FP8_BLOCK_WEIGHT))
        return kept
    return x, weight_values(w)
