"""HF tensors <-> model parameters, through `precision.names` (the one name table) and `model.hf_io`.

Loading is all-or-nothing: every tensor is checked (known name, shape, dtype, FP8 scale present and shaped
right) while the shards stream by, and the model object is built only after every expected tensor arrived.
A bad checkpoint raises `CheckpointError` naming the tensor, and no partially loaded model exists.
"""

from __future__ import annotations

import math
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxrl_fp8.model import hf_io
from jaxrl_fp8.model.config import ModelConfig
from jaxrl_fp8.model.hf_io import CheckpointError
from jaxrl_fp8.model.qwen3 import Qwen3
from jaxrl_fp8.precision import QuantizedWeight, dequantize_fp8_per_block
from jaxrl_fp8.precision.names import TensorRole, hf_to_trainer, role_of_hf, trainer_to_hf

__all__ = [
    "QUANTIZED_MODES",
    "check_quantization_config",
    "expected_hf_tensors",
    "load_params",
    "build_model",
    "model_params",
    "hf_tensors_of",
]

FLOAT_CODES = ("F32", "BF16", "F16")
FP8_CODE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
QUANTIZED_MODES = ("dequantize", "keep")
# Tensors some HF checkpoints carry that hold no parameters of ours.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
BLOCK = (128, 128)


def trainer_path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _abstract(cfg: ModelConfig, dtype):
    return nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def expected_hf_tensors(cfg: ModelConfig, dtype=jnp.float32) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    """HF name -> (trainer path, expert index or None, HF shape) for every parameter of `cfg`'s model."""
    _, state = nnx.split(_abstract(cfg, dtype))
    out = {}
    for path, var in nnx.to_flat_state(state):
        tp = trainer_path(path)
        shape = tuple(var.get_value().shape)
        if ".moe." in tp and not tp.endswith("router.weight"):
            for e in range(shape[0]):
                out[trainer_to_hf(tp, e)] = (tp, e, shape[1:])
        else:
            out[trainer_to_hf(tp)] = (tp, None, shape)
    return out


