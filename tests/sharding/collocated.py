"""Run as `python tests/sharding/collocated.py OUTDIR` (a subprocess of test_collocated.py): 8 virtual CPU devices,
mesh expert=4 x fsdp=2. For the fp8_block and bf16 recipes: a Trainer on the mesh pushes its sharded weights to
an EmbeddedEngine placed on the same mesh ("collocated"), the engine samples, and the trainer recomputes the
log-probs of the samples (R3 replay) with its sharded forward; the same is done with an engine on one device
("separate") for comparison. Writes OUTDIR/results.json.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import harness  # noqa: E402
from jaxrl_fp8 import sharding as S  # noqa: E402
from jaxrl_fp8.model import Qwen3  # noqa: E402
from jaxrl_fp8.precision import PrecisionPolicy, QuantizedWeight, get_recipe  # noqa: E402
from jaxrl_fp8.rl.batch import build_batch  # noqa: E402
from jaxrl_fp8.rl.trainer import Trainer  # noqa: E402
from jaxrl_fp8.rollout.embedded import EmbeddedEngine  # noqa: E402
from jaxrl_fp8.rollout.types import SamplingParams  # noqa: E402

MESH = dict(expert=4, fsdp=2, data=1)
SEQ = 16
MAX_NEW = 6


def prompts(cfg, n=8, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, cfg.vocab_size, int(rng.integers(3, 8))).tolist() for _ in range(n)]


def recompute(trainer, samples, cfg):
    tb = build_batch(samples, np.zeros(len(samples), np.float32), SEQ, 0, num_layers=cfg.num_hidden_layers,
                     top_k=cfg.num_experts_per_tok, with_routing=True)
    old = np.asarray(trainer._logprob_jit(trainer.params, jnp.asarray(tb.tokens), jnp.asarray(tb.routed_experts)))
    mask = tb.response_mask > 0
    diff = np.abs(old - tb.rollout_logp)[mask]
    return dict(max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()), tokens=int(mask.sum()),
                bitwise=bool(np.array_equal(old[mask].view(np.uint32), tb.rollout_logp[mask].view(np.uint32))),
                rows=len(samples))


def buffer_ptrs(tree):
    out = set()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            out.update(s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards)
    return out


def one_recipe(name, cfg):
    recipe = get_recipe(name)
    policy = PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
    model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(**MESH)))
    plan.validate(nnx.state(model, nnx.Param), policy)
    placement = S.CollocatedPlacement(plan, moe=cfg.is_moe)
    kw = dict(recipe=recipe, policy=policy, max_batch=16, max_seq_len=SEQ, seed=0)
    collocated = EmbeddedEngine(model, placement=placement, **kw)
    separate = EmbeddedEngine(model, **kw)
    s = harness.settings(backward=recipe.backward)
    trainer = Trainer(model=model, settings=s, optimizer=optax.sgd(0.0), schedule=optax.constant_schedule(0.0),
                      engine=collocated, tokenizer=None, loader=None, reward_fn=None, train_policy=policy,
                      push_weights=collocated.update_params, plan=plan)
    out = {}
    t0 = time.perf_counter()
    # the push: by reference on the devices, never through the host
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        trainer.push_weights()
    out["push_seconds"] = time.perf_counter() - t0
    separate.update_params(trainer.current_model(), "v0")
    state = collocated._weights.state
    per_dev = S.per_device_bytes(state)
    total = sum(int(x.nbytes) for x in jax.tree.leaves(state))
    out["engine_weight_bytes_total"] = total
    out["engine_weight_bytes_per_device"] = sorted(set(per_dev.values()))
    out["engine_devices"] = len(per_dev)
    out["separate_devices"] = len(S.per_device_bytes(separate._weights.state))
    up = collocated._weights.state["layers"][0]["moe"]["up_proj"]["weight"].get_value()
    data = up.data if isinstance(up, QuantizedWeight) else up
    out["expert_up_proj_type"] = type(up).__name__
    out["expert_up_proj_shard"] = list(data.addressable_shards[0].data.shape)
    out["expert_up_proj_spec"] = [str(e) for e in data.sharding.spec]
    out["shares_trainer_buffers"] = bool(buffer_ptrs(state) & buffer_ptrs(trainer.params))
    out["notes"] = placement.notes[:4]
    ps = prompts(cfg)
    sp = [SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=2, seed=11 + i) for i in range(len(ps))]
    for label, engine in (("collocated", collocated), ("separate", separate)):
        t0 = time.perf_counter()
        samples = engine.generate(ps, sp, return_routed_experts=True)
        out[f"{label}_generate_seconds"] = time.perf_counter() - t0
        out[label] = recompute(trainer, samples, cfg)
        out[label]["response_ids"] = [s.response_ids.tolist() for s in samples]
        print(name, label, out[label]["max_abs_diff"], out[label]["bitwise"], flush=True)
    return out


def main(out_dir):
    cfg = harness.fp8_test_config()
    results = {"mesh": MESH, "recipes": {}}
    for name in ("fp8_block", "bf16"):
        t0 = time.perf_counter()
        results["recipes"][name] = one_recipe(name, cfg)
        results["recipes"][name]["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, "results.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(out_dir, "results.json.tmp"), os.path.join(out_dir, "results.json"))


if __name__ == "__main__":
    main(sys.argv[1])
