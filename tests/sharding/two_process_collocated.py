"""Collocated rollout on a multi-process job vs one process (test_two_process_collocated.py).

`python tests/sharding/two_process_collocated.py multi PROCESS_ID PORT WORKDIR`: one of 2 processes x 2 CPU devices
    (jax.distributed + gloo), mesh data=2 x expert=2. For fp8_block and bf16: a Trainer on the mesh pushes its
    sharded weights to an EmbeddedEngine placed on the same mesh; each process asks for ITS OWN requests (other
    numbers of prompts, prompt lengths, max_new_tokens and samples per prompt than the other process; one
    request of process 1 without a seed). The union has 2 chunks. The trainer then recomputes the log-probs of
    each process's samples (R3 replay) over the global batch. bf16 also runs the "python" decode loop. Last, a
    request that process 1 rejects must fail `generate` on both processes.
`python tests/sharding/two_process_collocated.py single WORKDIR`: one process x 4 devices, the same mesh shape: a
    collocated engine and a separate (one-device) engine each generate process 0's requests, then process 1's.
Both write WORKDIR/<phase>[_<pid>].json.
"""

import os
import sys

PHASE = sys.argv[1]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (" --xla_force_host_platform_device_count=" +
                                                             ("2" if PHASE == "multi" else "4"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_fp8 import distributed  # noqa: E402

MESH = dict(data=2, expert=2, fsdp=1)
SEQ = 16
RECIPES = ("fp8_block", "bf16")


def requests(pid, cfg):
    """Process pid's prompts and sampling parameters (process 0: 3 prompts x 2 samples; process 1: 2 prompts x 1
    and x 3 samples, the second without a seed, so its engine draws it)."""
    from jaxrl_fp8.rollout.types import SamplingParams

    rng = np.random.default_rng(10 + pid)
    if pid == 0:
        lens, sps = (3, 7, 5), [SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=21 + i) for i in range(3)]
    else:
        lens = (4, 9)
        sps = [SamplingParams(temperature=1.0, top_k=20, max_new_tokens=4, n=1, seed=5),
               SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5, n=3, seed=None)]
    return [rng.integers(1, cfg.vocab_size, n).tolist() for n in lens], sps


def dump(samples):
    return [dict(prompt=s.prompt_ids.tolist(), response=s.response_ids.tolist(),
                 logprob_bits=s.rollout_logprobs.view(np.uint32).tolist(),
                 routed=None if s.routed_experts is None else s.routed_experts.tolist(),
                 prompt_index=s.prompt_index, sample_index=s.sample_index, seed=s.seed, finish=s.finish_reason,
                 version=s.weight_version) for s in samples]


def setup(name, cfg, plan, with_trainer=True):
    import optax
    from flax import nnx

    import harness
    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.model import Qwen3
    from jaxrl_fp8.precision import PrecisionPolicy, get_recipe
    from jaxrl_fp8.rl.trainer import Trainer
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine

    recipe = get_recipe(name)
    policy = PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts)
    model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kw = dict(recipe=recipe, policy=policy, max_batch=8, max_seq_len=SEQ, seed=0)
    engine = EmbeddedEngine(model, placement=S.CollocatedPlacement(plan, moe=cfg.is_moe), **kw)
    trainer = Trainer(model=model, settings=harness.settings(backward=recipe.backward), optimizer=optax.sgd(0.0),
                      schedule=optax.constant_schedule(0.0), engine=engine, tokenizer=None, loader=None, reward_fn=None,
                      train_policy=policy, push_weights=engine.update_params, plan=plan)
    trainer.push_weights()  # the trainer's sharded masters, by reference
    return engine, trainer, model, kw


def recompute(trainer, samples, cfg):
    """The trainer's log-probs of this process's samples, computed over the global batch (process-local rows,
    padded to the same count on every process)."""
    from jaxrl_fp8.rl.batch import build_batch

    tb = build_batch(samples, np.zeros(len(samples), np.float32), SEQ, 0, num_layers=cfg.num_hidden_layers,
                     top_k=cfg.num_experts_per_tok, with_routing=True)
    rows = max(distributed.allgather_json(len(samples)))
    rows = -(-rows // 4) * 4  # a multiple of the 4 batch shards over the 2 processes' 2-row blocks
    pad = lambda x, v: np.concatenate([x, np.full((rows - x.shape[0], *x.shape[1:]), v, x.dtype)])
    put = trainer.plan.put_batch({"tokens": pad(tb.tokens, 0), "routed": pad(tb.routed_experts, -1)}, process_local=True)
    old = distributed.local_rows(trainer._logprob_jit(trainer.params, put["tokens"], put["routed"]))[: len(samples)]
    mask = tb.response_mask > 0
    return dict(bitwise=bool(np.array_equal(old[mask].view(np.uint32), tb.rollout_logp[mask].view(np.uint32))),
                max_abs_diff=float(np.abs(old - tb.rollout_logp)[mask].max()), tokens=int(mask.sum()), rows=len(samples))


def multi(pid, port, workdir):
    distributed.initialize(distributed.DistributedConfig(coordinator_address=f"localhost:{port}", num_processes=2,
                                                         process_id=pid, initialization_timeout_s=120))
    import harness
    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine

    assert jax.process_count() == 2 and len(jax.devices()) == 4
    cfg = harness.fp8_test_config()
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(**MESH)))
    log = {"process": pid, "recipes": {}}
    prompts, sps = requests(pid, cfg)
    for name in RECIPES:
        engine, trainer, model, kw = setup(name, cfg, plan)
        samples = engine.generate(prompts, sps, return_routed_experts=True)
        r = {"samples": dump(samples), "stats": engine.last_stats, "recompute": recompute(trainer, samples, cfg)}
        if name == "bf16":  # the jitted-step decode loop on the same mesh
            py = EmbeddedEngine(model, placement=engine.placement, decode_loop="python", **kw)
            py.update_params(trainer.current_model(), engine.weight_version)
            r["python_loop"] = dump(py.generate(prompts, sps, return_routed_experts=True))
        # this process asks for no routed experts while the other does (process 1 asks, process 0 not)
        r["no_routed"] = dump(engine.generate(prompts, sps, return_routed_experts=pid == 1))
        log["recipes"][name] = r
        print(pid, name, r["recompute"], flush=True)
    # a request rejected on process 1 fails generate on both processes (nobody waits in a collective)
    bad = prompts if pid == 0 else [[]]
    try:
        engine.generate(bad, sps[: len(bad)])
        log["error"] = None
    except ValueError as e:
        log["error"] = str(e)
    with open(os.path.join(workdir, f"multi_{pid}.json"), "w") as f:
        json.dump(log, f)


def single(workdir):
    import harness
    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine

    assert jax.process_count() == 1 and len(jax.devices()) == 4
    cfg = harness.fp8_test_config()
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(**MESH)))
    log = {"recipes": {}}
    for name in RECIPES:
        engine, trainer, _, kw = setup(name, cfg, plan)
        separate = EmbeddedEngine(trainer.current_model(), weight_version=engine.weight_version, **kw)
        log["recipes"][name] = {label: {str(pid): dump(e.generate(*requests(pid, cfg), return_routed_experts=True))
                                        for pid in (0, 1)}
                                for label, e in (("collocated", engine), ("separate", separate))}
    with open(os.path.join(workdir, "single.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    if PHASE == "multi":
        multi(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        single(sys.argv[2])
