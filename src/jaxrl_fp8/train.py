"""`python -m jaxrl_fp8.train --config=experiments/configs/<name>.py [--config.key=value ...]`

Runs the unified low-precision RL loop (see jaxrl_fp8.rl.trainer). The config is validated before any
compute; the workdir receives metrics.jsonl, tensorboard/, checkpoints/ (Orbax), plots/ and export/.
A run whose workdir already has checkpoints resumes from the latest one (checkpoint.resume).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml_collections config file (experiments/configs/*.py). Any key can be overridden "
    "as --config.section.key=value, e.g. --config.rl.learning_rate=1e-6 --config.total_steps=10 --config.workdir=DIR.",
    lock_config=True)
flags.mark_flag_as_required("config")


def _records_and_tokenizer(c):
    from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer
    from jaxrl_fp8.data.readers import DatasetFields, read_prompt_dataset
    from jaxrl_fp8.data.synthetic import make_task, synthetic_splits
    from jaxrl_fp8.data.tokenizer import load_tokenizer

    if c.data.source == "synthetic":
        task = make_task(c.data.task, c.data.num_digits)
        train, evals = synthetic_splits(task, seed=c.seed, max_eval=c.logging.eval_prompts)
        return train, evals, builtin_tokenizer()
    tok_dir = c.data.tokenizer or c.model.checkpoint
    if not tok_dir:
        raise ValueError("config.data.tokenizer: a dataset needs a tokenizer directory (or model.checkpoint with tokenizer.json)")
    records, report = read_prompt_dataset(c.data.path, DatasetFields(prompt=c.data.prompt_key, answer=c.data.answer_key),
                                          skip_malformed=c.data.skip_malformed)
    if report.num_skipped:
        logging.warning("%s: skipped %d malformed rows, e.g. %s", c.data.path, report.num_skipped, report.errors[:3])
    n_eval = min(c.logging.eval_prompts, len(records) // 10) if c.logging.eval_every_steps else 0
    return records[n_eval:], records[:n_eval], load_tokenizer(tok_dir)


def _model(c, vocab_size: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_fp8.model.config import tiny_config
    from jaxrl_fp8.model.qwen3 import Qwen3

    if c.model.checkpoint:
        from jaxrl_fp8.model import from_pretrained

        return from_pretrained(c.model.checkpoint, dtype="float32", attention_impl=c.model.attention_impl).model
    m = c.model
    if m.get("vocab_size", 0) and m.vocab_size < vocab_size:
        from jaxrl_fp8.config import ConfigError

        raise ConfigError(f"config.model.vocab_size: {m.vocab_size} is smaller than the tokenizer's {vocab_size} ids")
    cfg = tiny_config(vocab_size=m.get("vocab_size", 0) or vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                      num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                      num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                      moe_intermediate_size=m.moe_intermediate_size, intermediate_size=m.intermediate_size,
                      decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=tuple(m.mlp_only_layers),
                      norm_topk_prob=m.norm_topk_prob, tie_word_embeddings=m.tie_word_embeddings, rope_theta=m.rope_theta,
                      attention_impl=m.attention_impl)
    if jax.device_count() > 1 and jax.default_backend() != "cpu":
        # sharded runs: random FP32 masters on the host, the trainer shards them (a 30B model fits no one GPU)
        with jax.default_device(jax.devices("cpu")[0]):
            return _init_scaled(Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(c.seed)), m)
    return _init_scaled(Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(c.seed)), m)


# the projections whose output is added to the residual stream (Megatron's scaled init applies to these)
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def _init_scaled(model, m):
    """The random model with its weights ~ normal(0, model.init_std), its embedding ~ normal(0,
    model.embed_init_std or init_std) and, with model.scaled_output_init, the residual-stream outputs
    (`RESIDUAL_OUTPUTS`) ~ normal(0, init_std / sqrt(2 * layers)): Qwen3 draws normal(0, INIT_STD), rescaled here
    (the same distribution)."""
    import math

    from flax import nnx

    from jaxrl_fp8.model.qwen3 import INIT_STD as base

    std, embed_std = float(m.init_std), float(m.get("embed_init_std", 0.0) or m.init_std)
    out_std = std / math.sqrt(2 * m.num_hidden_layers) if m.get("scaled_output_init", False) else std
    if std == base and embed_std == base and out_std == base:
        return model
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "embedding":
            target = embed_std
        elif path[-1] == "weight":
            target = out_std if len(path) > 1 and path[-2] in RESIDUAL_OUTPUTS else std
        else:
            continue
        var.set_value(var.get_value() * (target / base))
    return model


def _policies(c, recipe, model_cfg):
    from jaxrl_fp8.precision import PrecisionPolicy

    p = c.precision
    train = PrecisionPolicy.for_format(
        recipe.train_format, num_layers=model_cfg.num_hidden_layers, num_experts=model_cfg.num_experts,
        precision_config=p.precision_config or None, num_layers_at_start_in_bf16=p.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=p.num_layers_at_end_in_bf16, extra_high_precision_hf=tuple(p.extra_high_precision_layers_hf),
        extra_high_precision_trainer=tuple(p.extra_high_precision_layers_trainer), nvfp4_dense=p.nvfp4_dense,
        kv_cache=recipe.kv_cache)
    return train, train.with_format(recipe.rollout_format)


def trainer_settings(c, recipe, model_cfg, seq_len: int):
    """The `rl.trainer.TrainerSettings` of config `c` (loss, sampling, minibatches, the recipe's backward mode) for a
    model of `model_cfg` and rows of `seq_len` tokens; `run` trains with them (benchmarks build their trainer so)."""
    import jax.numpy as jnp

    from jaxrl_fp8.rl.losses import PolicyLossConfig
    from jaxrl_fp8.rl.trainer import TrainerSettings

    loss_cfg = PolicyLossConfig(eps_clip=c.rl.eps_clip, eps_clip_high=c.rl.eps_clip_high, dual_clip_c=c.rl.dual_clip_c or None,
                                use_tis=c.rl.use_tis, tis_clip=c.rl.tis_clip, tis_clip_low=c.rl.tis_clip_low, kl_coef=c.rl.kl_coef,
                                kl_type=c.rl.kl_type, entropy_coef=c.rl.entropy_coef, loss_agg=c.rl.loss_agg)
    return TrainerSettings(
        total_steps=c.total_steps, prompts_per_step=c.data.prompts_per_step, n_samples=c.rollout.n_samples, seq_len=seq_len,
        temperature=c.rollout.temperature, top_p=c.rollout.top_p, top_k=c.rollout.top_k, max_new_tokens=c.rollout.max_new_tokens,
        routing_replay=c.rollout.routing_replay and model_cfg.is_moe, advantage=c.rl.advantage, std_normalize=c.rl.std_normalize,
        num_minibatches=c.rl.num_minibatches, loss=loss_cfg, backward=recipe.backward,
        compute_dtype=jnp.bfloat16 if c.model.dtype == "bfloat16" else jnp.float32, seed=c.seed,
        eval_every_steps=c.logging.eval_every_steps, use_ref=c.rl.kl_coef > 0,
        ignore_eos=c.rollout.ignore_eos, logprob_chunk_rows=c.rl.logprob_chunk_rows,
        micro_batch_rows=c.rl.micro_batch_rows, logit_chunk_tokens=c.rl.logit_chunk_tokens)


def _engine_and_push(c, model, recipe, train_policy, seq_len, tokenizer, plan=None):
    """The rollout engine and the function that pushes new weights (version v+1) to it."""
    if c.rollout.engine == "embedded":
        from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig

        placement = None
        if c.rollout.get("placement", "separate") == "collocated" and plan is not None and plan.mesh.size > 1:
            from jaxrl_fp8.sharding import CollocatedPlacement

            placement = CollocatedPlacement(plan, moe=model.cfg.is_moe)  # the trainer's mesh and sharded weights
        engine_config = EngineConfig(max_batch=c.rollout.max_batch, max_seq_len=seq_len, eos_token_ids=tuple(tokenizer.stop_ids),
                                     seed=c.seed, scheduler=c.rollout.get("scheduler", "continuous"),
                                     kv_pages=c.rollout.get("kv_pages", 0), refill_every=c.rollout.get("refill_every", 64),
                                     refill_batch=c.rollout.get("refill_batch", 0))
        engine = EmbeddedEngine(model, recipe=recipe, policy=train_policy, engine_config=engine_config, placement=placement)
        return engine, engine.update_params
    from jaxrl_fp8.rollout.sglang_engine import SGLangFleetEngine

    engine = SGLangFleetEngine(list(c.rollout.sglang_urls), weight_sync_dir=c.rollout.weight_sync_dir, recipe=recipe,
                               policy=train_policy.with_format(recipe.rollout_format), model_config=model.cfg,
                               side_files_from=c.model.checkpoint or None)
    return engine, engine.push_model


def run(c, on_step=None) -> str:
    """Train as configured; returns the workdir. Importable for tests and benchmarks (`run(config)`).

    on_step: optional `on_step(step, metrics)` called after every RL step with the step's metrics (the trainer's
    phase timers `rollout_seconds`, `train_seconds` = `logprob_seconds` + `update_seconds`, `sync_seconds`,
    `step_seconds`, and the mismatch metrics), before they are written; it may add keys to `metrics` (written too).
    """
    from jaxrl_fp8.config import recipe_of, validate_config

    validate_config(c)  # before anything heavy is imported or computed
    from jaxrl_fp8 import distributed

    distributed.initialize(c.distributed)  # multi-host: before any device is touched
    import jax
    from tqdm import tqdm

    from jaxrl_fp8.checkpoint import Checkpointer
    from jaxrl_fp8.data.pipeline import LoaderConfig, PromptLoader
    from jaxrl_fp8.metrics import MetricsWriter
    from jaxrl_fp8.precision import detect_hardware
    from jaxrl_fp8.rl.rewards import get_reward_fn
    from jaxrl_fp8.rl.trainer import Trainer, make_optimizer

    recipe = recipe_of(c)
    hardware = detect_hardware() if c.hardware == "auto" else c.hardware
    recipe.validate_for(hardware)
    workdir = os.path.abspath(c.workdir)
    os.makedirs(workdir, exist_ok=True)
    if distributed.is_writer():  # one writer of shared files (process 0), temp file renamed into place
        tmp = os.path.join(workdir, f".config.json.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(c.to_json_best_effort(indent=2))
        os.replace(tmp, os.path.join(workdir, "config.json"))

    train_records, eval_records, tokenizer = _records_and_tokenizer(c)
    reward_fn = get_reward_fn(c.data.reward)
    loader = PromptLoader(train_records, tokenizer, LoaderConfig(batch_size=c.data.prompts_per_step, seed=c.seed,
                          max_prompt_tokens=c.data.max_prompt_tokens, process_index=jax.process_index(),
                          process_count=jax.process_count()))
    model = _model(c, tokenizer.vocab_size)
    train_policy, rollout_policy = _policies(c, recipe, model.cfg)
    seq_len = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    plan = None
    if jax.device_count() > 1:
        from flax import nnx

        from jaxrl_fp8.sharding import ShardingPlan, make_mesh

        plan = ShardingPlan(make_mesh(c.mesh))
        plan.validate(nnx.state(model, nnx.Param), train_policy)  # no FP8 block split across devices
    engine, push = _engine_and_push(c, model, recipe, train_policy, seq_len, tokenizer, plan)
    settings = trainer_settings(c, recipe, model.cfg, seq_len)
    optimizer, schedule = make_optimizer(c.rl, c.total_steps * c.rl.num_minibatches)
    trainer = Trainer(model=model, settings=settings, optimizer=optimizer, schedule=schedule, engine=engine,
                      tokenizer=tokenizer, loader=loader, reward_fn=reward_fn, train_policy=train_policy,
                      push_weights=push, plan=plan)
    # the trainer holds its masters in buffers of its own and the engine its rollout weights: the random / loaded
    # float32 model is not needed again, and kept alive here it held 4 B/param for the whole run (17.4 GB of a
    # 6-layer slice's peak on the H200)
    del model

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.checkpoint.keep, async_save=c.checkpoint.async_save)
    writer = MetricsWriter(workdir, tensorboard=c.logging.tensorboard, enabled=jax.process_index() == 0)
    if c.checkpoint.resume and ckpt.latest_step is not None:
        state, meta = ckpt.restore(None, trainer.state())
        trainer.load_state(state, meta)
        trainer.push_weights()
        writer.truncate_after(trainer.step)
        logging.info("resumed from %s at step %d", ckpt.directory, trainer.step)
    else:
        writer.truncate_after(-1)
        trainer.push_weights()

    eval_loader_cfg = LoaderConfig(batch_size=1, shuffle=False, num_epochs=1, drop_remainder=False)
    bar = tqdm(total=c.total_steps, initial=trainer.step, desc=f"train[{recipe.name}]", disable=not c.logging.progress_bar,
               dynamic_ncols=True)
    while trainer.step < c.total_steps:
        metrics = trainer.train_step()
        if c.logging.eval_every_steps and eval_records and (trainer.step % c.logging.eval_every_steps == 0 or trainer.step == c.total_steps):
            metrics["eval_reward_mean"] = _evaluate(trainer, eval_records, tokenizer, reward_fn, eval_loader_cfg)
        if on_step is not None:
            on_step(trainer.step, metrics)
        writer.write(trainer.step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", mismatch=f"{metrics['train_rollout_logprob_abs_diff']:.2g}",
                        s=f"{metrics['step_seconds']:.1f}")
        if c.checkpoint.get("save", True) and (trainer.step % c.checkpoint.every_steps == 0 or trainer.step == c.total_steps):
            ckpt.save(trainer.step, trainer.state(), {"step": trainer.step, "data": distributed.gather_process_states(trainer.loader.get_state()),
                                                       "skipped_updates": trainer.skipped_updates, "time": time.time()})
    bar.close()
    ckpt.close()
    writer.close()
    if c.logging.plot_at_end and distributed.is_writer():
        from jaxrl_fp8.plot import plot_workdir

        plot_workdir(workdir)
    if c.checkpoint.export_final_hf:  # every process: it gathers the sharded masters; process 0 writes
        _export_final(trainer, recipe, rollout_policy, tokenizer, workdir)
    return workdir


def _evaluate(trainer, records, tokenizer, reward_fn, loader_cfg) -> float:
    import numpy as np

    from jaxrl_fp8.rl.rewards import compute_rewards

    prompts, answers, texts = [], [], []
    for r in records:
        text, ids = tokenizer.encode_prompt(r.prompt, loader_cfg.use_chat_template)
        prompts.append([int(i) for i in ids])
        texts.append(text)
        answers.append(r.answer)
    samples = trainer.engine.generate(prompts, trainer.sampling(0, greedy=True), return_routed_experts=False)
    responses = [tokenizer.decode([int(t) for t in s.response_ids]) for s in samples]
    return float(np.mean(compute_rewards(reward_fn, texts, responses, answers)))


def _export_final(trainer, recipe, rollout_policy, tokenizer, workdir) -> None:
    """HF safetensors of the final masters in BF16 and, if the rollout format is quantized, in that format
    (through converters.export: the same quantization step as the CLI converters and the live weight push).

    Every process must call it: the masters may be sharded over the mesh (and over processes), so each tensor
    is gathered on its own (`sharding.export.gathered_params`, a collective) while the converter walks them;
    only process 0 writes, each directory built in a temp dir and renamed into place (converters.export).
    """
    import tempfile

    from converters.export import save_exported

    from jaxrl_fp8 import distributed
    from jaxrl_fp8.model.config import to_hf_config
    from jaxrl_fp8.sharding.export import gathered_params

    writer = distributed.is_writer()
    export_dir = os.path.join(workdir, "export")
    if writer:
        os.makedirs(export_dir, exist_ok=True)
    params = gathered_params(trainer.params)  # lazy: one tensor (or one expert) on the host at a time
    hf_config = to_hf_config(trainer.cfg, dtype="bfloat16")
    bf16_dir = os.path.join(export_dir, "hf_bf16")
    with tempfile.TemporaryDirectory() as side:  # tokenizer files travel inside the atomic directory rename
        if writer:
            tokenizer.save(side)
        save_exported(params, "bf16", rollout_policy, bf16_dir, hf_config=hf_config, overwrite=True,
                      side_files_from=side if writer else None, write=writer)
    if recipe.rollout_format != "bf16":
        save_exported(params, recipe, rollout_policy, os.path.join(export_dir, f"hf_{recipe.rollout_format}"),
                      hf_config=hf_config, overwrite=True, side_files_from=bf16_dir if writer else None, write=writer)
    distributed.barrier("export_final")  # nobody moves on before process 0 renamed the directories into place


def main(argv):
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO; keep the progress bar readable
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.key=value for overrides")
    workdir = run(_CONFIG.value)
    print(json.dumps({"workdir": workdir}))


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
