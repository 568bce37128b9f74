"""Command-line flags for layer exceptions, turned into the trainer's `PrecisionPolicy` (no second implementation).

Every converter CLI takes the same flags; `build_policy` is also what tests and live export use, so the
converter and the trainer decide each tensor's format with one object.
"""

from __future__ import annotations

import argparse

from jaxrl_fp8.precision import PrecisionPolicy

from converters.spec import model_dims

__all__ = ["add_policy_flags", "build_policy", "policy_from_args"]


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("layer exceptions (kept in BF16; same rules as the trainer's PrecisionPolicy)")
    g.add_argument(
        "--num-layers-at-start-in-bf16", type=int, default=0, metavar="N",
        help="keep the first N decoder layers entirely in BF16 (default 0)",
    )
    g.add_argument(
        "--num-layers-at-end-in-bf16", type=int, default=0, metavar="N",
        help="keep the last N decoder layers entirely in BF16 (default 0)",
    )
    g.add_argument(
        "--extra-high-precision-layers-hf", nargs="*", default=[], metavar="REGEX",
        help="regexes (re.search) on HF tensor names, e.g. 'layers\\.3\\.self_attn\\.' ; matching projections stay BF16",
    )
    g.add_argument(
        "--extra-high-precision-layers-trainer", nargs="*", default=[], metavar="REGEX",
        help="the same on trainer parameter paths (e.g. 'layers\\.3\\.moe\\.'), translated through precision.names.TABLE",
    )
    g.add_argument(
        "--precision-config", default=None, metavar="FILE",
        help="JSON/YAML file {\"rules\": [{\"pattern\"|\"trainer_pattern\": REGEX, \"format\": bf16|<target>}]}; first match wins",
    )
    g.add_argument(
        "--on-split-group", choices=("extend", "error"), default="extend",
        help="an exception hitting part of an SGLang fused group (q/k/v, gate/up, the experts of a layer): "
        "'extend' keeps the whole group in BF16 (default), 'error' refuses",
    )


def build_policy(
    fmt: str,
    config: dict,
    *,
    num_layers_at_start_in_bf16: int = 0,
    num_layers_at_end_in_bf16: int = 0,
    extra_high_precision_hf=(),
    extra_high_precision_trainer=(),
    precision_config: str | None = None,
    on_split_group: str = "extend",
    nvfp4_dense: bool = False,
) -> PrecisionPolicy:
    """The policy for an HF `config` (num layers / experts from it). NVFP4 keeps dense projections in BF16
    unless `nvfp4_dense` (experts-only, as the reference NVFP4 converter)."""
    num_layers, num_experts = model_dims(config)
    return PrecisionPolicy.for_format(
        fmt,
        num_layers=num_layers,
        num_experts=num_experts,
        precision_config=precision_config,
        num_layers_at_start_in_bf16=num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=num_layers_at_end_in_bf16,
        extra_high_precision_hf=tuple(extra_high_precision_hf),
        extra_high_precision_trainer=tuple(extra_high_precision_trainer),
        on_split_group=on_split_group,
        nvfp4_dense=nvfp4_dense,
    )


def policy_from_args(args: argparse.Namespace, fmt: str, config: dict) -> PrecisionPolicy:
    return build_policy(
        fmt,
        config,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
        extra_high_precision_hf=args.extra_high_precision_layers_hf,
        extra_high_precision_trainer=args.extra_high_precision_layers_trainer,
        precision_config=args.precision_config,
        on_split_group=args.on_split_group,
        nvfp4_dense=getattr(args, "quantize_dense", False),
    )
