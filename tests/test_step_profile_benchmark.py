"""experiments/benchmarks/step_profile.py: the kernel categoriser on made-up names, the trace parser on a GPU-shaped
XSpace built from a text proto (stream lines summed, derived "XLA Ops" not, host events ignored) and on nested
XLA:CPU thunks (self times), and `--tiny` on CPU end to end (decode + update, fp8_block): the JSON's structure,
categories summing to the kernel time, the traces kept under --trace-dir."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "step_profile.py"
sys.path.insert(0, str(SCRIPT.parent))

import hlo_sources  # noqa: E402
import step_profile as sp  # noqa: E402


def test_categorize_made_up_kernel_names():
    want = {
        "gemm_grouped_fp8_mosaic_gpu_kernel": "fp8 grouped GEMM (ours)",
        "gemm_wgrad_fp8_mosaic_gpu_kernel": "fp8 grouped wgrad (ours)",
        "gemm_wgrad_fp8_gather_mosaic_gpu_kernel": "fp8 grouped wgrad (ours)",
        "gemm_dense_fp8_mosaic_gpu_kernel": "fp8 dense GEMM (ours)",
        "gemm_grouped_bf16_nk_mosaic_gpu_kernel": "bf16 grouped GEMM (ours)",
        "gemm_wgrad_bf16_mosaic_gpu_kernel": "bf16 grouped GEMM (ours)",
        "gemm_dense_bf16_kn_mosaic_gpu_kernel": "bf16 dense GEMM (ours: split-BF16 router / lm_head / projections)",
        "attention_paged_mosaic_gpu_kernel": "flash attention (ours)",
        "attention_bwd_dkv_mosaic_gpu_kernel": "flash attention (ours)",
        "quantize_fp8_g128_dyn_mosaic_gpu_kernel": "quantize (ours)",
        "quantize_fp8_transposed_g128_mosaic_gpu_kernel": "quantize (ours)",
        "anonymous_mosaic_gpu_kernel": "Mosaic GPU, unnamed",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "dense GEMM (cuBLAS / CUTLASS / XLA dot)",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN": "dense GEMM (cuBLAS / CUTLASS / XLA dot)",
        "cutlass3x_sm90_tensorop_s64x128x16gemm_bf16": "dense GEMM (cuBLAS / CUTLASS / XLA dot)",
        "ynn_fusion.12": "dense GEMM (cuBLAS / CUTLASS / XLA dot)",
        "void cub::DeviceRadixSortOnesweepKernel<Policy>": "sort / scatter / gather (routing, sampling, cache writes)",
        "loop_dynamic_update_slice_fusion_3": "sort / scatter / gather (routing, sampling, cache writes)",
        "input_scatter_fusion": "sort / scatter / gather (routing, sampling, cache writes)",
        "loop_gather_fusion_1": "sort / scatter / gather (routing, sampling, cache writes)",
        "MemcpyD2H": "copies / memcpy / memset",
        "Memset": "copies / memcpy / memset",
        "copy.291": "copies / memcpy / memset",
        "loop_transpose_fusion_1": "copies / memcpy / memset",
        "wrapped_concatenate": "copies / memcpy / memset",
        "input_reduce_fusion_2": "reductions",
        "reduce_convert_fusion.1": "reductions",
        "loop_multiply_fusion": "fusions (loop / elementwise)",
        "wrapped_add": "fusions (loop / elementwise)",
        "triton_softmax": "fusions (loop / elementwise)",
        "while.745": "while-loop control",
        "rng_bit_generator": "other",
    }
    assert {name: sp.categorize(name) for name in want} == want
    assert set(want.values()) == {c for c, _ in sp.CATEGORIES}  # every category has a name that lands in it
    assert sp.kind("loop_add_fusion_3") == "loop_add_fusion" and sp.kind("copy.291") == "copy"
    assert sp.kind("gemm_grouped_fp8_mosaic_gpu_kernel") == "gemm_grouped_fp8_mosaic_gpu_kernel"


def _event(meta, offset_us, dur_us, **stats):
    s = "".join(f' stats {{ metadata_id: {sid} str_value: "{v}" }}' for sid, v in ((1 if k == "hlo_op" else 2, v)
                                                                                 for k, v in stats.items()))
    return f"events {{ metadata_id: {meta} offset_ps: {int(offset_us * 1e6)} duration_ps: {int(dur_us * 1e6)}{s} }}"


META = """
  event_metadata { key: 1 value { id: 1 name: "gemm_grouped_fp8_mosaic_gpu_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "MemcpyD2H" } }
  event_metadata { key: 3 value { id: 3 name: "loop_add_fusion" } }
  event_metadata { key: 4 value { id: 4 name: "while.5" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_module" } }
"""


def test_parser_reads_gpu_stream_lines_not_derived_lines():
    from jax.profiler import ProfileData

    dec = {"hlo_module": "jit_decode_slots"}
    stream = " ".join([_event(1, 0, 10, hlo_op="custom-call.1", **dec), _event(3, 12, 2, hlo_op="fusion.1", **dec),
                       _event(2, 15, 1, **dec), _event(3, 30, 4, hlo_op="fusion.9", hlo_module="jit_place_rows"),
                       _event(1, 40, 10, hlo_op="custom-call.1", **dec)])
    second = _event(3, 5, 3, hlo_op="fusion.2", **dec)  # another stream, overlapping the first kernel
    txt = f"""
planes {{ id: 1 name: "/device:GPU:0"
  lines {{ id: 1 name: "Stream #13(Kernel,MemcpyD2H)" timestamp_ns: 1000 {stream} }}
  lines {{ id: 2 name: "Stream #14(Kernel)" timestamp_ns: 1000 {second} }}
  lines {{ id: 3 name: "XLA Ops" timestamp_ns: 1000 {_event(3, 0, 50)} }}
  lines {{ id: 4 name: "XLA Modules" timestamp_ns: 1000 {_event(3, 0, 50)} }}
  {META} }}
planes {{ id: 2 name: "/host:CPU"
  lines {{ id: 1 name: "tf_XLAPjRtCpuClient/1" timestamp_ns: 1000 {_event(3, 0, 99, hlo_op="fusion.1", **dec)} }}
  {META} }}
"""
    profile = ProfileData.from_text_proto(txt)
    kernels, source = sp.trace_kernels(profile)
    assert source == "device_streams" and len(kernels) == 6
    s, how = sp.program_summary(kernels, sp.DECODE_MODULE, 2, top=3)  # 2 steps
    assert how == "module" and s["kernels"] == 5 / 2
    assert s["kernel_ms"] == pytest.approx((10 + 2 + 1 + 10 + 3) / 2 / 1e3)
    assert s["busy_ms"] == pytest.approx((10 + 2 + 1 + 10) / 2 / 1e3)  # the second stream's kernel overlaps
    assert s["program_runs"] == 2 and s["span_ms"] == pytest.approx((16 + 10) / 2 / 1e3)  # place_rows splits the runs
    cats = {c["category"]: c["ms"] for c in s["categories"]}
    assert cats == pytest.approx({"fp8 grouped GEMM (ours)": 0.010, "fusions (loop / elementwise)": 0.0025,
                                  "copies / memcpy / memset": 0.0005})
    assert sum(cats.values()) == pytest.approx(s["kernel_ms"])
    assert s["top_kernels"][0] == {"name": "gemm_grouped_fp8_mosaic_gpu_kernel", "category": "fp8 grouped GEMM (ours)",
                                   "count": 1.0, "ms": 0.010, "share": pytest.approx(20 / 26), "hlo_op": "custom-call.1",
                                   "modules": ["jit_decode_slots"]}
    info = sp.trace_info(profile, kernels, source)
    assert info["modules"] == {"jit_decode_slots": 5, "jit_place_rows": 1} and info["with_hlo_op"] == 5
    lines = {(x["plane"], x["line"]): x["events"] for x in sp.line_inventory(profile)}
    assert lines[("/device:GPU:0", "XLA Ops")] == 1 and lines[("/host:CPU", "tf_XLAPjRtCpuClient/1")] == 1


def test_parser_falls_back_to_host_thunks_with_self_times():
    from jax.profiler import ProfileData

    m = {"hlo_module": "jit__update"}
    body = " ".join([_event(4, 0, 20, hlo_op="while.5", **m), _event(3, 2, 5, hlo_op="fusion.1", **m),
                     _event(3, 9, 6, hlo_op="fusion.2", **m), _event(2, 30, 1)])  # the last: no hlo_op, not XLA's
    txt = f'planes {{ id: 1 name: "/host:CPU" lines {{ id: 1 name: "tf_XLAEigen/1" timestamp_ns: 0 {body} }} {META} }}'
    kernels, source = sp.trace_kernels(ProfileData.from_text_proto(txt))
    assert source == "host_xla_ops"
    assert {k.op: k.self_ns for k in kernels} == {"while.5": 9000.0, "fusion.1": 5000.0, "fusion.2": 6000.0}
    s, how = sp.program_summary(kernels, sp.UPDATE_MODULE, 1, top=20)
    assert how == "module" and s["kernel_ms"] == pytest.approx(0.020) and s["busy_ms"] == pytest.approx(0.020)
    assert {c["category"] for c in s["categories"]} == {"while-loop control", "fusions (loop / elementwise)"}
    assert s["top_kinds"][0]["kind"] == "loop_add_fusion" and s["top_kinds"][0]["names"] == 1


def test_compare_and_table_side_by_side():
    def point(recipe, wall, ms):
        s = sp.summarize_totals({"gemm_grouped_fp8_mosaic_gpu_kernel": (1, ms * 1e6), "loop_add_fusion": (2, 1e6)}, 1, 20)
        s.update(busy_ms=s["kernel_ms"], span_ms=s["kernel_ms"] + 0.5, program_runs=1)
        p = {"program": "decode", "recipe": recipe, "status": "ok", "attribution": "module", "trace": {"source": "x"}}
        sp._finish(p, s, wall / 1e3, 2 * wall / 1e3)
        return p

    pts = [point("bf16", 4.0, 2.0), point("fp8_block", 3.0, 1.0)]
    c = sp.compare(pts)["decode"]
    assert c["wall_ms_per_step"] == {"bf16": 4.0, "fp8_block": 3.0}
    assert c["gap_ms_per_step"] == pytest.approx({"bf16": 1.0, "fp8_block": 1.0})
    assert c["idle_in_program_ms_per_step"] == pytest.approx({"bf16": 0.5, "fp8_block": 0.5})
    assert c["categories_ms_per_step"]["fp8 grouped GEMM (ours)"] == pytest.approx({"bf16": 2.0, "fp8_block": 1.0})
    assert c["fp8_block_over_bf16"] == pytest.approx({"wall": 4 / 3, "kernels": 1.5})
    text = sp.table(pts, sp.compare(pts))
    assert "| fp8 grouped GEMM (ours) | 2.000 | 1.000 |" in text and "## decode, fp8_block (module; trace x)" in text
    assert "ceiling if FP8's products took no time" in text


def test_amdahl_splits_the_products_fp8_runs_from_the_rest():
    dense = "bf16 dense GEMM (ours: split-BF16 router / lm_head / projections)"
    cats = {"bf16 grouped GEMM (ours)": {"bf16": 60.0, "fp8_block": 0.0},
            "fp8 grouped GEMM (ours)": {"bf16": 0.0, "fp8_block": 25.0},
            "fp8 dense GEMM (ours)": {"bf16": 0.0, "fp8_block": 5.0},
            "quantize (ours)": {"bf16": 0.0, "fp8_block": 10.0},
            dense: {"bf16": 50.0, "fp8_block": 42.0},  # fp8_block keeps the lm_head / router here: 8 ms moved
            "dense GEMM (cuBLAS / CUTLASS / XLA dot)": {"bf16": 20.0, "fp8_block": 22.0},  # more in fp8: nothing moved
            "fusions (loop / elementwise)": {"bf16": 70.0, "fp8_block": 60.0}}
    bf16_total = 60 + 50 + 20 + 70
    fp8_total = 25 + 5 + 10 + 42 + 22 + 60
    a = sp.amdahl(cats, bf16_total, fp8_total)
    assert a["bf16_ms_of_the_products"] == pytest.approx(68.0)
    assert a["fp8_ms_of_the_products_with_quantizers"] == pytest.approx(40.0) and a["quantizers_ms"] == 10.0
    assert a["products_speedup"] == pytest.approx(68 / 40)
    assert a["bf16_ms_of_the_rest"] == pytest.approx(bf16_total - 68) and a["fp8_ms_of_the_rest"] == pytest.approx(124.0)
    assert a["ceiling_if_fp8_products_took_no_time"] == pytest.approx(bf16_total / 124)
    assert sp.amdahl({"fusions (loop / elementwise)": {"bf16": 5.0, "fp8_block": 6.0}}, 5.0, 6.0) is None  # no FP8 kernel ran


def _scaled_tanh(x):
    return jnp.tanh(x) * 3.0  # the forward's elementwise ops: this line


def test_hlo_sources_name_the_lines_a_fusion_computes():
    """A compiled module's fusions map to the source lines of their ops (forward and backward told apart), under the
    instruction name and under its GPU kernel form ('.' -> '_'); `attribute` sums top kernels by dominant line."""
    line = _scaled_tanh.__code__.co_firstlineno + 1
    f = jax.jit(jax.grad(lambda x: jnp.sum(_scaled_tanh(x) ** 2)))
    text = f.lower(jnp.ones((8, 128))).compile().as_text()
    mapping = hlo_sources.module_sources(text)
    mine = {name: info for name, info in mapping.items()
            if any(s.startswith(f"tests/test_step_profile_benchmark.py:{line}") for s, _ in info["sources"])}
    assert mine, "no instruction attributed to _scaled_tanh's line"
    assert any(info["backward"] for info in mine.values()) and any(not info["backward"] for info in mine.values())
    name = next(n for n in mine if "." in n)
    assert mapping[hlo_sources.normalize(name)] is mapping[name]
    per_step = {"top_kernels": [{"name": hlo_sources.normalize(name), "ms": 2.0}, {"name": "unknown_kernel", "ms": 1.0}]}
    got = hlo_sources.attribute(per_step, mapping)
    assert got["attributed_ms"] == 2.0 and got["unattributed_ms"] == 1.0
    assert got["by_source"][0]["ms"] == 2.0 and "sources" in per_step["top_kernels"][0]
    assert "sources" not in per_step["top_kernels"][1]
    assert hlo_sources.shape_bytes("(f32[4,128]{1,0}, bf16[2])") == 4 * 128 * 4 + 4


def test_hlo_sources_read_inline_source_metadata():
    """Older dumps write source_file / source_line into each instruction's metadata (no stack-frame tables)."""
    text = """HloModule m

%fused_computation.3 (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %mul.1 = f32[64]{0} multiply(%p, %p), metadata={op_name="jit(f)/transpose(jvp())/mul" source_file="/x/src/jaxrl_fp8/model/moe.py" source_line=128}
}

ENTRY %main (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %loop_multiply_fusion.3 = f32[64]{0} fusion(%a), kind=kLoop, calls=%fused_computation.3, metadata={op_name="jit(f)/mul"}
}
"""
    info = hlo_sources.module_sources(text)["loop_multiply_fusion_3"]
    assert info["sources"] == [("jaxrl_fp8/model/moe.py:128", 1.0)] and info["backward"]


@pytest.mark.slow
def test_tiny_run_writes_per_kernel_profile(tmp_path):
    out, traces, dump = tmp_path / "sp.json", tmp_path / "traces", tmp_path / "hlo"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text", JAX_ENABLE_COMPILATION_CACHE="false")
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--trace-dir", str(traces),
                        "--hlo-dump", str(dump), "--out", str(out)], env=env, capture_output=True, text=True, timeout=400,
                       cwd=ROOT)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    r = json.loads(out.read_text())
    assert r["complete"] and r["tiny"] and r["device"]["platform"] == "cpu" and r["versions"]["jax"] and r["date"]
    assert r["command"].startswith("python experiments/benchmarks/step_profile.py --tiny")
    assert r["shapes"]["decode"]["slots"] == 4 and r["shapes"]["update"]["tokens_per_row"] == 32
    assert [(x["program"], x["recipe"], x["status"]) for x in r["points"]] == [("decode", "fp8_block", "ok"),
                                                                              ("update", "fp8_block", "ok")]
    for x in r["points"]:
        s = x["per_step"]
        assert x["attribution"] == "module" and x["trace"]["source"] == "host_xla_ops"
        assert s["kernel_ms"] > 0 and s["kernels"] > 0 and 0 < s["busy_ms"] <= s["span_ms"] + 1e-9
        assert sum(c["ms"] for c in s["categories"]) == pytest.approx(s["kernel_ms"], rel=1e-9)
        assert sum(c["share"] for c in s["categories"]) == pytest.approx(1.0)
        assert sum(c["kernels"] for c in s["categories"]) == pytest.approx(s["kernels"])
        assert 0 < len(s["top_kernels"]) <= 20 and sum(k["ms"] for k in s["top_kernels"]) <= s["kernel_ms"] * (1 + 1e-9)
        assert [k["ms"] for k in s["top_kernels"]] == sorted((k["ms"] for k in s["top_kernels"]), reverse=True)
        assert all(k["category"] == sp.categorize(k["name"]) for k in s["top_kernels"])
        # decode's unprofiled wall is a difference of two timed generates (one call each here): on a loaded CPU it can
        # come out <= 0, so only its presence is checked; the update's is a direct timing
        assert math.isfinite(x["wall_ms_per_step"]["no_profiler"]) and x["wall_ms_per_step"]["profiled"] > 0
        assert x["program"] == "decode" or x["wall_ms_per_step"]["no_profiler"] > 0
        assert x["gap_ms_per_step"] == pytest.approx(x["wall_ms_per_step"]["no_profiler"] - s["kernel_ms"])
        assert any(line["line"] and line["line"].startswith("tf_XLA") for line in x["trace"]["lines"])
        hs = x["hlo_sources"]  # the dump of the program's module names the lines its top kernels compute
        assert hs["dump"] and hs["attributed_ms"] > 0 and hs["by_source"]
        assert any(src.startswith("jaxrl_fp8/") for k in s["top_kernels"] for src in k.get("sources", []))
        assert x["trace"]["with_hlo_module"] == x["trace"]["kernels"] > 0 and os.path.isfile(x["trace"]["xplane"])
    dec, upd = r["points"]
    assert dec["steps_per_call"] == 7 and dec["decode_steps_profiled"] == 7  # --step-new 8: 7 steps, --repeats 1
    assert dec["per_step"]["program_runs"] == 1 and dec["trace"]["modules"]["jit_decode_slots"] > 0
    assert "jit_prefill_prompts" in dec["other_modules_per_generate"]  # the prefill side, named by its module
    assert "jit_prefill_prompts" in dec["prefill_side_per_generate_1"]
    assert dec["by_difference"]["kernel_ms"] > 0 and dec["by_difference"]["categories"]
    assert upd["metrics_first_call"]["finite"] == 1.0 and "jit__update" in upd["trace"]["modules"]
    assert set(r["comparison"]) == {"decode", "update"}
    assert "## decode, fp8_block" in p.stdout and "| category | ms/step | share | kernels/step |" in p.stdout
