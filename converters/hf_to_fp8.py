"""python -m converters.hf_to_fp8: HF BF16 checkpoint -> block-wise (or per-channel / per-tensor) FP8 for SGLang.

Every quantized projection gets `weight` (float8_e4m3fn) and its dequantization scale, computed by the
precision contract (docs/decisions/0001-precision-contract.md), bit-identical to the trainer's FP8 weights.
"""

from __future__ import annotations

import argparse

from jaxrl_fp8.precision import FP8_BLOCK

from converters.convert import add_io_flags, cli_main, convert_hf
from converters.policy_flags import add_policy_flags, policy_from_args
from converters.spec import STRATEGIES, QuantSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m converters.hf_to_fp8",
        description=(
            "Convert an HF Qwen3/Qwen3-MoE BF16 checkpoint to FP8 (E4M3) that SGLang loads. Quantized: q/k/v/o, dense "
            "gate/up/down and expert gate/up/down projections; never: embeddings, lm_head, norms, the MoE router. "
            "block: `weight_scale_inv` f32 [ceil(N/bn), ceil(K/bk)] + quant_method fp8 with weight_block_size; "
            "tensor: `weight_scale` f32 [1], quant_method fp8; channel: `weight_scale` f32 [N, 1], compressed-tensors."
        ),
    )
    add_io_flags(p)
    p.add_argument("--strategy", choices=STRATEGIES, default="block", help="scale granularity (default block; the trainer uses block 128x128)")
    p.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"), help="block shape for --strategy block (default 128 128)")
    p.add_argument(
        "--pow2-scale", action="store_true",
        help="round every scale up to a power of two (recipe pow2_scale; writes scale_fmt ue8m0 so SGLang uses "
        "power-of-two activation scales too)",
    )
    add_policy_flags(p)
    return p


def run(args: argparse.Namespace):
    spec = QuantSpec(FP8_BLOCK, args.strategy, tuple(args.block_size), pow2_scale=args.pow2_scale)
    return convert_hf(
        args.model_dir, args.save_dir, spec, lambda cfg: policy_from_args(args, FP8_BLOCK, cfg),
        overwrite=args.overwrite, progress=not args.no_progress,
    )


def main(argv=None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
