"""Writing one safetensors shard, scalars included.

Why not `jaxrl_fp8.model.hf_io.write_safetensors`: it passes every array through `np.ascontiguousarray`,
which turns 0-d arrays into shape [1], and NVFP4's `weight_scale_2` / `input_scale` must be 0-d scalars
as ModelOpt writes them. Everything else (dtype codes, reading) is reused from hf_io. Once hf_io keeps
0-d shapes this module can be replaced by it (same signature and return value).
"""

from __future__ import annotations

import json
import struct
from typing import Mapping

import numpy as np

from jaxrl_fp8.model.hf_io import dtype_code

__all__ = ["write_safetensors"]


def write_safetensors(file: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file, keeping each array's exact shape; returns the bytes of tensor data."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, arrays = 0, []
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        header[name] = {"dtype": dtype_code(a.dtype), "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    return offset
