"""The contract is written in ops that XLA:GPU cannot rewrite into different bits (checked on CPU).

XLA:GPU's SimplifyFPConversions deletes float32 -> fp8 -> float32 convert chains inside one jit (on by default;
docs/decisions/0001, "On the GPU"). So the contract decodes fp8 with `arith.fp8_to_f32` (bit operations),
which must equal the plain cast on every code, and no lowered contract function may contain a convert from an
fp8 type to float32.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import precision as P
from jaxrl_fp8.precision.arith import bf16_to_f32, fp8_to_f32


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_to_f32_equals_cast_on_every_code(dtype):
    q = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), dtype)
    want = np.asarray(jax.jit(lambda a: a.astype(jnp.float32))(q)).view(np.uint32)
    for got in (fp8_to_f32(q), jax.jit(fp8_to_f32)(q)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want)  # NaN bits and -0.0 included


def test_bf16_to_f32_equals_cast_on_every_code():
    h = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16), jnp.bfloat16)
    want = np.asarray(jax.jit(lambda a: a.astype(jnp.float32))(h)).view(np.uint32)
    for got in (bf16_to_f32(h), jax.jit(bf16_to_f32)(h)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want)


def test_fp8_to_f32_passes_other_dtypes_through():
    x = jnp.array([1.5, -2.0], jnp.bfloat16)
    assert fp8_to_f32(x).dtype == jnp.float32 and np.asarray(fp8_to_f32(x)).tolist() == [1.5, -2.0]


_FP8_TO_F32 = re.compile(r"stablehlo\.convert[^\n]*f8E(4M3FN|5M2)>\) -> tensor<[^>]*xf32>")


@pytest.mark.parametrize(
    "name, fn",
    [
        ("nvfp4", lambda x: P.quantize_nvfp4(x)),
        ("nvfp4_four_over_six", lambda x: P.quantize_nvfp4(x, four_over_six=True)),
        ("qdq_nvfp4", lambda x: P.quantize_dequantize_activation(x, "nvfp4")),
        ("qdq_fp8", lambda x: P.quantize_dequantize_activation(x, "fp8-block")),
        ("qdq_mxfp8", lambda x: P.quantize_dequantize_activation(x, "mxfp8")),
        ("w_fp8", lambda x: P.dequantize_weight(P.quantize_weight(x, "fp8-block"))),
        ("w_nvfp4", lambda x: P.dequantize_weight(P.quantize_weight(x, "nvfp4"))),
    ],
)
def test_no_fp8_to_f32_convert_in_lowered_contract(name, fn):
    text = jax.jit(fn).lower(jnp.zeros((4, 256), jnp.float32)).as_text()
    assert not _FP8_TO_F32.search(text), f"{name}: an fp8 -> f32 convert that XLA:GPU may elide"


def test_quantize_dequantize_really_rounds():
    """A round trip must change values that are not on the grid (on GPU it did not, before fp8_to_f32)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32))
    for fmt in ("fp8-block", "mxfp8", "nvfp4"):
        y = jax.jit(lambda a, f=fmt: P.quantize_dequantize_activation(a, f))(x)
        assert int((np.asarray(y) != np.asarray(x)).sum()) > 1000, fmt
