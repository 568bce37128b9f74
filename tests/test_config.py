import pytest

from jaxrl_fp8.config import ConfigError, as_benchmark_run, base_config, recipe_of, validate_config


def test_defaults_and_shipped_configs_validate():
    validate_config(base_config())
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny", "experiments/configs/tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    validate_config(mod.get_config())


@pytest.mark.parametrize("key,value,msg", [
    ("recipe", "fp16", "config.recipe: 'fp16' is not a recipe"),
    ("rl.eps_clip", 1.5, "config.rl.eps_clip"),
    ("rl.tis_clip", 0.0, "config.rl.tis_clip"),
    ("rl.num_minibatches", 3, "config.rl.num_minibatches: must divide"),
    ("rollout.temperature", 0.0, "config.rollout.temperature"),
    ("rollout.engine", "vllm", "config.rollout.engine"),
    ("data.source", "csv", "config.data.source"),
    ("data.task", "sort", "config.data.task"),
    ("model.num_key_value_heads", 3, "config.model.num_key_value_heads"),
    ("model.checkpoint", "/nonexistent", "config.model.checkpoint"),
    ("total_steps", 0, "config.total_steps"),
    ("rollout.ignore_eos", None, "config.rollout.ignore_eos: must be a bool"),
    ("rl.logprob_chunk_rows", -1, "config.rl.logprob_chunk_rows: must be an int >= 0"),
    ("rollout.scheduler", "eager", "config.rollout.scheduler"),
    ("rollout.kv_pages", -1, "config.rollout.kv_pages: must be an int >= 0"),
    ("rollout.refill_every", 0, "config.rollout.refill_every: must be an int >= 1"),
    ("rollout.refill_batch", -1, "config.rollout.refill_batch: must be an int >= 0"),
    ("rl.micro_batch_rows", -2, "config.rl.micro_batch_rows: must be an int >= 0"),
    ("rl.micro_batch_rows", 5, "config.rl.micro_batch_rows: 5 must divide the minibatch"),
    ("rl.logit_chunk_tokens", -1, "config.rl.logit_chunk_tokens: must be an int >= 0"),
    ("kv_cache", "int8", "config.kv_cache: 'int8' is not a KV-cache format"),
])
def test_bad_values_name_their_key(key, value, msg):
    c = base_config()
    section, _, leaf = key.rpartition(".")
    target = c if not section else c[section]
    target[leaf] = value
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        validate_config(c)


def test_recipe_checked_against_hardware():
    c = base_config()
    c.recipe, c.hardware, c.emulate = "mxfp8", "hopper", False
    with pytest.raises(ConfigError, match="no native support on hopper"):
        validate_config(c)
    c.emulate = True
    validate_config(c)
    c.recipe, c.hardware, c.emulate = "fp8_block", "ampere", None
    with pytest.raises(ConfigError, match="config.recipe"):
        validate_config(c)


