"""The random Qwen3-MoE slice the rollout benchmarks (decode.py, rollout_workload.py) build: its command-line flags,
the `--tiny` shape and the ModelConfig made from them, in one place.

    p = argparse.ArgumentParser(...)
    p.add_argument("--tiny", ...)
    add_model_slice_args(p, layers=6, experts=32, top_k=4, vocab=32768)   # the script's defaults
    ...
    args = p.parse_args(argv)
    if args.tiny:
        apply_tiny_slice(args)
    cfg = model_config_from_args(args, max_position_embeddings=8192)
"""

from __future__ import annotations

import argparse

# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, experts of 768, top-8, 128 experts,
# vocab 151936); a script passes the ones it changes (layers always: the full model's 48 is no benchmark slice)
SLICE_DEFAULTS = {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
                  "moe_inter": 768, "vocab": 151936}
# the CPU smoke-run shape every slice benchmark uses under --tiny
TINY_SLICE = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 8, "top_k": 2,
              "moe_inter": 128, "vocab": 512}
FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "moe_inter", "vocab")
HELP = {"layers": "decoder layers, every one MoE", "hidden": "hidden size", "heads": "query heads",
        "kv_heads": "key / value heads", "head_dim": "head dimension", "experts": "experts per MoE layer",
        "top_k": "experts per token", "moe_inter": "expert intermediate size", "vocab": "vocabulary size"}


def add_model_slice_args(parser: argparse.ArgumentParser, *, layers: int, **defaults: int) -> None:
    """Add --layers --hidden --heads --kv-heads --head-dim --experts --top-k --moe-inter --vocab (ints, in this
    order) to `parser`; `defaults` (keys as in SLICE_DEFAULTS) override the Qwen3-30B-A3B shapes."""
    unknown = set(defaults) - set(SLICE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown model-slice defaults: {sorted(unknown)}")
    values = {"layers": layers, **SLICE_DEFAULTS, **defaults}
    for name in FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=values[name],
                            help=f"model slice: {HELP[name]} (default %(default)s)")


def apply_tiny_slice(args: argparse.Namespace) -> argparse.Namespace:
    """Set the slice flags of `args` to the --tiny shape (in place; returned for chaining)."""
    for name, value in TINY_SLICE.items():
        setattr(args, name, value)
    return args


def model_config_from_args(args: argparse.Namespace, *, max_position_embeddings: int = 8192, **overrides):
    """The ModelConfig of the slice flags in `args` (every layer MoE, dense intermediate 4 x hidden, normalised
    top-k, attention_impl = args.attention); `overrides` are further ModelConfig fields."""
    from jaxrl_fp8.model import ModelConfig

    fields = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate_size=4 * args.hidden, moe_intermediate_size=args.moe_inter, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=max_position_embeddings,
        attention_impl=args.attention,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


RECORDED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "attention_impl")


def slice_fields(cfg) -> dict:
    """The ModelConfig fields a result JSON records for the slice it ran."""
    return {k: getattr(cfg, k) for k in RECORDED_FIELDS}
