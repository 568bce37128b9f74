"""On a GPU: conversions and live export computed on the GPU equal the CPU's bit for bit.

Why: the trainer exports on its accelerator while checkpoints are often converted on CPU hosts; the contract
promises the same bits either way (IEEE division, no reciprocal rewrites). Runs with `pytest -m gpu`, or as a
script (`python tests/converters/test_gpu_bitwise.py`) where pytest is not installed.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

import numpy as np

try:
    import pytest

    gpu = pytest.mark.gpu
except ImportError:  # script mode on a machine without pytest
    pytest = None

    def gpu(f):
        return f


CASES = [("hf_to_fp8", ()), ("hf_to_fp8", ("--pow2-scale",)), ("hf_to_fp8", ("--strategy", "channel")), ("hf_to_mxfp8", ())]
# NVFP4 through XLA:GPU: bitwise with the CPU, the contract fencing both operands of every division (passed on the
# H200: stress tensor and both CLI cases).
NVFP4_CASES = [("hf_to_nvfp4", ("--quantize-dense",)), ("hf_to_nvfp4", ("--four-over-six",))]
# FP8 gaps on the H200 (XLA_FLAGS with -nvptx-prec-divf32=2, a raw GPU division IEEE in 100k of 100k): the stress
# tensor's jitted FP8 block quantization differs from the CPU in 213 of 549,120 values (the 8 printed sit at or next
# to e4m3 rounding ties) while the division and the cast alone agree, so the fused program differs
# (experiments/checks/nvfp4_gpu_diag.py, input converter_stress, runs it under each flag set, no_triton_fusions
# included); converting the tiny checkpoints on the GPU gave other FP8 block scales in 22 of 95 tensors (expert
# gate/up first; measured with only the divisor fenced). The CPU results equal an independent numpy IEEE statement
# (checked), so the GPU lowering is the odd one out; cause not found.
FP8_STRESS_GAP = ("contract gap (measured on the H200): the jitted FP8 block quantization of the stress tensor differs "
                  "GPU vs CPU in 213 of 549,120 values (the printed ones at e4m3 ties); division and cast alone agree")
FP8_SMALL_GAP = ("contract gap (measured on the H200): FP8 block scales of the tiny checkpoints differ GPU vs CPU in 22 of "
                 "95 tensors although raw division is IEEE; export(device=cpu) gives the CPU's bits")


def _same(a: dict, b: dict) -> list[str]:
    bad = [n for n in a if n not in b or a[n].dtype != b[n].dtype or a[n].tobytes() != b[n].tobytes()]
    return bad + sorted(set(b) - set(a))


def gpu_division_report() -> str:
    """XLA_FLAGS and how many of 100k float32 quotients jitted on the GPU differ from IEEE (numpy)."""
    import jax

    x = np.random.default_rng(0).uniform(1e-3, 1e3, (1000, 100)).astype(np.float32)
    s = x[:, :1].copy()
    got = np.asarray(jax.jit(lambda a, b: a / b)(jax.device_put(x, jax.devices("gpu")[0]), jax.device_put(s, jax.devices("gpu")[0])))
    return f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; GPU a/b != IEEE in {int((got != x / s).sum())} of {x.size}"


def check_cli_gpu_equals_cpu(src: str, work: str, cases=CASES) -> None:
    import jax

    from tests.converters.helpers import load_all

    assert jax.default_backend() == "gpu", jax.default_backend()
    print(gpu_division_report())
    cpu = jax.devices("cpu")[0]
    for i, (tool, flags) in enumerate(cases):
        main = importlib.import_module(f"converters.{tool}").main
        g, c = os.path.join(work, f"g{i}-{tool}"), os.path.join(work, f"c{i}-{tool}")
        assert main(["--model-dir", src, "--save-dir", g, "--no-progress", *flags]) == 0
        with jax.default_device(cpu):
            assert main(["--model-dir", src, "--save-dir", c, "--no-progress", *flags]) == 0
        bad = _same(load_all(g), load_all(c))
        assert not bad, (tool, flags, len(bad), bad[:5])
        print(f"GPU == CPU bitwise: {tool} {' '.join(flags)} ({len(load_all(g))} tensors)")


def check_stress_tensors_gpu_equals_cpu(fmts=("fp8-block", "mxfp8")) -> None:
    """Rows spanning 1e-6 .. 1e3 (many binades, tiny and huge scales), partial blocks, zero rows."""
    import jax
    import jax.numpy as jnp

    from converters.quantize import pair_global_amax, quantize_hf_tensor
    from converters.spec import QuantSpec

    rng = np.random.default_rng(0)
    w = rng.standard_normal((520, 1056)).astype(np.float32) * np.exp(rng.uniform(np.log(1e-6), np.log(1e3), (520, 1))).astype(np.float32)
    w[7] = 0
    w = w.astype(jnp.bfloat16)
    cpu = jax.devices("cpu")[0]
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    specs = [QuantSpec("fp8-block"), QuantSpec("fp8-block", pow2_scale=True), QuantSpec("fp8-block", "channel"),
             QuantSpec("fp8-block", "tensor"), QuantSpec("mxfp8"), QuantSpec("nvfp4"), QuantSpec("nvfp4", four_over_six=True)]
    for spec in [s for s in specs if s.fmt in fmts]:
        ga = pair_global_amax(w, w[::-1]) if spec.fmt == "nvfp4" else None
        g = quantize_hf_tensor(name, jax.device_put(w, jax.devices("gpu")[0]), spec, spec.fmt, global_amax=ga)
        with jax.default_device(cpu):
            c = quantize_hf_tensor(name, jax.device_put(w, cpu), spec, spec.fmt, global_amax=None if ga is None else np.asarray(ga))
        bad = _same(dict(g), dict(c))
        assert not bad, (spec, bad)
        print(f"GPU == CPU bitwise on a 520x1056 stress tensor: {spec}")


def check_export_on_gpu_equals_cpu_cli(src: str, work: str, fmts=(("fp8-block", "hf_to_fp8"), ("mxfp8", "hf_to_mxfp8")), on_cpu=False) -> None:
    """Parameters on the GPU; quantized there (or, with on_cpu, by export's device=cpu) vs the CLI on the CPU."""
    import json

    import jax

    from converters.export import export_weights
    from converters.policy_flags import build_policy
    from tests.converters.helpers import load_all, trainer_params

    cpu = jax.devices("cpu")[0]
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    params = jax.tree.map(lambda a: jax.device_put(a, jax.devices("gpu")[0]), trainer_params(load_all(src)))
    for fmt, tool in fmts:
        c = os.path.join(work, f"export-{fmt}-{on_cpu}")
        with jax.default_device(cpu):
            assert importlib.import_module(f"converters.{tool}").main(["--model-dir", src, "--save-dir", c, "--no-progress"]) == 0
        device = cpu if on_cpu else None
        exported = {n: a for b in export_weights(params, fmt, build_policy(fmt, config), bucket_bytes=1 << 20, device=device) for n, a in b}
        bad = _same(exported, load_all(c))
        assert not bad, (fmt, bad[:5])
        print(f"export of GPU parameters (quantized on {'cpu' if on_cpu else 'gpu'}) == CLI on CPU bitwise: {fmt}")


def _xfail(reason):
    return (lambda f: pytest.mark.xfail(reason=reason, strict=False)(f)) if pytest else (lambda f: f)


@gpu
@_xfail(FP8_SMALL_GAP)
def test_cli_gpu_equals_cpu(ckpt160, tmp_path):
    check_cli_gpu_equals_cpu(ckpt160, str(tmp_path))


@gpu
def test_stress_tensor_mxfp8_gpu_equals_cpu():
    check_stress_tensors_gpu_equals_cpu(fmts=("mxfp8",))


@gpu
@_xfail(FP8_STRESS_GAP)
def test_stress_tensor_fp8_block_gpu_equals_cpu():
    check_stress_tensors_gpu_equals_cpu(fmts=("fp8-block",))


@gpu
@_xfail(FP8_SMALL_GAP)
def test_export_on_gpu_equals_cpu_cli(ckpt128, tmp_path):
    check_export_on_gpu_equals_cpu_cli(ckpt128, str(tmp_path))


@gpu
def test_export_quantized_on_cpu_equals_cli(ckpt128, tmp_path):
    """The workaround for the GPU gaps: export(device=cpu) from GPU parameters gives the CLI's (CPU) bits."""
    check_export_on_gpu_equals_cpu_cli(ckpt128, str(tmp_path), fmts=(("fp8-block", "hf_to_fp8"), ("nvfp4", "hf_to_nvfp4")), on_cpu=True)


@gpu
def test_nvfp4_gpu_equals_cpu(ckpt160, tmp_path):
    check_stress_tensors_gpu_equals_cpu(fmts=("nvfp4",))
    check_cli_gpu_equals_cpu(ckpt160, str(tmp_path), NVFP4_CASES)


if __name__ == "__main__":
    sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "src"), os.path.join(os.path.dirname(__file__), "..", "..")]
    from tests.converters.helpers import make_checkpoint

    with tempfile.TemporaryDirectory() as d:
        c160 = make_checkpoint(os.path.join(d, "ckpt160"), "ckpt160", seed=1)
        c128 = make_checkpoint(os.path.join(d, "ckpt128"), "ckpt128")
        checks = [
            ("stress fp8/mxfp8", lambda: check_stress_tensors_gpu_equals_cpu()),
            ("stress nvfp4", lambda: check_stress_tensors_gpu_equals_cpu(fmts=("nvfp4",))),
            ("cli fp8/mxfp8", lambda: check_cli_gpu_equals_cpu(c160, os.path.join(d, "a"))),
            ("cli nvfp4", lambda: check_cli_gpu_equals_cpu(c160, os.path.join(d, "b"), NVFP4_CASES)),
            ("export on gpu", lambda: check_export_on_gpu_equals_cpu_cli(c128, os.path.join(d, "c"))),
            ("export device=cpu", lambda: check_export_on_gpu_equals_cpu_cli(c128, os.path.join(d, "e"), fmts=(("fp8-block", "hf_to_fp8"), ("nvfp4", "hf_to_nvfp4")), on_cpu=True)),
        ]
        for label, check in checks:
            try:
                check()
                print(f"PASS {label}")
            except AssertionError as e:
                print(f"FAIL {label}: {str(e)[:300]}")
