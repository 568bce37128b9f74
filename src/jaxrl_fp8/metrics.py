"""Per-step metrics to JSONL (the record plots and tests read) and TensorBoard (what people look at live)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping

import numpy as np

__all__ = ["MetricsWriter", "read_metrics"]


def _to_float(value) -> float | None:
    try:
        f = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return f


class MetricsWriter:
    """Appends one JSON object per step to `<workdir>/metrics.jsonl` and scalars to TensorBoard events."""

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.enabled = enabled
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), flush_secs=10)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the restored step so the JSONL stays one line per step."""
        if not (self.enabled and os.path.exists(self.path)):
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", -1) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: Mapping[str, object]) -> dict:
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            f = _to_float(value)
            if f is not None:
                record[key] = f if math.isfinite(f) else str(f)
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self._tb is not None:
                for key, value in record.items():
                    if key not in ("step", "time") and isinstance(value, float):
                        self._tb.add_scalar(key, value, step)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics.jsonl (a workdir or the file itself)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path!r}")
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON record ({e})") from e
    return out
