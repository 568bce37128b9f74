"""Run as `python tests/sharding/eight_devices.py OUTDIR` (a subprocess of test_eight_devices.py): 8 virtual
CPU devices, one FP8 train step on five meshes, the block validation, expert-parallel HLO, sharded export.
Writes OUTDIR/results.json and OUTDIR/mesh_<name>.npz."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import harness  # noqa: E402
from jaxrl_fp8 import sharding as S  # noqa: E402
from jaxrl_fp8.model import Qwen3, tiny_config  # noqa: E402

MESHES = {
    "1": dict(data=1, fsdp=1),
    "data8": dict(data=8, fsdp=1),
    "fsdp8": dict(fsdp=8),
    "expert4_data2": dict(expert=4, data=2, fsdp=1),
    "tensor2_fsdp4": dict(tensor=2, fsdp=4),
}
ROWS = 16


def plan_for(mc):
    devices = jax.devices()[:1] if mc == MESHES["1"] else None
    return S.ShardingPlan(S.make_mesh(S.MeshConfig(**mc), devices=devices))


def expected_bytes(plan, tree):
    """Per-device bytes the storage specs imply: each leaf's bytes / the product of its split axes."""
    total = 0
    shardings = jax.tree.leaves(plan.state_shardings(tree))
    for leaf, sh in zip(jax.tree.leaves(tree), shardings):
        parts = 1
        for entry in sh.spec:
            for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
                parts *= plan.sizes[a]
        total += leaf.nbytes // parts
    return total