def test_sglang_needs_servers():
    c = base_config()
    c.rollout.engine = "sglang"
    with pytest.raises(ConfigError, match="config.rollout.sglang_urls"):
        validate_config(c)


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_fp8", "qwen3_4b_bf16_train_fp8_rollout", "qwen3_30b_a3b_mxfp8", "qwen3_30b_a3b_nvfp4"])
def test_gpu_recipe_configs_load_and_fail_only_on_missing_paths(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, f"experiments/configs/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    assert c.rl.use_tis and c.recipe in ("fp8_block", "bf16_train_fp8_rollout", "mxfp8", "nvfp4")
    # here the checkpoint directory does not exist: validation must say so, naming the key
    with pytest.raises(ConfigError, match="config.model.checkpoint"):
        validate_config(c)


def test_as_benchmark_run_turns_off_checkpoints_logging_and_eval():
    c = base_config()
    c.logging.eval_every_steps = 10
    before = c.to_dict()
    assert as_benchmark_run(c) is c
    assert (c.checkpoint.save, c.checkpoint.resume, c.checkpoint.export_final_hf) == (False, False, False)
    assert (c.logging.tensorboard, c.logging.plot_at_end, c.logging.progress_bar) == (False, False, False)
    assert c.logging.eval_every_steps == 0
    changed = {(s, k) for s in before if isinstance(before[s], dict) for k in before[s] if before[s][k] != c[s][k]}
    assert changed == {("checkpoint", k) for k in ("save", "resume", "export_final_hf")} | {
        ("logging", k) for k in ("tensorboard", "plot_at_end", "progress_bar", "eval_every_steps")}
    validate_config(c)


def test_random_init_std_and_embedding_std_are_applied():
    """model.init_std scales every random weight, model.embed_init_std (0: init_std) the token embedding alone; the
    default 0.02 keeps Qwen3's own draw bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_fp8 import train

    c = base_config()
    default = train._model(c, 100)
    c.model.embed_init_std = 1.0
    c.model.init_std = 0.04
    scaled = train._model(c, 100)
    emb, emb0 = np.asarray(scaled.embed.embedding.get_value()), np.asarray(default.embed.embedding.get_value())
    np.testing.assert_allclose(emb, emb0 * 50.0, rtol=1e-6)
    for name in ("q_proj", "o_proj"):
        w, w0 = (np.asarray(getattr(m.layers[0].attn, name).weight.get_value()) for m in (scaled, default))
        np.testing.assert_allclose(w, w0 * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(scaled.final_norm.scale.get_value()), np.ones(c.model.hidden_size, np.float32))
    assert abs(float(jnp.std(default.embed.embedding.get_value())) - 0.02) < 2e-3


def test_scaled_output_init_scales_only_the_residual_outputs():
    """model.scaled_output_init draws attention o_proj and MLP / expert down_proj at init_std / sqrt(2 * layers)
    (Megatron's scaled init); every other weight and the embedding keep their std."""
    import numpy as np

    from jaxrl_fp8 import train

    c = base_config()
    default = train._model(c, 100)
    c.model.scaled_output_init = True
    scaled = train._model(c, 100)
    f = 1.0 / np.sqrt(2 * c.model.num_hidden_layers)
    for i, (layer, layer0) in enumerate(zip(scaled.layers, default.layers)):
        ffn, ffn0 = (getattr(x, "moe", None) or x.mlp for x in (layer, layer0))
        for mod, mod0, factor in ((layer.attn.o_proj, layer0.attn.o_proj, f), (ffn.down_proj, ffn0.down_proj, f),
                                  (layer.attn.q_proj, layer0.attn.q_proj, 1.0), (ffn.up_proj, ffn0.up_proj, 1.0)):
            np.testing.assert_allclose(np.asarray(mod.weight.get_value()), np.asarray(mod0.weight.get_value()) * factor,
                                       rtol=1e-6, err_msg=f"layer {i}")
    np.testing.assert_array_equal(np.asarray(scaled.embed.embedding.get_value()),
                                  np.asarray(default.embed.embedding.get_value()))



def test_kv_cache_overrides_the_recipe():
    c = base_config()
    assert recipe_of(c).kv_cache == "bf16"
    c.kv_cache = "fp8"
    validate_config(c)
    r = recipe_of(c)
    assert r.name == "fp8_block" and r.kv_cache == "fp8"
    c.kv_cache, c.recipe = None, "fp8_block_kv"
    assert recipe_of(c).kv_cache == "fp8"


def test_sglang_cannot_keep_the_fp8_kv_contract():
    c = base_config()
    c.rollout.engine, c.rollout.sglang_urls, c.rollout.weight_sync_dir = "sglang", ("http://h:1",), "/tmp/w"
    c.kv_cache = "fp8"
    with pytest.raises(ConfigError, match="config.rollout.engine: engine=sglang cannot keep the FP8 KV-cache"):
        validate_config(c)
