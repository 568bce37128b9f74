"""Quantized tensors shard with their scales: no mesh split may cut a 128x128 block or a 1xG group.

Which granularity a split must respect, per format (weights are [N, K] or [E, N, K], HF layout):

| format    | rows (N) per device | columns (K) per device                                    |
|-----------|---------------------|-----------------------------------------------------------|
| fp8-block | multiple of 128     | multiple of 128 (the weight block and the 1x128 act group) |
| mxfp8     | any                 | multiple of 32                                             |
| nvfp4     | any                 | multiple of 16                                             |

K is also the activations' quantization axis, and a K-split weight (o_proj, down_proj under tensor
parallelism) meets K-split activations, so the weight's K check covers the activation groups. The expert
dimension may be split freely. Checked layout: the compute layout for FP32 masters (they are quantized at use,
after the FSDP gather) and the storage layout for tensors stored quantized (`QuantizedWeight`: data and scales
must split at the same block boundaries). A failure names the tensor, the dimension and the mesh axis.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from jaxrl_fp8.precision import QuantizedWeight
from jaxrl_fp8.precision import formats as F

__all__ = ["BlockSplitError", "GRANULARITY", "check_split", "validate_quantized_layout"]


class BlockSplitError(ValueError):
    """A mesh split that would cut a quantization block or group; the message names tensor and axis."""


# format -> (rows per block along N, columns per block/group along K, what to call them)
GRANULARITY = {
    F.FP8_BLOCK: (F.FP8_BLOCK_WEIGHT[0], F.FP8_BLOCK_WEIGHT[1], "FP8 block"),
    F.MXFP8: (1, F.MXFP8_BLOCK, "MXFP8 group"),
    F.NVFP4: (1, F.NVFP4_BLOCK, "NVFP4 group"),
}


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_split(name: str, shape: tuple[int, ...], spec: P, mesh_sizes, fmt: str, *, packed_k: bool = False) -> None:
    """Raise BlockSplitError when `spec` cuts a block of the last two dims (N, K) of weight `name` in `fmt`."""
    if fmt not in GRANULARITY or len(shape) < 2:
        return
    rows, cols, what = GRANULARITY[fmt]
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    for dim, label, unit, need in ((len(shape) - 2, "N", "rows", rows), (len(shape) - 1, "K", "columns", cols)):
        axes = _axes(entries[dim])
        if not axes or need == 1:
            continue
        parts = math.prod(mesh_sizes[a] for a in axes)
        size = shape[dim] * (2 if packed_k and label == "K" else 1)  # NVFP4 data packs two values per byte
        per = size // parts
        over = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
        if size % parts or per % need:
            shape_of = f"{per} {unit} per device" if size % parts == 0 else f"{size / parts:g} {unit} per device"
            tail = " (and the 1x128 activation group)" if fmt == F.FP8_BLOCK and label == "K" else ""
            raise BlockSplitError(f"{name} dim {label}={size} over {over} gives {shape_of}, not a multiple of the "
                                  f"{need}-{unit[:-1]} {what}{tail}; split {'/'.join(axes)} less (for MoE "
                                  f"weights: expert parallelism)")


def validate_quantized_layout(named_values, policy, compute_spec_of, storage_spec_of, mesh_sizes) -> list[str]:
    """Check every quantized tensor of `named_values` [(trainer name, value)] against its layouts.

    policy: PrecisionPolicy (or None: nothing is quantized at use). compute_spec_of / storage_spec_of:
    name -> PartitionSpec. Returns the names checked; raises one BlockSplitError listing every cut block.
    """
    checked, errors = [], []

    def check(*args, **kw):
        try:
            check_split(*args, **kw)
        except BlockSplitError as e:
            errors.append(str(e))

    for name, value in named_values:
        if isinstance(value, QuantizedWeight):
            shape, packed = tuple(value.data.shape), value.fmt == F.NVFP4
            check(name, shape, storage_spec_of(name), mesh_sizes, value.fmt, packed_k=packed)
            check(name, shape, compute_spec_of(name), mesh_sizes, value.fmt, packed_k=packed)
            checked.append(name)
            continue
        if policy is None or not name.endswith(".weight"):
            continue
        try:
            fmt = policy.format_for_trainer(name)
        except KeyError:
            continue
        if fmt in GRANULARITY:
            check(name, tuple(value.shape), compute_spec_of(name), mesh_sizes, fmt)
            checked.append(name)
    if errors:
        head = f"{len(errors)} quantized tensor(s) would be split inside a quantization block:\n  "
        raise BlockSplitError(head + "\n  ".join(errors))
    return checked