def expert_allgathers(hlo: str, cfg) -> list[str]:
    """HLO all-gathers whose result is a whole [E, ...] expert stack (would mean experts are replicated)."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {f"[{e},{i},{h}]", f"[{e},{h},{i}]"}
    return [ln.strip()[:160] for ln in hlo.splitlines() if "all-gather" in ln and any(s in ln.split("all-gather")[0] for s in shapes)]


def main(out):
    results = {"meshes": {}, "timing_s": {}}
    cfg = harness.fp8_test_config()
    batch = harness.minibatch(cfg, ROWS)
    nt = float(batch["mask"].sum())
    for name, mc in MESHES.items():
        t0 = time.perf_counter()
        plan = plan_for(mc)
        tr = harness.build_trainer(plan, cfg)
        plan.validate(tr.params, tr.train_policy)
        params_bytes = S.per_device_bytes(tr.params)
        opt_bytes = S.per_device_bytes(tr.opt_state)
        expect_p, expect_o = expected_bytes(plan, tr.params), expected_bytes(plan, tr.opt_state)
        tr.params, tr.opt_state, metrics = tr.apply_update(batch, nt)
        new_params, new_opt = tr.params, tr.opt_state
        compiled = tr.compiled_update(batch, nt)  # the executable that ran
        mem, hlo = compiled.memory_analysis(), compiled.as_text()
        grads = harness.flat_numpy(new_opt[0].grads)
        np.savez(os.path.join(out, f"mesh_{name}.npz"), **{f"grad/{k}": v for k, v in grads.items()},
                 **{f"param/{k}": v for k, v in harness.flat_numpy(new_params).items()})
        results["meshes"][name] = dict(
            sizes=plan.sizes, loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]),
            finite=float(metrics["finite"]),
            param_bytes_per_device=sorted(set(params_bytes.values())), opt_bytes_per_device=sorted(set(opt_bytes.values())),
            expected_param_bytes=expect_p, expected_opt_bytes=expect_o,
            compiled_argument_bytes=int(mem.argument_size_in_bytes), compiled_temp_bytes=int(mem.temp_size_in_bytes),
            all_to_all=len(re.findall(r"all-to-all\(", hlo)), expert_allgathers=expert_allgathers(hlo, cfg),
            expert_weight_shard=list(new_params["layers"][0]["moe"]["up_proj"]["weight"].get_value().addressable_shards[0].data.shape),
            notes=plan.notes[:6])
        results["timing_s"][name] = time.perf_counter() - t0
        print(name, results["meshes"][name]["loss"], f"{results['timing_s'][name]:.1f}s", flush=True)
        if name == "fsdp8":
            results["export"] = export_check(plan, new_params, tr.train_policy)

    results["validation"] = validation_messages()
    with open(os.path.join(out, "results.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))


def export_check(plan, params, policy):
    """Sharded export (gathered tensor by tensor) == single-device export, bitwise; host peak measured."""
    from converters.export import export_weights
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.sharding.export import export_weights_sharded, peak_host_bytes

    recipe = get_recipe("fp8_block")
    bucket = 256 * 1024
    host_params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
    reference = [(n, a.copy()) for b in export_weights(host_params, recipe, policy, bucket_bytes=bucket) for n, a in b]
    total = sum(a.nbytes for _, a in reference)
    largest = max(int(np.prod(v.shape)) * 4 for v in jax.tree.leaves(host_params) if np.ndim(v) == 2)
    largest = max(largest, max(int(np.prod(v.shape[1:])) * 4 for v in jax.tree.leaves(host_params) if np.ndim(v) == 3))

    def run():
        names, equal, buckets = [], True, 0
        ref = iter(reference)
        for b in export_weights_sharded(params, recipe, policy, bucket_bytes=bucket):
            buckets += 1
            for n, a in b:
                rn, ra = next(ref)
                names.append(n)
                equal &= rn == n and ra.dtype == a.dtype and ra.shape == a.shape and ra.tobytes() == a.tobytes()
            del b
        return names, equal, buckets

    (names, equal, buckets), peak = peak_host_bytes(run)
    master_bytes = sum(v.nbytes for v in jax.tree.leaves(host_params))
    return dict(tensors=len(names), reference_tensors=len(reference), bitwise_equal=bool(equal), buckets=buckets,
                bucket_bytes=bucket, exported_bytes=total, master_bytes=master_bytes, largest_tensor_f32_bytes=largest,
                peak_host_bytes=peak)


def validation_messages():
    """Block validation on layouts that split FP8 blocks (no compile: abstract shapes)."""
    out = {}
    tiny = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,))  # hidden 64, heads 4 x 16
    q30 = tiny_config(vocab_size=151936, hidden_size=2048, num_hidden_layers=1, mlp_only_layers=(), num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8)
    for label, cfg, mc in (("tiny_tensor2", tiny, dict(tensor=2, fsdp=4)), ("tiny_expert4", tiny, dict(expert=4, data=2, fsdp=1)),
                           ("qwen3_30b_tensor8", q30, dict(tensor=8, fsdp=1)), ("qwen3_30b_expert8", q30, dict(expert=8, fsdp=1))):
        plan = plan_for(mc)
        state = nnx.state(nnx.eval_shape(lambda c=cfg: Qwen3(c, dtype=jnp.float32, rngs=nnx.Rngs(0))), nnx.Param)
        try:
            checked = plan.validate(state, harness.fp8_policy(cfg))
            out[label] = dict(ok=True, checked=len(checked))
        except S.BlockSplitError as e:
            out[label] = dict(ok=False, message=str(e))
    out["quantized_storage"] = quantized_storage()
    from jaxrl_fp8.model import init_cache

    sh = plan_for(MESHES["tensor2_fsdp4"]).kv_cache_shardings(init_cache(tiny, 8, 16, jnp.float32))
    out["kv_cache_specs"] = dict(k=list(sh.k[0].spec), lengths=list(sh.lengths.spec))
    return out


def quantized_storage():
    """A stored QuantizedWeight [E, N, K] placed on two meshes: scales follow their blocks, or a clear error."""
    from jaxrl_fp8.precision import quantize_weight

    qw = quantize_weight(jax.random.normal(jax.random.PRNGKey(0), (8, 256, 256)) * 0.02, "fp8-block")
    tree = {"layers": {"0": {"moe": {"up_proj": {"weight": nnx.Param(qw, out_sharding=("expert", "mlp", "embed"),
                                                                       eager_sharding=False)}}}}}
    out = {}
    for label, mc in (("expert4_data2", MESHES["expert4_data2"]), ("tensor2_fsdp4", MESHES["tensor2_fsdp4"])):
        plan = plan_for(mc)
        try:
            q = plan.shard(tree)["layers"]["0"]["moe"]["up_proj"]["weight"].get_value()
            shards = [(list(a.data.shape), list(b.data.shape)) for a, b in zip(q.data.addressable_shards, q.scale.addressable_shards)]
            same = all(np.asarray(sh.data).tobytes() == np.asarray(full)[sh.index].tobytes()
                       for arr, full in ((q.scale, qw.scale), (q.data, qw.data)) for sh in arr.addressable_shards)
            out[label] = dict(ok=True, data_shard=shards[0][0], scale_shard=shards[0][1], scales_match=bool(same))
        except S.BlockSplitError as e:
            out[label] = dict(ok=False, message=str(e))
    return out


if __name__ == "__main__":
    main(sys.argv[1])
