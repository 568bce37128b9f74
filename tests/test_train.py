"""End-to-end: short training runs of every recipe family on CPU, the mismatch ordering, and exact resume."""

import os

import numpy as np
import pytest

from jaxrl_fp8.config import base_config
from jaxrl_fp8.metrics import read_metrics

TIMING = {"time", "rollout_seconds", "train_seconds", "logprob_seconds", "update_seconds", "sync_seconds", "step_seconds",
          "tokens_per_second"}


def small_config(workdir, recipe, steps=2):
    c = base_config()
    c.workdir = str(workdir)
    c.recipe = recipe
    c.total_steps = steps
    c.model.hidden_size = 128
    c.model.num_hidden_layers = 2
    c.model.num_attention_heads = 2
    c.model.num_key_value_heads = 1
    c.model.head_dim = 32
    c.model.num_experts = 4
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 128
    c.model.intermediate_size = 128
    c.data.prompts_per_step = 4
    c.data.max_prompt_tokens = 8
    c.rollout.n_samples = 4
    c.rollout.max_new_tokens = 3
    c.rl.learning_rate = 1e-3
    c.rl.num_minibatches = 2
    c.checkpoint.every_steps = 1
    c.checkpoint.async_save = False
    c.checkpoint.export_final_hf = False
    c.logging.progress_bar = False
    c.logging.plot_at_end = False
    c.logging.tensorboard = False
    return c


@pytest.mark.slow
@pytest.mark.parametrize("recipe,unified", [("bf16", True), ("fp8_block", True), ("fp8_block_kv", True),
                                            ("bf16_train_fp8_rollout", False), ("mxfp8", True), ("nvfp4", True)])
def test_recipes_run_and_mismatch_ordering(tmp_path, recipe, unified):
    from jaxrl_fp8.train import run

    run(small_config(tmp_path, recipe))
    recs = read_metrics(str(tmp_path))
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert isinstance(r["loss"], float) and np.isfinite(r["loss"]), r
        diff = r["train_rollout_logprob_abs_diff"]
        if unified:
            assert diff == 0.0, f"{recipe}: unified recipe must show zero train-rollout mismatch, got {diff}"
        else:
            assert diff > 0.0, f"{recipe}: BF16 train / FP8 rollout must show a real mismatch"
    assert os.path.isdir(tmp_path / "checkpoints" / "2")


@pytest.mark.slow
def test_resume_reproduces_next_step(tmp_path):
    from jaxrl_fp8.train import run

    straight = small_config(tmp_path / "straight", "fp8_block", steps=3)
    run(straight)
    interrupted = small_config(tmp_path / "resumed", "fp8_block", steps=2)
    run(interrupted)
    resumed = small_config(tmp_path / "resumed", "fp8_block", steps=3)
    run(resumed)
    a = read_metrics(str(tmp_path / "straight"))
    b = read_metrics(str(tmp_path / "resumed"))
    assert [r["step"] for r in b] == [1, 2, 3]
    for key, value in a[2].items():
        if key not in TIMING:
            assert b[2][key] == value, (key, value, b[2][key])


@pytest.mark.slow
def test_run_benchmark_keys_on_step_ignore_eos_chunked_logprobs(tmp_path):
    """What experiments/benchmarks/rl_step.py relies on: `run(c, on_step=...)` sees every step's metrics (with the
    train phase split into logprob + update seconds), `rollout.ignore_eos` makes every response max_new_tokens long
    (the built-in tokenizer's ~24-id vocabulary samples its EOS often at random init), and old log-probs recomputed
    in chunks (`rl.logprob_chunk_rows`, 16 rows in chunks of 3: a shorter last chunk) still equal the unified
    rollout's bit for bit."""
    import gc

    from jaxrl_fp8.config import ConfigError
    from jaxrl_fp8.model.qwen3 import Qwen3
    from jaxrl_fp8.train import run

    c = small_config(tmp_path, "fp8_block", steps=2)
    c.checkpoint.save = False
    c.rollout.max_new_tokens = 6
    c.rollout.ignore_eos = True
    c.rl.logprob_chunk_rows = 3
    seen = []

    alive = []

    def models_alive():  # other tests of this worker may keep theirs (module-level caches): count the run's only
        gc.collect()
        return sum(isinstance(o, Qwen3) for o in gc.get_objects())

    before = models_alive()

    def on_step(step, metrics):
        seen.append((step, dict(metrics)))
        metrics["extra_from_callback"] = 1.5
        alive.append(models_alive() - before)

    run(c, on_step=on_step)
    assert [s for s, _ in seen] == [1, 2]
    # the float32 model is dropped once the trainer copied its masters (it held 4 B/param for the whole run)
    assert alive == [0, 0], alive
    recs = read_metrics(str(tmp_path))
    for (_, m), r in zip(seen, recs):
        assert r["extra_from_callback"] == 1.5
        assert m["train_seconds"] == pytest.approx(m["logprob_seconds"] + m["update_seconds"])
        assert m["logprob_seconds"] > 0 and m["update_seconds"] > 0
        assert m["response_length"] == 6.0 and m["truncated_frac"] == 1.0, m
        assert m["train_rollout_logprob_abs_diff"] == 0.0 and m["train_rollout_max_abs_diff"] == 0.0
    bad = small_config(tmp_path / "bad", "bf16")
    bad.rl.logprob_chunk_rows = -1
    with pytest.raises(ConfigError, match="config.rl.logprob_chunk_rows"):
        run(bad)
