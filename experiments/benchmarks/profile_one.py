"""Runs one quantization kernel call twice (compile, then the call to profile), for Nsight Compute.

    ncu --kernel-name regex:quantize_nvfp4 --launch-skip 1 --launch-count 1 --section WarpStateStats ... \\
        python3 experiments/benchmarks/profile_one.py --impl v12 --ctas-per-sm 3 [--schedule dynamic]

The input is the NVFP4 benchmark's 256 MiB case (`quantize.random_input`: normals with one power of two per row, a
given global amax of 4.0), so a profile reads against quantize.py's timings. Options not given keep the kernel's
defaults (quantize_nvfp4.default_impl, default_tiles by dtype).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import jaxrl_fp8  # noqa: F401  (sets the precision contract's XLA flags before JAX starts)
from pallas_kernels import quantize as Q
from pallas_kernels.quantize_nvfp4 import default_tiles
from quantize import random_input  # noqa: E402  (this folder is on sys.path when the script runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default=None, help="nvfp4 kernel version (quantize_nvfp4.IMPLS; default: the kernel's)")
    ap.add_argument("--rows", type=int, default=None, help="rows per tile (default: the kernel's)")
    ap.add_argument("--stages", type=int, default=None, help="TMA buffers per CTA (default: the kernel's)")
    ap.add_argument("--ctas-per-sm", type=int, default=None, help="CTAs per SM of the persistent grid (default: the kernel's)")
    ap.add_argument("--schedule", default=None, choices=("static", "dynamic"),
                    help="tile schedule of the persistent grid (TileConfig.schedule; default: the kernel's)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="input dtype")
    args = ap.parse_args()
    shape = (32768, 4096) if args.dtype == "bfloat16" else (8192, 8192)
    x = random_input(shape, jnp.dtype(args.dtype))
    given = {k: v for k, v in (("rows", args.rows), ("stages", args.stages), ("ctas_per_sm", args.ctas_per_sm),
                               ("schedule", args.schedule)) if v}
    cfg = dataclasses.replace(default_tiles(x.dtype), **given) if given else None
    fn = jax.jit(lambda a: Q.nvfp4(a, global_amax=4.0, config=cfg, impl=args.impl))
    for _ in range(2):
        jax.block_until_ready(fn(x))
    print(f"ran nvfp4 {args.impl or 'default'} {cfg or 'default tiles'} on {shape} {args.dtype}")


if __name__ == "__main__":
    main()
