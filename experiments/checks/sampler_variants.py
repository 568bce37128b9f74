"""The decode step's sampler and log-prob over the full vocabulary: which formulations are row invariant on this
device, and what each costs at the rollout's batch.

Why: on the H200 the one-per-step kernels over the [rows, vocab] float32 logits (temperature division, Gumbel
noise, argmax, log-softmax) take ~0.7 ms of a 3.5 ms decode step at 256 rows (step_profile_h200.json). The
log-softmax's sum is `numerics.row_sum` (a pairwise tree over the vocabulary padded to 2^18) because XLA:CPU's
reductions are not row invariant; on the GPU XLA's own row reduction may be, and would be one pass. A replacement
must give a row the same bits at every batch size (decode: rows; trainer: B x T positions), so this checks that
bitwise before it times anything.

Variants of log_softmax(z)[token] (z = logits / T):
  row_sum     the product's (numerics.log_softmax)
  jnp_sum     max, then jnp.sum(exp(z - max)) (XLA's reduction), log
and of the draw:
  current     sampling.sample_tokens
  fused       the same values, argmax inside the filter's cond (no [rows, V] keep mask) and greedy rows only when
              there are some

    python experiments/checks/sampler_variants.py --out $OUT/sampler_variants_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "benchmarks")]
from row_invariance import _diff  # noqa: E402  (elements whose bits differ)
from timing import bench, run_header, write_results  # noqa: E402


def _ms(f, *args) -> float:
    return bench(f, *args)[0] * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,3,64,256,2560")
    ap.add_argument("--rows", type=int, default=256, help="the batch the variants are timed at")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jaxrl_fp8  # noqa: F401  (its XLA flags before the first device use)
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxrl_fp8.model.numerics import lanewise
    from jaxrl_fp8.rollout import sampling

    v = args.vocab
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    big = max(batches)
    logits = jnp.asarray(rng.standard_normal((big, v)) * 3.0, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, big), jnp.int32)
    temp = jnp.full((big,), 0.9, jnp.float32)

    def lp_jnp_sum(lg, tok, t):
        z = sampling.tempered_logits(lg, t)
        m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
        s = z - m
        logp = s - lanewise(jnp.log, jnp.sum(jnp.exp(s), axis=-1, keepdims=True))
        return jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

    logprob_variants = {"row_sum": jax.jit(sampling.token_logprobs), "jnp_sum": jax.jit(lp_jnp_sum)}
    result = {**run_header(__file__, argv), "vocab": v, "batches": batches, "counts": "elements whose bits differ",
              "logprob": {}, "sample": {}}
    ref_rows = 3
    for name, f in logprob_variants.items():
        full = np.asarray(f(logits, tokens, temp))
        per_batch = {}
        for b in batches:
            part = np.asarray(f(logits[:b], tokens[:b], temp[:b]))
            per_batch[b] = _diff(part[:min(b, ref_rows)], full[:min(b, ref_rows)]) + _diff(part[-1:], full[b - 1:b])
        # the trainer's layout: [B, T, V] with the rows as positions
        bt = np.asarray(jax.jit(lambda lg, tok, t: f(lg.reshape(-1, v), tok.reshape(-1), t.reshape(-1)))(
            logits.reshape(2, big // 2, v), tokens.reshape(2, big // 2), temp.reshape(2, big // 2)))
        ms = _ms(f, logits[:args.rows], tokens[:args.rows], temp[:args.rows])
        same_as_product = _diff(full, np.asarray(logprob_variants["row_sum"](logits, tokens, temp)))
        result["logprob"][name] = {"differing_by_batch": per_batch, "differing_in_trainer_layout": _diff(bt, full),
                                   "differing_from_row_sum": same_as_product, "ms_at_rows": ms}
        print(f"logprob {name:8s}: differing by batch {per_batch}, trainer layout {_diff(bt, full)}, "
              f"vs row_sum {same_as_product}; {ms:.3f} ms at {args.rows} rows")

    rows = args.rows
    top_k = jnp.zeros((rows,), jnp.int32)
    top_p = jnp.ones((rows,), jnp.float32)
    seeds = jnp.arange(rows, dtype=jnp.int32)
    steps = jnp.full((rows,), 7, jnp.int32)

    def fused(lg, t, k, p, sd, st):
        lg = lg.astype(jnp.float32)
        z = sampling.tempered_logits(lg, t)
        noise = sampling.gumbel_noise(sampling.row_keys(sd, st), z.shape[-1])
        needs_filter = jnp.any(((k > 0) & (k < z.shape[-1])) | (p < 1.0))
        drawn = lax.cond(needs_filter,
                         lambda: jnp.argmax(jnp.where(sampling.keep_mask(z, k, p), z + noise, -jnp.inf), axis=-1),
                         lambda: jnp.argmax(z + noise, axis=-1))
        greedy_rows = jnp.asarray(t) <= 0
        greedy = lax.cond(jnp.any(greedy_rows), lambda: jnp.argmax(lg, axis=-1), lambda: jnp.zeros_like(drawn))
        return jnp.where(greedy_rows, greedy, drawn).astype(jnp.int32)

    sample_variants = {"current": jax.jit(sampling.sample_tokens), "fused": jax.jit(fused)}
    drawn_ref = np.asarray(sample_variants["current"](logits[:rows], temp[:rows], top_k, top_p, seeds, steps))
    for name, f in sample_variants.items():
        out = np.asarray(f(logits[:rows], temp[:rows], top_k, top_p, seeds, steps))
        ms = _ms(f, logits[:rows], temp[:rows], top_k, top_p, seeds, steps)
        greedy_t = temp[:rows].at[::2].set(0.0)
        agree_greedy = _diff(np.asarray(f(logits[:rows], greedy_t, top_k, top_p, seeds, steps)),
                             np.asarray(sample_variants["current"](logits[:rows], greedy_t, top_k, top_p, seeds, steps)))
        result["sample"][name] = {"ms_at_rows": ms, "differing_from_current": _diff(out, drawn_ref),
                                  "differing_from_current_half_greedy": agree_greedy}
        print(f"sample {name:8s}: {ms:.3f} ms at {rows} rows; differing from current {_diff(out, drawn_ref)}, "
              f"half greedy {agree_greedy}")
    if args.out:
        write_results(args.out, result)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
