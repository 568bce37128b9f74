"""The embedded SGLang-API server over real HTTP on localhost (in-thread servers, ephemeral ports)."""

import threading

import numpy as np
import pytest
import requests
from fake_rollout_engine import FakeEngine, make_table, wait_for, write_checkpoint

from jaxrl_fp8.rollout.http_server import ServerConfig, start_in_thread
from jaxrl_fp8.rollout.sglang_client import RetryPolicy, SGLangClient, SGLangHTTPError
from jaxrl_fp8.rollout.types import GenerateRequest, SamplingParams

ONCE = RetryPolicy(max_attempts=1)


def assert_same_samples(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        assert a.rollout_logprobs.tobytes() == b.rollout_logprobs.tobytes()  # bit for bit through JSON
        assert (a.finish_reason, a.weight_version) == (b.finish_reason, b.weight_version)
        if b.routed_experts is None:
            assert a.routed_experts is None
        else:
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


@pytest.fixture
def server():
    engine = FakeEngine()
    with start_in_thread(engine, config=ServerConfig(max_body_bytes=1 << 16)) as srv:
        srv.engine_ref = engine
        yield srv


def test_generate_with_logprobs_and_routed_experts_round_trips(server):
    client = SGLangClient(server.url, retry=ONCE)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=12, n=3, seed=1234)
    got = client.generate(GenerateRequest(0, (5, 9, 2, 7), sp, "r0", return_routed_experts=True))
    want = FakeEngine().generate([[5, 9, 2, 7]], sp, return_routed_experts=True)
    assert_same_samples(got, want)
    assert got[0].routed_experts.shape == (4 + got[0].response_ids.size - 1, 3, 2)
    assert [s.sample_index for s in got] == [0, 1, 2]
    # Greedy with a stop id: finish "stop", the stop token is the last response token.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    first = FakeEngine().generate([[5, 9]], greedy)[0].response_ids
    stop = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[int(first[2])])
    s = client.generate(GenerateRequest(0, (5, 9), stop, "r1"))[0]
    assert s.finish_reason == "stop" and s.response_ids.tolist() == first[:3].tolist()


def test_batch_request_shape_and_per_prompt_params(server):
    body = {"input_ids": [[3, 4], [5, 6, 7]], "return_logprob": True, "rid": ["a", "b"],
            "sampling_params": [{"n": 2, "max_new_tokens": 4, "sampling_seed": 1}, {"max_new_tokens": 3, "temperature": 0}]}
    out = requests.post(server.url + "/generate", json=body, timeout=10).json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "b"]
    want = FakeEngine().generate([[3, 4], [5, 6, 7]], [SamplingParams(n=2, max_new_tokens=4, seed=1),
                                                       SamplingParams(max_new_tokens=3, temperature=0.0)])
    for o, w in zip(out, want):
        assert o["output_ids"] == w.response_ids.tolist()
        assert [e[1] for e in o["meta_info"]["output_token_logprobs"]] == w.response_ids.tolist()
        assert o["meta_info"]["finish_reason"]["type"] == w.finish_reason
        assert o["meta_info"]["weight_version"] == "v0" and "routed_experts" not in o["meta_info"]
    single = requests.post(server.url + "/generate", json={"input_ids": [3, 4]}, timeout=10).json()
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]  # return_logprob off


