"""SGLangClient: wire parsing (as SGLang sends it), retries/backoff, routed-expert support errors."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from fake_rollout_engine import FakeEngine

from jaxrl_fp8.rollout.http_server import ServerConfig, start_in_thread
from jaxrl_fp8.rollout.sglang_client import (
    MalformedResponse,
    RetryPolicy,
    RoutedExpertsUnsupported,
    SGLangClient,
    SGLangHTTPError,
    ServerUnavailable,
    decode_routed_experts,
    encode_routed_experts,
    parse_finish_reason,
    parse_generate_output,
)
from jaxrl_fp8.rollout.types import GenerateRequest, SamplingParams, sample_seed

NO_SLEEP = RetryPolicy(max_attempts=4, backoff_base_s=0.0, backoff_max_s=0.0)


class Scripted:
    """A stub HTTP server answering each POST/GET with the next scripted (status, json body)."""

    def __init__(self, script):
        self.script, self.hits, self.bodies = list(script), 0, []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                outer.bodies.append(json.loads(self.rfile.read(n)) if n else None)
                status, body = outer.script[min(outer.hits, len(outer.script) - 1)]
                outer.hits += 1
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def sglang_output(prompt_len, tokens, logprobs, finish, routed=None, version="v7"):
    """A /generate output exactly as SGLang shapes it (tuples become lists in JSON)."""
    meta = {"id": "x", "finish_reason": finish, "prompt_tokens": prompt_len, "completion_tokens": len(tokens),
            "cached_tokens": 0, "weight_version": version, "e2e_latency": 0.1,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)]}
    if routed is not None:
        meta["routed_experts"] = routed
    return {"text": "abc", "output_ids": tokens, "meta_info": meta}


def test_routed_experts_codec_round_trip_and_size_check():
    arr = np.random.default_rng(0).integers(0, 128, size=(7, 4, 8), dtype=np.int32)
    payload = encode_routed_experts(arr)
    np.testing.assert_array_equal(decode_routed_experts(payload, 7, 4, 8), arr)
    # Little-endian int32, like SGLang's tensor.numpy().tobytes() on x86.
    assert np.frombuffer(__import__("base64").b64decode(payload), "<i4")[1] == arr.reshape(-1)[1]
    with pytest.raises(MalformedResponse, match=r"expected 6 tokens x 4 layers x 8 experts"):
        decode_routed_experts(payload, 6, 4, 8)
    with pytest.raises(MalformedResponse, match="base64"):
        decode_routed_experts("not base64!", 1, 1, 1)


@pytest.mark.parametrize("value, kind", [({"type": "length", "length": 5}, "length"), ({"type": "stop", "matched": 2}, "stop"),
                                         ({"type": "abort", "message": "m"}, "abort"), ("stop", "stop"), ("length", "length")])
def test_finish_reason_dict_or_string(value, kind):
    assert parse_finish_reason(value) == kind


def test_finish_reason_unknown_is_an_error():
    with pytest.raises(MalformedResponse, match="finish_reason"):
        parse_finish_reason({"type": "eos"})
    with pytest.raises(MalformedResponse):
        parse_finish_reason(None)


def test_parse_output_slices_nothing_and_checks_lengths():
    req = GenerateRequest(0, (5, 6, 7), SamplingParams(n=2, seed=11), "r", return_routed_experts=True,
                          prompt_index=4, first_sample_index=0)
    routing = np.arange((3 + 2 - 1) * 2 * 3, dtype=np.int32).reshape(4, 2, 3)
    out = sglang_output(3, [9, 1], [-0.25, -1.5], {"type": "stop", "matched": 1}, encode_routed_experts(routing))
    s = parse_generate_output(out, req, 1, routed_experts_shape=(2, 3))
    np.testing.assert_array_equal(s.response_ids, [9, 1])
    np.testing.assert_array_equal(s.rollout_logprobs, np.float32([-0.25, -1.5]))
    np.testing.assert_array_equal(s.routed_experts, routing)
    np.testing.assert_array_equal(s.response_routed_experts, routing[2:4])
    assert (s.finish_reason, s.weight_version, s.prompt_index, s.sample_index, s.seed) == ("stop", "v7", 4, 1,
                                                                                          sample_seed(11, 1))
    # Routing for the response only (T rows) is not what SGLang sends: refuse rather than misalign.
    short = sglang_output(3, [9, 1], [-0.25, -1.5], "stop", encode_routed_experts(routing[2:]))
    with pytest.raises(MalformedResponse, match="got 2 token rows"):
        parse_generate_output(short, req, 0, routed_experts_shape=(2, 3))
    bad = sglang_output(3, [9, 1], [-0.25, -1.5], "stop")
    bad["meta_info"]["output_token_logprobs"][1][1] = 4
    with pytest.raises(MalformedResponse, match="for token 4 but output_ids"):
        parse_generate_output(bad, req, 0, routed_experts_shape=(2, 3))


def test_generate_against_an_sglang_shaped_stub_n2():
    outs = [sglang_output(2, [3, 4], [-1.0, -2.0], {"type": "length", "length": 2}),
            sglang_output(2, [5], [-0.5], {"type": "stop", "matched": 5})]
    stub = Scripted([(200, outs)])
    try:
        req = GenerateRequest(0, (1, 2), SamplingParams(n=2, max_new_tokens=2, temperature=0.5), "rid-1")
        samples = SGLangClient(stub.url, retry=NO_SLEEP).generate(req, wire_rid="rid-1.a1")
        assert [s.response_ids.tolist() for s in samples] == [[3, 4], [5]]
        assert [s.sample_index for s in samples] == [0, 1] and samples[1].finish_reason == "stop"
        body = stub.bodies[0]
        assert body["rid"] == "rid-1.a1" and body["input_ids"] == [1, 2] and body["return_logprob"] is True
        assert body["sampling_params"]["n"] == 2 and body["logprob_start_len"] == -1
    finally:
        stub.close()


def test_retries_5xx_with_backoff_then_succeeds():
    ok = sglang_output(1, [2], [-0.1], "length")
    stub = Scripted([(503, {"e": 1}), (500, {"e": 2}), (200, ok)])
    sleeps = []
    try:
        client = SGLangClient(stub.url, retry=RetryPolicy(max_attempts=4, backoff_base_s=0.5, jitter=0.5),
                              sleep=sleeps.append)
        samples = client.generate(GenerateRequest(0, (1,), SamplingParams(max_new_tokens=1), "r"))
        assert stub.hits == 3 and samples[0].response_ids.tolist() == [2]
        assert len(sleeps) == 2 and 0.25 <= sleeps[0] <= 0.5 and 0.5 <= sleeps[1] <= 1.0  # exponential, jittered
    finally:
        stub.close()


def test_4xx_is_not_retried():
    stub = Scripted([(400, {"message": "bad input_ids"})])
    try:
        with pytest.raises(SGLangHTTPError, match="bad input_ids") as e:
            SGLangClient(stub.url, retry=NO_SLEEP).generate(GenerateRequest(0, (1,), SamplingParams(), "r"))
        assert e.value.status == 400 and stub.hits == 1
    finally:
        stub.close()


def test_persistent_5xx_and_connection_refused_raise_server_unavailable():
    stub = Scripted([(502, {})])
    try:
        with pytest.raises(ServerUnavailable, match="after 4 attempts"):
            SGLangClient(stub.url, retry=NO_SLEEP).flush_cache()
        assert stub.hits == 4
    finally:
        stub.close()
    with pytest.raises(ServerUnavailable, match="ConnectionError"):
        SGLangClient(stub.url, retry=NO_SLEEP, connect_timeout_s=1).generate(
            GenerateRequest(0, (1,), SamplingParams(), "r"))
    assert SGLangClient(stub.url).health(timeout_s=1) is False


def test_connection_broken_inside_the_body_is_server_unavailable():
    """A server killed while it answers: headers and part of the body sent, then the socket closed. requests raises
    ChunkedEncodingError (not a ConnectionError); the client retries and then reports the server unavailable, so the
    fleet takes it out and resends the request elsewhere instead of failing the rollout."""
    hits = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hits.append(1)
            self.send_response(200)
            self.send_header("Content-Length", "1084")
            self.end_headers()
            self.wfile.write(b'{"text": "partial')
            self.wfile.flush()
            self.close_connection = True

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ServerUnavailable, match="after 4 attempts; last: ChunkedEncodingError"):
            SGLangClient(url, retry=NO_SLEEP).generate(GenerateRequest(0, (1,), SamplingParams(), "r"))
        assert len(hits) == 4
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_model_info_falls_back_to_legacy_endpoint():
    stub = Scripted([(404, {"detail": "Not Found"}), (200, {"weight_version": "w3", "model_path": "m"})])
    try:
        assert SGLangClient(stub.url, retry=NO_SLEEP).weight_version() == "w3"
        assert stub.hits == 2
    finally:
        stub.close()


def test_missing_routed_experts_support_is_a_clear_error():
    with start_in_thread(FakeEngine(), config=ServerConfig(enable_return_routed_experts=False)) as srv:
        client = SGLangClient(srv.url, retry=NO_SLEEP)
        req = GenerateRequest(0, (3, 4), SamplingParams(max_new_tokens=3, temperature=0.0), "r",
                              return_routed_experts=True)
        with pytest.raises(RoutedExpertsUnsupported, match="--enable-return-routed-experts"):
            client.generate(req)
        with pytest.raises(RoutedExpertsUnsupported, match="--enable-return-routed-experts"):
            client.check_routed_experts_support()
        # Without replay the same server is fine.
        assert client.generate(GenerateRequest(0, (3, 4), SamplingParams(max_new_tokens=3), "r"))[0].routed_experts is None


def test_missing_routed_experts_field_on_a_plain_sglang_stub():
    stub = Scripted([(200, sglang_output(2, [3], [-0.1], "length"))])
    try:
        client = SGLangClient(stub.url, retry=NO_SLEEP, routed_experts_shape=(2, 2))
        req = GenerateRequest(0, (1, 2), SamplingParams(max_new_tokens=1), "r", return_routed_experts=True)
        with pytest.raises(RoutedExpertsUnsupported, match="no meta_info.routed_experts"):
            client.generate(req)
    finally:
        stub.close()
