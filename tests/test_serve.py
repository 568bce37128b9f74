"""`python -m jaxrl_fp8.serve` over real HTTP on localhost: generate with log-probs and routed experts,
a weight update from a disk checkpoint changes outputs and weight_version, bad requests get a 4xx."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

import jaxrl_fp8
from jaxrl_fp8.model import random_policy, tiny_config
from jaxrl_fp8.rollout.sglang_client import SGLangClient, decode_routed_experts
from jaxrl_fp8.rollout.types import GenerateRequest, SamplingParams

SRC = Path(jaxrl_fp8.__file__).resolve().parents[1]
OVERRIDES = {"num_hidden_layers": 2, "mlp_only_layers": [1]}
STARTUP_S = 300  # the server compiles nothing before it listens, but imports JAX and builds the model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    cfg_file = tmp / "tiny.json"
    cfg_file.write_text(json.dumps(OVERRIDES))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxrl_fp8.serve", "--checkpoint", str(cfg_file), "--recipe", "fp8_block",
             "--port", "0", "--max-batch", "4", "--max-seq-len", "24", "--static-shapes",
             "--port-file", str(tmp / "port"), "--weight-version", "init"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.monotonic() + STARTUP_S
        while not (tmp / "port").exists():  # port 0: the server binds a free port and writes it here
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (rc={proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{int((tmp / 'port').read_text())}", tmp
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _generate(url, body, timeout=600):
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_update_and_errors(server):
    url, tmp = server
    assert requests.get(url + "/health", timeout=10).status_code == 200
    info = requests.get(url + "/model_info", timeout=10).json()
    assert (info["weight_version"], info["num_hidden_layers"], info["num_experts_per_tok"], info["vocab_size"]) == ("init", 2, 2, 259)

    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    body = {"input_ids": prompts, "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 11},
            "return_logprob": True, "return_routed_experts": True}
    out = _generate(url, body)
    assert len(out) == 2
    for p, o in zip(prompts, out):
        meta = o["meta_info"]
        assert len(o["output_ids"]) == meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == o["output_ids"] and all(lp < 0 for lp, _, _ in lps)
        routed = decode_routed_experts(meta["routed_experts"], len(p) + 6 - 1, 2, 2)  # checks the size
        assert (routed[:, 1] == -1).all() and ((routed[:, 0] >= 0) & (routed[:, 0] < 8)).all()
        assert meta["weight_version"] == "init"
    again = _generate(url, body)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]  # seeded: reproducible

    # the fleet's client reads the same server (n = 2 samples, routed experts decoded to arrays)
    client = SGLangClient(url)
    samples = client.generate(GenerateRequest(0, tuple(prompts[0]), SamplingParams(max_new_tokens=4, n=2, seed=11), "r0",
                                              return_routed_experts=True))
    assert len(samples) == 2 and samples[0].routed_experts.shape == (3 + 4 - 1, 2, 2)
    assert list(samples[0].response_ids) == out[0]["output_ids"][:4]  # sample 0 uses the base seed itself

    # malformed requests: 4xx with a message, and the server keeps serving
    bad = requests.post(url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and "JSON" in bad.json()["message"]
    oov = requests.post(url + "/generate", json={"input_ids": [1, 259]}, timeout=10)
    assert oov.status_code == 400 and "vocabulary" in oov.json()["message"]
    long = requests.post(url + "/generate", json={"input_ids": [1] * 20, "sampling_params": {"max_new_tokens": 8}}, timeout=10)
    assert long.status_code == 400 and "max_total_tokens" in long.json()["message"]

    # a weight update from a checkpoint saved by the model's save_pretrained
    ckpt = str(tmp / "v1")
    random_policy(tiny_config(**OVERRIDES), seed=5, dtype="float32").save_pretrained(ckpt)
    r = requests.post(url + "/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "v1"}, timeout=600)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == "v1"
    updated = _generate(url, body)
    assert all(o["meta_info"]["weight_version"] == "v1" for o in updated)
    old_lp = np.array([lp for o in out for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
    new_lp = np.array([lp for o in updated for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
    assert not np.array_equal(old_lp, new_lp)

    missing = requests.post(url + "/update_weights_from_disk", json={"model_path": str(tmp / "nope"), "weight_version": "v2"}, timeout=60)
    assert missing.status_code == 400 and not missing.json()["success"]
    assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == "v1"  # unchanged
    assert _generate(url, body)[0]["output_ids"] == updated[0]["output_ids"]


def test_fleet_engine_push_model_exports_and_loads(server):
    """The trainer's SGLang path: push_model exports through the converter into weight_sync_dir/<version>,
    the server loads it (version visible in model_info and in generations), old versions are pruned."""
    from jaxrl_fp8.precision import PrecisionPolicy, get_recipe
    from jaxrl_fp8.rollout.sglang_engine import SGLangFleetEngine

    url, tmp = server
    cfg = tiny_config(**OVERRIDES)
    recipe = get_recipe("fp8_block")
    engine = SGLangFleetEngine([url], weight_sync_dir=str(tmp / "sync"), recipe=recipe,
                               policy=PrecisionPolicy.for_format(recipe.rollout_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts),
                               model_config=cfg, keep_versions=1)
    for seed, version in [(7, "p1"), (8, "p2")]:
        path = engine.push_model(random_policy(cfg, seed=seed, dtype="float32").model, version)
        assert path == str(tmp / "sync" / version)
        assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == version
        assert engine.weight_version == version
        quant = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
        assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert sorted(os.listdir(tmp / "sync")) == ["p2"]  # keep_versions=1: p1 removed after p2 loaded
    out = _generate(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})
    assert out["meta_info"]["weight_version"] == "p2"


def test_help_explains_every_flag():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "jaxrl_fp8.serve", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0
    for flag in ("--checkpoint", "--recipe", "--port", "--host", "--max-batch", "--max-seq-len", "--static-shapes",
                 "--enable-return-routed-experts", "--eos-token-id", "--attention-impl", "--refill-every",
                 "--refill-batch"):
        assert flag in out.stdout


@pytest.mark.parametrize("flag,value", [("--refill-batch", "-1"), ("--refill-every", "0"), ("--kv-pages", "-1")])
def test_bad_scheduler_flags_name_themselves(flag, value, capsys):
    from jaxrl_fp8.serve import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--checkpoint", "tiny", "--port", "0", flag, value])
    assert exit_info.value.code == 2 and f"{flag} must be" in capsys.readouterr().err
