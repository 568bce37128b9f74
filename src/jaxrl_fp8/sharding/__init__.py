"""Scale-out: the training mesh (data, fsdp, expert, tensor), partition rules from the parameters' logical axis
names, FP8-block-safe split validation, expert parallelism (shard_map + all_to_all), the sharded train step,
and bucket-by-bucket weight export from sharded parameters. Design: docs/decisions/0009-sharding.md.
"""

from jaxrl_fp8.sharding.blocks import BlockSplitError, check_split, validate_quantized_layout
from jaxrl_fp8.sharding.expert import expert_parallel_moe, make_moe_impl
from jaxrl_fp8.sharding.mesh import BATCH_AXES, MESH_AXES, MeshConfig, MeshError, make_mesh, mesh_config_defaults
from jaxrl_fp8.sharding.plan import ShardingPlan, per_device_bytes
from jaxrl_fp8.sharding.rollout import PLACEMENTS, CollocatedPlacement, block_safe_spec
from jaxrl_fp8.sharding.rules import DEFAULT_RULES, PartitionRules

__all__ = [
    "BATCH_AXES",
    "BlockSplitError",
    "CollocatedPlacement",
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshConfig",
    "MeshError",
    "PLACEMENTS",
    "PartitionRules",
    "ShardingPlan",
    "block_safe_spec",
    "check_split",
    "expert_parallel_moe",
    "make_mesh",
    "make_moe_impl",
    "mesh_config_defaults",
    "per_device_bytes",
    "validate_quantized_layout",
]
