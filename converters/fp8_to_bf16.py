"""python -m converters.fp8_to_bf16: a quantized checkpoint (FP8 block/tensor/channel, MXFP8, NVFP4) -> BF16.

Each quantized weight is dequantized with the contract (`x = float32(q) * s`, per format) and rounded to
BF16 (round-to-nearest-even). For FP8 checkpoints written from BF16 by `hf_to_fp8`, FP8 -> BF16 -> FP8 gives
back the same bits (each block's amax element is q = ±448, whose dequantized value rounds back to the
original BF16 amax, so the scale is recomputed exactly).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.precision import BF16, NVFP4

from converters.convert import add_io_flags, cli_main
from converters.pipeline import HF_QUANT_CONFIG, ConversionSummary, SourceCheckpoint, run_conversion
from converters.quantize import ConversionError, check_finite, dequantize_hf_module, output_names
from converters.spec import QuantSpec, spec_from_checkpoint

__all__ = ["convert_to_bf16", "dequantize_handler", "main"]


def read_hf_quant_config(path: str) -> dict | None:
    file = os.path.join(path, HF_QUANT_CONFIG)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{file} is not valid JSON: {e}") from e


def _scale_names(spec: QuantSpec, src: SourceCheckpoint) -> dict[str, str]:
    """scale tensor name -> its weight name, for every weight stored quantized in `src`."""
    owned = {}
    for name in src.names():
        if not name.endswith(".weight"):
            continue
        outs = output_names(name, spec, spec.fmt)[1:]
        if outs and outs[0] in src:
            for n in outs:
                owned[n] = name
    return owned


def dequantize_handler(spec: QuantSpec, src: SourceCheckpoint):
    scales = _scale_names(spec, src)

    def handle(name: str, src: SourceCheckpoint) -> list:
        if name in scales:
            return []  # written as part of its weight
        first_scale = output_names(name, spec, spec.fmt)[1] if name.endswith(".weight") and spec.fmt != BF16 else None
        if first_scale is None or first_scale not in scales:
            w = src.read(name)
            check_finite(name, w, src.file_of(name))
            return [(name, w)]
        names = [n for n in output_names(name, spec, spec.fmt) if n in src]
        tensors = {n: src.read(n) for n in names}
        if spec.fmt == NVFP4 and f"{name[:-len('.weight')]}.input_scale" not in tensors:
            tensors[f"{name[:-len('.weight')]}.input_scale"] = np.ones((), np.float32)  # unused by dequantization
        x = dequantize_hf_module(name, tensors, spec, spec.fmt)
        out = np.array(jnp.asarray(x).astype(jnp.bfloat16))
        check_finite(name, out, src.file_of(name))
        return [(name, out)]

    return handle


def convert_to_bf16(model_dir: str, save_dir: str, *, overwrite: bool = False, progress: bool = True) -> ConversionSummary:
    src = SourceCheckpoint.open(model_dir)
    spec, _ = spec_from_checkpoint(src.config, read_hf_quant_config(model_dir), where=f"{model_dir}/config.json")
    if spec.fmt == BF16:
        raise ConversionError(f"{model_dir} has no quantization_config (already high precision); nothing to convert")
    config = copy.deepcopy(src.config)
    config.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    handler = dequantize_handler(spec, src)
    scales = _scale_names(spec, src)
    quantized_weights = set(scales.values())
    return run_conversion(
        src, save_dir, handler, config=config, overwrite=overwrite, progress=progress,
        desc=f"{spec.fmt} -> bf16", is_quantized=lambda n: n in quantized_weights,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m converters.fp8_to_bf16",
        description=(
            "Dequantize a quantized HF checkpoint (quant_method fp8 block/tensor, compressed-tensors per-channel FP8, "
            "mxfp8, or modelopt NVFP4; detected from config.json / hf_quant_config.json) back to BF16. Scale tensors "
            "are dropped, quantization_config removed, other tensors and files copied unchanged."
        ),
    )
    add_io_flags(p)
    return p


def run(args: argparse.Namespace):
    return convert_to_bf16(args.model_dir, args.save_dir, overwrite=args.overwrite, progress=not args.no_progress)


def main(argv=None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
