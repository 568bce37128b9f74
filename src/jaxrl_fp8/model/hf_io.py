"""Hugging Face checkpoint files: safetensors shards, the shard index and config.json. No model knowledge.

Why our own safetensors reader/writer: the `safetensors` package (0.8) cannot hand FP8 tensors to numpy or
JAX, and block-FP8 checkpoints are half of what we load. The format is small (8-byte little-endian header
length, a JSON header of {name: {dtype, shape, data_offsets}} plus optional "__metadata__", then the raw
little-endian bytes), so reading one tensor at a time from disk keeps memory to one tensor and lets the
converters stream checkpoints larger than RAM.

Public functions (the converters reuse them):
- `read_config(path)` / `write_json_atomic(file, obj)`
- `list_shards(path)`: shard files of a checkpoint directory (index or single file), validated
- `SafetensorsFile(file)`: header access (`names`, `info`, `metadata`) and `read(name)` of one tensor
- `iter_shards(path)`: SafetensorsFile per shard, one at a time
- `iter_tensors(path)`: (name, numpy array) over the whole checkpoint, one tensor in memory at a time
- `write_safetensors(file, tensors, metadata)`: one shard file from {name: array}
- `save_sharded(path, tensors, *, config, max_shard_size, extra_files)`: shards + `model.safetensors.index.json`
  (metadata.total_size = bytes of tensor data) + config.json, written to a temp dir and renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import uuid
from typing import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

__all__ = [
    "CheckpointError",
    "DTYPE_CODES",
    "SafetensorsFile",
    "read_config",
    "list_shards",
    "iter_shards",
    "iter_tensors",
    "write_safetensors",
    "save_sharded",
    "write_json_atomic",
    "parse_size",
    "INDEX_NAME",
    "SINGLE_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed or holds a tensor we cannot use. The message names it."""


DTYPE_CODES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise CheckpointError(f"dtype {dt} has no safetensors code")
    return _CODE_OF[dt]


# ------------------------------------------------------------------------------------------------ reading


class SafetensorsFile:
    """Header of one .safetensors file; tensors are read from disk on demand."""

    def __init__(self, file: str):
        self.file = file
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8 or n > 100 * 2**20:
                    raise CheckpointError(f"{file}: header length {n} is impossible for a file of {size} bytes")
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint shard {file}: {e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: safetensors header is not valid JSON: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{file}: safetensors header is not a JSON object")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                code, shape, (begin, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{file}: malformed header entry for tensor {name!r}: {e!r}") from err
            if code not in DTYPE_CODES:
                raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {code!r}")
            nbytes = math.prod(shape) * DTYPE_CODES[code].itemsize
            if end - begin != nbytes or begin < 0 or self._data_start + end > size:
                raise CheckpointError(
                    f"{file}: tensor {name!r} ({code} {list(shape)}) has data_offsets [{begin}, {end}] that do not "
                    f"match its size {nbytes} bytes or the file size {size}"
                )
            self._entries[name] = (code, shape, begin, end)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) without reading the data."""
        code, shape, _, _ = self._entries[name]
        return code, shape

    def read(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise CheckpointError(f"{self.file}: no tensor named {name!r}")
        code, shape, begin, end = self._entries[name]
        with open(self.file, "rb") as f:
            f.seek(self._data_start + begin)
            buf = f.read(end - begin)
        return np.frombuffer(buf, dtype=DTYPE_CODES[code].newbyteorder("<")).reshape(shape).astype(DTYPE_CODES[code], copy=False)


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: a checkpoint directory needs an HF config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e


def list_shards(path: str) -> list[str]:
    """Shard files of a checkpoint directory, in index order; every file named by the index must exist."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = list(dict.fromkeys(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{index} names shard {name!r}, which is missing from {path}")
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}")


def iter_shards(path: str) -> Iterator[SafetensorsFile]:
    for file in list_shards(path):
        yield SafetensorsFile(file)


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of a checkpoint; one tensor is held in memory at a time."""
    for shard in iter_shards(path):
        for name in shard.names():
            yield name, shard.read(name)


# ------------------------------------------------------------------------------------------------ writing


def write_safetensors(file: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file, keeping each array's exact shape (0-d scalars too, as NVFP4's
    `weight_scale_2` needs); returns the bytes of tensor data written."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.asarray(a)  # not np.ascontiguousarray: it turns 0-d arrays into shape [1]
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


def parse_size(size) -> int:
    """'5GB' / '500MB' / '50KB' / int bytes -> bytes (decimal units, as transformers uses)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or an integer number of bytes")
    unit = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[m.group(2)]
    return int(float(m.group(1)) * unit)


def write_json_atomic(file: str, obj) -> None:
    tmp = f"{file}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, file)


TensorSource = Callable[[], np.ndarray]


def save_sharded(
    path: str,
    tensors: Mapping[str, tuple[tuple[int, ...], np.dtype, TensorSource]],
    *,
    config: dict | None = None,
    max_shard_size="5GB",
    extra_files: Mapping[str, dict] | None = None,
) -> list[str]:
    """Write an HF checkpoint directory: shards, `model.safetensors.index.json` (always), config.json.

    `tensors` maps HF name -> (shape, dtype, producer); producers are called one shard at a time, so the
    caller never materializes the whole checkpoint. Shards are planned in insertion order, each at most
    `max_shard_size` bytes (a single bigger tensor gets a shard of its own). Everything is written into a
    temporary sibling directory which then replaces `path`, so a failed save never leaves a half checkpoint.
    """
    limit = parse_size(max_shard_size)
    plan: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype, _) in tensors.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if plan[-1] and used + nbytes > limit:
            plan.append([])
            used = 0
        plan[-1].append(name)
        used += nbytes
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(path))}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        n = len(plan)
        files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, total = {}, 0
        for file, names in zip(files, plan):
            shard = {}
            for name in names:
                shape, dtype, produce = tensors[name]
                a = np.asarray(produce())
                if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                    raise CheckpointError(f"tensor {name!r}: producer gave {a.dtype} {a.shape}, planned {np.dtype(dtype)} {tuple(shape)}")
                shard[name] = a
                weight_map[name] = file
            total += write_safetensors(os.path.join(tmp, file), shard, {"format": "pt"})
            del shard
        write_json_atomic(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
        if config is not None:
            write_json_atomic(os.path.join(tmp, CONFIG_NAME), config)
        for fname, obj in (extra_files or {}).items():
            write_json_atomic(os.path.join(tmp, fname), obj)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(path, f) for f in files]


def _replace_dir(src: str, dst: str) -> None:
    """Move the finished directory `src` to `dst`; an existing `dst` is moved aside first, then removed."""
    if os.path.exists(dst):
        aside = f"{dst}.old-{uuid.uuid4().hex}"
        os.rename(dst, aside)
        os.rename(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(src, dst)
