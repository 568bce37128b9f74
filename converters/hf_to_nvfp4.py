"""python -m converters.hf_to_nvfp4: HF BF16 checkpoint -> NVFP4 in NVIDIA ModelOpt's layout for SGLang.

Per quantized projection: `weight` uint8 [N, K/2] (two E2M1 codes, element 2i in the low nibble),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` float32 scalar (the global scale, amax / (6 * 448)),
`input_scale` float32 scalar = 1.0 (no activation calibration; the value the reference converter writes).
The gate and up projections of one expert share one global scale. MoE experts only by default.
"""

from __future__ import annotations

import argparse

from jaxrl_fp8.precision import NVFP4

from converters.convert import add_io_flags, cli_main, convert_hf
from converters.policy_flags import add_policy_flags, policy_from_args
from converters.spec import QuantSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m converters.hf_to_nvfp4",
        description=(
            "Convert an HF Qwen3-MoE BF16 checkpoint to NVFP4 (ModelOpt layout + hf_quant_config.json, "
            "quant_method modelopt / quant_algo NVFP4 / group_size 16). By default only the MoE expert projections "
            "are quantized (attention and dense MLP stay BF16, as in the reference converter); in-features must be "
            "multiples of 16. Never quantized: embeddings, lm_head, norms, the MoE router."
        ),
    )
    add_io_flags(p)
    p.add_argument("--four-over-six", action="store_true", help="per 16-value block map the max to 4 or 6, whichever errs less (recipe four_over_six)")
    p.add_argument("--quantize-dense", action="store_true", help="also quantize attention and dense-MLP projections (default: experts only)")
    add_policy_flags(p)
    return p


def run(args: argparse.Namespace):
    return convert_hf(
        args.model_dir, args.save_dir, QuantSpec(NVFP4, four_over_six=args.four_over_six),
        lambda cfg: policy_from_args(args, NVFP4, cfg), overwrite=args.overwrite, progress=not args.no_progress,
    )


def main(argv=None) -> int:
    return cli_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
