"""One trainer step (forward + backward, fp8_block) of a Qwen3-30B-A3B-shaped slice at long T, per attention impl.

The slice: hidden 2048, 32/4 heads of 128, 128 experts of 768 top-8, vocab 151936, 2 layers; one row of T tokens;
FP32 masters cast to BF16 inside the loss (as the trainer does), the recipe's backward mode. For each (impl, T) the
step is compiled, its memory need read from XLA's analysis of the program (arguments + outputs + temporaries: the
step's peak, independent of what ran before in the process), and timed when `--run` allows it. A point that fails
to compile or to run (out of memory) is recorded with its error. Writes a table and results/train_step_long_<device>.json.

    python experiments/benchmarks/train_step_long.py --out experiments/benchmarks/results/train_step_long_h200.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jaxrl_fp8  # noqa: F401  (first: sets the XLA flags of the precision contract before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bench, write_results  # noqa: E402

SLICE = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
             norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="flash:4096,flash:16384,xla:16384,exact:4096,exact:16384",
                   help="comma list of impl:T (impl: flash | exact | xla)")
    p.add_argument("--no-run", default="exact:16384",
                   help="impl:T points only compiled (memory analysis), not timed (the exact scan at 16k takes minutes)")
    p.add_argument("--recipe", default="fp8_block")
    p.add_argument("--iters", type=int, default=2, help="steps per timing repetition")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (test of the script)")
    p.add_argument("--out", default=None, help="JSON path (default: results/train_step_long_<device>.json)")
    return p.parse_args(argv)


def _step_fn(cfg, recipe):
    from jaxrl_fp8.model.qwen3 import Qwen3
    from jaxrl_fp8.precision import PrecisionPolicy

    policy = PrecisionPolicy.for_format(recipe.train_format, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                                        kv_cache=recipe.kv_cache)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))

    def loss(params, tokens):
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
        logits = model(tokens, policy=policy, backward=recipe.backward).logits
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss)), params


def run_point(impl: str, t: int, shape: dict, recipe, timed: bool, iters: int) -> dict:
    from jaxrl_fp8.model.attention import resolve_impl
    from jaxrl_fp8.model.config import tiny_config

    cfg = tiny_config(**shape, attention_impl=impl)
    out: dict = {"impl": impl, "T": t, "runs": resolve_impl(impl, cfg.head_dim, jnp.bfloat16)}
    step, abstract = _step_fn(cfg, recipe)
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
    t0 = time.perf_counter()
    try:
        compiled = step.lower(abstract, tokens).compile()
    except Exception as e:  # noqa: BLE001  (recorded, the sweep goes on)
        out["error"] = f"compile: {type(e).__name__}: {str(e)[:400]}"
        return out
    out["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:
        need = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
        out["memory_gb"] = need / 1e9
        out["temp_gb"] = mem.temp_size_in_bytes / 1e9
    if not timed:
        out["timed"] = False
        return out
    try:
        params = jax.tree.map(lambda s: 0.02 * jax.random.normal(jax.random.key(0), s.shape, s.dtype), abstract)
        ids = jax.random.randint(jax.random.key(1), (1, t), 0, shape["vocab_size"], jnp.int32)
        med, _ = bench(compiled, params, ids, iters=iters, warmup=1, reps=3)
        out.update(step_s=med, tokens_per_s=t / med)
        del params
    except Exception as e:  # noqa: BLE001
        out["error"] = f"run: {type(e).__name__}: {str(e)[:400]}"
    return out


def main(argv=None):
    args = parse_args(argv)
    from jaxrl_fp8.precision import get_recipe

    recipe = get_recipe(args.recipe)
    dev = jax.devices()[0]
    shape = TINY if args.tiny else SLICE
    skip = {p for p in args.no_run.split(",") if p}
    res = {"benchmark": "train_step_long", "what": __doc__.split("\n")[0], "recipe": args.recipe, "shape": shape,
           "device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
           "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "date": time.strftime("%Y-%m-%d"), "points": []}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"train_step_long_{'cpu_tiny' if args.tiny else dev.platform}.json")
    print(f"{'impl':6} {'runs':6} {'T':>6} {'memory GB':>10} {'step s':>8} {'tok/s':>9}  note")
    for spec in [p for p in args.points.split(",") if p]:
        impl, t = spec.split(":")
        point = run_point(impl, int(t), shape, recipe, spec not in skip, args.iters)
        res["points"].append(point)
        write_results(out, res)
        mem = f"{point['memory_gb']:.1f}" if "memory_gb" in point else "-"
        step = f"{point['step_s']:.3f}" if "step_s" in point else "-"
        tps = f"{point['tokens_per_s']:.0f}" if "tokens_per_s" in point else "-"
        note = point.get("error", "compiled only" if point.get("timed") is False else "")
        print(f"{impl:6} {point['runs']:6} {int(t):6} {mem:>10} {step:>8} {tps:>9}  {note[:120]}", flush=True)
    flash = {p["T"]: p for p in res["points"] if p["impl"] == "flash" and "step_s" in p}
    for p in res["points"]:
        if p["impl"] != "flash" and "step_s" in p and p["T"] in flash:
            p["flash_speedup"] = p["step_s"] / flash[p["T"]]["step_s"]
    write_results(out, res)
    return res


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
