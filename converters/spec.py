"""What a quantized checkpoint is: the output format, its options, and the config fields SGLang reads.

`QuantSpec` is the one description shared by the converters, live export and the verifier. It knows how to
write itself into `config.json` (`quantization_config`) and `hf_quant_config.json`, and how to read itself
back from a checkpoint, so `converters.verify` can re-derive every tensor from the checkpoint alone.

Layouts written (what SGLang's loaders read):
  fp8-block, strategy block : quant_method "fp8", weight_block_size [bn, bk]; `weight_scale_inv` f32 [ceil(N/bn), ceil(K/bk)]
  fp8-block, strategy tensor: quant_method "fp8", no weight_block_size;       `weight_scale` f32 [1]
  fp8-block, strategy channel: quant_method "compressed-tensors" (SGLang's per-channel FP8 path); `weight_scale` f32 [N, 1]
  mxfp8                     : quant_method "mxfp8", weight_block_size [1, 32], scale_fmt "ue8m0"; `weight_scale_inv` u8 [N, K/32]
  nvfp4                     : quant_method "modelopt", quant_algo "NVFP4" + hf_quant_config.json (ModelOpt layout)
Our own options (pow2 scales, four-over-six, strategy) are also recorded under `quantization_config["jaxrl_fp8"]`;
SGLang ignores unknown keys there.
"""

from __future__ import annotations

import dataclasses
import re

from jaxrl_fp8.precision import BF16, FP8_BLOCK, MXFP8, NVFP4, PrecisionPolicy
from jaxrl_fp8.precision import names as N

__all__ = [
    "QuantSpec",
    "STRATEGIES",
    "quantization_config",
    "hf_quant_config",
    "spec_from_checkpoint",
    "modules_to_not_convert",
    "policy_from_excluded_modules",
    "excluded_module_regex",
    "model_dims",
]

STRATEGIES = ("block", "channel", "tensor")
META_KEY = "jaxrl_fp8"
# NVFP4 quantizes MoE experts only by default (as the reference converter does): attention and dense-MLP
# projections are kept high precision through these policy regexes, so trainer and converter agree.


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """Output format of a checkpoint and the knobs of its quantizer."""

    fmt: str  # bf16 | fp8-block | mxfp8 | nvfp4
    strategy: str = "block"  # fp8-block only: block | channel | tensor
    block_size: tuple[int, int] = (128, 128)  # fp8-block + strategy block only
    pow2_scale: bool = False  # fp8-block: power-of-two scales (SGLang scale_fmt "ue8m0")
    four_over_six: bool = False  # nvfp4 only

    def __post_init__(self):
        if self.fmt not in (BF16, FP8_BLOCK, MXFP8, NVFP4):
            raise ValueError(f"QuantSpec.fmt={self.fmt!r}; expected one of bf16, fp8-block, mxfp8, nvfp4")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"QuantSpec.strategy={self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.fmt != FP8_BLOCK and self.strategy != "block":
            raise ValueError(f"--strategy {self.strategy} applies to FP8 only, not {self.fmt}")
        bs = tuple(int(b) for b in self.block_size)
        if len(bs) != 2 or min(bs) <= 0:
            raise ValueError(f"QuantSpec.block_size={self.block_size!r}; expected two positive integers, e.g. 128 128")
        object.__setattr__(self, "block_size", bs)
        if self.pow2_scale and self.fmt != FP8_BLOCK:
            raise ValueError("pow2_scale applies to fp8-block (MXFP8 scales are always powers of two; NVFP4 has none)")
        if self.four_over_six and self.fmt != NVFP4:
            raise ValueError("four_over_six applies to nvfp4 only")

    @classmethod
    def from_recipe(cls, recipe) -> "QuantSpec":
        """The rollout side of a `precision.Recipe` (what the rollout engine serves)."""
        fmt = recipe.rollout_format
        return cls(
            fmt,
            pow2_scale=bool(recipe.pow2_scale) and fmt == FP8_BLOCK,
            four_over_six=bool(recipe.four_over_six) and fmt == NVFP4,
        )

    @property
    def quantized(self) -> bool:
        return self.fmt != BF16


