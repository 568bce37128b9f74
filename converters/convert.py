"""HF BF16 checkpoint -> quantized checkpoint (FP8 / MXFP8 / NVFP4), and the shared CLI plumbing.

`convert_hf` is the library entry the `hf_to_*` CLIs call; `quantize_handler` is the per-tensor step (policy
decision -> `quantize_hf_tensor`), the same step `converters.verify` replays.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Callable

from jaxrl_fp8.model.hf_io import CheckpointError
from jaxrl_fp8.precision import NVFP4, PrecisionPolicy

from converters.pipeline import HF_QUANT_CONFIG, ConversionSummary, SourceCheckpoint, run_conversion
from converters.quantize import ConversionError, check_finite, pair_global_amax, pair_partner, quantize_hf_tensor
from converters.spec import QuantSpec, hf_quant_config, modules_to_not_convert, quantization_config

__all__ = ["convert_hf", "quantize_handler", "policy_decisions", "add_io_flags", "cli_main"]

_FLOAT_INPUTS = ("bfloat16", "float16", "float32")


def policy_decisions(policy: PrecisionPolicy, names) -> dict[str, str]:
    """Format of every tensor name; unknown names fail with the list of what the table knows."""
    out = {}
    for name in names:
        try:
            out[name] = policy.format_for(name)
        except KeyError as e:
            raise ConversionError(f"{e.args[0]} (only Qwen3 / Qwen3-MoE checkpoints are supported)") from None
    return out


def quantize_handler(spec: QuantSpec, decisions: dict[str, str]):
    """name, source -> output tensors. NVFP4 expert gate/up read their partner once to share one global amax."""
    shared_amax: dict[frozenset, object] = {}

    def handle(name: str, src) -> list:
        w = src.read(name)
        fmt = decisions[name]
        check_finite(name, w, src.file_of(name))
        if fmt != "bf16" and w.dtype.name not in _FLOAT_INPUTS:
            raise ConversionError(f"tensor {name!r} in {src.file_of(name)} has dtype {w.dtype.name}; expected one of {', '.join(_FLOAT_INPUTS)} (is the input already quantized?)")
        global_amax = None
        partner = pair_partner(name) if fmt == NVFP4 else None
        if partner is not None:
            if partner not in src:
                raise ConversionError(f"tensor {name!r} has no partner {partner!r} in {src.path}: NVFP4 pairs gate/up on one global scale")
            if decisions[partner] != fmt:
                raise ConversionError(f"policy gives {name!r} {fmt} but its partner {partner!r} {decisions[partner]}")
            key = frozenset((name, partner))
            if key in shared_amax:
                global_amax = shared_amax.pop(key)
            else:
                other = src.read(partner)
                check_finite(partner, other, src.file_of(partner))
                global_amax = shared_amax[key] = pair_global_amax(w, other)
                del other
        return quantize_hf_tensor(name, w, spec, fmt, global_amax=global_amax)

    return handle


def convert_hf(
    model_dir: str,
    save_dir: str,
    spec: QuantSpec,
    policy_factory: Callable[[dict], PrecisionPolicy],
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionSummary:
    """Quantize the HF checkpoint in `model_dir` into `save_dir` under the policy `policy_factory(config)`."""
    src = SourceCheckpoint.open(model_dir)
    if src.config.get("quantization_config"):
        method = src.config["quantization_config"].get("quant_method")
        raise ConversionError(f"{model_dir}/config.json already has a quantization_config ({method}); convert a BF16 checkpoint (use converters.fp8_to_bf16 first)")
    policy = policy_factory(src.config)
    if policy.fmt != spec.fmt:
        raise ConversionError(f"policy format {policy.fmt} differs from the requested checkpoint format {spec.fmt}")
    names = src.names()
    decisions = policy_decisions(policy, names)
    excluded = modules_to_not_convert(policy, names, include_always_high_precision=spec.fmt == NVFP4)
    config = copy.deepcopy(src.config)
    config["quantization_config"] = quantization_config(spec, excluded)
    extra = {HF_QUANT_CONFIG: hf_quant_config(spec, excluded)} if spec.fmt == NVFP4 else {}
    return run_conversion(
        src,
        save_dir,
        quantize_handler(spec, decisions),
        config=config,
        extra_json=extra,
        overwrite=overwrite,
        progress=progress,
        desc=f"hf -> {spec.fmt}",
        is_quantized=lambda n: decisions[n] != "bf16",
    )


# ------------------------------------------------------------------------------------------------ CLI plumbing


def add_io_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", required=True, help="input HF checkpoint directory (config.json + *.safetensors [+ index])")
    parser.add_argument("--save-dir", required=True, help="output directory; written to a hidden temp dir beside it, renamed into place at the end")
    parser.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists (default: refuse)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def cli_main(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], ConversionSummary], argv=None) -> int:
    """Parse, run, print the summary; a bad input prints one clear error line and returns 1."""
    args = parser.parse_args(argv)
    try:
        summary = run(args)
    except (ConversionError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # policy / config validation (names the field)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary.format())
    return 0
