"""Prompt datasets from JSONL and Parquet files, rows like the reference recipes' math sets:
`{"prompt": "...", "label": "..."}` or `{"prompt": [{"role": "user", "content": "..."}], "label": "..."}`.

Field names are configurable and may be dotted paths into nested objects (`reward_model.ground_truth`).
A malformed row is an error naming `file:line` (for Parquet, the 1-based row number), or, with
`skip_malformed=True`, is skipped and counted in the `ReadReport`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from jaxrl_fp8.data.records import DatasetError, Message, PromptRecord

__all__ = ["DatasetFields", "ReadReport", "read_prompt_dataset", "parse_row"]

CHAT_ROLES = ("system", "user", "assistant", "tool")
_MAX_REPORTED_ERRORS = 20


@dataclasses.dataclass(frozen=True)
class DatasetFields:
    """Names of the row fields holding the prompt and the answer (dotted paths allowed); `answer=None`: none."""

    prompt: str = "prompt"
    answer: str | None = "label"
    metadata: tuple[str, ...] = ()


@dataclasses.dataclass
class ReadReport:
    """What reading one file did: rows seen, records kept, rows skipped and the first skip reasons."""

    path: str
    num_rows: int = 0
    num_records: int = 0
    num_skipped: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def _lookup(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def _parse_prompt(value: Any, key: str) -> str | tuple[Message, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"field {key!r} is an empty string")
        return value
    if isinstance(value, list) and value:
        messages = []
        for k, msg in enumerate(value):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(
                    msg.get("content"), str):
                raise ValueError(f"field {key!r}[{k}] must be an object with string 'role' and 'content'")
            if msg["role"] not in CHAT_ROLES:
                raise ValueError(f"field {key!r}[{k}] has role {msg['role']!r}, expected one of {CHAT_ROLES}")
            messages.append({"role": msg["role"], "content": msg["content"]})
        return tuple(messages)
    raise ValueError(f"field {key!r} must be a non-empty string or a non-empty list of chat messages, "
                     f"got {type(value).__name__}")


def _parse_answer(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"field {key!r} must be a string or a number, got {type(value).__name__}")
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)


def parse_row(row: Any, fields: DatasetFields, uid: int, source: str) -> PromptRecord:
    """One decoded row → `PromptRecord`; raises ValueError saying what is wrong (without the location)."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    try:
        prompt = _parse_prompt(_lookup(row, fields.prompt), fields.prompt)
    except KeyError:
        raise ValueError(f"missing prompt field {fields.prompt!r} (row keys: {sorted(row)})") from None
    answer = ""
    if fields.answer is not None:
        try:
            answer = _parse_answer(_lookup(row, fields.answer), fields.answer)
        except KeyError:
            raise ValueError(f"missing answer field {fields.answer!r} (row keys: {sorted(row)})") from None
    metadata = {}
    for key in fields.metadata:
        try:
            metadata[key] = _lookup(row, key)
        except KeyError:
            raise ValueError(f"missing metadata field {key!r}") from None
    return PromptRecord(uid=uid, prompt=prompt, answer=answer, source=source, metadata=metadata)


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, DatasetError(f"invalid JSON: {e.msg} (column {e.colno})")


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DatasetError(f"{path}: reading Parquet needs the 'pyarrow' package ({e})") from e
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for item in batch.to_pylist():
            row += 1
            yield row, item


def read_prompt_dataset(
    path: str | os.PathLike,
    fields: DatasetFields = DatasetFields(),
    *,
    skip_malformed: bool = False,
    max_records: int | None = None,
) -> tuple[list[PromptRecord], ReadReport]:
    """All records of a `.jsonl` / `.json` (one object per line) or `.parquet` file, and a report."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such dataset file")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".jsonl.txt")):
        rows = _jsonl_rows(path)
    elif lower.endswith((".parquet", ".pq")):
        rows = _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unknown dataset format (expected .jsonl, .json or .parquet)")
    report = ReadReport(path=path)
    records: list[PromptRecord] = []
    for line, row in rows:
        report.num_rows += 1
        source = f"{path}:{line}"
        try:
            if isinstance(row, DatasetError):
                raise ValueError(str(row))
            records.append(parse_row(row, fields, uid=len(records), source=source))
        except ValueError as e:
            if not skip_malformed:
                raise DatasetError(f"{source}: {e}") from None
            report.num_skipped += 1
            if len(report.errors) < _MAX_REPORTED_ERRORS:
                report.errors.append(f"{source}: {e}")
        if max_records is not None and len(records) >= max_records:
            break
    report.num_records = len(records)
    if not records:
        raise DatasetError(f"{path}: no valid records ({report.num_rows} rows, {report.num_skipped} skipped)")
    return records, report
