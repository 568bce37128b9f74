"""Runs one quantization kernel call twice (compile, then the call to profile), for Nsight Compute.

    ncu --kernel-name regex:quantize_nvfp4 --launch-skip 1 --launch-count 1 --section WarpStateStats ... \\
        python3 experiments/benchmarks/profile_one.py --impl v6 --ctas-per-sm 3

The input is the NVFP4 benchmark's 256 MiB case (experiments/benchmarks/quantize.py: normals with one power of two
per row, a given global amax of 4.0), so a profile reads against the same-run timings of quantize.py.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxrl_fp8  # noqa: F401  (sets the precision contract's XLA flags before JAX starts)
from pallas_kernels import quantize as Q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="v3", help="nvfp4 kernel version (pallas_kernels.quantize_nvfp4.IMPLS)")
    ap.add_argument("--rows", type=int, default=None, help="rows per tile (default: the kernel's)")
    ap.add_argument("--stages", type=int, default=2, help="TMA buffers per CTA")
    ap.add_argument("--ctas-per-sm", type=int, default=2, help="CTAs per SM of the persistent grid")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="input dtype")
    args = ap.parse_args()
    shape = (32768, 4096) if args.dtype == "bfloat16" else (8192, 8192)
    key = jax.random.key(0)
    x = jax.random.normal(key, shape, jnp.float32)
    x = (x * jnp.exp2(jax.random.randint(key, shape[:1] + (1,), -8, 8)).astype(jnp.float32)).astype(args.dtype)
    cfg = Q.TileConfig(rows=args.rows, stages=args.stages, ctas_per_sm=args.ctas_per_sm)
    fn = jax.jit(lambda a: Q.nvfp4(a, global_amax=4.0, config=cfg, impl=args.impl))
    for _ in range(2):
        jax.block_until_ready(fn(x))
    print(f"ran nvfp4 {args.impl} {cfg} on {shape} {args.dtype}")


if __name__ == "__main__":
    main()
