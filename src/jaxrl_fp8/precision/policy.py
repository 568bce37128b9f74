"""Per-tensor precision policy: which format each weight of the model computes in.

One object answers for the trainer, the converter, live export and rollout, so layer exceptions can never
differ between stages. Decision for a tensor, in order:
  1. norms, embeddings, the MoE router and lm_head: always high precision ("bf16");
  2. the first / last N transformer layers: high precision;
  3. rules from a precision-config file (first match wins; HF-name or trainer-name regexes);
  4. extra high-precision regexes on HF names and on trainer names (`re.search`);
  5. NVFP4 quantizes MoE experts only (attention and dense MLP stay high precision, as Miles' NVFP4 recipe,
     the system this project re-implements, and its reference converter do) unless `nvfp4_dense=True`;
  6. otherwise the policy's base format.
Then SGLang's fused groups are enforced: q/k/v of a layer, dense gate/up of a layer, and all experts of a
layer must share one format. With on_split_group="extend" a high-precision exception spreads to its whole
group; with "error" a split group raises. Trainer names are derived from HF names through `names.TABLE`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

from jaxrl_fp8.precision import names as N
from jaxrl_fp8.precision.formats import BF16, FORMATS, NVFP4, QUANTIZED_FORMATS
from jaxrl_fp8.precision.kv import check_kv_cache

__all__ = ["PrecisionPolicy", "load_precision_config"]

_QUANTIZABLE = (N.TensorRole.LINEAR, N.TensorRole.EXPERT)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    fmt: str
    namespace: str = "hf"  # "hf" or "trainer"


def load_precision_config(path: str) -> tuple[Rule, ...]:
    """Read a precision-config file (JSON or YAML): {"rules": [{"pattern"|"trainer_pattern": RE, "format": F}, ...]}."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"precision config {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"precision config {path!r} is not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"precision config {path!r}: expected a mapping with a list under 'rules'")
    rules = []
    for i, item in enumerate(data["rules"]):
        where = f"precision config {path!r}, rules[{i}]"
        if not isinstance(item, dict) or "format" not in item or ("pattern" in item) == ("trainer_pattern" in item):
            raise ValueError(f"{where}: each rule needs 'format' and exactly one of 'pattern' (HF names) or 'trainer_pattern'")
        unknown = set(item) - {"pattern", "trainer_pattern", "format"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if item["format"] not in FORMATS:
            raise ValueError(f"{where}: format {item['format']!r} is not one of {', '.join(FORMATS)}")
        namespace = "hf" if "pattern" in item else "trainer"
        pattern = item["pattern"] if namespace == "hf" else item["trainer_pattern"]
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: bad regex {pattern!r}: {e}") from e
        rules.append(Rule(pattern, item["format"], namespace))
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    fmt: str  # base format of quantizable weights ("bf16" means: nothing quantized)
    num_layers: int
    num_experts: int = 0
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    extra_high_precision_hf: tuple[str, ...] = ()
    extra_high_precision_trainer: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    on_split_group: str = "extend"  # or "error"
    nvfp4_dense: bool = False  # NVFP4 also on attention / dense MLP projections (default: experts only)
    kv_cache: str = "bf16"  # the recipe's KV-cache contract (precision.kv): "fp8" quantizes k/v where attention reads them

    def __post_init__(self):
        check_kv_cache(self.kv_cache, what="PrecisionPolicy.kv_cache")
        if self.fmt not in FORMATS:
            raise ValueError(f"PrecisionPolicy.fmt={self.fmt!r} is not one of {', '.join(FORMATS)}")
        if self.on_split_group not in ("extend", "error"):
            raise ValueError(f"PrecisionPolicy.on_split_group={self.on_split_group!r}; expected 'extend' or 'error'")
        for field in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if not 0 <= getattr(self, field) <= self.num_layers:
                raise ValueError(f"PrecisionPolicy.{field}={getattr(self, field)} must be within [0, num_layers={self.num_layers}]")
        for field in ("extra_high_precision_hf", "extra_high_precision_trainer"):
            for pattern in getattr(self, field):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"PrecisionPolicy.{field}: bad regex {pattern!r}: {e}") from e
        for rule in self.rules:
            if rule.fmt not in (BF16, self.fmt):
                raise ValueError(
                    f"precision rule {rule.pattern!r} -> {rule.fmt}: a policy whose base format is {self.fmt} may only "
                    f"assign {BF16} or {self.fmt} (one quantized format per checkpoint)"
                )

    @classmethod
    def for_format(cls, fmt: str, *, num_layers: int, num_experts: int = 0, precision_config: str | None = None, **kw):
        rules = load_precision_config(precision_config) if precision_config else ()
        return cls(fmt=fmt, num_layers=num_layers, num_experts=num_experts, rules=rules, **kw)

    def with_format(self, fmt: str) -> "PrecisionPolicy":
        """Same exceptions, another base format (e.g. the rollout side of a recipe)."""
        return dataclasses.replace(self, fmt=fmt)

    def with_kv_cache(self, kv_cache: str) -> "PrecisionPolicy":
        return self if kv_cache == self.kv_cache else dataclasses.replace(self, kv_cache=kv_cache)

    # -- decisions ---------------------------------------------------------------------------------
    def _raw(self, hf_name: str) -> str:
        role = N.role_of_hf(hf_name)
        if role not in _QUANTIZABLE or self.fmt == BF16:
            return BF16
        m = _LAYER.match(hf_name)
        layer = int(m.group(1))
        if layer < self.num_layers_at_start_in_bf16 or layer >= self.num_layers - self.num_layers_at_end_in_bf16:
            return BF16
        trainer_name, _ = N.hf_to_trainer(hf_name)
        for rule in self.rules:
            subject = hf_name if rule.namespace == "hf" else trainer_name
            if re.search(rule.pattern, subject):
                return rule.fmt
        if any(re.search(p, hf_name) for p in self.extra_high_precision_hf):
            return BF16
        if any(re.search(p, trainer_name) for p in self.extra_high_precision_trainer):
            return BF16
        if self.fmt == NVFP4 and role != N.TensorRole.EXPERT and not self.nvfp4_dense:
            return BF16
        return self.fmt

    def _group_members(self, hf_name: str, group: str) -> list[str]:
        prefix = group.rsplit(".", 1)[0]
        if group.endswith("qkv_proj"):
            return [f"{prefix}.{p}_proj.weight" for p in "qkv"]
        if group.endswith("gate_up_proj"):
            return [f"{prefix}.{p}_proj.weight" for p in ("gate", "up")]
        experts = range(self.num_experts) if self.num_experts else [int(hf_name.split(".experts.")[1].split(".")[0])]
        return [f"{group}.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up", "down")]

    @functools.lru_cache(maxsize=None)
    def _group_format(self, hf_name: str, group: str) -> str:
        decided = {m: self._raw(m) for m in self._group_members(hf_name, group)}
        fmts = set(decided.values())
        if len(fmts) == 1:
            return fmts.pop()
        if self.on_split_group == "error":
            detail = ", ".join(f"{m}={f}" for m, f in sorted(decided.items()) if f == BF16)
            raise ValueError(
                f"precision policy splits SGLang's fused module {group}: some members high precision ({detail}), others "
                f"{self.fmt}. Extend the exception to the whole group, or use on_split_group='extend'."
            )
        return BF16

    def format_for(self, hf_name: str) -> str:
        """Format of the HF tensor `hf_name` ("bf16" = high precision)."""
        group = N.fused_group_of_hf(hf_name)
        return self._group_format(hf_name, group) if group else self._raw(hf_name)

    def format_for_trainer(self, trainer_name: str, expert: int | None = None) -> str:
        """Format of a trainer parameter; expert stacks answer for the whole stack (all experts agree)."""
        if N.TensorRole.EXPERT == _trainer_role(trainer_name):
            expert = 0 if expert is None else expert
        return self.format_for(N.trainer_to_hf(trainer_name, expert))

    def projection_format(self, trainer_name: str) -> str | None:
        """The format a projection weight (a LINEAR or EXPERT tensor of the name table) is multiplied in; None for
        every other parameter (norms, embeddings, router, lm_head) and for names outside the table. What the engine
        prepares its rollout operands by and the trainer its once-per-update FP8 operands."""
        try:
            hf = N.trainer_to_hf(trainer_name, 0 if _trainer_role(trainer_name) == N.TensorRole.EXPERT else None)
            if N.role_of_hf(hf) not in _QUANTIZABLE:
                return None
        except (KeyError, ValueError):
            return None
        return self.format_for(hf)

    def high_precision_modules(self, hf_names) -> list[str]:
        """HF module paths (no `.weight`) of quantizable tensors kept high precision, for `modules_to_not_convert`."""
        if self.fmt == BF16:
            return []
        out = []
        for name in hf_names:
            if N.role_of_hf(name) in _QUANTIZABLE and self.format_for(name) == BF16:
                out.append(name[: -len(".weight")])
        return sorted(set(out), key=_natural_key)

    def quantized(self, hf_name: str) -> bool:
        return self.format_for(hf_name) in QUANTIZED_FORMATS


def _trainer_role(trainer_name: str) -> str | None:
    return N.TensorRole.EXPERT if ".moe." in trainer_name and not trainer_name.endswith("router.weight") else None


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
