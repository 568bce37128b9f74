"""Logical axis names on parameters, and a jitted forward on a data x fsdp mesh of 8 virtual CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from flax import nnx

import jaxrl_fp8.model as M

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parameters_carry_logical_axes():
    model = nnx.eval_shape(lambda: M.Qwen3(M.tiny_config(num_hidden_layers=2)))
    specs = {".".join(map(str, p)): v.get_metadata().get("out_sharding") for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert specs["embed.embedding"] == ("vocab", "embed")
    assert specs["lm_head.weight"] == ("vocab", "embed")
    assert specs["layers.0.attn.q_proj.weight"] == ("heads", "embed")
    assert specs["layers.0.attn.k_proj.weight"] == ("kv", "embed")
    assert specs["layers.0.attn.o_proj.weight"] == ("embed", "heads")
    assert specs["layers.0.moe.router.weight"] == ("expert", "embed")
    assert specs["layers.0.moe.down_proj.weight"] == ("expert", "embed", "mlp")
    assert specs["layers.1.mlp.gate_proj.weight"] == ("mlp", "embed")
    assert specs["final_norm.scale"] == ("embed",)


def test_forward_on_8_device_data_fsdp_mesh_matches_one_device():
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from flax import nnx
        import jaxrl_fp8.model as M
        assert jax.device_count() == 8
        policy = M.random_policy(M.tiny_config(num_hidden_layers=2), seed=0, dtype="float32")
        ids = np.random.default_rng(0).integers(0, 259, (4, 8))
        ref = np.asarray(policy.logits(ids))
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
        rules = {"embed": "fsdp", "vocab": None, "heads": None, "kv": None, "mlp": None, "expert": None}
        graphdef, state = nnx.split(policy.model)
        def place(var):
            axes = var.get_metadata().get("out_sharding") or ()
            spec = P(*(rules.get(a) if a else None for a in axes))
            return var.replace(jax.device_put(var.get_value(), NamedSharding(mesh, spec)))
        state = jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        x = jax.device_put(jnp.asarray(ids, jnp.int32), NamedSharding(mesh, P("data", None)))
        @jax.jit
        def fwd(state, x):
            return nnx.merge(graphdef, state)(x).logits
        out = fwd(state, x)
        emb = state["embed"]["embedding"].get_value()
        assert len(emb.sharding.device_set) == 8 and emb.addressable_shards[0].data.shape == (259, 16), emb.sharding
        out = np.asarray(out)
        print("MAXDIFF", float(np.abs(out - ref).max()), "BITWISE", bool((out == ref).all()))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), REPO, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [l for l in res.stdout.splitlines() if l.startswith("MAXDIFF")][0]
    print(line)
    assert float(line.split()[1]) <= 1e-5, line
