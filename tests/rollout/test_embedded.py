"""The embedded engine: protocol, batch independence, n samples and seeds, stops, weight updates."""

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_fp8.model import hf_io, loader, random_policy, tiny_config, to_hf_config
from jaxrl_fp8.precision import get_recipe, quantize_weight
from jaxrl_fp8.precision.names import TensorRole, role_of_hf
from jaxrl_fp8.rollout.embedded import EmbeddedEngine
from jaxrl_fp8.rollout.types import ModelInfo, RolloutEngine, Sample, SamplingParams

CFG = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,))
KW = dict(max_batch=4, max_seq_len=24, static_shapes=True)  # one compiled program for the whole module
SP = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [100], [33, 44], [250, 251, 252, 253, 254]]


@pytest.fixture(scope="module")
def policies():
    recipe = get_recipe("fp8_block")
    return random_policy(CFG, seed=0, dtype="float32", recipe=recipe), random_policy(CFG, seed=1, dtype="float32", recipe=recipe)


@pytest.fixture(scope="module")
def engine(policies):
    return EmbeddedEngine(policies[0], **KW)


def _same(a: list[Sample], b: list[Sample]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.rollout_logprobs.view(np.uint32), y.rollout_logprobs.view(np.uint32))
        assert x.finish_reason == y.finish_reason
        if x.routed_experts is not None or y.routed_experts is not None:
            np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


def test_protocol_and_model_info(engine):
    assert isinstance(engine, RolloutEngine)
    info = engine.model_info()
    assert isinstance(info, ModelInfo)
    assert (info.vocab_size, info.num_hidden_layers, info.num_experts_per_tok, info.max_total_tokens) == (259, 2, 2, 24)
    assert engine.health() and engine.weight_version == "0"


def test_samples_do_not_depend_on_the_batch(engine):
    """5 prompts in two chunks (sorted by length) give the same bits as each prompt alone."""
    together = engine.generate(PROMPTS, SP, return_routed_experts=True)
    assert [s.prompt_index for s in together] == list(range(5))
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], SP, return_routed_experts=True)
        _same([together[i]], alone)
        s = together[i]
        assert s.routed_experts.shape == (len(p) + s.response_ids.size - 1, 2, 2)
        assert s.seed == 7 and s.weight_version == "0"
    assert np.isfinite(np.concatenate([s.rollout_logprobs for s in together])).all()
    assert all(s.rollout_logprobs.max() < 0 for s in together)


def test_n_samples_split_into_single_requests(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=123)
    many = engine.generate([PROMPTS[1]], sp)
    assert [s.sample_index for s in many] == [0, 1, 2]
    singles = [engine.generate([PROMPTS[1]], sp.for_sample(j))[0] for j in range(3)]
    _same(many, singles)
    assert len({tuple(s.response_ids) for s in many}) > 1  # different seeds, different samples
    unseeded = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, n=2))
    assert all(s.seed is not None for s in unseeded)
    _same([unseeded[1]], engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, seed=unseeded[1].seed)))


def test_stops_eos_lengths(policies):
    base = EmbeddedEngine(policies[0], **KW)
    free = base.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, seed=5))[0]
    stop_tok = int(free.response_ids[3])
    first = int(np.argmax(free.response_ids == stop_tok))
    eos_engine = EmbeddedEngine(policies[0], eos_token_ids=[stop_tok], **KW)
    stopped = eos_engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, seed=5))[0]
    assert stopped.finish_reason == "stop" and stopped.response_ids.size == first + 1
    np.testing.assert_array_equal(stopped.response_ids, free.response_ids[: first + 1])
    ignored = eos_engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, seed=5, ignore_eos=True))[0]
    _same([ignored], [free])
    assert ignored.finish_reason == "length"
    # stop_token_ids are honoured even with ignore_eos (SGLang's rule)
    by_id = base.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, seed=5, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    _same([by_id], [stopped])
    empty = base.generate([PROMPTS[1]], SamplingParams(max_new_tokens=0), return_routed_experts=True)[0]
    assert empty.response_ids.size == 0 and empty.finish_reason == "length"
    assert empty.routed_experts.shape == (len(PROMPTS[1]) - 1, 2, 2)
    greedy = base.generate([PROMPTS[3]] * 2, [SamplingParams(temperature=0.0, max_new_tokens=5, seed=s) for s in (1, 2)])
    _same([greedy[0]], [greedy[1]])


def test_rejects_bad_requests(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 259]], SP)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        engine.generate([[1] * 20], SP)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SP)


def _hf_arrays(policy):
    return [(name, producer()) for name, (_, _, producer) in loader.hf_tensors_of(policy.model).items()]


