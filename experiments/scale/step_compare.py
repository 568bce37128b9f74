"""One unified-FP8 train step of a ~2B-parameter Qwen3-MoE on 2 GPUs (expert parallel, dense weights FSDP over
the same axis) against 1 GPU: loss, step time and memory per GPU -> JSON.

    python experiments/scale/step_compare.py                 # the 2xH200 measurement (nvidia-h200-x2)
    python experiments/scale/step_compare.py --tiny          # CPU smoke test: tiny model, 2 virtual devices

Each layout runs in its own subprocess (so per-device peak memory is that layout's alone), on the same
initial parameters and the same minibatch; the parent merges the two into
experiments/benchmarks/results/scale_step_compare[_tiny].json. The step is the RL trainer's own sharded update
(`Trainer(plan=...)`, `compiled_update`: PPO-clip x TIS loss, grads in the recipe's backward mode, AdamW on FP32
masters, jitted by `ShardingPlan.jit_train_step` with explicit shardings); on more than one device the MoE layers
go through `sharding.expert_parallel_moe`, on one device through the model's single-device dispatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "experiments", "benchmarks", "results")

MODEL_2B = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                head_dim=128, intermediate_size=6144, moe_intermediate_size=1024, num_experts=32, num_experts_per_tok=4,
                mlp_only_layers=(), max_position_embeddings=4096, attention_impl="xla")
MODEL_TINY = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                  mlp_only_layers=(), max_position_embeddings=256)
LAYOUTS = {"1gpu": dict(devices=1, mesh=dict(data=1, fsdp=1, expert=1, tensor=1)),
           "2gpu_expert": dict(devices=2, mesh=dict(data=1, fsdp=1, expert=2, tensor=1)),
           "2gpu_fsdp": dict(devices=2, mesh=dict(data=1, fsdp=2, expert=1, tensor=1))}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small model on 2 virtual CPU devices (smoke test)")
    p.add_argument("--layouts", default="1gpu,2gpu_expert", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--recipe", default="fp8_block")
    p.add_argument("--rows", type=int, default=8, help="sequences per minibatch")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (--tiny: 16)")
    p.add_argument("--steps", type=int, default=5, help="steps timed after the first (compiling) one")
    p.add_argument("--out", default="")
    p.add_argument("--only", default="", help=argparse.SUPPRESS)  # child: run one layout, write --out
    return p.parse_args()


def child(args) -> dict:
    """Run one layout in this process and return its measurements."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.config import base_config
    from jaxrl_fp8.model import Qwen3, tiny_config
    from jaxrl_fp8.precision import PrecisionPolicy, get_recipe
    from jaxrl_fp8.rl.losses import PolicyLossConfig
    from jaxrl_fp8.rl.trainer import Trainer, TrainerSettings, make_optimizer

    layout = LAYOUTS[args.only]
    devices = jax.devices()[: layout["devices"]]
    if len(devices) < layout["devices"]:
        raise SystemExit(f"layout {args.only} needs {layout['devices']} devices, {len(jax.devices())} visible")
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(**layout["mesh"]), devices=devices))
    cfg = tiny_config(**(MODEL_TINY if args.tiny else MODEL_2B))
    recipe = get_recipe(args.recipe)
    policy = PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                                        kv_cache=recipe.kv_cache)
    seq = 16 if args.tiny and args.seq == 1024 else args.seq
    rl = base_config().rl
    rl.learning_rate = 1e-5
    opt, schedule = make_optimizer(rl, args.steps + 1)
    settings = TrainerSettings(total_steps=1, prompts_per_step=1, n_samples=args.rows, seq_len=seq, temperature=1.0, top_p=1.0,
                               top_k=-1, max_new_tokens=1, routing_replay=False, advantage="grpo", std_normalize=True,
                               num_minibatches=1, loss=PolicyLossConfig(), backward=recipe.backward,
                               compute_dtype=jnp.bfloat16, seed=0)
    # masters initialized on the host's CPU so both layouts start from the same values, then placed on the mesh
    with jax.default_device(jax.devices("cpu")[0] if jax.default_backend() != "cpu" else devices[0]):
        model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    tr = Trainer(model=model, settings=settings, optimizer=opt, schedule=schedule, engine=None, tokenizer=None, loader=None,
                 reward_fn=None, train_policy=policy, push_weights=lambda *a: None, plan=plan)
    checked = plan.validate(tr.params, policy)
    del model
    rng = np.random.default_rng(0)
    mb = dict(tokens=rng.integers(0, cfg.vocab_size, (args.rows, seq)).astype(np.int32),
              old_logp=(-3 * rng.random((args.rows, seq - 1))).astype(np.float32),
              rollout_logp=(-3 * rng.random((args.rows, seq - 1))).astype(np.float32),
              mask=np.ones((args.rows, seq - 1), np.float32), advantages=rng.normal(size=(args.rows,)).astype(np.float32))
    nt = float(mb["mask"].sum())
    t0 = time.perf_counter()
    compiled = tr.compiled_update(mb, nt)  # the trainer's sharded step (what Trainer.apply_update runs)
    compile_s = time.perf_counter() - t0
    batch = plan.put_batch(mb)  # placed once: the timed loop measures the step, not the host-to-device copy
    nt = jax.device_put(jnp.float32(nt), plan.replicated())
    state_bytes = S.per_device_bytes((tr.params, tr.opt_state))
    losses, times = [], []
    for i in range(args.steps + 1):
        t = time.perf_counter()
        tr.params, tr.opt_state, met = compiled(tr.params, tr.opt_state, batch, nt)
        loss = float(met["loss"])  # blocks until the step is done
        times.append(time.perf_counter() - t)
        losses.append(loss)
    mem = compiled.memory_analysis()
    peaks = {}
    for d in devices:
        stats = d.memory_stats() or {}
        peaks[str(d.id)] = stats.get("peak_bytes_in_use")
    hlo = compiled.as_text()
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(tr.params))
    return dict(
        layout=args.only, mesh=plan.sizes, devices=[str(d) for d in devices], platform=jax.default_backend(),
        model=dataclasses.asdict(cfg), parameters=n_params, recipe=args.recipe, rows=args.rows, seq=seq,
        losses=losses, step_seconds=times[1:], first_step_seconds=times[0], median_step_seconds=float(np.median(times[1:])) if args.steps else None,
        compile_seconds=compile_s, state_bytes_per_device={str(k): v for k, v in state_bytes.items()},
        compiled_bytes=dict(argument=int(mem.argument_size_in_bytes), output=int(mem.output_size_in_bytes),
                            temp=int(mem.temp_size_in_bytes), alias=int(mem.alias_size_in_bytes)),
        peak_bytes_in_use_per_device=peaks, all_to_all_ops=hlo.count("all-to-all("), block_checked_tensors=len(checked),
        sharding_notes=plan.notes[:10])


