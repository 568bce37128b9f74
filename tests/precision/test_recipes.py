import itertools

import pytest

from jaxrl_fp8.precision import FORMATS, RECIPES, Recipe, get_recipe
from jaxrl_fp8.precision.recipes import COMPATIBLE_TRAIN_FORMATS

SEED_MATRIX = {  # Miles' rollout x train compatibility table, written out cell by cell
    ("bf16", "bf16"): True, ("bf16", "fp8-block"): False, ("bf16", "mxfp8"): False, ("bf16", "nvfp4"): False,
    ("fp8-block", "bf16"): True, ("fp8-block", "fp8-block"): True, ("fp8-block", "mxfp8"): False, ("fp8-block", "nvfp4"): False,
    ("mxfp8", "bf16"): True, ("mxfp8", "fp8-block"): False, ("mxfp8", "mxfp8"): True, ("mxfp8", "nvfp4"): False,
    ("nvfp4", "bf16"): False, ("nvfp4", "fp8-block"): False, ("nvfp4", "mxfp8"): False, ("nvfp4", "nvfp4"): True,
}


@pytest.mark.parametrize("rollout,train", list(itertools.product(FORMATS, FORMATS)))
def test_compatibility_matrix(rollout, train):
    if SEED_MATRIX[(rollout, train)]:
        Recipe("r", rollout, train)
    else:
        with pytest.raises(ValueError, match=f"With {rollout} rollout use training format"):
            Recipe("r", rollout, train)


def test_backward_modes_and_master_dtype():
    with pytest.raises(ValueError, match="backward='fp8' is not available with train_format=bf16"):
        Recipe("r", "bf16", "bf16", "fp8")
    with pytest.raises(ValueError, match="backward='fp8' is not available with train_format=nvfp4"):
        Recipe("r", "nvfp4", "nvfp4", "fp8")
    with pytest.raises(ValueError, match="master_dtype"):
        Recipe("r", master_dtype="bfloat16")
    with pytest.raises(ValueError, match="not a format"):
        Recipe("r", "fp4", "bf16")


def test_pow2_scales_only_where_the_trainer_runs_bf16():
    """The trainer's fp8-block GEMMs quantize with exact scales; power-of-two rollout scales would be a mismatch."""
    assert get_recipe("bf16_train_fp8_rollout", pow2_scale=True).pow2_scale
    with pytest.raises(ValueError, match="pow2_scale with train_format=fp8-block"):
        get_recipe("fp8_block", pow2_scale=True)


def test_hardware_table():
    fp8 = get_recipe("fp8_block")
    assert fp8.validate_for("hopper") is fp8 and fp8.validate_for("cpu") is fp8
    with pytest.raises(ValueError, match="no native support on ampere"):
        fp8.validate_for("ampere")
    strict = get_recipe("mxfp8", emulate=False)
    with pytest.raises(ValueError, match=r"format mxfp8 has no native support on hopper.*emulate=True"):
        strict.validate_for("hopper")
    strict.validate_for("blackwell")
    get_recipe("mxfp8").validate_for("hopper")  # emulated
    get_recipe("nvfp4").validate_for("cpu")
    with pytest.raises(ValueError, match="unknown hardware"):
        fp8.validate_for("tpu")


def test_presets_are_valid_and_named():
    assert set(RECIPES) >= {"bf16", "fp8_block", "bf16_train_fp8_rollout", "mxfp8", "nvfp4"}
    assert get_recipe("fp8_block").unified and not get_recipe("bf16_train_fp8_rollout").unified
    with pytest.raises(ValueError, match="known recipes"):
        get_recipe("fp16")
    for r in RECIPES.values():
        assert r.train_format in COMPATIBLE_TRAIN_FORMATS[r.rollout_format]
