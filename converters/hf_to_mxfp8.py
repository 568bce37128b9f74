"""python -m converters.hf_to_mxfp8: HF BF16 checkpoint -> MXFP8 (E4M3 values, UE8M0 scale per 32) for SGLang.

`weight` float8_e4m3fn [N, K] and `weight_scale_inv` uint8 exponent bytes [N, K/32] per quantized projection,
computed by the precision contract (bit-identical to the trainer's MXFP8 weights).
"""

from __future__ import annotations

import argparse

from jaxrl_fp8.precision import MXFP8

from converters.convert import add_io_flags, cli_main, convert_hf
from converters.policy_flags import add_policy_flags, policy_from_args
from converters.spec import QuantSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m converters.hf_to_mxfp8",
        description=(
            "Convert an HF Qwen3/Qwen3-MoE BF16 checkpoint to MXFP8 that SGLang loads (quant_method mxfp8, "
            "weight_block_size [1, 32], scale_fmt ue8m0). Quantized: q/k/v/o, dense and expert gate/up/down "
            "projections (in-features must be multiples of 32); never: embeddings, lm_head, norms, the MoE router."
        ),
    )
    add_io_flags(p)
    add_policy_flags(p)
    return p


def run(args: argparse.Namespace):
    return convert_hf(
        args.model_dir, args.save_dir, QuantSpec(MXFP8), lambda cfg: policy_from_args(args, MXFP8, cfg),
        overwrite=args.overwrite, progress=not args.no_progress,
    )


def main(argv=None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
