"""The device mesh of training: four named axes, sizes from config, -1 meaning "all devices left".

Axis order is (data, fsdp, expert, tensor): the outermost axis changes slowest over the device list, so on a
multi-host job the data axis spans hosts and the tensor axis stays inside one host (fastest links), which is
what `jax.make_mesh` lays out for the given order. Axes are `Auto` (GSPMD propagates shardings between the
annotated inputs/outputs); the MoE expert exchange is an explicit `shard_map` (see `sharding.expert`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import ml_collections
from jax.sharding import AxisType, Mesh

__all__ = ["MESH_AXES", "BATCH_AXES", "MeshConfig", "MeshError", "mesh_config_defaults", "make_mesh"]

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# Axes over which different devices hold different tokens (the tensor axis holds copies of the same tokens).
BATCH_AXES = ("data", "fsdp", "expert")


class MeshError(ValueError):
    """A mesh that cannot be built or would break a sharding invariant; the message names the key/tensor."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; exactly one may be -1 (= the devices left). 1 disables an axis."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    @classmethod
    def from_config(cls, c) -> "MeshConfig":
        """From `config.mesh` (a ConfigDict or mapping with data/fsdp/expert/tensor), or a MeshConfig."""
        if isinstance(c, MeshConfig):
            return c
        if c is None:
            return cls()
        get = c.get if isinstance(c, Mapping) or hasattr(c, "get") else (lambda k, d=None: getattr(c, k, d))
        unknown = set(c.keys()) - set(MESH_AXES) if hasattr(c, "keys") else set()
        if unknown:
            raise MeshError(f"config.mesh.{sorted(unknown)[0]}: unknown mesh axis; the axes are {', '.join(MESH_AXES)}")
        return cls(**{a: int(get(a, getattr(cls, a))) for a in MESH_AXES})

    def sizes(self, num_devices: int) -> dict[str, int]:
        """{axis: size} with -1 resolved; raises MeshError naming `config.mesh.<axis>` when it cannot fit."""
        raw = {a: getattr(self, a) for a in MESH_AXES}
        for a, v in raw.items():
            if v == 0 or v < -1:
                raise MeshError(f"config.mesh.{a}={v}: use a positive size, or -1 for the devices left")
        rest = [a for a, v in raw.items() if v == -1]
        if len(rest) > 1:
            raise MeshError(f"config.mesh: only one axis may be -1, got {', '.join(rest)}")
        fixed = math.prod(v for v in raw.values() if v != -1)
        if rest:
            if num_devices % fixed:
                raise MeshError(f"config.mesh.{rest[0]}=-1: {num_devices} devices are not a multiple of the other axes' "
                                f"product {fixed} ({_fmt(raw)})")
            raw[rest[0]] = num_devices // fixed
        if math.prod(raw.values()) != num_devices:
            raise MeshError(f"config.mesh: {_fmt(raw)} needs {math.prod(raw.values())} devices, {num_devices} are visible")
        return raw


def _fmt(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={v}" for a, v in sizes.items())


def mesh_config_defaults() -> ml_collections.ConfigDict:
    """`config.mesh`: one size per axis; -1 = all devices left. Default: pure FSDP over every device."""
    c = ml_collections.ConfigDict()
    c.data = 1  # replicas of the whole training state, each on its own tokens
    c.fsdp = -1  # parameters, FP32 masters and optimizer state sharded (ZeRO-3), gathered at use
    c.expert = 1  # MoE experts split over devices; tokens travel by all-to-all (also shards dense weights, FSDP-style)
    c.tensor = 1  # heads / MLP columns / vocab split (Megatron style); splits must keep 128-wide FP8 blocks whole
    return c


def make_mesh(config=None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, expert, tensor) over `devices` (default: all devices of all processes)."""
    cfg = MeshConfig.from_config(config)
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.sizes(len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