def test_weight_updates(policies, tmp_path):
    old, new = policies
    reference = EmbeddedEngine(new, **KW).generate(PROMPTS[:2], SP, return_routed_experts=True)
    eng = EmbeddedEngine(old, **KW)
    before = eng.generate(PROMPTS[:2], SP)
    assert any(not np.array_equal(a.rollout_logprobs, b.rollout_logprobs) for a, b in zip(before, reference))

    eng.update_params(new, "v1")
    out = eng.generate(PROMPTS[:2], SP, return_routed_experts=True)
    _same(out, reference)
    assert eng.weight_version == "v1" and all(s.weight_version == "v1" for s in out)

    eng.update_params(old, "v0")
    eng.update_weights(_hf_arrays(new), "v2")  # HF names, as a live export sends them
    _same(eng.generate(PROMPTS[:2], SP, return_routed_experts=True), reference)
    assert eng.weight_version == "v2"

    # a partial update: one expert of one layer back to the old weights == an engine on that hybrid model
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    old_value = dict(_hf_arrays(old))[name]
    eng.update_weights([(name, old_value)], "v3")
    hybrid = {tp: v for tp, v in loader.model_params(new.model)}
    hybrid["layers.0.moe.up_proj.weight"] = hybrid["layers.0.moe.up_proj.weight"].at[3].set(jnp.asarray(old_value))
    _same(eng.generate(PROMPTS[:2], SP), EmbeddedEngine(hybrid, CFG, recipe=get_recipe("fp8_block"), **KW).generate(PROMPTS[:2], SP))

    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([(name, old_value[:, :3])], "bad")
    with pytest.raises(ValueError, match="not a Qwen3"):
        eng.update_weights([("model.layers.0.bogus.weight", old_value)], "bad")
    assert eng.weight_version == "v3"  # a failed update changes nothing

    path = str(tmp_path / "ckpt")
    new.save_pretrained(path)
    eng.update_weights_from_disk(path, "disk")
    _same(eng.generate(PROMPTS[:2], SP, return_routed_experts=True), reference)
    assert eng.weight_version == "disk" and eng.model_info().model_path == path


def test_update_from_live_fp8_export(policies):
    """`converters.export` buckets (block-FP8 weight + weight_scale_inv pairs), sent in one call = one version."""
    import itertools

    from converters.export import export_weights

    old, new = policies
    eng = EmbeddedEngine(old, **KW)
    buckets = list(export_weights(new.model, get_recipe("fp8_block"), new.train_precision, bucket_bytes=1 << 15,
                                  high_precision_dtype=None))
    assert len(buckets) > 1 and any(n.endswith("_scale_inv") for b in buckets for n, _ in b)
    eng.update_weights(itertools.chain.from_iterable(buckets), "export")
    _same(eng.generate(PROMPTS[:2], SP), EmbeddedEngine(new, **KW).generate(PROMPTS[:2], SP))
    fp8 = [(n, a) for b in buckets for n, a in b if n == "model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match="scale_inv"):
        eng.update_weights(fp8, "bad")  # FP8 data without its scale
    assert eng.weight_version == "export"


def test_update_from_fp8_checkpoint_uses_its_quantized_weights(policies, tmp_path):
    """An FP8 checkpoint's weights (kept as QuantizedWeight) give the same bits as quantizing the masters."""
    new = policies[1]
    tensors = {}
    for name, value in _hf_arrays(new):
        if role_of_hf(name) in (TensorRole.LINEAR, TensorRole.EXPERT):
            qw = quantize_weight(jnp.asarray(value), "fp8-block")
            q = np.asarray(qw.data).astype(ml_dtypes.float8_e4m3fn)
            s = np.asarray(qw.scale, np.float32)
            tensors[name] = (q.shape, q.dtype, lambda q=q: q)
            tensors[name + "_scale_inv"] = (s.shape, s.dtype, lambda s=s: s)
        else:
            tensors[name] = (value.shape, value.dtype, lambda v=value: v)
    config = to_hf_config(CFG, dtype="float32")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = str(tmp_path / "fp8")
    hf_io.save_sharded(path, tensors, config=config)
    eng = EmbeddedEngine(policies[0], **KW)
    eng.update_weights_from_disk(path, "fp8")
    _same(eng.generate(PROMPTS[:2], SP), EmbeddedEngine(new, **KW).generate(PROMPTS[:2], SP))


def test_no_sample_mixes_versions(policies):
    """Updates racing a long generate land between calls: each call's samples carry one version."""
    eng = EmbeddedEngine(policies[0], **KW)
    versions, errors = [], []

    def roll():
        try:
            for _ in range(3):
                versions.append({s.weight_version for s in eng.generate(PROMPTS, SP)})
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    t = threading.Thread(target=roll)
    t.start()
    for i, p in enumerate([policies[1], policies[0], policies[1]]):
        eng.update_params(p, f"r{i}")
    t.join()
    assert not errors and all(len(v) == 1 for v in versions)


def test_python_decode_loop_matches_while_loop(policies, engine):
    """The static scheduler's Python-driven loop gives the continuous scheduler's bits (the module's engine)."""
    from jaxrl_fp8.rollout.embedded import EngineConfig

    py = EmbeddedEngine(policies[0], engine_config=EngineConfig(decode_loop="python", scheduler="static", **KW))
    _same(py.generate(PROMPTS[:3], SP, return_routed_experts=True), engine.generate(PROMPTS[:3], SP, return_routed_experts=True))


def test_min_new_bucket_shares_one_program_across_response_lengths(policies):
    """A 1-token and an 8-token request compile one program when min_new_bucket covers both (the decode
    benchmark's two timings), and the short run's token is the long run's first: the static scheduler's
    generate program, and the continuous scheduler's decode program."""
    from jaxrl_fp8.rollout import embedded, programs

    with pytest.raises(ValueError, match="min_new_bucket"):
        embedded.EngineConfig(min_new_bucket=0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    for scheduler, program in (("static", embedded._generate_while), ("continuous", programs.decode_slots)):
        eng = EmbeddedEngine(policies[0], engine_config=embedded.EngineConfig(max_batch=2, max_seq_len=40, min_new_bucket=8,
                                                                             scheduler=scheduler))
        before = program._cache_size()
        long = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
        short = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=1, seed=5))
        assert program._cache_size() == before + 1, scheduler
        for a, b in zip(long, short):
            assert b.response_ids.size == 1 and b.finish_reason == "length"
            assert a.response_ids[0] == b.response_ids[0]
            assert a.rollout_logprobs[:1].view(np.uint32) == b.rollout_logprobs.view(np.uint32)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "nvfp4"])
