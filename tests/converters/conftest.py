"""Session fixtures for the converter tests: the tiny checkpoints of `helpers.make_checkpoint`, and conversions
run once per session (see helpers.py for what the checkpoints contain)."""

from __future__ import annotations

import importlib
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.converters.helpers import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def ckpt128(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("hf") / "ckpt128"), "ckpt128")


@pytest.fixture(scope="session")
def ckpt160(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("hf") / "ckpt160"), "ckpt160", seed=1)


@pytest.fixture(params=["ckpt128", "ckpt160"])
def ckpt(request):
    return request.getfixturevalue(request.param)


_CONVERTED: dict = {}


@pytest.fixture(scope="session")
def convert(tmp_path_factory):
    """convert(src_dir, tool, *flags) -> output dir; each distinct conversion runs once per session."""

    def run(src: str, tool: str, *flags: str) -> str:
        key = (src, tool, flags)
        if key not in _CONVERTED:
            out = str(tmp_path_factory.mktemp("out") / f"{os.path.basename(src)}-{tool}")
            rc = importlib.import_module(f"converters.{tool}").main(["--model-dir", src, "--save-dir", out, "--no-progress", *flags])
            assert rc == 0, (tool, flags)
            _CONVERTED[key] = out
        return _CONVERTED[key]

    return run
