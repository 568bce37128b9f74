"""Shared pytest set-up: GPU-marked tests skip (with the reason) when no CUDA device is visible."""

import os

import pytest

import jaxrl_fp8  # noqa: F401  (first: sets the XLA flags of the precision contract before JAX starts)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
