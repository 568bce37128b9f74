"""experiments/benchmarks/quantize.py's measurement loop on CPU (interpret-mode kernels on tiny inputs): every config
is checked bit for bit before it is timed, a wrong kernel is reported with its first differing bits, a failing config
is recorded and the sweep goes on, and each case gets its interleaved rounds, its own copy anchor and (on CPU) the
CUPTI error instead of a device time."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxrl_fp8 import precision as P
from pallas_kernels import quantize as Q

_DIR = Path(__file__).parents[1] / "experiments/benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_DIR))  # the script imports `timing` from its own folder
    try:
        spec = importlib.util.spec_from_file_location("quantize_benchmark", _DIR / "quantize.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(_DIR))


def _wrong_scale(x, cfg):
    q, s = Q.fp8_per_token_group(x, config=cfg, interpret=True)
    return q, s * 2  # every scale off: must be reported, never counted as a result


def test_run_checks_bits_times_in_rounds_and_records_failures(bench, monkeypatch, tmp_path):
    T = Q.TileConfig
    tok = lambda x, cfg: Q.fp8_per_token_group(x, config=cfg, interpret=True)  # noqa: E731
    nv = lambda x, ci: Q.nvfp4(x, global_amax=4.0, config=ci[0], impl=ci[1], interpret=True)  # noqa: E731
    cases = [
        ("fp8_per_token_group", (64, 256), jnp.bfloat16, tok, jax.jit(P.quantize_fp8_per_token_group),
         [T(), T(stages=3)]),
        ("fp8_per_token_group", (32, 128), jnp.float32, _wrong_scale, jax.jit(P.quantize_fp8_per_token_group), [T()]),
        ("nvfp4", (128, 64), jnp.float32, nv, jax.jit(lambda x: P.quantize_nvfp4(x, global_amax=4.0)),
         [(T(rows=128), "v12"), (T(rows=128), "no-such-version")]),
    ]
    monkeypatch.setattr(bench, "cases", lambda quick, kernels: cases)
    monkeypatch.setattr(bench, "copy_anchor", lambda torch_anchor=True: {"xla_copy": {"GBps": 1.0}})
    out = tmp_path / "q.json"
    bench.run(out, False, rounds=2, batch=2, copy_bytes=1 << 20, reps=1, iters=2)  # CPU: 1 MiB copy, few calls
    result = json.loads(out.read_text())
    assert "median of 1 x (2 dispatches" in result["timing"] and "median over 2 rounds" in result["timing"]
    assert "on 2 distinct input copies" in result["timing"]
    assert "CUPTI" in result["copy_anchor"]["device_time"]["xla_copy"]["error"]  # no GPU here: recorded, not raised
    rows = result["rows"]
    timed = [r for r in rows if "error" not in r]
    assert len(timed) == 7  # XLA + 2, XLA + 1, XLA + 1 (the unknown version is an error row)
    for r in timed:
        assert len(r["round_median_ms"]) == 2 and r["median_ms"] > 0 and r["case_copy_GBps"] > 0
        assert r["pct_of_copy"] == pytest.approx(100 * r["GBps"] / r["case_copy_GBps"])
        assert r["pct_of_equal_bytes_copy"] == pytest.approx(100 * r["GBps"] / r["equal_bytes_copy_GBps"])
        assert "error" in r["device_time"]
    ok = [r for r in timed if r["kernel"] != "fp8_per_token_group" or r["in_dtype"] == "bfloat16"]
    assert all(r["bitwise_vs_contract"] for r in ok)
    wrong = [r for r in timed if r["in_dtype"] == "float32" and r["impl"] == "pallas" and r["kernel"] != "nvfp4"]
    assert len(wrong) == 1 and not wrong[0]["bitwise_vs_contract"]
    differing = [m for m in wrong[0]["mismatch"] if m["differ"]]
    assert [m["output"] for m in differing] == [1] and differing[0]["examples"]  # the scales, q untouched
    [failed] = [r for r in rows if "error" in r]
    assert "no-such-version" in failed["error"] and failed["config"]["impl"] == "no-such-version"


def test_device_time_without_cupti_is_an_error_entry(bench):
    d = bench.device_time(jax.jit(lambda a: a * 2), jnp.ones(8))
    assert set(d) == {"error"}


def test_nvfp4_floor_probe_lowers_for_cuda():
    """experiments/benchmarks/nvfp4_floor.py runs only on a GPU; its pipeline probe (every output subset, the dynamic
    schedule, bfloat16 and float32 rows) must still build a Mosaic GPU module here, so it can't break unseen between
    GPU runs."""
    sys.path.insert(0, str(_DIR))
    try:
        spec = importlib.util.spec_from_file_location("nvfp4_floor", _DIR / "nvfp4_floor.py")
        floor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floor)
    finally:
        sys.path.remove(str(_DIR))
    cfg = Q.TileConfig(rows=256, schedule="dynamic")
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.ShapeDtypeStruct((4096, 64), dtype)
        for outs in (("packed", "bs"), ("packed",), ()):
            txt = (jax.jit(lambda a, outs=outs: floor.pipeline_only(a, cfg, outs)).trace(x)
                   .lower(lowering_platforms=("cuda",)).as_text())
            assert txt.count("stablehlo.custom_call @mosaic_gpu") == 1, (dtype, outs)
