"""Projections that read the same input, stacked into one weight for the decode loop.

Why: a decode step multiplies q, k and v (and a dense MLP's gate and up) by the same normalised hidden state. Run
apart, each is its own kernel launch (XLA already shares the input's one quantization between them); k and v are
512 columns wide, too narrow to fill the GPU, so at 256 rows each took about as long as q (H100 step profile: 24 FP8
dense products, 0.29 ms of a 3.9 ms step). Stacked, the three are one product of the input and [q; k; v].

Bits: an output column of our GEMM kernels depends only on its row of the input, its row of the weight and the K
order, which no tiling or width changes (decision record 0002), so the stacked product gives each projection's
bits. That is a property of the Mosaic GPU kernels (and their interpreter); XLA:CPU's dot picks its blocking from the
whole shape, so the stacking is made only where the kernels run (`enabled_here`), and the trainer never stacks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_fp8.precision import QuantizedWeight, formats as F

__all__ = ["FusedWeight", "FusedPart", "SHARED_INPUT_GROUPS", "enabled_here", "fuse_shared_inputs", "split_outputs"]

# (module name, the projections of one input, in output order); paths end in (<module>, <projection>, "weight")
SHARED_INPUT_GROUPS = (("attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedWeight:
    """The first projection's slot holds the stack: `weight` [sum(widths), K] (an array or an fp8-block
    QuantizedWeight / PreparedWeight), `widths` the output widths of the projections in order."""

    weight: object
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Another projection's slot: its rows live in the group's FusedWeight (no data here)."""

    index: int = dataclasses.field(metadata=dict(static=True))


def enabled_here() -> bool:
    """Stack only where the projections run on the Mosaic GPU kernels (column independent: module doc)."""
    from jaxrl_fp8.ops.backends import default_device_is_hopper

    return default_device_is_hopper()


def _stack(values):
    """The stacked weight of `values` [N_i, K], or None when they cannot share one product."""
    if all(isinstance(v, QuantizedWeight) for v in values):
        if any(v.fmt != F.FP8_BLOCK or v.global_scale is not None for v in values):
            return None
        if len({(v.k, v.pow2_scale, v.data.dtype, v.data.ndim) for v in values}) != 1 or values[0].data.ndim != 2:
            return None
        if any(v.data.shape[0] % 128 for v in values):  # a 128x128 scale block must not straddle two projections
            return None
        return QuantizedWeight(jnp.concatenate([v.data for v in values]), jnp.concatenate([v.scale for v in values]),
                               None, F.FP8_BLOCK, values[0].k, values[0].pow2_scale)
    if all(isinstance(v, jax.Array) for v in values):
        if len({(v.dtype, v.ndim, v.shape[-1]) for v in values}) != 1 or values[0].ndim != 2:
            return None
        return jnp.concatenate(values)
    return None


def fuse_shared_inputs(state: nnx.State) -> nnx.State:
    """`state` with each group of `SHARED_INPUT_GROUPS` stacked: the first projection's weight a FusedWeight, the
    others FusedPart. Groups whose weights differ in kind or format (or are not 2-D) are left as they are."""
    flat = list(nnx.to_flat_state(state))
    index = {tuple(path): i for i, (path, _) in enumerate(flat)}
    items = list(flat)
    for path, _ in flat:
        path = tuple(path)
        for module, names in SHARED_INPUT_GROUPS:
            if len(path) < 3 or path[-3:] != (module, names[0], "weight"):
                continue
            paths = [path[:-2] + (name, "weight") for name in names]
            if not all(p in index for p in paths):
                continue
            values = [flat[index[p]][1].get_value() for p in paths]
            stacked = _stack(values)
            if stacked is None:
                continue
            widths = tuple(int(v.shape[0]) for v in values)
            for j, p in enumerate(paths):
                var = flat[index[p]][1]
                items[index[p]] = (p, var.replace(FusedWeight(stacked, widths) if j == 0 else FusedPart(j)))
    return nnx.from_flat_state(items)


def split_outputs(y: jax.Array, widths: tuple[int, ...]) -> list[jax.Array]:
    """The stacked product's columns back as one output per projection."""
    out, start = [], 0
    for w in widths:
        out.append(y[..., start:start + w])
        start += w
    return out
