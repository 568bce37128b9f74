"""Live weight export: trainer parameters -> the exact tensors a quantized HF checkpoint would hold.

The rollout weight sync calls `export_weights` after each optimizer step. It runs the very function the
CLI converters run (`converters.quantize.quantize_hf_tensor`) on the same policy decisions, so exporting
parameters equals converting a checkpoint of those parameters, bit for bit (tested). Expert stacks
`[E, N, K]` are unstacked into per-expert HF names; NVFP4 gate/up of one expert share one global amax.
`save_exported` writes the same tensors as an SGLang-loadable directory (the "update from disk" path).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.model.hf_io import INDEX_NAME, write_json_atomic
from jaxrl_fp8.precision import BF16, NVFP4, PrecisionPolicy
from jaxrl_fp8.precision import names as N

from converters.pipeline import HF_QUANT_CONFIG, _replace_dir
from jaxrl_fp8.model.hf_io import write_safetensors
from converters.quantize import ConversionError, check_finite, pair_global_amax, quantize_hf_tensor
from converters.spec import QuantSpec, hf_quant_config, modules_to_not_convert, quantization_config

__all__ = ["export_weights", "iter_hf_tensors", "flatten_params", "save_exported", "spec_of"]


def spec_of(recipe_or_fmt) -> QuantSpec:
    """A QuantSpec from a `precision.Recipe` (its rollout side), a format string, or a QuantSpec."""
    if isinstance(recipe_or_fmt, QuantSpec):
        return recipe_or_fmt
    if isinstance(recipe_or_fmt, str):
        return QuantSpec(recipe_or_fmt)
    if hasattr(recipe_or_fmt, "rollout_format"):
        return QuantSpec.from_recipe(recipe_or_fmt)
    raise TypeError(f"expected a Recipe, a format string or a QuantSpec; got {type(recipe_or_fmt).__name__}")


def _leaf_value(v):
    try:
        from flax import nnx

        if isinstance(v, nnx.Variable):
            return v.get_value() if isinstance(v, nnx.Param) else None
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    return v


def flatten_params(params) -> dict[str, object]:
    """{dot-joined trainer path: array} from an nnx.Module, an nnx.State, a nested mapping or a flat mapping.

    Non-Param NNX variables (RNG state, caches) are skipped; every remaining path must be in names.TABLE.
    """
    try:
        from flax import nnx

        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
    except ImportError:  # pragma: no cover
        pass
    out: dict[str, object] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
            return
        value = _leaf_value(node)
        if value is not None:
            out[prefix] = value

    walk(params, "")
    return out


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _plan(flat: dict[str, object]) -> list[tuple[str, str, int | None]]:
    """(hf_name, trainer_path, expert) for every tensor, in natural HF-name order."""
    plan = []
    for path, value in flat.items():
        is_stack = ".moe." in path and not path.endswith("router.weight")
        try:
            if is_stack:
                for e in range(int(np.shape(value)[0])):
                    plan.append((N.trainer_to_hf(path, e), path, e))
            else:
                plan.append((N.trainer_to_hf(path), path, None))
        except KeyError as err:
            raise ConversionError(f"trainer parameter {path!r}: {err.args[0]}") from None
    return sorted(plan, key=lambda t: _natural_key(t[0]))


def iter_hf_tensors(params, spec: QuantSpec, policy: PrecisionPolicy, *, high_precision_dtype=jnp.bfloat16, device=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) of every checkpoint tensor of `params`, one HF weight at a time.

    `device`: where the quantizers run (default: where the parameters live). Pass `jax.devices("cpu")[0]` to get
    the CPU's bits from parameters on an accelerator (see docs/decisions/0007: NVFP4 on XLA:GPU is not yet
    bitwise with the CPU contract).
    """
    flat = flatten_params(params)
    pending_amax: dict[tuple, object] = {}
    for hf_name, path, expert in _plan(flat):
        w = flat[path] if expert is None else flat[path][expert]
        if device is not None:
            w = jax.device_put(w, device)
        fmt = policy.format_for(hf_name)
        check_finite(hf_name, np.asarray(w), f"trainer parameter {path}" + ("" if expert is None else f"[{expert}]"))
        if fmt == BF16:
            arr = jnp.asarray(w)
            if high_precision_dtype is not None:
                arr = arr.astype(high_precision_dtype)
            yield hf_name, np.array(arr)
            continue
        global_amax = None
        if fmt == NVFP4 and expert is not None and (".gate_proj." in path or ".up_proj." in path):
            partner_path = path.replace(".gate_proj.", ".up_proj.") if ".gate_proj." in path else path.replace(".up_proj.", ".gate_proj.")
            if partner_path not in flat:
                raise ConversionError(f"trainer parameter {path!r} has no partner {partner_path!r}: NVFP4 pairs gate/up on one global scale")
            key = (path.split(".moe.")[0], expert)
            if key in pending_amax:
                global_amax = pending_amax.pop(key)
            else:
                partner = flat[partner_path][expert]
                with _on(device):
                    global_amax = pending_amax[key] = pair_global_amax(w, partner if device is None else jax.device_put(partner, device))
        with _on(device):  # not held across the yield: the caller's code must not run under it
            outputs = quantize_hf_tensor(hf_name, w, spec, fmt, global_amax=global_amax)
        yield from outputs


