"""`python -m jaxrl_fp8.serve`: the embedded JAX rollout engine behind SGLang's HTTP API subset.

So a JAX rollout fleet runs as separate processes (or hosts) that `SGLangClient` / `SGLangFleet` drive
exactly like SGLang servers. Wiring only: the engine is `rollout.embedded.EmbeddedEngine`, the HTTP side
`rollout.http_server` (request validation, batching of concurrent requests, pause / weight-update gates).

    python -m jaxrl_fp8.serve --checkpoint /ckpt/qwen3-30b-a3b --recipe fp8_block --port 30000
    python -m jaxrl_fp8.serve --checkpoint tiny --recipe bf16 --port 0 --port-file /tmp/port   # tests
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jaxrl_fp8.model.config import ATTENTION_IMPLS

__all__ = ["main", "build_engine", "parse_args"]

log = logging.getLogger("jaxrl_fp8.serve")

_HELP_CHECKPOINT = (
    "What to serve. A directory: an HF Qwen3-MoE / Qwen3 checkpoint (config.json + safetensors, BF16/FP32 or "
    "block FP8) loaded with model.from_pretrained. 'tiny': a randomly initialized tiny Qwen3-MoE "
    "(model.tiny_config(), for tests). A .json file: a random model from that config — an HF config.json "
    "(has 'architectures' or 'model_type') or a dict of tiny_config overrides such as "
    '{"num_hidden_layers": 2}.'
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxrl_fp8.precision import RECIPES

    p = argparse.ArgumentParser(
        prog="python -m jaxrl_fp8.serve",
        description="Serve the embedded JAX rollout engine over the SGLang HTTP API subset used for RL "
        "(/generate, /update_weights_from_disk, /model_info, /server_info, /health, /health_generate, "
        "/flush_cache, /pause_generation, /continue_generation, /update_weight_version).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help=_HELP_CHECKPOINT)
    p.add_argument("--recipe", default="bf16", choices=sorted(RECIPES),
                   help="Precision recipe; the engine computes in its ROLLOUT format (e.g. fp8_block: block-FP8 "
                   "weights and 1x128 activations, the same contract as the trainer).")
    p.add_argument("--host", default="127.0.0.1", help="Interface to bind (0.0.0.0 for every interface).")
    p.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one (see --port-file).")
    p.add_argument("--port-file", default=None,
                   help="Write the bound port to this file once the server accepts requests (atomic rename).")
    p.add_argument("--max-batch", type=int, default=64,
                   help="Sample rows decoded together; bigger batches are cut into chunks of this size.")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="Longest prompt + max_new_tokens of one request (the KV-cache length); longer "
                   "requests get a 400.")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="Parameter / activation dtype. auto: float32 for random models (the trainer's "
                   "masters), bfloat16 for checkpoints.")
    p.add_argument("--init-seed", type=int, default=0, help="Parameter seed of random models (tiny / .json).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seeds the base seed of requests that carry no sampling_seed.")
    p.add_argument("--weight-version", default="0", help="weight_version reported before the first update.")
    p.add_argument("--eos-token-id", type=int, action="append", default=None,
                   help="Stop id(s) added to every request without ignore_eos (repeatable). Default: the "
                   "checkpoint's config.json / generation_config.json eos_token_id; none for random models.")
    p.add_argument("--decode-loop", default="while", choices=["while", "python"],
                   help="while: the decode loop is a lax.while_loop inside one jitted program; python: one "
                   "jitted step per token driven from Python.")
    p.add_argument("--scheduler", default="continuous", choices=["continuous", "static"],
                   help="continuous: decode slots refilled as rows finish, one paged KV pool per batch, a prompt's "
                   "samples share its pages; static: chunks of max-batch rows decoded until their longest row stops.")
    p.add_argument("--kv-pages", type=int, default=0,
                   help="KV page budget (0: max-batch rows of max-seq-len); rows wait for pages, never truncated.")
    p.add_argument("--refill-every", type=int, default=64,
                   help="continuous: most decode steps the device runs between two host refills.")
    p.add_argument("--refill-batch", type=int, default=0,
                   help="continuous: slots that finish before the device stops to refill while rows wait (0: "
                   "max-batch // 32, at least 1); a refill costs host round trips, a finished slot idles meanwhile.")
    p.add_argument("--static-shapes", action="store_true",
                   help="Run every batch at (max-batch, max-seq-len) so exactly one program compiles; "
                   "default: shapes bucketed to powers of two.")
    p.add_argument("--attention-impl", default="auto", choices=list(ATTENTION_IMPLS),
                   help="auto: the flash attention kernels on a Hopper GPU when they take the model (bfloat16, head_dim "
                   "a multiple of 64), else exact; exact: the row-invariant scan; flash: the kernels (row invariant, "
                   "rollout log-probs equal the trainer's bit for bit); xla: einsum attention, not row invariant.")
    p.add_argument("--enable-return-routed-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="Return routed experts (R3) when a request asks (SGLang's flag of the same name).")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="How long the first queued /generate waits for other requests to batch with.")
    p.add_argument("--max-batch-prompts", type=int, default=256,
                   help="Most prompts merged into one engine call (also the most in one request).")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Python logging level.")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_batch", "max_seq_len", "max_batch_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_pages < 0:
        p.error(f"--kv-pages must be >= 0 (0: the default), got {args.kv_pages}")
    if args.refill_every < 1:
        p.error(f"--refill-every must be >= 1, got {args.refill_every}")
    if args.refill_batch < 0:
        p.error(f"--refill-batch must be >= 0 (0: the default), got {args.refill_batch}")
    if args.batch_window_ms < 0:
        p.error(f"--batch-window-ms must be >= 0, got {args.batch_window_ms}")
    return args


def _random_config(spec: str, attention_impl: str):
    from jaxrl_fp8.model import from_hf_config, tiny_config

    if spec == "tiny":
        return tiny_config(attention_impl=attention_impl)
    try:
        with open(spec) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--checkpoint {spec!r}: cannot read a JSON config: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--checkpoint {spec!r}: expected a JSON object")
    if "architectures" in data or "model_type" in data:
        return from_hf_config(data, attention_impl=attention_impl)
    return tiny_config(**{**data, "attention_impl": attention_impl})


def _checkpoint_eos(path: str) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, name)) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def build_engine(args: argparse.Namespace):
    """The EmbeddedEngine the flags describe."""
    from jaxrl_fp8.model import from_pretrained, random_policy
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig

    recipe = get_recipe(args.recipe)
    if os.path.isdir(args.checkpoint):
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        keep = recipe.rollout_format == "fp8-block"
        policy = from_pretrained(args.checkpoint, dtype=dtype, recipe=recipe, quantized="keep" if keep else "dequantize",
                                 attention_impl=args.attention_impl)
        eos = _checkpoint_eos(args.checkpoint)
        model_path = os.path.abspath(args.checkpoint)
    elif args.checkpoint == "tiny" or args.checkpoint.endswith(".json"):
        cfg = _random_config(args.checkpoint, args.attention_impl)
        dtype = "float32" if args.dtype == "auto" else args.dtype
        policy = random_policy(cfg, seed=args.init_seed, dtype=dtype, recipe=recipe)
        eos = []
        model_path = f"random:{args.checkpoint}"
    else:
        raise SystemExit(f"--checkpoint {args.checkpoint!r} is neither a checkpoint directory, 'tiny', nor a .json config")
    if args.eos_token_id is not None:
        eos = args.eos_token_id
    engine_config = EngineConfig(
        max_batch=args.max_batch, max_seq_len=args.max_seq_len, eos_token_ids=tuple(eos), decode_loop=args.decode_loop,
        static_shapes=args.static_shapes, seed=args.seed, model_path=model_path, scheduler=args.scheduler,
        kv_pages=args.kv_pages, refill_every=args.refill_every, refill_batch=args.refill_batch,
    )
    return EmbeddedEngine(policy, recipe=recipe, engine_config=engine_config, weight_version=args.weight_version)


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # XLA flags (IEEE division, no excess precision) are set by importing jaxrl_fp8
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from jaxrl_fp8.rollout.http_server import ServerConfig, serve_forever

    engine = build_engine(args)
    info = engine.model_info()
    log.info("engine ready: %s, recipe %s (rollout format %s), %d layers, vocab %d, max_seq_len %d",
             info.model_path, args.recipe, engine.recipe.rollout_format if engine.recipe else "params dtype",
             info.num_hidden_layers, info.vocab_size, info.max_total_tokens)
    config = ServerConfig(
        max_batch_prompts=args.max_batch_prompts,
        max_prompts_per_request=args.max_batch_prompts,
        max_wait_s=args.batch_window_ms / 1000.0,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )

    def ready(server) -> None:
        print(f"jaxrl_fp8.serve: serving on http://{args.host}:{server.port}", flush=True)
        if args.port_file:
            _write_port_file(args.port_file, server.port)

    serve_forever(engine, args.host, args.port, config, ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