# ---------------------------------------------------------------------------------------------- writing


def _meta(spec: QuantSpec) -> dict:
    return {
        "format": spec.fmt,
        "strategy": spec.strategy,
        "block_size": list(spec.block_size),
        "pow2_scale": spec.pow2_scale,
        "four_over_six": spec.four_over_six,
    }


def quantization_config(spec: QuantSpec, excluded: list[str]) -> dict:
    """The `quantization_config` entry of config.json for `spec`; `excluded` = modules kept high precision."""
    if spec.fmt == FP8_BLOCK and spec.strategy == "channel":
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": list(excluded),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel", "group_size": None},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token", "group_size": None},
                    "output_activations": None,
                }
            },
            META_KEY: _meta(spec),
        }
    if spec.fmt == FP8_BLOCK:
        cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if spec.strategy == "block":
            cfg["weight_block_size"] = list(spec.block_size)
        if spec.pow2_scale:
            cfg["scale_fmt"] = "ue8m0"
        cfg["modules_to_not_convert"] = list(excluded)
        cfg[META_KEY] = _meta(spec)
        return cfg
    if spec.fmt == MXFP8:
        return {
            "quant_method": "mxfp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [1, 32],
            "scale_fmt": "ue8m0",
            "modules_to_not_convert": list(excluded),
            META_KEY: _meta(spec),
        }
    if spec.fmt == NVFP4:
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            # No FP8 KV cache: it would change the served numerics away from the trainer's.
            "kv_cache_quant_algo": None,
            "ignore": list(excluded),
            META_KEY: _meta(spec),
        }
    raise ValueError(f"no quantization_config for format {spec.fmt!r}")


