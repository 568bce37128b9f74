"""Bad input fails clearly and leaves nothing behind; overwrite rules; streaming memory; --help of every CLI."""

from __future__ import annotations

import importlib
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from converters.convert import convert_hf
from converters.policy_flags import build_policy
from converters.spec import QuantSpec

TOOLS = ("hf_to_fp8", "hf_to_mxfp8", "hf_to_nvfp4", "fp8_to_bf16", "verify")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _shard(path, i=3):
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[i])


def _leftovers(parent):
    return [d for d in os.listdir(parent) if ".tmp-" in d or d == "out"]


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "garbage_header", "missing_shard"])
def test_corrupt_input_clear_error_and_no_output(ckpt160, tmp_path, capsys, damage):
    src = _copy(ckpt160, tmp_path / "src")
    shard = _shard(src)
    size = os.path.getsize(shard)
    if damage == "truncate_data":
        with open(shard, "r+b") as f:
            f.truncate(size - 1000)
    elif damage == "truncate_header":
        with open(shard, "r+b") as f:
            f.truncate(20)
    elif damage == "garbage_header":
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 32)
    else:
        os.remove(shard)
    out = tmp_path / "out"
    rc = importlib.import_module("converters.hf_to_fp8").main(["--model-dir", src, "--save-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error:") and os.path.basename(shard) in err, err
    assert not os.path.exists(out) and not _leftovers(tmp_path)


def test_non_finite_weight_names_tensor_and_leaves_nothing(ckpt160, tmp_path, capsys):
    """A NaN found mid-stream (after earlier shards were written to the temp dir) still leaves nothing."""
    src = _copy(ckpt160, tmp_path / "src")
    shard = _shard(src, -1)
    from jaxrl_fp8.model.hf_io import SafetensorsFile

    sf = SafetensorsFile(shard)
    name = next(n for n in sf.names() if n.endswith("proj.weight"))
    code, shape = sf.info(name)
    begin = sf._entries[name][2]
    with open(shard, "r+b") as f:
        f.seek(sf._data_start + begin + 2 * 5)
        f.write(struct.pack("<H", 0x7FC0))  # a BF16 NaN at element 5
    rc = importlib.import_module("converters.hf_to_mxfp8").main(["--model-dir", src, "--save-dir", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and name in err and "non-finite" in err and os.path.basename(shard) in err, err
    assert not _leftovers(tmp_path)


def test_existing_save_dir_needs_overwrite(ckpt160, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    tool = importlib.import_module("converters.hf_to_fp8")
    assert tool.main(["--model-dir", ckpt160, "--save-dir", str(out), "--no-progress"]) == 1
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert tool.main(["--model-dir", ckpt160, "--save-dir", str(out), "--no-progress", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors.index.json").exists()
    assert tool.main(["--model-dir", ckpt160, "--save-dir", ckpt160, "--no-progress", "--overwrite"]) == 1  # never onto the input
    assert os.path.exists(os.path.join(ckpt160, "config.json"))


def test_refuses_already_quantized_input(ckpt160, convert, tmp_path, capsys):
    fp8 = convert(ckpt160, "hf_to_fp8")
    rc = importlib.import_module("converters.hf_to_nvfp4").main(["--model-dir", fp8, "--save-dir", str(tmp_path / "o"), "--no-progress"])
    assert rc == 1 and "quantization_config" in capsys.readouterr().err


def test_streaming_memory_is_about_one_shard(ckpt128, tmp_path):
    """Warm (jit compiled) conversion: traced host memory stays near one shard, far below the checkpoint."""
    spec = QuantSpec("fp8-block")
    policy = lambda cfg: build_policy("fp8-block", cfg)  # noqa: E731
    convert_hf(ckpt128, str(tmp_path / "warm"), spec, policy, progress=False)
    s = convert_hf(ckpt128, str(tmp_path / "o"), spec, policy, progress=False)
    total = sum(os.path.getsize(os.path.join(ckpt128, f)) for f in os.listdir(ckpt128) if f.endswith(".safetensors"))
    assert s.shards >= 8 and s.largest_input_shard * 4 < total
    assert s.traced_peak <= 2.5 * s.largest_input_shard + 256 * 1024, s.format()
    assert "peak host memory" in s.format() and s.rss_peak >= s.rss_baseline > 0


def test_help_in_process_explains_every_flag(capsys):
    for tool in TOOLS:
        module = importlib.import_module(f"converters.{tool}")
        with pytest.raises(SystemExit) as e:
            module.main(["--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        parser = module.build_parser()
        for action in parser._actions:
            for opt in action.option_strings:
                assert opt in text, (tool, opt)
            assert action.help, (tool, action.option_strings)


def test_help_as_module_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("src", ".", os.environ.get("PYTHONPATH", "")) if p))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "converters.hf_to_nvfp4", "--help"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--four-over-six" in r.stdout and "--num-layers-at-start-in-bf16" in r.stdout


def test_scalar_tensors_round_trip_through_our_writer(tmp_path):
    from jaxrl_fp8.model.hf_io import SafetensorsFile

    from jaxrl_fp8.model.hf_io import write_safetensors

    write_safetensors(str(tmp_path / "a.safetensors"), {"s": np.float32(3.0), "v": np.arange(6, dtype=np.uint8).reshape(2, 3)[:, ::2]})
    f = SafetensorsFile(str(tmp_path / "a.safetensors"))
    assert f.info("s") == ("F32", ()) and f.read("s") == 3.0
    assert np.array_equal(f.read("v"), [[0, 2], [3, 5]])
