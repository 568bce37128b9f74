"""python -m converters.verify --checkpoint DIR --reference DIR: prove a checkpoint is the contract's output.

The policy is rebuilt from the checkpoint itself (format and options from `quantization_config`, the
high-precision modules from `modules_to_not_convert` / `ignore` / `exclude_modules`, layer and expert
counts from config.json). Then every reference weight goes through the converter's own per-tensor step
and each expected tensor is compared with the stored one bit for bit (dtype, shape, bytes). Tensors that
are missing, extra, or differ are mismatches; the exit status is 1 if there is any. For every quantized
weight the stored values are dequantized and compared with the reference: relative Frobenius error and
max |error| are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from jaxrl_fp8.model.hf_io import CheckpointError
from jaxrl_fp8.precision import BF16

from converters.convert import policy_decisions, quantize_handler
from converters.fp8_to_bf16 import read_hf_quant_config
from converters.pipeline import SourceCheckpoint
from converters.quantize import ConversionError, dequantize_hf_module
from converters.reference import open_reference
from converters.spec import QuantSpec, model_dims, policy_from_excluded_modules, spec_from_checkpoint

__all__ = ["TensorCheck", "VerifyReport", "verify", "main"]


@dataclasses.dataclass
class TensorCheck:
    name: str  # HF weight name of the reference
    fmt: str
    ok: bool
    detail: str = ""
    rel_err: float = 0.0  # ||x_hat - x|| / ||x|| of the stored weight vs the reference
    max_abs_err: float = 0.0


@dataclasses.dataclass
class VerifyReport:
    spec: QuantSpec
    excluded: list[str]
    checks: list[TensorCheck]
    extra: list[str]  # stored tensors no reference weight explains

    @property
    def ok(self) -> bool:
        return not self.extra and all(c.ok for c in self.checks)

    @property
    def mismatches(self) -> list[TensorCheck]:
        return [c for c in self.checks if not c.ok]


def _same_bits(a: np.ndarray, b: np.ndarray) -> str:
    if a.dtype != b.dtype:
        return f"dtype {b.dtype} stored, {a.dtype} expected"
    if a.shape != b.shape:
        return f"shape {list(b.shape)} stored, {list(a.shape)} expected"
    if a.tobytes() != b.tobytes():
        diff = np.frombuffer(a.tobytes(), np.uint8) != np.frombuffer(b.tobytes(), np.uint8)
        return f"{int(diff.sum())} of {a.nbytes} bytes differ"
    return ""


def verify(checkpoint: str, reference) -> VerifyReport:
    """Compare checkpoint directory `checkpoint` with `reference` (a path, or an object of converters.reference)."""
    ck = SourceCheckpoint.open(checkpoint)
    spec, excluded = spec_from_checkpoint(ck.config, read_hf_quant_config(checkpoint), where=os.path.join(checkpoint, "config.json"))
    num_layers, num_experts = model_dims(ck.config, where=os.path.join(checkpoint, "config.json"))
    policy = policy_from_excluded_modules(spec.fmt, excluded, num_layers, num_experts)
    ref = open_reference(reference) if isinstance(reference, str) else reference
    decisions = policy_decisions(policy, ref.names())
    step = quantize_handler(spec, decisions)
    checks, explained = [], set()
    for name in ref.names():
        fmt = decisions[name]
        expected = step(name, ref)
        stored, problems = {}, []
        for out_name, arr in expected:
            explained.add(out_name)
            if out_name not in ck:
                problems.append(f"{out_name} missing")
                continue
            stored[out_name] = ck.read(out_name)
            why = _same_bits(arr, stored[out_name])
            if why:
                problems.append(f"{out_name}: {why}")
        check = TensorCheck(name, fmt, not problems, "; ".join(problems))
        if fmt != BF16 and len(stored) == len(expected):
            x = ref.read(name).astype(np.float32)
            x_hat = dequantize_hf_module(name, stored, spec, fmt)
            if x_hat.shape == x.shape:
                err = x_hat - x
                norm = float(np.linalg.norm(x))
                check.rel_err = float(np.linalg.norm(err)) / norm if norm > 0 else float(np.linalg.norm(err))
                check.max_abs_err = float(np.max(np.abs(err))) if err.size else 0.0
        checks.append(check)
    extra = sorted(set(ck.names()) - explained)
    return VerifyReport(spec, excluded, checks, extra)


def format_report(report: VerifyReport, *, quiet: bool = False) -> str:
    lines = []
    s = report.spec
    lines.append(
        f"format {s.fmt} (strategy {s.strategy}, block {list(s.block_size)}, pow2_scale {s.pow2_scale}, "
        f"four_over_six {s.four_over_six}); {len(report.excluded)} excluded module entries"
    )
    lines.append(f"{'status':8} {'format':9} {'rel_err':>10} {'max_abs':>10}  tensor")
    for c in report.checks:
        if quiet and c.ok:
            continue
        if c.ok and c.fmt == BF16:
            continue  # high-precision copies: shown only in the counts below
        status = "ok" if c.ok else "MISMATCH"
        line = f"{status:8} {c.fmt:9} {c.rel_err:10.3e} {c.max_abs_err:10.3e}  {c.name}"
        lines.append(line + (f"  <- {c.detail}" if c.detail else ""))
    for name in report.extra:
        lines.append(f"{'EXTRA':8} {'-':9} {'':>10} {'':>10}  {name}  <- stored, but no reference weight produces it")
    q = [c for c in report.checks if c.fmt != BF16]
    worst = max(q, key=lambda c: c.rel_err, default=None)
    lines.append(
        f"{len(report.checks)} reference weights: {len(q)} quantized, {len(report.checks) - len(q)} high precision; "
        f"{len(report.mismatches)} mismatching, {len(report.extra)} extra stored tensors"
        + (f"; worst relative error {worst.rel_err:.3e} ({worst.name})" if worst else "")
    )
    lines.append("VERIFIED: bit-identical to the precision contract" if report.ok else "FAILED: checkpoint differs from the precision contract")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m converters.verify",
        description=(
            "Re-derive every tensor of a quantized checkpoint from reference weights through the precision contract "
            "and the checkpoint's own policy (rebuilt from its config.json / hf_quant_config.json) and compare bit for "
            "bit. Prints each quantized weight's error against the reference. Exit 0: identical; 1: any mismatch, "
            "missing or extra tensor; 2: unreadable input."
        ),
    )
    p.add_argument("--checkpoint", required=True, help="quantized HF checkpoint directory to check (written by converters.hf_to_* or export)")
    p.add_argument(
        "--reference", required=True,
        help="the weights it should come from: an HF BF16 checkpoint directory, or an Orbax checkpoint of trainer "
        "parameters (layout not final; see converters/reference.py)",
    )
    p.add_argument("--quiet", action="store_true", help="print only mismatches and the summary")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the per-tensor results as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = verify(args.checkpoint, args.reference)
    except (ConversionError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report, quiet=args.quiet))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": report.ok, "extra": report.extra, "checks": [dataclasses.asdict(c) for c in report.checks]}, f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