def test_weight_push_program_equals_the_eager_contract(recipe):
    """The separate placement prepares a weight version as one jitted program; every operand has the bits of the
    contract's functions run eagerly (the trainer's ops quantize the same values inside its own programs)."""
    from flax import nnx

    from jaxrl_fp8.rollout.embedded import _prepare_one_device, prepare_rollout_params

    policy = random_policy(CFG, seed=3, dtype="float32", recipe=get_recipe(recipe))
    eng = EmbeddedEngine(policy, **KW)
    graphdef, state = nnx.split(policy.model)
    jitted = jax.tree.leaves(_prepare_one_device(graphdef, state, eng.precision))
    eager = jax.tree.leaves(prepare_rollout_params(policy.model, eng.precision)[1])
    assert len(jitted) == len(eager) and any(x.dtype != jnp.float32 for x in eager)  # the projections were converted
    for a, b in zip(jitted, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(jax.tree.leaves(eng._weights.state), eager):  # what the engine serves
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_decode_loops_take_fp8_weights_as_operands_prepared_once(engine):
    """`programs.loop_operands`: every fp8-block weight of the served state becomes operands only (no value) with the
    same e4m3 data and scales; everything else is left as it is. (The generate tests above run through it.)"""
    from jaxrl_fp8.ops.operands import PreparedWeight
    from jaxrl_fp8.precision import QuantizedWeight
    from jaxrl_fp8.rollout.programs import loop_operands

    state = engine._weights.state
    before = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, QuantizedWeight))
    after = jax.tree.leaves(loop_operands(state), is_leaf=lambda v: isinstance(v, PreparedWeight))
    assert len(before) == len(after) and sum(isinstance(v, QuantizedWeight) for v in before) > 0
    for a, b in zip(before, after):
        if isinstance(a, QuantizedWeight):
            assert isinstance(b, PreparedWeight) and b.value is None and b.shape == a.shape
            np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.q).view(np.uint8))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
        else:
            assert b is a


def test_fp8_rollout_weights_are_quantized_on_the_trainers_backend(monkeypatch):
    """The engine's fp8-block operands come from the quantizer the trainer's GEMMs use for that shape (on Hopper the
    Pallas kernel, whose bits XLA:GPU's fusion of the contract does not always give for BF16 weights: decision record
    0001). A rollout quantized on the other backend failed the 4k bitwise GPU test (fp8_block, H100)."""
    from jaxrl_fp8.ops import backends, operands
    from jaxrl_fp8.precision import formats as F
    from jaxrl_fp8.rollout.embedded import rollout_operand

    asked = []
    quantize = operands.fp8_weight
    monkeypatch.setattr(backends, "resolve", lambda backend, fmt, n, k: asked.append((backend, fmt, n, k)) or "xla")
    monkeypatch.setattr(operands, "fp8_weight", lambda w, backend=None, **kw: asked.append(backend) or quantize(w, backend, **kw))
    w = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256, 384)), jnp.bfloat16)
    got = rollout_operand(w, F.FP8_BLOCK)
    assert asked == [(None, F.FP8_BLOCK, 256, 384), "xla"]  # the trainer's choice (auto), then that backend
    q, s = quantize(w, "xla")
    np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(s))
