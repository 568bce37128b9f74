"""Mesh sizes, partition rules, the FP8 block check and the distributed config, in-process (1 device, no compile)."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_fp8 import distributed
from jaxrl_fp8.sharding import BlockSplitError, MeshConfig, MeshError, PartitionRules, check_split, mesh_config_defaults

SIZES = dict(data=2, fsdp=4, expert=1, tensor=2)


def test_mesh_sizes_resolve_the_rest_and_name_bad_keys():
    assert MeshConfig(data=2, fsdp=-1).sizes(8) == dict(data=2, fsdp=4, expert=1, tensor=1)
    assert MeshConfig.from_config(mesh_config_defaults()).sizes(8)["fsdp"] == 8
    with pytest.raises(MeshError, match=r"config.mesh.fsdp=-1: 8 devices are not a multiple of .* product 3"):
        MeshConfig(data=3).sizes(8)
    with pytest.raises(MeshError, match=r"needs 16 devices, 8 are visible"):
        MeshConfig(data=4, fsdp=4).sizes(8)
    with pytest.raises(MeshError, match=r"only one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1).sizes(8)
    with pytest.raises(MeshError, match=r"config.mesh.expert=0"):
        MeshConfig(expert=0).sizes(8)
    with pytest.raises(MeshError, match=r"config.mesh.pipeline: unknown mesh axis"):
        MeshConfig.from_config({"data": 1, "pipeline": 2})


def test_rules_storage_and_compute_layouts():
    r = PartitionRules()
    # expert stack [E, I, H]: experts over expert, I over tensor, H (embed) is the FSDP dim
    sizes = dict(data=1, fsdp=2, expert=4, tensor=2)
    assert r.spec("up", ("expert", "mlp", "embed"), (8, 256, 128), sizes) == P("expert", "tensor", "fsdp")
    assert r.spec("up", ("expert", "mlp", "embed"), (8, 256, 128), sizes, compute=True) == P("expert", "tensor", None)
    # a dense weight shards its embed dim over fsdp and expert (the expert axis is data-parallel for dense layers)
    assert r.spec("q", ("heads", "embed"), (512, 128), sizes) == P("tensor", ("fsdp", "expert"))
    # a mesh axis is used once per tensor; size-1 axes are left out
    assert r.spec("x", ("embed", "embed"), (64, 64), dict(data=1, fsdp=8, expert=1, tensor=1)) == P("fsdp", None)


def test_rules_fall_back_to_replication_and_record_why():
    notes = []
    spec = PartitionRules().spec("lm_head.weight", ("vocab", "embed"), (259, 64), SIZES, notes=notes)
    assert spec == P(None, "fsdp")
    assert notes == ["lm_head.weight dim 0 (vocab=259) not split over tensor=2: not divisible"]
    notes = []
    assert PartitionRules().spec("w", ("embed",), (6,), dict(data=1, fsdp=2, expert=4, tensor=1), notes=notes) == P("fsdp")
    assert "not split over expert=4" in notes[0]
    with pytest.raises(ValueError, match=r"w: 1 logical axis names .* for a 2-d tensor"):
        PartitionRules().spec("w", ("embed",), (4, 4), SIZES)


@pytest.mark.parametrize("fmt,shape,spec,ok", [
    ("fp8-block", (768, 2048), P("tensor", None), False),  # 96 rows per device
    ("fp8-block", (1024, 2048), P("tensor", None), True),
    ("fp8-block", (2048, 768), P(None, "tensor"), False),  # 96 columns: cuts blocks and 1x128 act groups
    ("fp8-block", (8, 768, 2048), P("tensor", None, None), True),  # experts split freely
    ("mxfp8", (768, 2048), P("tensor", None), True),  # rows are free for 1x32 groups
    ("mxfp8", (2048, 96 * 8), P(None, "tensor"), True),  # 96 = 3 groups of 32
    ("mxfp8", (2048, 80 * 8), P(None, "tensor"), False),
    ("nvfp4", (2048, 8 * 8), P(None, "tensor"), False),  # 8 columns < one 16-group
    ("bf16", (2, 2), P("tensor", "tensor"), True),
])
def test_block_check(fmt, shape, spec, ok):
    sizes = dict(data=1, fsdp=1, expert=1, tensor=8)
    if ok:
        check_split("w", shape, spec, sizes, fmt)
    else:
        with pytest.raises(BlockSplitError, match=r"^w dim [NK]="):
            check_split("w", shape, spec, sizes, fmt)


def test_block_check_message_matches_the_brief():
    with pytest.raises(BlockSplitError) as e:
        check_split("layers.0.moe.up_proj.weight", (128, 768, 2048), P(None, "tensor", None), dict(tensor=8), "fp8-block")
    assert str(e.value).startswith("layers.0.moe.up_proj.weight dim N=768 over tensor=8 gives 96 rows per device, "
                                   "not a multiple of the 128-row FP8 block")


def test_distributed_config_from_config_and_environment():
    D = distributed.DistributedConfig
    assert D().resolved(environ={}) is None  # single process
    env = {distributed.ENV_ADDRESS: "10.0.0.1:1234", distributed.ENV_NUM: "4", distributed.ENV_ID: "3"}
    r = D().resolved(environ=env)
    assert (r.coordinator_address, r.num_processes, r.process_id) == ("10.0.0.1:1234", 4, 3)
    r = D(coordinator_address="h:1", num_processes=2, process_id=1).resolved(environ=env)  # config wins
    assert (r.coordinator_address, r.num_processes, r.process_id) == ("h:1", 2, 1)
    with pytest.raises(ValueError, match=r"process_id=5 must be in \[0, num_processes=4\)"):
        D().resolved(environ={**env, distributed.ENV_ID: "5"})
    with pytest.raises(ValueError, match=r"JAXRL_NUM_PROCESSES='x' must be an integer"):
        D().resolved(environ={**env, distributed.ENV_NUM: "x"})
    with pytest.raises(ValueError, match=r"must be host:port"):
        D(coordinator_address="host", num_processes=2, process_id=0).resolved(environ={})
    with pytest.raises(ValueError, match=r"config.distributed.port: unknown key"):
        D.from_config({"port": 1})
    c = distributed.config_defaults()
    assert D.from_config(c) == D()


def test_process_states_single_process():
    states = distributed.gather_process_states({"epoch": 1, "pos": [3, 4]})
    assert states == {"0": {"epoch": 1, "pos": [3, 4]}}
    assert distributed.own_process_state(states) == {"epoch": 1, "pos": [3, 4]}
    with pytest.raises(ValueError, match=r"not for process 0"):
        distributed.own_process_state({"1": {}})


def test_lazy_param_gathers_one_expert_and_whole_tensors():
    import jax.numpy as jnp

    from jaxrl_fp8.sharding.export import gathered_params

    w = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    lazy = gathered_params({"layers": {"0": {"moe": {"up_proj": {"weight": jnp.asarray(w)}}}}})
    p = lazy["layers.0.moe.up_proj.weight"]
    assert p.shape == (2, 3, 4) and np.shape(p) == (2, 3, 4)
    np.testing.assert_array_equal(p[1], w[1])
    np.testing.assert_array_equal(np.asarray(p), w)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(p)), w)


def test_rollout_placement_is_validated_by_key():
    from jaxrl_fp8.config import ConfigError, base_config, validate_config

    c = base_config()
    c.workdir = "/tmp/unused"
    c.rollout.placement = "nearby"
    with pytest.raises(ConfigError, match=r"config.rollout.placement: 'nearby': separate \| collocated"):
        validate_config(c)
    c.rollout.placement = "collocated"
    c.rollout.engine = "sglang"
    c.rollout.sglang_urls = ("http://localhost:1",)
    c.rollout.weight_sync_dir = "/tmp/unused"
    with pytest.raises(ConfigError, match=r"config.rollout.placement: 'collocated' runs the embedded engine"):
        validate_config(c)


def test_rollout_operands_are_split_on_whole_blocks_only():
    import jax.numpy as jnp

    from jaxrl_fp8.precision import QuantizedWeight
    from jaxrl_fp8.sharding import block_safe_spec

    sizes = dict(data=1, fsdp=2, expert=4, tensor=1)
    stack = QuantizedWeight(jnp.zeros((8, 256, 128), jnp.float8_e4m3fn), jnp.ones((8, 2, 1)), None, "fp8-block", 128)
    notes = []
    # experts split freely; K=128 over fsdp=2 would leave 64 columns of a 128x128 block per device
    assert block_safe_spec("s", P("expert", None, "fsdp"), stack, sizes, notes) == P("expert", None, None)
    assert notes == ["rollout s dim 2 (size 128) not split over fsdp: it would cut a 128-wide FP8 block"]
    dense = QuantizedWeight(jnp.zeros((512, 1024), jnp.float8_e4m3fn), jnp.ones((4, 8)), None, "fp8-block", 1024)
    # K=1024 over fsdp x expert = 8 gives 128 columns: kept; over 16 it would not be
    assert block_safe_spec("d", P(None, ("fsdp", "expert")), dense, sizes) == P(None, ("fsdp", "expert"))
    assert block_safe_spec("d", P(None, ("fsdp", "expert")), dense, dict(sizes, expert=8)) == P(None, "fsdp")
