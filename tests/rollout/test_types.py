"""The rollout contract: parameter validation, SGLang field names, seeds, sample alignment."""

import numpy as np
import pytest

from jaxrl_fp8.rollout.types import (
    MAX_SEED,
    GenerateRequest,
    Sample,
    SamplingParams,
    per_prompt_sampling,
    prompt_seed,
    sample_seed,
)


def test_sampling_params_to_sglang_uses_sglang_names():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33, stop_token_ids=[5, 6],
                        ignore_eos=True, n=4, seed=123)
    assert sp.to_sglang() == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33,
                              "stop_token_ids": [5, 6], "ignore_eos": True, "n": 4, "sampling_seed": 123}
    # Optional fields are left out rather than sent as null.
    assert set(SamplingParams().to_sglang()) == {"temperature", "top_p", "top_k", "max_new_tokens", "ignore_eos", "n"}
    # from_sglang is its inverse, with errors under SGLang's names and the server's limits.
    assert SamplingParams.from_sglang(sp.to_sglang()) == sp and SamplingParams.from_sglang(None) == SamplingParams()
    with pytest.raises(ValueError, match=r"sampling_params\[2\]\.sampling_seed must be an integer"):
        SamplingParams.from_sglang({"sampling_seed": -1}, "sampling_params[2]")
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 4\]"):
        SamplingParams.from_sglang({"n": 5}, max_n=4)
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] = 9 is out of the vocabulary \[0, 8\)"):
        SamplingParams.from_sglang({"stop_token_ids": [1, 9]}, vocab_size=8)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"n": 0}, "n"), ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"), ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"max_new_tokens": True}, "max_new_tokens"),
])
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sample_seed_contract():
    assert sample_seed(77, 0) == 77
    seeds = [sample_seed(77, j) for j in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s <= MAX_SEED for s in seeds)
    assert sample_seed(78, 1) != sample_seed(77, 1)
    # Splitting an n-sample request into single-sample requests keeps every sample's seed.
    sp = SamplingParams(n=5, seed=9)
    assert [sp.for_sample(j).seed for j in range(5)] == [sample_seed(9, j) for j in range(5)]
    assert all(sp.for_sample(j).n == 1 for j in range(5))
    assert SamplingParams(n=3).for_sample(2).seed is None
    with pytest.raises(ValueError):
        sample_seed(1, -1)


def test_prompt_seed_contract():
    """Every (prompt, sample) of a batch draws its own stream: prompt seeds distinct from each other and from the
    sample seeds they derive, deterministic, in range."""
    base = 12345
    prompts = [prompt_seed(base, i) for i in range(256)]
    assert prompts == [prompt_seed(base, i) for i in range(256)] and all(0 <= s <= MAX_SEED for s in prompts)
    streams = {sample_seed(p, j) for p in prompts for j in range(16)}
    assert len(streams) == 256 * 16
    assert prompt_seed(base, 1) != sample_seed(base, 1) and prompt_seed(base + 1, 0) != prompt_seed(base, 0)
    with pytest.raises(ValueError, match="prompt_index"):
        prompt_seed(base, -1)
    with pytest.raises(ValueError, match="seed"):
        prompt_seed(MAX_SEED + 1, 0)


def test_per_prompt_sampling():
    sp = SamplingParams()
    assert per_prompt_sampling(sp, 3) == [sp, sp, sp]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        per_prompt_sampling([sp, sp], 3)
    with pytest.raises(TypeError, match=r"sampling\[1\]"):
        per_prompt_sampling([sp, {"n": 1}], 2)


def _sample(prompt_len=4, resp_len=3, routed_rows=None):
    rows = prompt_len + resp_len - 1 if routed_rows is None else routed_rows
    return Sample(
        prompt_ids=np.arange(prompt_len), response_ids=np.arange(resp_len) + 10,
        rollout_logprobs=-np.arange(resp_len, dtype=np.float64) - 0.5, finish_reason="length",
        weight_version="v1", routed_experts=np.arange(rows * 2 * 3).reshape(rows, 2, 3),
    )


def test_sample_routed_experts_alignment():
    s = _sample(4, 3)
    assert s.routed_experts.dtype == np.int32 and s.routed_experts.shape == (6, 2, 3)
    assert s.rollout_logprobs.dtype == np.float32
    # Row t of the response slice is position P - 1 + t: the position whose logits scored token t.
    np.testing.assert_array_equal(s.response_routed_experts, s.routed_experts[3:6])
    assert s.response_routed_experts.shape == (3, 2, 3)
    np.testing.assert_array_equal(s.token_ids, [0, 1, 2, 3, 10, 11, 12])
    empty = _sample(1, 0)
    assert empty.routed_experts.shape == (0, 2, 3) and empty.response_routed_experts.shape == (0, 2, 3)


def test_sample_rejects_misaligned_fields():
    with pytest.raises(ValueError, match="routed_experts has 3 rows; expected"):
        _sample(4, 3, routed_rows=3)  # response-only routing is not the contract
    with pytest.raises(ValueError, match="one log-prob per response token"):
        Sample(np.arange(3), np.arange(2), np.zeros(3), "stop", "v")
    with pytest.raises(ValueError, match="finish_reason"):
        Sample(np.arange(3), np.arange(2), np.zeros(2), "eos", "v")
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        Sample(np.arange(0), np.arange(2), np.zeros(2), "stop", "v")
    with pytest.raises(ValueError, match="integers"):
        Sample(np.array([0.5, 1.0]), np.arange(2), np.zeros(2), "stop", "v")


def test_generate_request_body():
    req = GenerateRequest(3, (1, 2, 3), SamplingParams(n=2, seed=4), "abc", return_routed_experts=True)
    body = req.to_sglang(rid="abc.a2")
    assert body == {"input_ids": [1, 2, 3], "sampling_params": SamplingParams(n=2, seed=4).to_sglang(),
                    "return_logprob": True, "logprob_start_len": -1, "rid": "abc.a2", "stream": False,
                    "return_routed_experts": True}
    assert "return_routed_experts" not in GenerateRequest(0, (1,), SamplingParams(), "x").to_sglang()