def check_quantization_config(hf_config: dict) -> bool:
    """True for a block-FP8 checkpoint we can read; False without quantization_config; error otherwise."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return False
    if qc.get("quant_method") != "fp8":
        raise CheckpointError(f"config field 'quantization_config.quant_method' = {qc.get('quant_method')!r}: only block FP8 ('fp8') checkpoints load here (use the converters for MXFP8/NVFP4)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"config field 'quantization_config.fmt' = {qc.get('fmt')!r}: only 'e4m3' is supported")
    if list(qc.get("weight_block_size") or []) != list(BLOCK):
        raise CheckpointError(f"config field 'quantization_config.weight_block_size' = {qc.get('weight_block_size')!r}: only [128, 128] blocks are supported")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"config field 'quantization_config.activation_scheme' = {qc.get('activation_scheme')!r}: only 'dynamic' is supported")
    return True


def _np_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def load_params(path: str, cfg: ModelConfig, hf_config: dict, *, dtype=jnp.bfloat16, quantized: str = "dequantize") -> dict:
    """Stream a checkpoint and return {trainer path: array or QuantizedWeight}, validated completely.

    quantized="dequantize": FP8 weights become master weights in `dtype` (`precision.dequantize_fp8_per_block`).
    quantized="keep": FP8 weights stay `QuantizedWeight(fmt="fp8-block")` (experts of a layer stacked).
    """
    if quantized not in QUANTIZED_MODES:
        raise ValueError(f"quantized={quantized!r}; expected one of {QUANTIZED_MODES}")
    is_fp8 = check_quantization_config(hf_config)
    expected = expected_hf_tensors(cfg)
    target = _np_dtype(dtype)
    dense: dict[str, np.ndarray] = {}  # trainer path -> master array (experts stacked)
    fp8_data: dict[str, np.ndarray] = {}  # HF name -> e4m3 data waiting for / holding its scale
    fp8_scale: dict[str, np.ndarray] = {}  # HF weight name -> scale_inv
    seen: set[str] = set()

    for shard in hf_io.iter_shards(path):
        for name in shard.names():
            code, shape = shard.info(name)
            where = f"{shard.file}: tensor {name!r}"
            if name.endswith(SCALE_SUFFIX):
                wname = name[: -len(SCALE_SUFFIX)]
                if wname not in expected:
                    raise CheckpointError(f"{where} is a scale for unknown weight {wname!r}")
                if not is_fp8:
                    raise CheckpointError(f"{where}: FP8 scale in a checkpoint without quantization_config")
                n, k = expected[wname][2]
                want = (math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]))
                if code != "F32" or shape != want:
                    raise CheckpointError(f"{where} is {code} {list(shape)}; expected F32 {list(want)} (128x128 blocks of {[n, k]})")
                fp8_scale[wname] = shard.read(name)
                continue
            if name not in expected:
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                raise CheckpointError(f"{where} is not a parameter of {cfg.architecture} with this config (unexpected tensor)")
            tp, expert, want_shape = expected[name]
            if shape != want_shape:
                raise CheckpointError(f"{where} has shape {list(shape)}; the config implies {list(want_shape)}")
            if code == FP8_CODE:
                if not is_fp8:
                    raise CheckpointError(f"{where} is F8_E4M3 but config.json has no quantization_config")
                if role_of_hf(name) not in (TensorRole.LINEAR, TensorRole.EXPERT):
                    raise CheckpointError(f"{where} is F8_E4M3, but {role_of_hf(name)} tensors must stay high precision")
                fp8_data[name] = shard.read(name)
            elif code in FLOAT_CODES:
                _store(dense, tp, expert, cfg, shard.read(name).astype(target))
            else:
                raise CheckpointError(f"{where} has dtype {code}; expected one of {FLOAT_CODES} (or F8_E4M3 with a weight_scale_inv)")
            seen.add(name)

    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensor {missing[0]!r}{more}")
    for name in fp8_data:
        if name not in fp8_scale:
            raise CheckpointError(f"checkpoint {path}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
    for name in fp8_scale:
        if name not in fp8_data:
            raise CheckpointError(f"checkpoint {path}: {name + SCALE_SUFFIX!r} belongs to {name!r}, which is not FP8")

    if quantized == "dequantize":
        for name, q in fp8_data.items():
            tp, expert, _ = expected[name]
            w = dequantize_fp8_per_block(jnp.asarray(q), jnp.asarray(fp8_scale[name]), BLOCK, out_dtype=jnp.float32)
            _store(dense, tp, expert, cfg, np.asarray(w).astype(target))
        params = {tp: jnp.asarray(a) for tp, a in dense.items()}
    else:
        params = {tp: jnp.asarray(a) for tp, a in dense.items()}
        params.update(_stack_quantized(fp8_data, fp8_scale, expected, cfg, dense))
    return params


def _store(dense: dict, tp: str, expert: int | None, cfg: ModelConfig, a: np.ndarray) -> None:
    if expert is None:
        dense[tp] = a
        return
    if tp not in dense:
        dense[tp] = np.zeros((cfg.num_experts, *a.shape), a.dtype)
    dense[tp][expert] = a


def _stack_quantized(fp8_data, fp8_scale, expected, cfg, dense) -> dict:
    out: dict = {}
    stacks: dict[str, dict[int, str]] = {}
    for name in fp8_data:
        tp, expert, (n, k) = expected[name]
        if expert is None:
            out[tp] = QuantizedWeight(jnp.asarray(fp8_data[name]), jnp.asarray(fp8_scale[name]), None, "fp8-block", k)
        else:
            stacks.setdefault(tp, {})[expert] = name
    for tp, members in stacks.items():
        if len(members) != cfg.num_experts or tp in dense:
            raise CheckpointError(f"{tp}: some experts of this layer are FP8 and others not; all experts of a layer must share one format")
        names = [members[e] for e in range(cfg.num_experts)]
        data = np.stack([fp8_data[n] for n in names])
        scale = np.stack([fp8_scale[n] for n in names])
        out[tp] = QuantizedWeight(jnp.asarray(data), jnp.asarray(scale), None, "fp8-block", int(data.shape[-1]))
    return out


def build_model(cfg: ModelConfig, params: dict, *, dtype=jnp.bfloat16) -> Qwen3:
    """A Qwen3 whose parameters are exactly `params` (no random init is materialized)."""
    graphdef, state = nnx.split(_abstract(cfg, dtype))
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        tp = trainer_path(path)
        if tp not in params:
            raise CheckpointError(f"no value for parameter {tp!r}")
        var.set_value(params[tp])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def model_params(model: Qwen3) -> Iterator[tuple[str, object]]:
    """(trainer path, value) for every parameter (QuantizedWeight values included)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield trainer_path(path), var.get_value()


def hf_tensors_of(model: Qwen3, dtype=None) -> dict:
    """HF name -> (shape, numpy dtype, producer) for `hf_io.save_sharded` (kept-FP8 weights dequantized)."""
    out, memo = {}, {}
    for tp, value in model_params(model):
        np_dtype = _np_dtype(dtype or (jnp.float32 if isinstance(value, QuantizedWeight) else value.dtype))

        def dense_value(value=value, np_dtype=np_dtype):
            v = value.dequantize(jnp.float32) if isinstance(value, QuantizedWeight) else value
            return np.asarray(jax.device_get(v)).astype(np_dtype)

        shape = tuple(value.shape)
        if ".moe." in tp and not tp.endswith("router.weight"):
            def expert_value(e, tp=tp, f=dense_value):  # producers run in order: convert each stack once
                if memo.get("tp") != tp:
                    memo.clear()
                    memo.update(tp=tp, a=f())
                return memo["a"][e]

            for e in range(shape[0]):
                out[trainer_to_hf(tp, e)] = (shape[1:], np_dtype, lambda e=e, g=expert_value: g(e))
        else:
            out[trainer_to_hf(tp)] = (shape, np_dtype, dense_value)
    return out
