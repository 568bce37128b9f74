"""The training job's configuration: defaults (`base_config`) and validation before any compute.

Config files in experiments/configs/ start from `base_config()` and change what their recipe needs; every
key is documented here, and `validate_config` names the offending key (`config.rl.eps_clip`) on bad values.
"""

from __future__ import annotations

import os

import ml_collections

from jaxrl_fp8.precision import KV_CACHE_FORMATS, RECIPES

__all__ = ["base_config", "validate_config", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the key."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"  # metrics.jsonl, tensorboard/, checkpoints/, plots/, export/
    c.seed = 0
    c.total_steps = 100  # RL steps (one rollout batch + its optimizer updates each)
    c.recipe = "fp8_block"  # a name in jaxrl_fp8.precision.RECIPES
    c.emulate = ml_collections.config_dict.placeholder(bool)  # override the recipe's emulate flag
    c.kv_cache = ml_collections.config_dict.placeholder(str)  # override the recipe's KV cache: bf16 | fp8 (e4m3, both sides)
    c.hardware = "auto"  # auto | cpu | hopper | blackwell | ampere | amd (validates the recipe)

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = ""  # HF directory (BF16/FP32 or block-FP8); empty: random init from model.* below
    c.model.dtype = "float32"  # compute dtype of activations; masters are always FP32
    # auto: the flash attention kernels on a Hopper GPU when they take the model (bfloat16, head_dim a multiple of
    # 64), else the exact scan; exact | flash | xla force one (xla: fast einsum, NOT bitwise train == rollout)
    c.model.attention_impl = "auto"
    c.model.hidden_size = 64
    c.model.num_hidden_layers = 2
    c.model.num_attention_heads = 4
    c.model.num_key_value_heads = 2
    c.model.head_dim = 16
    c.model.num_experts = 4
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 64
    c.model.intermediate_size = 128
    c.model.decoder_sparse_step = 1
    c.model.mlp_only_layers = ()
    c.model.norm_topk_prob = True
    c.model.tie_word_embeddings = False
    c.model.rope_theta = 10000.0
    c.model.init_std = 0.02  # random init: weights ~ normal(0, init_std) (norms start at 1)
    # random init: the token embedding's std (0: init_std). At 0.02 a random model's residual stream is dominated by
    # attention's near-uniform average of the context, so every token of a row routes to the same experts and a
    # decode step of 64 rows touches ~30-40 of 128 experts instead of the ~120 a load-balanced (trained) router
    # spreads them over; 1.0 keeps each token's identity in the router input (benchmarks of MoE decode cost)
    c.model.embed_init_std = 0.0
    # random init: the projections that write into the residual stream (attention o_proj, MLP / expert down_proj) at
    # init_std / sqrt(2 * num_hidden_layers), Megatron's scaled init. Without it a deep random model's residual fills
    # with the layers' context averages, and on low-diversity prompts the routing collapses with depth
    # (decision record 0013); off by default, which keeps Qwen3's own draw
    c.model.scaled_output_init = False
    c.model.vocab_size = 0  # random init only: 0 = the tokenizer's size; larger pads the vocab (ids past it decode to "")

    c.precision = ml_collections.ConfigDict()
    c.precision.num_layers_at_start_in_bf16 = 0
    c.precision.num_layers_at_end_in_bf16 = 0
    c.precision.extra_high_precision_layers_hf = ()
    c.precision.extra_high_precision_layers_trainer = ()
    c.precision.precision_config = ""  # JSON/YAML rules file, see jaxrl_fp8.precision.policy
    c.precision.nvfp4_dense = False  # NVFP4 recipes: also quantize attention / dense MLP (default: experts only)

    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic"  # synthetic | jsonl | parquet
    c.data.task = "copy"  # synthetic task: copy | reverse | add
    c.data.num_digits = 2
    c.data.path = ""  # dataset file for jsonl/parquet
    c.data.prompt_key = "prompt"
    c.data.answer_key = "label"
    c.data.skip_malformed = False  # False: a bad row stops with file:line; True: skipped and counted
    c.data.tokenizer = ""  # directory with tokenizer.json (default: the checkpoint's; built-in for synthetic)
    c.data.prompts_per_step = 8
    c.data.max_prompt_tokens = 64
    c.data.reward = "positional_match"  # math | exact_match | positional_match | package.module:function

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "embedded"  # embedded | sglang
    c.rollout.sglang_urls = ()  # http://host:port of each SGLang server (engine=sglang)
    c.rollout.weight_sync_dir = ""  # shared directory the converter writes for /update_weights_from_disk
    c.rollout.n_samples = 8  # responses per prompt (the GRPO group)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    c.rollout.max_new_tokens = 8
    c.rollout.routing_replay = True  # R3: replay rollout expert selection in the trainer
    c.rollout.max_batch = 256
    # True: no stop ids, every sampled response runs to max_new_tokens (SGLang's ignore_eos); for benchmarks whose
    # steps must have a fixed token count
    c.rollout.ignore_eos = False
    # embedded engine with more than one device: "separate" = on one device of its own (sharded weights are
    # copied there); "collocated" = on the training mesh with the trainer's sharded weights (docs/decisions/0009)
    c.rollout.placement = "separate"
    # embedded engine, separate placement: "continuous" (decode slots refilled as rows finish, prefix sharing) or
    # "static" (chunks decoded until their longest row stops); KV page budget (0: max_batch rows of the longest
    # sequence); decode steps on device between host refills (docs/decisions/0008)
    c.rollout.scheduler = "continuous"
    c.rollout.kv_pages = 0
    c.rollout.refill_every = 64
    c.rollout.refill_batch = 0  # slots that finish before a refill while rows wait (0: max_batch // 32, at least 1)

    c.rl = ml_collections.ConfigDict()
    c.rl.advantage = "grpo"  # grpo | rloo | reinforce
    c.rl.std_normalize = True  # GRPO: divide by the group std (+1e-6)
    c.rl.eps_clip = 0.2
    c.rl.eps_clip_high = 0.28
    c.rl.dual_clip_c = 0.0  # > 1 enables dual clip; 0 disables
    c.rl.use_tis = True
    c.rl.tis_clip = 2.0
    c.rl.tis_clip_low = 0.0
    c.rl.kl_coef = 0.0  # KL to the frozen initial policy
    c.rl.kl_type = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    c.rl.entropy_coef = 0.0
    c.rl.loss_agg = "token_mean"  # token_mean | seq_mean_token_mean
    c.rl.num_minibatches = 1  # optimizer steps per rollout batch
    # > 0: the old (and reference) log-probs are recomputed in chunks of this many rows instead of the whole rollout
    # batch at once, bounding that pass's peak memory (B x T x vocab float32 logits); same values (rows are
    # independent). 0: the whole batch at once. Multi-host runs always take the whole (global) batch.
    c.rl.logprob_chunk_rows = 0
    # > 0: each minibatch's gradient is accumulated over micro-batches of this many rows (must divide the minibatch,
    # prompts_per_step*n_samples/num_minibatches), one optimizer update per minibatch; bounds the update's activation
    # memory by the micro-batch instead of the minibatch. 0: the whole minibatch at once.
    c.rl.micro_batch_rows = 0
    # > 0: the loss's head / log-softmax / entropy over equal chunks of at most this many token positions (as few as that
    # allows: little padding), recomputed in the backward:
    # the update never holds [tokens, vocab] float32 logits (~24 B x vocab a token, 3.6 MB at vocab 151936); same
    # values. 0: all positions at once.
    c.rl.logit_chunk_tokens = 0
    c.rl.learning_rate = 1e-6
    c.rl.lr_schedule = "constant"  # constant | cosine
    c.rl.warmup_steps = 0
    c.rl.weight_decay = 0.0
    c.rl.adam_b1 = 0.9
    c.rl.adam_b2 = 0.98
    c.rl.adam_eps = 1e-8
    c.rl.grad_clip = 1.0

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.save = True  # False: no checkpoint is written (benchmarks; such a run cannot resume)
    c.checkpoint.every_steps = 50
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    c.checkpoint.resume = True  # continue from the latest checkpoint in workdir if there is one
    c.checkpoint.export_final_hf = True  # HF safetensors in BF16 and in the recipe's rollout format at the end

    from jaxrl_fp8 import distributed, sharding

    c.mesh = sharding.mesh_config_defaults()  # data / fsdp / expert / tensor sizes (-1: the devices left)
    c.distributed = distributed.config_defaults()  # coordinator address, process count / id (multi-host)

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.progress_bar = True
    c.logging.plot_at_end = True
    c.logging.eval_every_steps = 0  # greedy eval on held-out prompts; 0 disables
    c.logging.eval_prompts = 64
    return c


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"config.{key}: {message}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def recipe_of(c: ml_collections.ConfigDict):
    """The config's recipe with its overrides (`emulate`, `kv_cache`) applied."""
    from jaxrl_fp8.precision import get_recipe

    overrides = {k: c.get(k) for k in ("emulate", "kv_cache") if c.get(k) is not None}
    return get_recipe(c.recipe, **overrides)


def validate_config(c: ml_collections.ConfigDict) -> None:
    """Raise ConfigError naming the key of the first value that cannot run. Cheap: no arrays, no files read."""
    _check(c.recipe in RECIPES, "recipe", f"{c.recipe!r} is not a recipe; choose one of {', '.join(RECIPES)}")
    _check(c.get("kv_cache") in (None, *KV_CACHE_FORMATS), "kv_cache",
           f"{c.get('kv_cache')!r} is not a KV-cache format; choose one of {', '.join(KV_CACHE_FORMATS)}")
    _check(c.hardware in ("auto", "cpu", "hopper", "blackwell", "ampere", "amd"), "hardware", f"{c.hardware!r} is not a hardware family")
    _check(c.total_steps >= 1, "total_steps", f"must be >= 1, got {c.total_steps}")
    _check(bool(c.workdir), "workdir", "must be set")
    m = c.model
    _check(m.dtype in ("float32", "bfloat16"), "model.dtype", f"{m.dtype!r}: use float32 or bfloat16")
    from jaxrl_fp8.model.config import ATTENTION_IMPLS

    _check(m.attention_impl in ATTENTION_IMPLS, "model.attention_impl", f"{m.attention_impl!r}: use one of {', '.join(ATTENTION_IMPLS)}")
    _check(m.attention_impl != "flash" or m.dtype == "bfloat16", "model.attention_impl",
           "'flash' needs model.dtype='bfloat16' (the kernels take BF16 q/k/v)")
    if m.checkpoint:
        _check(os.path.isdir(m.checkpoint), "model.checkpoint", f"{m.checkpoint!r} is not a directory")
        _check(os.path.exists(os.path.join(m.checkpoint, "config.json")), "model.checkpoint", f"{m.checkpoint!r} has no config.json")
    else:
        _check(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
               f"{m.num_key_value_heads} does not divide num_attention_heads={m.num_attention_heads}")
        _check(0 < m.num_experts_per_tok <= max(m.num_experts, 1), "model.num_experts_per_tok", f"must be in [1, num_experts={m.num_experts}]")
    _check(m.init_std > 0, "model.init_std", f"must be > 0, got {m.init_std}")
    _check(m.get("embed_init_std", 0.0) >= 0, "model.embed_init_std", f"must be >= 0 (0: init_std), got {m.get('embed_init_std')}")
    _check(m.get("vocab_size", 0) >= 0, "model.vocab_size", f"must be >= 0 (0: the tokenizer's size), got {m.get('vocab_size', 0)}")
    _check(not (m.checkpoint and m.get("vocab_size", 0)), "model.vocab_size", "only for random init; a checkpoint brings its own vocab")
    d = c.data
    _check(d.source in ("synthetic", "jsonl", "parquet"), "data.source", f"{d.source!r}: synthetic | jsonl | parquet")
    if d.source == "synthetic":
        _check(d.task in ("copy", "reverse", "add"), "data.task", f"{d.task!r}: copy | reverse | add")
    else:
        _check(os.path.isfile(d.path), "data.path", f"{d.path!r} is not a file")
    _check(d.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
    r = c.rollout
    _check(r.engine in ("embedded", "sglang"), "rollout.engine", f"{r.engine!r}: embedded | sglang")
    if r.engine == "sglang":
        _check(len(r.sglang_urls) > 0, "rollout.sglang_urls", "engine=sglang needs at least one server URL")
        _check(bool(r.weight_sync_dir), "rollout.weight_sync_dir", "engine=sglang needs a shared directory for weight updates")
        _check(recipe_of(c).kv_cache != "fp8", "rollout.engine", "engine=sglang cannot keep the FP8 KV-cache contract (kv_cache='fp8': a power-of-two "
               "scale per token and head; SGLang's fp8 KV cache scales per tensor): use engine=embedded or kv_cache=bf16")
    from jaxrl_fp8.sharding import PLACEMENTS

    placement = r.get("placement", "separate")
    _check(placement in PLACEMENTS, "rollout.placement", f"{placement!r}: {' | '.join(PLACEMENTS)}")
    _check(placement == "separate" or r.engine == "embedded", "rollout.placement",
           f"'collocated' runs the embedded engine on the training mesh; engine={r.engine!r} serves elsewhere (use 'separate')")
    _check(r.n_samples >= 2 or c.rl.advantage == "reinforce", "rollout.n_samples", "group advantages need >= 2 samples per prompt")
    _check(r.temperature > 0, "rollout.temperature", "must be > 0")
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _check(isinstance(r.ignore_eos, bool), "rollout.ignore_eos", f"must be a bool, got {r.ignore_eos!r}")
    _check(r.get("scheduler", "continuous") in ("continuous", "static"), "rollout.scheduler",
           f"{r.get('scheduler')!r}: continuous | static")
    _check(_is_int(r.get("kv_pages", 0)) and r.get("kv_pages", 0) >= 0, "rollout.kv_pages", "must be an int >= 0 (0: the default)")
    _check(_is_int(r.get("refill_every", 64)) and r.get("refill_every", 64) >= 1, "rollout.refill_every", "must be an int >= 1")
    _check(_is_int(r.get("refill_batch", 0)) and r.get("refill_batch", 0) >= 0, "rollout.refill_batch",
           "must be an int >= 0 (0: the default)")
    rl = c.rl
    _check(rl.advantage in ("grpo", "rloo", "reinforce"), "rl.advantage", f"{rl.advantage!r}: grpo | rloo | reinforce")
    _check(0 < rl.eps_clip < 1, "rl.eps_clip", "must be in (0, 1)")
    _check(rl.eps_clip_high > 0, "rl.eps_clip_high", "must be > 0")
    _check(rl.dual_clip_c == 0 or rl.dual_clip_c > 1, "rl.dual_clip_c", "must be 0 (off) or > 1")
    _check(0 <= rl.tis_clip_low < rl.tis_clip, "rl.tis_clip", f"need 0 <= tis_clip_low < tis_clip, got {rl.tis_clip_low}, {rl.tis_clip}")
    _check(rl.kl_type in ("k1", "k2", "k3", "low_var_kl"), "rl.kl_type", f"{rl.kl_type!r}")
    _check(rl.loss_agg in ("token_mean", "seq_mean_token_mean"), "rl.loss_agg", f"{rl.loss_agg!r}")
    _check(rl.learning_rate > 0, "rl.learning_rate", "must be > 0")
    _check(rl.lr_schedule in ("constant", "cosine"), "rl.lr_schedule", f"{rl.lr_schedule!r}: constant | cosine")
    _check(rl.num_minibatches >= 1, "rl.num_minibatches", "must be >= 1")
    chunk = rl.logprob_chunk_rows
    _check(isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0, "rl.logprob_chunk_rows",
           f"must be an int >= 0 (0: the whole batch at once), got {chunk!r}")
    total = d.prompts_per_step * r.n_samples
    _check(total % rl.num_minibatches == 0, "rl.num_minibatches", f"must divide prompts_per_step*n_samples={total}")
    micro = rl.get("micro_batch_rows", 0)
    _check(_is_int(micro) and micro >= 0, "rl.micro_batch_rows", f"must be an int >= 0 (0: the whole minibatch), got {micro!r}")
    minibatch = total // rl.num_minibatches
    _check(micro == 0 or minibatch % micro == 0, "rl.micro_batch_rows",
           f"{micro} must divide the minibatch of {minibatch} rows (prompts_per_step*n_samples/num_minibatches)")
    lchunk = rl.get("logit_chunk_tokens", 0)
    _check(_is_int(lchunk) and lchunk >= 0, "rl.logit_chunk_tokens", f"must be an int >= 0 (0: all positions at once), got {lchunk!r}")
    _check(rl.grad_clip >= 0, "rl.grad_clip", "must be >= 0 (0 disables)")
    _check(c.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
    _check(c.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    # the recipe against the hardware: before any compute
    recipe = recipe_of(c)
    if c.hardware != "auto":
        try:
            recipe.validate_for(c.hardware)
        except ValueError as e:
            raise ConfigError(f"config.recipe: {e}") from e


def as_benchmark_run(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Make `c` a benchmark run (in place; `c` is returned): no checkpoint saved or resumed, no final HF export, no
    tensorboard, no plots at the end, no progress bar, no eval. A benchmark times the RL loop itself; those write
    to disk (masters + Adam state of a 30B model are ~370 GB) or take host time between steps, and a resume would
    start a point from another run's state. Such a run cannot be resumed."""
    c.checkpoint.save = False
    c.checkpoint.resume = False
    c.checkpoint.export_final_hf = False
    c.logging.tensorboard = False
    c.logging.plot_at_end = False
    c.logging.progress_bar = False
    c.logging.eval_every_steps = 0
    return c


def math_rl_config(*, workdir: str, recipe: str, checkpoint: str, dataset: str = "/data/dapo-math-17k.jsonl",
                   hardware: str = "auto", routing_replay: bool = True) -> ml_collections.ConfigDict:
    """The GPU math-RL configs (experiments/configs/qwen3_30b_a3b_{fp8,mxfp8,nvfp4}.py, qwen3_4b_bf16_train_fp8_rollout.py)
    share everything but the recipe and the checkpoint: math prompts with a boxed-answer reward, 32 prompts x 8
    samples, 4k-token responses, TIS on, lr 1e-6, 4 minibatches."""
    c = base_config()
    c.workdir = workdir
    c.recipe = recipe
    c.hardware = hardware
    c.total_steps = 200
    c.model.checkpoint = checkpoint
    c.model.dtype = "bfloat16"
    c.data.source = "jsonl"
    c.data.path = dataset
    c.data.prompt_key = "prompt"
    c.data.answer_key = "label"
    c.data.reward = "math"
    c.data.prompts_per_step = 32
    c.data.max_prompt_tokens = 1024
    c.rollout.n_samples = 8
    c.rollout.max_new_tokens = 4096
    c.rollout.routing_replay = routing_replay
    c.rl.use_tis = True
    c.rl.eps_clip_high = 0.28
    c.rl.learning_rate = 1e-6
    c.rl.num_minibatches = 4
    c.checkpoint.every_steps = 20
    return c
