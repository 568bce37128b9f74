"""One process of a 2-process CPU job (jax.distributed + gloo), 2 devices each -> mesh data=2 x expert=2.

`python tests/sharding/two_process.py PHASE PROCESS_ID PORT WORKDIR`
  train:  steps 1 and 2, Orbax checkpoint at step 2 (both processes write their shards), then step 3.
  resume: a fresh trainer initialized from another seed restores step 2 (params, optimizer, data iterator) and
          runs step 3. The test compares step 3 of both phases bitwise.
Prompts come from the grain loader sharded by process (process_index / process_count); each process feeds
only its rows and the global batch is assembled with make_array_from_process_local_data.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_fp8 import distributed  # noqa: E402


def main(phase, pid, port, workdir):
    distributed.initialize(distributed.DistributedConfig(coordinator_address=f"localhost:{port}", num_processes=2,
                                                         process_id=pid, initialization_timeout_s=120))
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import harness
    from jaxrl_fp8 import sharding as S
    from jaxrl_fp8.checkpoint import Checkpointer
    from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer
    from jaxrl_fp8.data.pipeline import LoaderConfig, PromptLoader, pad_prompts
    from jaxrl_fp8.data.synthetic import make_task, synthetic_splits

    assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
    tok = builtin_tokenizer()
    train, _ = synthetic_splits(make_task("copy", 2), seed=0, max_eval=4)
    loader = PromptLoader(train, tok, LoaderConfig(batch_size=4, seed=0, max_prompt_tokens=harness.T,
                                                   process_index=jax.process_index(), process_count=jax.process_count()))
    cfg = harness.fp8_test_config(vocab_size=tok.vocab_size, hidden_size=128, head_dim=32, intermediate_size=128,
                                  moe_intermediate_size=128, num_experts=4)
    plan = S.ShardingPlan(S.make_mesh(S.MeshConfig(data=2, expert=2, fsdp=1)))
    trainer = harness.build_trainer(plan, cfg, seed=0 if phase == "train" else 7)
    trainer.loader = loader
    plan.validate(trainer.params, trainer.train_policy)
    ckpt = Checkpointer(os.path.join(workdir, "ckpt"), max_to_keep=2, async_save=False)
    log = {"process": pid, "uids": {}, "loss": {}}

    def step(n):
        batch = next(loader)
        log["uids"][n] = [int(u) for u in batch.uids]
        tokens, _ = pad_prompts(batch.prompt_ids, tok.pad_id, side="left", length=harness.T)
        mb = harness.minibatch(cfg, len(batch), seed=100 * n + pid, tokens=tokens)
        nt = float(jax.experimental.multihost_utils.process_allgather(mb["mask"].sum()).sum())
        trainer.params, trainer.opt_state, met = trainer.apply_update(mb, nt)  # each process feeds its own rows
        trainer.step = n
        log["loss"][n] = float(met["loss"])

    if phase == "train":
        step(1)
        step(2)
        ckpt.save(2, trainer.state(), {"step": 2, "data": distributed.gather_process_states(loader.get_state())})
        ckpt.wait()
    else:
        state, meta = ckpt.restore(2, trainer.state())
        trainer.params, trainer.opt_state = state["params"], state["opt_state"]
        loader.set_state(distributed.own_process_state(meta["data"]))
        log["restored_step"] = int(meta["step"])
    step(3)
    full = jax.experimental.multihost_utils.process_allgather(trainer.params, tiled=True)
    if pid == 0:
        np.savez(os.path.join(workdir, f"{phase}_params.npz"), **harness.flat_numpy(full))
    log["param_bytes_per_device"] = sorted(set(S.per_device_bytes(trainer.params).values()))
    with open(os.path.join(workdir, f"{phase}_{pid}.json"), "w") as f:
        json.dump(log, f)
    ckpt.close()


if __name__ == "__main__":
    import jax.experimental.multihost_utils  # noqa: F401

    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
