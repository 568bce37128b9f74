"""Recipes: which format the rollout uses, which the training forward uses, and how gradients flow.

Which rollout format pairs with which training format (`COMPATIBLE_TRAIN_FORMATS`: a BF16 rollout trains in BF16
only, FP8-block and MXFP8 rollouts in BF16 or their own format, NVFP4 in NVFP4 only) and which formats each
hardware runs natively (`HARDWARE_NATIVE`) are Miles' tables; both are enforced at construction / validation,
before any compute, with messages that name the supported alternatives.
"""

from __future__ import annotations

import dataclasses

from jaxrl_fp8.precision.formats import BF16, FORMATS, FP8_BLOCK, MXFP8, NVFP4
from jaxrl_fp8.precision.kv import check_kv_cache

__all__ = ["Recipe", "RECIPES", "get_recipe", "COMPATIBLE_TRAIN_FORMATS", "BACKWARD_MODES", "detect_hardware", "HARDWARE_NATIVE"]

# rollout format -> training-forward formats it may be paired with.
COMPATIBLE_TRAIN_FORMATS: dict[str, tuple[str, ...]] = {
    BF16: (BF16,),
    FP8_BLOCK: (BF16, FP8_BLOCK),
    MXFP8: (BF16, MXFP8),
    NVFP4: (NVFP4,),
}
BACKWARD_MODES = ("high_precision", "dequantized", "fp8")
# Backward modes each training format admits: FP8 gradients need an FP8 forward format.
_BACKWARD_FOR_TRAIN = {
    BF16: ("high_precision",),
    FP8_BLOCK: BACKWARD_MODES,
    MXFP8: BACKWARD_MODES,
    NVFP4: ("high_precision", "dequantized"),
}
# Formats each hardware family runs natively (MXFP8 and NVFP4 need Blackwell). On CPU every format runs on
# the XLA reference path of the contract; MXFP8/NVFP4 there and on Hopper need emulate=True.
HARDWARE_NATIVE: dict[str, tuple[str, ...]] = {
    "hopper": (BF16, FP8_BLOCK),
    "blackwell": (BF16, FP8_BLOCK, MXFP8, NVFP4),
    "ampere": (BF16,),
    "amd": (BF16,),
    "cpu": (BF16, FP8_BLOCK),
}
MASTER_DTYPES = ("float32",)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One low-precision RL recipe. Frozen: a recipe is a contract, not a knob to mutate mid-run."""

    name: str = "custom"
    rollout_format: str = BF16
    train_format: str = BF16
    backward: str = "high_precision"
    master_dtype: str = "float32"
    emulate: bool = False  # allow MXFP8/NVFP4 where not native: quantize -> dequantize -> BF16 GEMM
    pow2_scale: bool = False  # rollout's FP8 block scales rounded up to powers of two (SGLang ue8m0); BF16 trainers only
    four_over_six: bool = False  # NVFP4: per block map max to 4 or 6, whichever errs less
    kv_cache: str = "bf16"  # "fp8": keys and values in e4m3, a power-of-two scale per token and head, both sides

    def __post_init__(self):
        check_kv_cache(self.kv_cache, what=f"recipe {self.name!r}: kv_cache")
        for field, value in (("rollout_format", self.rollout_format), ("train_format", self.train_format)):
            if value not in FORMATS:
                raise ValueError(f"recipe {self.name!r}: {field}={value!r} is not a format; expected one of {', '.join(FORMATS)}")
        allowed = COMPATIBLE_TRAIN_FORMATS[self.rollout_format]
        if self.train_format not in allowed:
            pairs = "; ".join(f"{r} rollout -> train {'/'.join(t)}" for r, t in COMPATIBLE_TRAIN_FORMATS.items())
            raise ValueError(
                f"recipe {self.name!r}: rollout {self.rollout_format} with training forward {self.train_format} is not "
                f"supported. With {self.rollout_format} rollout use training format {' or '.join(allowed)}. Supported: {pairs}."
            )
        if self.backward not in _BACKWARD_FOR_TRAIN[self.train_format]:
            raise ValueError(
                f"recipe {self.name!r}: backward={self.backward!r} is not available with train_format={self.train_format}; "
                f"choose one of {', '.join(_BACKWARD_FOR_TRAIN[self.train_format])}"
            )
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"recipe {self.name!r}: master_dtype={self.master_dtype!r}; master weights are kept in {MASTER_DTYPES}")
        if self.pow2_scale and self.train_format == FP8_BLOCK:
            raise ValueError(
                f"recipe {self.name!r}: pow2_scale with train_format={FP8_BLOCK}: the trainer's FP8 GEMMs quantize with "
                "exact block scales, so power-of-two rollout scales would make sampler and learner disagree; use it "
                "with a BF16 training forward (e.g. bf16_train_fp8_rollout) or drop it"
            )
        if self.four_over_six and NVFP4 not in (self.rollout_format, self.train_format):
            raise ValueError(f"recipe {self.name!r}: four_over_six applies to NVFP4 only")

    @property
    def unified(self) -> bool:
        """Rollout and training forward compute with the same format (no quantization mismatch)."""
        return self.rollout_format == self.train_format

    def validate_for(self, hardware: str) -> "Recipe":
        """Fail before any compute if this recipe cannot run on `hardware` (see `detect_hardware`)."""
        if hardware not in HARDWARE_NATIVE:
            raise ValueError(f"unknown hardware {hardware!r}; expected one of {', '.join(HARDWARE_NATIVE)}")
        native = HARDWARE_NATIVE[hardware]
        for fmt in sorted({self.rollout_format, self.train_format}):
            if fmt in native or self.emulate:
                continue
            where = [h for h, fmts in HARDWARE_NATIVE.items() if fmt in fmts and h != "cpu"]
            raise ValueError(
                f"recipe {self.name!r}: format {fmt} has no native support on {hardware} (native there: {', '.join(native)}). "
                f"Run it on {' or '.join(where)}, or set emulate=True (quantize -> dequantize -> BF16 GEMM, same values), "
                f"or pick a recipe in {', '.join(native)}."
            )
        return self


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", BF16, BF16, "high_precision"),
        Recipe("fp8_block", FP8_BLOCK, FP8_BLOCK, "fp8"),
        Recipe("fp8_block_kv", FP8_BLOCK, FP8_BLOCK, "fp8", kv_cache="fp8"),
        Recipe("fp8_block_hp_backward", FP8_BLOCK, FP8_BLOCK, "high_precision"),
        Recipe("bf16_train_fp8_rollout", FP8_BLOCK, BF16, "high_precision"),
        Recipe("mxfp8", MXFP8, MXFP8, "fp8", emulate=True),
        Recipe("bf16_train_mxfp8_rollout", MXFP8, BF16, "high_precision", emulate=True),
        Recipe("nvfp4", NVFP4, NVFP4, "high_precision", emulate=True),
        Recipe("nvfp4_dequantized_backward", NVFP4, NVFP4, "dequantized", emulate=True),
    )
}


def get_recipe(name: str, **overrides) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}")
    return dataclasses.replace(RECIPES[name], **overrides) if overrides else RECIPES[name]


def detect_hardware(device=None) -> str:
    """Map a JAX device to a hardware family of `HARDWARE_NATIVE`."""
    import jax

    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = getattr(device, "device_kind", "").upper()
    if device.platform == "rocm" or "AMD" in kind or "MI3" in kind:
        return "amd"
    if any(tag in kind for tag in ("B100", "B200", "B300", "GB200", "GB300", "BLACKWELL")):
        return "blackwell"
    if any(tag in kind for tag in ("H100", "H200", "H800", "H20", "GH200", "HOPPER")):
        return "hopper"
    if any(tag in kind for tag in ("A100", "A800", "A10", "A30", "A40", "L4", "L40")):
        return "ampere"  # no FP8 GEMM on Ampere; L4/L40 (Ada) run FP8 but are not a validated target here
    raise ValueError(f"cannot classify device kind {kind!r}; pass hardware explicitly")