def _on(device):
    return jax.default_device(device) if device is not None else contextlib.nullcontext()


def export_weights(params, recipe_or_fmt, policy: PrecisionPolicy, *, bucket_bytes: int, high_precision_dtype=jnp.bfloat16, device=None) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Buckets [(hf_name, array)] of at most `bucket_bytes` bytes (a tensor bigger than that travels alone).

    params: trainer parameters (nnx.Module / nnx.State / nested dict keyed by names.TABLE trainer paths).
    recipe_or_fmt: a `precision.Recipe` (its rollout format, pow2_scale, four_over_six), a format string or a
        `QuantSpec`. policy: the trainer's PrecisionPolicy; its exceptions are used with the export format.
    High-precision tensors are cast to `high_precision_dtype` (BF16, as the HF checkpoint; None keeps dtype).
    device: where the quantizers run (see `iter_hf_tensors`); default where the parameters live.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    spec = spec_of(recipe_or_fmt)
    if policy.fmt != spec.fmt:
        policy = policy.with_format(spec.fmt)
    bucket, used = [], 0
    for name, arr in iter_hf_tensors(params, spec, policy, high_precision_dtype=high_precision_dtype, device=device):
        if bucket and used + arr.nbytes > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, arr))
        used += arr.nbytes
    if bucket:
        yield bucket


def save_exported(
    params,
    recipe_or_fmt,
    policy: PrecisionPolicy,
    save_dir: str,
    *,
    hf_config: dict,
    shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    side_files_from: str | None = None,
    high_precision_dtype=jnp.bfloat16,
    write: bool = True,
) -> list[str]:
    """Write `params` as a quantized HF checkpoint SGLang loads (config.json from `hf_config`, index, shards).

    Shards are the export buckets of `shard_bytes`. `side_files_from` copies tokenizer / generation files.
    Written in a temp dir and renamed into place; returns the shard paths.
    write=False (multi-host: every process but the writer) runs the same export, tensor by tensor (so the
    gathers of sharded parameters, which are collectives, happen on every process), and writes nothing.
    """
    spec = spec_of(recipe_or_fmt)
    if policy.fmt != spec.fmt:
        policy = policy.with_format(spec.fmt)
    if os.path.lexists(save_dir) and not overwrite:
        raise ConversionError(f"save_dir {save_dir!r} already exists; pass overwrite=True to replace it")
    hf_names = [hf for hf, _, _ in _plan(flatten_params(params))]
    excluded = modules_to_not_convert(policy, hf_names, include_always_high_precision=spec.fmt == NVFP4)
    config = copy.deepcopy(hf_config)
    if spec.quantized:
        config["quantization_config"] = quantization_config(spec, excluded)
    else:
        config.pop("quantization_config", None)
    if not write:
        for _ in export_weights(params, spec, policy, bucket_bytes=shard_bytes, high_precision_dtype=high_precision_dtype):
            pass
        return []
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(save_dir))}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        files, weight_map, total = [], {}, 0
        staged = []
        for i, bucket in enumerate(export_weights(params, spec, policy, bucket_bytes=shard_bytes, high_precision_dtype=high_precision_dtype)):
            fname = f"model-{i + 1:05d}.safetensors"
            total += write_safetensors(os.path.join(tmp, fname), dict(bucket), {"format": "pt"})
            staged.append((fname, [n for n, _ in bucket]))
        n = len(staged)
        for i, (fname, names) in enumerate(staged):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(tmp, fname), os.path.join(tmp, final))
            files.append(final)
            weight_map.update({name: final for name in names})
        write_json_atomic(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        write_json_atomic(os.path.join(tmp, "config.json"), config)
        if spec.fmt == NVFP4:
            write_json_atomic(os.path.join(tmp, HF_QUANT_CONFIG), hf_quant_config(spec, excluded))
        if side_files_from:
            for entry in sorted(os.listdir(side_files_from)):
                path = os.path.join(side_files_from, entry)
                if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in ("config.json", INDEX_NAME, HF_QUANT_CONFIG):
                    shutil.copy2(path, os.path.join(tmp, entry))
        _replace_dir(tmp, save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(save_dir, f) for f in files]
