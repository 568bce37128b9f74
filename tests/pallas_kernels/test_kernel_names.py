"""Every Mosaic GPU kernel carries its own name: CUDA names it `<name>_mosaic_gpu_kernel`, which is what a profile
(jax.profiler, nsys, ncu) shows and what experiments/benchmarks/step_profile.py sorts kernels by. A kernel body
given as a functools.partial would otherwise be "anonymous", and every attention kernel "kernel". Lowered for CUDA
on the CPU (no GPU needed); the name is in the serialized Mosaic module of the custom call."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import attention, gemm_dense, gemm_grouped, gemm_grouped_bf16
from pallas_kernels import interpret as interpret_mode
from pallas_kernels import gemm_grouped_wgrad as W

S = jax.ShapeDtypeStruct
F8, BF16, F32, I32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32


NAMES = ("gemm_grouped_fp8", "gemm_dense_fp8", "gemm_grouped_bf16_nk", "gemm_grouped_bf16_kn", "gemm_dense_bf16_nk",
         "gemm_dense_bf16_kn", "gemm_wgrad_fp8", "gemm_wgrad_fp8_gather", "gemm_wgrad_bf16", "attention_fwd",
         "attention_bwd_dq", "attention_bwd_dkv", "attention_paged", "attention_paged_fp8")


def _names(fn, *avals) -> set[str]:
    """The kernel names of NAMES in the lowered program (the serialized module holds "<name>_mosaic_gpu")."""
    txt = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in txt
    # the fallbacks: a functools.partial body is "anonymous", the attention family's inner body "kernel"
    assert "anonymous_mosaic_gpu" not in txt and not re.search(r"(?<![A-Za-z0-9_])kernel_mosaic_gpu", txt)
    return {name for name in NAMES if re.search(rf"{name}_mosaic_gpu(?![A-Za-z0-9_])", txt)}


def _flash_fwd_bwd(q, k, v, config=attention.FlashConfig()):
    return jax.grad(lambda q, k, v: attention.flash_attention(q, k, v, scale=0.125, config=config).astype(F32).sum(),
                    argnums=(0, 1, 2))(q, k, v)


CASES = {
    "gemm_grouped_fp8": (gemm_grouped.grouped_block_scaled_matmul,
                         (S((256, 256), F8), S((256, 2), F32), S((4, 256, 256), F8), S((4, 2, 2), F32), S((4,), I32))),
    "gemm_dense_fp8": (gemm_dense.block_scaled_matmul,
                       (S((256, 256), F8), S((256, 2), F32), S((256, 256), F8), S((2, 2), F32))),
    "gemm_grouped_bf16_nk": (gemm_grouped_bf16.grouped_matmul, (S((128, 256), BF16), S((4, 256, 256), BF16), S((4,), I32))),
    "gemm_grouped_bf16_kn": (functools.partial(gemm_grouped_bf16.grouped_matmul, layout="kn"),
                             (S((128, 256), BF16), S((4, 256, 256), BF16), S((4,), I32))),
    "gemm_dense_bf16_nk": (gemm_grouped_bf16.grouped_matmul, (S((128, 256), BF16), S((1, 256, 256), BF16), S((1,), I32))),
    "gemm_wgrad_fp8": (functools.partial(W.grouped_wgrad_fp8, num_groups=4),
                       (S((256, 512), F8), S((256, 4), F32), S((384, 512), F8), S((384, 4), F32), S((4,), I32))),
    "gemm_wgrad_fp8_gather": (functools.partial(W.grouped_wgrad_fp8_gather, num_groups=4),
                              (S((256, 512), F8), S((256, 4), F32), S((384, 512), F8), S((384, 4), F32), S((4,), I32))),
    "gemm_wgrad_bf16": (functools.partial(W.grouped_wgrad_bf16, num_groups=4),
                        (S((512, 256), F32), S((512, 384), F32), S((4,), I32))),
    "attention_paged": (functools.partial(attention.paged_attention, scale=0.125),
                        (S((2, 1, 8, 128), BF16), S((8, attention.BLOCK_KV, 2, 128), BF16),
                         S((8, attention.BLOCK_KV, 2, 128), BF16), S((2, 4), I32), S((2, 1), I32))),
    "attention_paged_fp8": (lambda q, k, v, table, pos, ks, vs: attention.paged_attention(
                                q, k, v, table, pos, scale=0.125, k_scales=ks, v_scales=vs),
                            (S((2, 1, 8, 128), BF16), S((8, attention.BLOCK_KV, 2, 128), F8),
                             S((8, attention.BLOCK_KV, 2, 128), F8), S((2, 4), I32), S((2, 1), I32),
                             S((8, 2, attention.BLOCK_KV), F32), S((8, 2, attention.BLOCK_KV), F32))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers_under_its_name(monkeypatch, name):
    monkeypatch.setattr(interpret_mode, "num_sms", lambda interpret: 132)  # no GPU here: an H200's SM count
    fn, avals = CASES[name]
    assert _names(fn, *avals) == {name}


@pytest.mark.parametrize("fp8,converters", [(False, 1), (True, 1), (True, 2)])
def test_paged_prefill_kernel_lowers(monkeypatch, fp8, converters):
    """A prefill's 128 query rows (two whole tiles), over BF16 or FP8 pages, FP8 with one or two converter
    warpgroups (registers rebalanced by setmaxnreg) (the CASES above decode 8 rows: part of one tile)."""
    monkeypatch.setattr(interpret_mode, "num_sms", lambda interpret: 132)
    pages = S((8, attention.BLOCK_KV, 2, 128), F8 if fp8 else BF16)
    scales = (S((8, 2, attention.BLOCK_KV), F32),) * 2 if fp8 else ()

    def fn(q, k, v, table, pos, *sc):
        return attention.paged_attention(q, k, v, table, pos, scale=0.125, k_scales=sc[0] if sc else None,
                                         v_scales=sc[1] if sc else None,
                                         config=attention.FlashConfig(paged_fp8_converters=converters))

    assert _names(fn, S((2, 16, 8, 128), BF16), pages, pages, S((2, 4), I32), S((2, 16), I32), *scales) == {
        "attention_paged_fp8" if fp8 else "attention_paged"}


@pytest.mark.parametrize("dq_keys", [64, 128])
def test_flash_forward_and_backward_kernels_are_named(dq_keys):
    q, kv = S((1, 256, 8, 128), BF16), S((1, 256, 2, 128), BF16)
    fn = functools.partial(_flash_fwd_bwd, config=attention.FlashConfig(bwd_dq_keys=dq_keys))
    assert _names(fn, q, kv, kv) == {"attention_fwd", "attention_bwd_dq", "attention_bwd_dkv"}