def hf_quant_config(spec: QuantSpec, excluded: list[str]) -> dict:
    """ModelOpt's hf_quant_config.json (NVFP4 only)."""
    if spec.fmt != NVFP4:
        raise ValueError("hf_quant_config.json is written for nvfp4 only")
    return {
        "producer": {"name": "modelopt", "version": "jaxrl_fp8.converters"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": list(excluded)},
    }


def model_dims(config: dict, *, where: str = "config.json") -> tuple[int, int]:
    """(num_hidden_layers, num_experts) of an HF Qwen3 / Qwen3-MoE config (transformers 5 writes num_local_experts)."""
    if "num_hidden_layers" not in config:
        raise ValueError(f"{where}: field 'num_hidden_layers' is missing")
    layers = config["num_hidden_layers"]
    experts = config.get("num_experts", config.get("num_local_experts", 0)) or 0
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(f"{where}: field 'num_hidden_layers' = {layers!r} must be a positive integer")
    if not isinstance(experts, int) or experts < 0:
        raise ValueError(f"{where}: field 'num_experts' = {experts!r} must be a non-negative integer")
    return layers, experts


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def modules_to_not_convert(policy: PrecisionPolicy, hf_names, *, include_always_high_precision: bool = False) -> list[str]:
    """Module paths SGLang must load unquantized: the policy's exceptions plus SGLang's fused-module names.

    The policy already keeps q/k/v, gate/up and all experts of a layer together; here the fused module
    names (`self_attn.qkv_proj`, `mlp.gate_up_proj`, `mlp.experts`) are listed too, because SGLang versions
    that match entries exactly (without a packed-modules mapping) look the fused name up.
    `include_always_high_precision` adds lm_head and the MoE routers (ModelOpt wants a non-empty list).
    """
    hf_names = list(hf_names)
    out = set(policy.high_precision_modules(hf_names)) if policy.fmt != BF16 else set()
    if include_always_high_precision:
        out.add("lm_head")  # also with tied embeddings, as ModelOpt checkpoints list it
    for name in hf_names:
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if module in out:
            group = N.fused_group_of_hf(name)
            if group:
                out.add(group)
        if include_always_high_precision and N.role_of_hf(name) in (N.TensorRole.LM_HEAD, N.TensorRole.ROUTER):
            out.add(module)
    return sorted(out, key=_natural_key)


# ---------------------------------------------------------------------------------------------- reading


def spec_from_checkpoint(config: dict, hf_quant: dict | None = None, *, where: str = "config.json") -> tuple[QuantSpec, list[str]]:
    """(spec, excluded modules) of a checkpoint from its config.json (and hf_quant_config.json if any)."""
    q = config.get("quantization_config")
    if not q and hf_quant:
        q = {"quant_method": "modelopt", **hf_quant.get("quantization", {})}
    if not q:
        return QuantSpec(BF16), []
    if not isinstance(q, dict) or "quant_method" not in q:
        raise ValueError(f"{where}: 'quantization_config' has no 'quant_method'")
    meta = q.get(META_KEY, {}) or {}
    method = q["quant_method"]
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{where}: quantization_config.fmt={q.get('fmt')!r}; only e4m3 is supported")
        block = q.get("weight_block_size")
        strategy = "block" if block else "tensor"
        pow2 = q.get("scale_fmt") == "ue8m0" or bool(meta.get("pow2_scale"))
        spec = QuantSpec(FP8_BLOCK, strategy, tuple(block) if block else (128, 128), pow2_scale=pow2)
        return spec, list(q.get("modules_to_not_convert", q.get("ignored_layers", [])) or [])
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        strategies = {g.get("weights", {}).get("strategy") for g in groups.values()}
        if strategies != {"channel"} or any(g.get("weights", {}).get("num_bits") != 8 for g in groups.values()):
            raise ValueError(f"{where}: compressed-tensors checkpoint is not per-channel FP8 (weights strategies {sorted(map(str, strategies))})")
        return QuantSpec(FP8_BLOCK, "channel", pow2_scale=bool(meta.get("pow2_scale"))), list(q.get("ignore", []) or [])
    if method == "mxfp8":
        return QuantSpec(MXFP8), list(q.get("modules_to_not_convert", q.get("ignored_layers", [])) or [])
    if method == "modelopt":
        algo = q.get("quant_algo") or (hf_quant or {}).get("quantization", {}).get("quant_algo")
        if algo != "NVFP4":
            raise ValueError(f"{where}: modelopt quant_algo={algo!r}; only NVFP4 is supported")
        excluded = q.get("ignore", q.get("exclude_modules"))
        if excluded is None and hf_quant:
            excluded = hf_quant.get("quantization", {}).get("exclude_modules")
        return QuantSpec(NVFP4, four_over_six=bool(meta.get("four_over_six"))), list(excluded or [])
    raise ValueError(f"{where}: quantization_config.quant_method={method!r} is not one of fp8, compressed-tensors, mxfp8, modelopt")


def excluded_module_regex(entry: str) -> str:
    """A regex (for `re.search` on HF tensor names) equivalent to SGLang's matching of one exclusion entry.

    Entries match on dotted module-path boundaries (`model.layers.0` covers the whole layer); ModelOpt's
    `*` wildcards are honoured; entries without the `model.` prefix also match with it.
    """
    entry = entry.rstrip(".")
    bases = {entry, entry if entry.startswith("model.") or entry.startswith("lm_head") else f"model.{entry}"}
    parts = []
    for base in sorted(bases):
        if "*" in base:
            parts.append(_wildcard(base))
        else:
            parts.append(re.escape(base) + r"\.")
    return r"^(?:" + "|".join(parts) + ")"


def _wildcard(base: str) -> str:
    return ".*".join(re.escape(p) for p in base.split("*")) + r"\."


def policy_from_excluded_modules(fmt: str, excluded: list[str], num_layers: int, num_experts: int) -> PrecisionPolicy:
    """The policy a checkpoint was written under, rebuilt from its exclusion list (for verification).

    The list is complete (NVFP4 checkpoints list their BF16 dense projections too), so nothing beyond it is
    kept high precision: `nvfp4_dense=True` turns the policy's experts-only NVFP4 default off."""
    patterns = tuple(excluded_module_regex(e) for e in excluded)
    return PrecisionPolicy(fmt=fmt, num_layers=num_layers, num_experts=num_experts, extra_high_precision_hf=patterns,
                           nvfp4_dense=True)
