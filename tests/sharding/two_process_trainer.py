"""`Trainer.train_step` across processes vs one process with the same global batch (test_two_process_trainer.py).

`python tests/sharding/two_process_trainer.py multi PROCESS_ID PORT WORKDIR`: one of 2 processes x 2 CPU devices
    (jax.distributed + gloo), mesh data=2 x expert=2; two real `Trainer.train_step`s (2 minibatches each) on
    this process's samples (a stub engine: process p always returns its own fixed samples, with other response
    lengths than the other process, so the per-process token counts differ); then every process joins the
    final export (`train.export_final`) and only process 0 writes.
`python tests/sharding/two_process_trainer.py single WORKDIR`: one process x 4 devices, the same mesh shape; the
    two steps applied by hand from the documented rule: global batch = process 0's rows then process 1's,
    minibatch m = rows perm[m*4:(m+1)*4] of each process's block (perm = the trainer's per-step permutation of
    the 8 local rows), normalised by the minibatch's global token count.
Both write WORKDIR/<phase>.json (+ .npz of the final params and the last minibatch's gradients).
"""

import os
import sys

PHASE = sys.argv[1]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (" --xla_force_host_platform_device_count=" +
                                                             ("2" if PHASE == "multi" else "4"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_fp8 import distributed  # noqa: E402

N_SAMPLES, PROMPTS, T, P_LEN, STEPS = 4, 2, 8, 3, 2


def samples_of(pid, cfg, step):
    """Process pid's fixed samples of a step: 2 prompts x 4 responses of pid-dependent lengths."""
    from jaxrl_fp8.rollout.types import Sample

    rng = np.random.default_rng(1000 * pid + step)
    out = []
    for i in range(PROMPTS):
        prompt = rng.integers(2, cfg.vocab_size, P_LEN)
        for j in range(N_SAMPLES):
            r = 1 + (i * N_SAMPLES + j + 3 * pid) % (T - P_LEN)  # process 1 answers longer on average
            routed = rng.integers(0, cfg.num_experts, (P_LEN + r - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok))
            for layer in range(cfg.num_hidden_layers):
                if not cfg.is_moe_layer(layer):
                    routed[:, layer] = -1
            out.append(Sample(prompt_ids=prompt, response_ids=rng.integers(2, cfg.vocab_size, r),
                              rollout_logprobs=(-3 * rng.random(r)).astype(np.float32), finish_reason="length",
                              weight_version="v", routed_experts=routed.astype(np.int32), prompt_index=i, sample_index=j))
    return out


class StubEngine:
    def __init__(self, pid, cfg, trainer_ref):
        self.pid, self.cfg, self.trainer_ref = pid, cfg, trainer_ref

    def generate(self, prompts, sampling, return_routed_experts=False):
        return samples_of(self.pid, self.cfg, self.trainer_ref[0].step)


class StubLoader:
    def __next__(self):
        return types.SimpleNamespace(prompt_ids=[[2, 3, 4]] * PROMPTS, prompts=["p"] * PROMPTS, answers=["a"] * PROMPTS)


class StubTokenizer:
    pad_id = 0
    stop_ids = (1,)

    def decode(self, ids):
        return " ".join(map(str, ids))


def reward(prompt, response, answer):
    return float(len(response) % 7)


def build(plan, pid):
    import harness
    from jaxrl_fp8.model import Qwen3
    from jaxrl_fp8.rl.trainer import Trainer

    cfg = harness.fp8_test_config(hidden_size=128, head_dim=32, intermediate_size=128, moe_intermediate_size=128, num_experts=4)
    # plain SGD: Adam's first steps move every weight by about +-lr whatever the size of its gradient, so a
    # weight whose gradient is ~0 up to rounding would move by lr or -lr depending on the reduction order
    opt, schedule = optax.sgd(0.1), optax.constant_schedule(0.1)
    settings = harness.settings()
    settings = type(settings)(**{**settings.__dict__, "num_minibatches": 2, "n_samples": N_SAMPLES, "prompts_per_step": PROMPTS})
    ref = [None]
    trainer = Trainer(model=Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), settings=settings,
                      optimizer=optax.chain(harness.capture_grads(), opt), schedule=schedule,
                      engine=StubEngine(pid, cfg, ref), tokenizer=StubTokenizer(), loader=StubLoader(), reward_fn=reward,
                      train_policy=harness.fp8_policy(cfg), push_weights=lambda *a: None, plan=plan)
    ref[0] = trainer
    trainer.updates = []  # (loss, grad_norm) of every minibatch update; the first update's gradients
    apply = trainer.apply_update

    def recording(mb, nt):
        out = apply(mb, nt)
        met = jax.device_get(out[2])
        trainer.updates.append((float(met["loss"]), float(met["grad_norm"]), float(nt)))
        if len(trainer.updates) == 1:
            trainer.first_grads = gathered(out[1][0].grads)
        return out

    trainer.apply_update = recording
    return trainer, cfg


def gathered(tree):
    import harness

    full = jax.experimental.multihost_utils.process_allgather(tree, tiled=True) if jax.process_count() > 1 else tree
    return harness.flat_numpy(full)


def multi(pid, port, workdir):
    distributed.initialize(distributed.DistributedConfig(coordinator_address=f"localhost:{port}", num_processes=2,
                                                         process_id=pid, initialization_timeout_s=120))
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from jaxrl_fp8 import sharding as S

    assert jax.process_count() == 2 and len(jax.devices()) == 4
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(data=2, expert=2, fsdp=1)))
    trainer, cfg = build(plan, pid)
    log = {"process": pid, "steps": []}
    for _ in range(STEPS):
        m = trainer.train_step()
        log["steps"].append({k: m[k] for k in ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff")})
    params, grads = gathered(trainer.params), gathered(trainer.opt_state[0].grads)
    log["updates"] = trainer.updates
    if pid == 0:
        np.savez(os.path.join(workdir, "multi.npz"), **{f"param/{k}": v for k, v in params.items()},
                 **{f"grad/{k}": v for k, v in grads.items()}, **{f"first/{k}": v for k, v in trainer.first_grads.items()})
    log["export"] = export(trainer, cfg, workdir)
    with open(os.path.join(workdir, f"multi_{pid}.json"), "w") as f:
        json.dump(log, f)


def export(trainer, cfg, workdir):
    """Every process runs the final export (it gathers tensor by tensor); only process 0 writes."""
    from jaxrl_fp8 import train
    from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer
    from jaxrl_fp8.precision import get_recipe

    import harness

    recipe = get_recipe("fp8_block")
    written = []
    real_replace = os.replace

    def spy(src, dst, *a, **kw):  # every rename into place made by this process
        written.append(os.path.relpath(os.path.abspath(dst), workdir))
        return real_replace(src, dst, *a, **kw)

    real_rename = os.rename
    os.replace = spy
    os.rename = lambda src, dst: (written.append(os.path.relpath(os.path.abspath(dst), workdir)), real_rename(src, dst))[1]
    try:
        train._export_final(trainer, recipe, harness.fp8_policy(cfg), builtin_tokenizer(), workdir)
    finally:
        os.replace, os.rename = real_replace, real_rename
    return {"renames": sorted(written)}


def single(workdir):
    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.rl.batch import build_batch

    assert jax.process_count() == 1 and len(jax.devices()) == 4
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(data=2, expert=2, fsdp=1)))
    trainer, cfg = build(plan, 0)
    log = {"steps": [], "local_token_counts": [], "minibatch_local_token_counts": []}
    for step in range(STEPS):
        blocks = []
        for pid in (0, 1):  # what each process builds from its own samples
            tb = build_batch(samples_of(pid, cfg, step), np.zeros(PROMPTS * N_SAMPLES, np.float32), T, 0,
                             num_layers=cfg.num_hidden_layers, top_k=cfg.num_experts_per_tok, with_routing=True)
            rewards = np.asarray([reward("p", StubTokenizer().decode(s.response_ids.tolist()), "a")
                                  for s in samples_of(pid, cfg, step)], np.float32)
            blocks.append(dict(tokens=tb.tokens, routed=tb.routed_experts, mask=tb.response_mask,
                               rollout_logp=tb.rollout_logp, advantages=trainer.advantages(rewards)))
        log["local_token_counts"].append([float(b["mask"].sum()) for b in blocks])
        glob = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
        put = plan.put_batch({"tokens": glob["tokens"], "routed": glob["routed"]})
        old = np.asarray(trainer._logprob_jit(trainer.params, put["tokens"], put["routed"]))
        glob["old_logp"] = old
        local = 8
        order = np.random.default_rng(trainer.s.seed + step).permutation(local)
        losses, norms = [], []
        for m in range(2):
            idx = np.concatenate([p * local + order[m * 4:(m + 1) * 4] for p in (0, 1)])
            mb = {k: v[idx] for k, v in glob.items()}
            log["minibatch_local_token_counts"].append([float(blk["mask"][order[m * 4:(m + 1) * 4]].sum()) for blk in blocks])
            nt = jnp.float32(max(float(mb["mask"].sum()), 1.0))
            trainer.params, trainer.opt_state, met = trainer.apply_update(mb, nt)
            losses.append(trainer.updates[-1][0])
            norms.append(trainer.updates[-1][1])
        trainer.step += 1
        log["steps"].append({"loss": float(np.mean(losses)), "grad_norm": float(np.mean(norms))})
    params, grads = gathered(trainer.params), gathered(trainer.opt_state[0].grads)
    log["updates"] = trainer.updates
    np.savez(os.path.join(workdir, "single.npz"), **{f"param/{k}": v for k, v in params.items()},
             **{f"grad/{k}": v for k, v in grads.items()}, **{f"first/{k}": v for k, v in trainer.first_grads.items()})
    with open(os.path.join(workdir, "single.json"), "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    import jax.experimental.multihost_utils  # noqa: F401

    if PHASE == "multi":
        multi(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        single(sys.argv[2])
