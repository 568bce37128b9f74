"""Identical kernels at several call sites are lowered once (`traced_once`) and, lowered apart, still share one
kernel hash (`install`: Mosaic GPU compiles each hash once)."""

import re

import jax
import jax.numpy as jnp

import pallas_kernels  # noqa: F401  (installs the cache fix)
from pallas_kernels import gemm_dense, gemm_grouped_bf16, kernel_cache
from pallas_kernels import interpret as interpret_mode


def _hashes(fn, *avals):
    txt = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'kernel_hash = "(.*?)", module', txt, flags=re.S)


def test_identical_call_sites_share_one_kernel_hash(monkeypatch):
    monkeypatch.setattr(interpret_mode, "num_sms", lambda interpret: 132)  # no GPU here: lower for sm_90 anyway
    assert kernel_cache.install()
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)

    def three_layers(kernel):
        def f(x, w, gs):
            for i in range(3):
                with jax.named_scope(f"layer{i}"):
                    x = kernel(x, w, gs, out_dtype=jnp.bfloat16)
            return x

        return f

    def two_kernels(x, w, gs):
        y = gemm_grouped_bf16.grouped_matmul(x, w, gs, out_dtype=jnp.bfloat16)
        return gemm_grouped_bf16.grouped_matmul(y, w, gs, layout="kn", out_dtype=jnp.bfloat16)

    # the entry point as shipped (traced_once): three call sites, one trace, one Mosaic lowering
    assert len(_hashes(three_layers(gemm_grouped_bf16.grouped_matmul), x, w, gs)) == 1
    # the bare function: three lowerings, one hash
    same = _hashes(three_layers(gemm_grouped_bf16.grouped_matmul.__wrapped__), x, w, gs)
    assert len(same) == 3 and len(set(same)) == 1
    assert len(set(_hashes(two_kernels, x, w, gs))) == 2  # different kernels keep different hashes