BAD_REQUESTS = [
    (b"{not json", 400, "malformed JSON"),
    (b"\xff\xfe", 400, "malformed JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"sampling_params": {}}, 400, "'input_ids' is required"),
    ({"input_ids": [1], "max_tokens": 3}, 400, "unsupported fields ['max_tokens']"),
    ({"input_ids": "1 2 3"}, 400, "'input_ids' must be a non-empty list"),
    ({"input_ids": []}, 400, "'input_ids' must be a non-empty list"),
    ({"input_ids": [1, 2.5]}, 400, "input_ids[1] must be an integer token id"),
    ({"input_ids": [True]}, 400, "input_ids[0] must be an integer token id"),
    ({"input_ids": [1, 64]}, 400, "input_ids[1] = 64 is out of the vocabulary [0, 64)"),
    ({"input_ids": [[1], [-1]]}, 400, "input_ids[1][0] = -1 is out of the vocabulary"),
    ({"input_ids": [[1], []]}, 400, "input_ids[1] must not be empty"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, 400, "sampling_params has unsupported fields"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, 400, "sampling_params.n must be an integer in [1, 64]"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, 400, "stop_token_ids[0] = 999"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": -4}}, 400, "sampling_seed"),
    ({"input_ids": [1], "sampling_params": [{}, {}]}, 400, "2 entries for 1 prompts"),
    ({"input_ids": [1] * 250, "sampling_params": {"max_new_tokens": 10}}, 400, "over this server's max_total_tokens 256"),
    ({"input_ids": [1], "stream": True}, 400, "'stream': true is not supported"),
    ({"text": "hello"}, 400, "send 'input_ids'"),
    ({"input_ids": [1], "logprob_start_len": 0}, 400, "logprob_start_len"),
    ({"input_ids": [1], "return_logprob": "yes"}, 400, "'return_logprob' must be a boolean"),
    ({"input_ids": [[1], [2]], "rid": ["only-one"]}, 400, "'rid' must be a string or a list of 2 strings"),
    ({"input_ids": [1] * 30000}, 413, "over the limit of 65536 bytes"),
]


@pytest.mark.parametrize("body, status, message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_malformed_requests_get_4xx_with_a_message(server, body, status, message):
    session = requests.Session()  # keep-alive: the same connection must stay usable after the error
    if isinstance(body, bytes):
        resp = session.post(server.url + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=10)
    else:
        resp = session.post(server.url + "/generate", json=body, timeout=10)
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["code"] == status and err["object"] == "error"
    assert message in err["message"], err["message"]
    # ignore_eos: a sampled end-of-sequence token would end the answer early (the length checks the connection)
    ok = session.post(server.url + "/generate",
                      json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}, timeout=10)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_routing_errors_and_control_validation(server):
    assert requests.get(server.url + "/nope", timeout=5).status_code == 404
    assert requests.get(server.url + "/generate", timeout=5).status_code == 405
    bad = requests.post(server.url + "/update_weights_from_disk", json={"weight_version": "v1"}, timeout=5)
    assert bad.status_code == 400 and "'model_path'" in bad.json()["message"]
    bad = requests.post(server.url + "/pause_generation", json={"mode": "later"}, timeout=5)
    assert bad.status_code == 400 and "'mode'" in bad.json()["message"]
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_engine_failure_is_a_500_and_the_server_keeps_serving(server):
    engine = server.engine_ref
    real = engine.generate

    def broken(*a, **k):
        engine.generate = real
        raise RuntimeError("device lost")

    engine.generate = broken
    resp = requests.post(server.url + "/generate", json={"input_ids": [1]}, timeout=10)
    assert resp.status_code == 500 and "device lost" in resp.json()["message"]
    assert requests.post(server.url + "/generate", json={"input_ids": [1]}, timeout=10).status_code == 200


def test_concurrent_requests_are_batched_into_one_engine_call():
    engine = FakeEngine(step_delay_s=0.01)
    reqs = [GenerateRequest(i, (i % 60 + 2, 3), SamplingParams(temperature=0.5 + i / 40, max_new_tokens=6, seed=i), f"r{i}")
            for i in range(16)]
    with start_in_thread(engine, config=ServerConfig(max_wait_s=0.05)) as srv:
        client = SGLangClient(srv.url, retry=ONCE)
        results = [None] * len(reqs)

        def run(i):
            results[i] = client.generate(reqs[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert max(engine.batch_sizes) > 1 and len(engine.batch_sizes) < len(reqs), engine.batch_sizes
    ref = FakeEngine()
    for req, got in zip(reqs, results):  # batching changed nothing: each request as if alone
        assert_same_samples(got, ref.generate([list(req.prompt_ids)], req.sampling))


def test_weight_update_changes_outputs_and_weight_version(server, tmp_path):
    client = SGLangClient(server.url, retry=ONCE)
    req = GenerateRequest(0, (7, 8, 9), SamplingParams(temperature=0.0, max_new_tokens=10), "r")
    before = client.generate(req)[0]
    table = make_table(1)
    ckpt = write_checkpoint(str(tmp_path / "step1.npz"), table)
    flushes = server.engine_ref.cache_flushes
    client.update_weights_from_disk(ckpt, weight_version="v1")
    assert client.weight_version() == "v1" and server.engine_ref.cache_flushes == flushes + 1
    after = client.generate(req)[0]
    assert after.weight_version == "v1" and before.weight_version == "v0"
    assert after.response_ids.tolist() != before.response_ids.tolist()
    assert_same_samples([after], FakeEngine(table=table, weight_version="v1").generate([[7, 8, 9]], req.sampling))
    # A checkpoint that cannot be read: 400 with success=false; weights and version unchanged.
    with pytest.raises(SGLangHTTPError, match="Failed to load weights") as e:
        client.update_weights_from_disk(str(tmp_path / "missing.npz"), weight_version="v2")
    assert e.value.status == 400
    assert client.weight_version() == "v1"
    assert_same_samples(client.generate(req), [after])
    # Relabel without loading (SGLang's /update_weight_version).
    client.update_weight_version("v1-relabelled")
    assert client.generate(req)[0].weight_version == "v1-relabelled"


def test_pause_blocks_new_generation_until_continue(server):
    client = SGLangClient(server.url, retry=ONCE)
    client.pause_generation("in_place")
    assert server.engine_ref.paused
    done = threading.Event()
    out = []
    t = threading.Thread(target=lambda: (out.append(client.generate(
        GenerateRequest(0, (4,), SamplingParams(max_new_tokens=3, ignore_eos=True), "r"))), done.set()))
    t.start()
    assert not done.wait(0.4), "generation ran while paused"
    assert requests.get(server.url + "/health", timeout=5).status_code == 200  # control plane still answers
    client.continue_generation()
    assert done.wait(10) and out[0][0].finish_reason == "length" and not server.engine_ref.paused


def test_pause_abort_answers_queued_requests_and_lets_the_running_batch_finish():
    engine = FakeEngine(step_delay_s=0.06)
    with start_in_thread(engine, config=ServerConfig(max_wait_s=0.0)) as srv:
        client = SGLangClient(srv.url, retry=ONCE)
        results = {}

        def run(name, prompt):
            results[name] = client.generate(GenerateRequest(0, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True), name))

        running = threading.Thread(target=run, args=("running", (5,)))
        running.start()
        wait_for(lambda: engine.batch_sizes, what="the first batch (0.6 s) to enter the engine")
        queued = threading.Thread(target=run, args=("queued", (6,)))
        queued.start()
        wait_for(lambda: srv.batcher.queued_prompts, what="the second request to queue behind it")
        client.pause_generation("abort")
        queued.join(5)
        assert results["queued"][0].finish_reason == "abort" and results["queued"][0].response_ids.size == 0
        running.join(5)
        assert results["running"][0].finish_reason == "length" and results["running"][0].response_ids.size == 10
        client.continue_generation()


def test_health_info_and_cache_endpoints(server):
    client = SGLangClient(server.url, retry=ONCE)
    assert client.health() and client.health_generate()
    info = client.model_info()
    assert (info["weight_version"], info["vocab_size"], info["num_hidden_layers"], info["num_experts_per_tok"]) == ("v0", 64, 3, 2)
    assert client.server_info()["enable_return_routed_experts"] is True
    assert requests.get(server.url + "/get_model_info", timeout=5).json()["weight_version"] == "v0"
    assert requests.get(server.url + "/get_weight_version", timeout=5).json() == {"weight_version": "v0"}
    before = server.engine_ref.cache_flushes
    assert requests.get(server.url + "/flush_cache", timeout=5).status_code == 200
    client.flush_cache()
    assert server.engine_ref.cache_flushes == before + 2


def test_graceful_shutdown_finishes_the_running_request():
    engine = FakeEngine(step_delay_s=0.05)
    srv = start_in_thread(engine)
    url = srv.url
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", requests.post(
        url + "/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}, timeout=10)))
    t.start()
    wait_for(lambda: engine.batch_sizes, what="the request to reach the engine")
    srv.shutdown()
    t.join(10)
    assert result["r"].status_code == 200 and len(result["r"].json()["output_ids"]) == 8
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=2)
