"""Streaming checkpoint conversion: one input shard at a time, written to a temp dir, renamed into place.

Why this shape: a 30B-parameter checkpoint does not fit in host memory twice, and a crash must never
leave a half-written directory that a rollout server could load. So every input shard becomes one output
shard of the same name (peak memory ~ one shard plus one tensor in flight), every header is validated
before any work starts (a truncated shard fails in seconds, naming the file), and the result is assembled
in a hidden sibling directory that is renamed to `--save-dir` only when complete.

Reuses `jaxrl_fp8.model.hf_io` for the safetensors format (reader, writer, JSON writer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import tracemalloc
import uuid
from typing import Callable

import numpy as np

from jaxrl_fp8.model.hf_io import (
    INDEX_NAME,
    CheckpointError,
    SafetensorsFile,
    list_shards,
    read_config,
    write_json_atomic,
)

from jaxrl_fp8.model.hf_io import write_safetensors

from converters.quantize import ConversionError

__all__ = ["SourceCheckpoint", "MemoryMeter", "ConversionSummary", "run_conversion", "prepare_save_dir", "HF_QUANT_CONFIG"]

HF_QUANT_CONFIG = "hf_quant_config.json"
_REWRITTEN = {"config.json", INDEX_NAME, HF_QUANT_CONFIG}

Handler = Callable[[str, "SourceCheckpoint"], list[tuple[str, np.ndarray]]]


@dataclasses.dataclass
class SourceCheckpoint:
    """An HF checkpoint directory whose shard headers have all been read and checked (data stays on disk)."""

    path: str
    config: dict
    shards: list[SafetensorsFile]
    where: dict[str, SafetensorsFile]

    @classmethod
    def open(cls, path: str) -> "SourceCheckpoint":
        config = read_config(path)
        shards = [SafetensorsFile(f) for f in list_shards(path)]  # raises CheckpointError naming a bad file
        where: dict[str, SafetensorsFile] = {}
        for shard in shards:
            for name in shard.names():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name].file} and {shard.file}")
                where[name] = shard
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name, file in weight_map.items():
                if name not in where or os.path.basename(where[name].file) != file:
                    raise CheckpointError(f"{index} maps tensor {name!r} to {file}, but that shard does not hold it")
        return cls(path, config, shards, where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return [n for s in self.shards for n in s.names()]

    def file_of(self, name: str) -> str:
        return self.where[name].file

    def read(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        shard = self.where[name]
        try:
            return shard.read(name)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {shard.file}: {e}") from e
        except ValueError as e:
            raise CheckpointError(f"{shard.file}: tensor {name!r} is unreadable (truncated or corrupt file?): {e}") from e

    def shard_nbytes(self) -> list[int]:
        return [os.path.getsize(s.file) for s in self.shards]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryMeter:
    """Peak host memory of a block: tracemalloc (Python/numpy allocations) and sampled process RSS."""

    def __init__(self):
        self.traced_peak = 0
        self.rss_baseline = 0
        self.rss_peak = 0
        self._owns_trace = False

    def __enter__(self):
        self._owns_trace = not tracemalloc.is_tracing()
        if self._owns_trace:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.rss_baseline = self.rss_peak = _rss_bytes()
        return self

    def sample(self) -> None:
        self.rss_peak = max(self.rss_peak, _rss_bytes())

    def __exit__(self, *exc):
        self.sample()
        self.traced_peak = tracemalloc.get_traced_memory()[1]
        if self._owns_trace:
            tracemalloc.stop()
        return False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass
class ConversionSummary:
    save_dir: str
    shards: int
    tensors_in: int
    tensors_out: int
    quantized: int
    bytes_in: int
    bytes_out: int
    largest_input_shard: int
    traced_peak: int
    rss_baseline: int
    rss_peak: int
    seconds: float
    copied_files: list[str]
    skipped_dirs: list[str]

    def format(self) -> str:
        lines = [
            f"wrote {self.save_dir}",
            f"  {self.shards} shard(s); {self.tensors_in} tensors in -> {self.tensors_out} out ({self.quantized} quantized)",
            f"  input shard files {_mib(self.bytes_in)} -> output tensor data {_mib(self.bytes_out)}",
            f"  peak host memory: {_mib(self.traced_peak)} traced (numpy/Python, tracemalloc); process RSS "
            f"{_mib(self.rss_baseline)} before -> {_mib(self.rss_peak)} peak (+{_mib(self.rss_peak - self.rss_baseline)}); "
            f"largest input shard {_mib(self.largest_input_shard)}",
            f"  copied: {', '.join(self.copied_files) or '-'}" + (f"; skipped directories: {', '.join(self.skipped_dirs)}" if self.skipped_dirs else ""),
            f"  {self.seconds:.1f} s",
        ]
        return "\n".join(lines)


def prepare_save_dir(save_dir: str, model_dir: str, overwrite: bool) -> None:
    """Refuse an existing output (unless overwrite) and an output that is, or is inside, the input."""
    out, src = os.path.realpath(save_dir), os.path.realpath(model_dir)
    if out == src or out.startswith(src + os.sep):
        raise ConversionError(f"--save-dir {save_dir!r} is (inside) the input directory {model_dir!r}; choose another path")
    if os.path.lexists(save_dir) and not overwrite:
        raise ConversionError(f"--save-dir {save_dir!r} already exists; pass --overwrite to replace it")
    if os.path.lexists(save_dir) and not os.path.isdir(save_dir):
        raise ConversionError(f"--save-dir {save_dir!r} exists and is not a directory")


def _replace_dir(tmp: str, dst: str) -> None:
    if os.path.lexists(dst):
        aside = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(os.path.abspath(dst))}.old-{uuid.uuid4().hex}")
        os.rename(dst, aside)
        os.rename(tmp, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, dst)


def run_conversion(
    src: SourceCheckpoint,
    save_dir: str,
    handler: Handler,
    *,
    config: dict,
    extra_json: dict[str, dict] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    desc: str = "converting",
    is_quantized: Callable[[str], bool] = lambda name: False,
) -> ConversionSummary:
    """Stream `src` through `handler` (input name -> output tensors) into `save_dir`.

    Non-weight files (tokenizer, generation config, ...) are copied; config.json is replaced by `config`;
    `extra_json` files are written (e.g. hf_quant_config.json). Any failure removes the temp directory and
    leaves `save_dir` untouched.
    """
    from tqdm import tqdm

    prepare_save_dir(save_dir, src.path, overwrite)
    t0 = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(save_dir))}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    tensors_in = quantized = bytes_in = bytes_out = 0
    try:
        with MemoryMeter() as mem:
            bar = tqdm(total=sum(len(s.names()) for s in src.shards), desc=desc, unit="tensor", disable=not progress, leave=False)
            for shard in src.shards:
                fname = os.path.basename(shard.file)
                bar.set_postfix_str(fname)
                out: dict[str, np.ndarray] = {}
                for name in shard.names():
                    outputs = handler(name, src)
                    tensors_in += 1
                    quantized += int(is_quantized(name))
                    for out_name, arr in outputs:
                        if out_name in out or out_name in weight_map:
                            raise ConversionError(f"two inputs produce the output tensor {out_name!r} (second from {shard.file})")
                        out[out_name] = arr
                        weight_map[out_name] = fname
                    mem.sample()
                    bar.update(1)
                bytes_in += os.path.getsize(shard.file)
                bytes_out += write_safetensors(os.path.join(tmp, fname), out, {"format": "pt"})
                mem.sample()
                del out
            bar.close()
        write_json_atomic(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))})
        write_json_atomic(os.path.join(tmp, "config.json"), config)
        for fname, obj in (extra_json or {}).items():
            write_json_atomic(os.path.join(tmp, fname), obj)
        copied, skipped = _copy_side_files(src.path, tmp)
        _replace_dir(tmp, save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionSummary(
        save_dir=save_dir,
        shards=len(src.shards),
        tensors_in=tensors_in,
        tensors_out=len(weight_map),
        quantized=quantized,
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        largest_input_shard=max(src.shard_nbytes()),
        traced_peak=mem.traced_peak,
        rss_baseline=mem.rss_baseline,
        rss_peak=mem.rss_peak,
        seconds=time.perf_counter() - t0,
        copied_files=copied,
        skipped_dirs=skipped,
    )


def _copy_side_files(src_dir: str, dst_dir: str) -> tuple[list[str], list[str]]:
    """Copy tokenizer / generation / other non-weight files; weights, index and rewritten configs are not copied."""
    copied, skipped = [], []
    for entry in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, entry)
        if os.path.isdir(path):
            skipped.append(entry)
            continue
        if entry.endswith(".safetensors") or entry in _REWRITTEN:
            continue
        shutil.copy2(path, os.path.join(dst_dir, entry))
        copied.append(entry)
    return copied, skipped