def main():
    args = parse()
    if args.only:
        result = child(args)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
        return
    out = args.out or os.path.join(RESULTS, "scale_step_compare_tiny.json" if args.tiny else "scale_step_compare.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT, env.get("PYTHONPATH", "")])
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    runs = {}
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        part = f"{out}.{layout}.part"
        cmd = [sys.executable, os.path.abspath(__file__), "--only", layout, "--out", part, "--recipe", args.recipe,
               "--rows", str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        print("running", layout, flush=True)
        subprocess.run(cmd, env=env, check=True)
        with open(part) as f:
            runs[layout] = json.load(f)
        os.remove(part)
    names = list(runs)
    base = runs[names[0]]
    summary = {}
    for name in names[1:]:
        r = runs[name]
        summary[name] = dict(
            first_loss_rel_diff=abs(r["losses"][0] - base["losses"][0]) / abs(base["losses"][0]),
            loss_rel_diff_per_step=[abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])],
            step_time_ratio=(r["median_step_seconds"] / base["median_step_seconds"]) if base["median_step_seconds"] else None,
            state_bytes_ratio=max(r["state_bytes_per_device"].values()) / max(base["state_bytes_per_device"].values()))
    result = dict(what="one unified-FP8 RL train step, 2 devices vs 1", command=" ".join(sys.argv), runs=runs,
                  compared_to=names[0], summary=summary, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)
    print(json.dumps(summary, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
