"""Which parts of the forward are row invariant on this device: a row computed alone (or in a decode step)
equals the same row computed inside a larger batch (or in the full-sequence forward), bit for bit?

Why: the embedded engine's rollout log-probs equal the trainer's bit for bit only if every op of the forward
gives a row the same bits whatever M it is computed with (decision record 0008). On CPU every op here is
row invariant (tests/checks/test_row_invariance.py asserts it). On the H200 the unified recipes are not
bitwise (docs/mismatch_study.md, BF16/BF16 mean |dlogp| 0.004-0.007), and the suspects are cuBLAS (the
float32 router / lm_head dots, BF16 dense dots) and attention; this audit names the ops that break, in one
short device run, using the product's own functions:

  dense      ops.linear in each format (bf16, fp8-block, mxfp8, nvfp4), an attention-projection shape
  grouped    ops.grouped_linear (bf16, fp8-block): expert 0's first row alone vs among every expert's rows
  high_prec  model.matmul.high_precision_linear at the router and lm_head shapes (float32 accumulation), in its
             default XLA form and in ops.high_precision's "split3" form (the Pallas BF16 kernel, a candidate fix)
  norm       model.numerics.rms_norm, softmax, log_softmax
  attention  model.attention.attention, "exact" and "xla": the decode query (Tq = 1 against a cache) vs the
             same query inside the full causal forward

For each op and each batch size M: differing elements among the compared rows (0 = invariant).

    python experiments/checks/row_invariance.py                    # full shapes (a GPU)
    python experiments/checks/row_invariance.py --small            # CPU-sized shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

SHAPES = {  # name -> full, small
    "hidden": (2048, 256),
    "proj_out": (4096, 256),
    "moe_inter": (768, 128),
    "experts": (16, 4),
    "router_out": (64, 8),
    "vocab": (32768, 1024),
    "heads": (32, 4),
    "kv_heads": (4, 2),
    "head_dim": (128, 32),
    "seq": (256, 40),
}
BATCHES = {False: (1, 3, 64, 512, 4096), True: (1, 3, 16, 64)}


def _shapes(small: bool) -> dict:
    return {k: v[1] if small else v[0] for k, v in SHAPES.items()}


def _diff(a, b) -> int:
    """Elements of a and b whose bits differ (NaN payloads and -0.0 included)."""
    a, b = np.asarray(a), np.asarray(b)
    bytes_a, bytes_b = a.view(np.uint8).reshape(a.shape + (-1,)), b.view(np.uint8).reshape(b.shape + (-1,))
    return int(np.sum(np.any(bytes_a != bytes_b, axis=-1)))


def row_ops(s: dict):
    """name -> (jitted f(x [M, K]) -> [M, ...], K): row-wise ops whose row r must not depend on M."""
    import jax
    import jax.numpy as jnp

    from jaxrl_fp8 import ops
    from jaxrl_fp8.model.matmul import high_precision_linear
    from jaxrl_fp8.ops.high_precision import high_precision_dot
    from jaxrl_fp8.model.numerics import log_softmax, rms_norm, softmax

    rng = np.random.default_rng(0)
    h = s["hidden"]
    w_proj = jnp.asarray(rng.standard_normal((s["proj_out"], h)) * 0.02, jnp.float32)
    w_router = jnp.asarray(rng.standard_normal((s["router_out"], h)) * 0.02, jnp.float32)
    w_head = jnp.asarray(rng.standard_normal((s["vocab"], h)) * 0.02, jnp.float32)
    scale = jnp.asarray(1.0 + 0.1 * rng.standard_normal(h), jnp.float32)
    out = {}
    for fmt in ("bf16", "fp8-block", "mxfp8", "nvfp4"):
        out[f"dense {fmt}"] = (jax.jit(lambda x, fmt=fmt: ops.linear(x.astype(jnp.bfloat16), w_proj, fmt=fmt, out_dtype=jnp.float32)), h)
    out["router f32 (high_precision_linear)"] = (jax.jit(lambda x: high_precision_linear(x, w_router)), h)
    out["lm_head f32 (high_precision_linear)"] = (jax.jit(lambda x: high_precision_linear(x, w_head)), h)
    out["dense bf16 split3 (ops.high_precision)"] = (
        jax.jit(lambda x: high_precision_dot(x.astype(jnp.bfloat16), w_proj.astype(jnp.bfloat16), "split3")), h)
    out["router split3 (ops.high_precision)"] = (jax.jit(lambda x: high_precision_dot(x, w_router, "split3")), h)
    out["lm_head split3 (ops.high_precision)"] = (jax.jit(lambda x: high_precision_dot(x, w_head, "split3")), h)
    out["rms_norm"] = (jax.jit(lambda x: rms_norm(x, scale, 1e-6)), h)
    out["softmax"] = (jax.jit(softmax), s["vocab"])
    out["log_softmax"] = (jax.jit(log_softmax), s["vocab"])
    return out


def audit_rows(s: dict, batches, log=print) -> list[dict]:
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    rows = []
    for name, (f, k) in row_ops(s).items():
        x = jnp.asarray(rng.standard_normal((max(batches), k)), jnp.float32)
        alone = np.asarray(f(x[:1]))[0]
        first = {m: np.asarray(f(x[:m])) for m in batches}
        compared = min(batches[1], 3)
        ref = first[batches[1]][:compared]  # rows 0..compared-1 inside a small batch
        per_m = {}
        for m in batches:
            if m == 1:
                per_m[m] = _diff(first[m][0], alone)
            else:
                per_m[m] = _diff(first[m][0], alone) + _diff(first[m][:compared], ref)
        rows.append({"op": name, "differing_by_batch": per_m})
        log(f"{name:40s} " + "  ".join(f"M={m}: {d}" for m, d in per_m.items()))
    return rows


def audit_grouped(s: dict, batches, log=print) -> list[dict]:
    """Expert 0's first row alone (group sizes [1, 0, ...]) vs among M rows spread over every expert."""
    import jax
    import jax.numpy as jnp

    from jaxrl_fp8 import ops

    rng = np.random.default_rng(2)
    e, n, k = s["experts"], s["moe_inter"], s["hidden"]
    w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.02, jnp.float32)
    x = jnp.asarray(rng.standard_normal((max(batches), k)), jnp.bfloat16)
    rows = []
    for fmt in ("bf16", "fp8-block"):
        f = jax.jit(lambda x, gs, fmt=fmt: ops.grouped_linear(x, w, gs, fmt=fmt, out_dtype=jnp.float32))
        alone = np.asarray(f(x[:1], jnp.asarray([1] + [0] * (e - 1), jnp.int32)))[0]
        per_m = {}
        for m in batches:
            sizes = np.full(e, m // e, np.int32)
            sizes[: m % e] += 1  # m rows over the experts, expert 0 first (it holds row 0 for every m >= 1)
            per_m[m] = _diff(np.asarray(f(x[:m], jnp.asarray(sizes)))[0], alone)
        rows.append({"op": f"grouped {fmt}", "differing_by_batch": per_m})
        log(f"{'grouped ' + fmt:40s} " + "  ".join(f"M={m}: {d}" for m, d in per_m.items()))
    return rows


def audit_attention(s: dict, log=print) -> list[dict]:
    """Query t of the full causal forward vs the same query as a decode step (Tq = 1, cache mask), batch 1 and 4."""
    import jax
    import jax.numpy as jnp

    from jaxrl_fp8.model.attention import attention, cache_mask, causal_segment_mask

    rng = np.random.default_rng(3)
    t_len, h, hkv, d = s["seq"], s["heads"], s["kv_heads"], s["head_dim"]
    rows = []
    for impl in ("exact", "xla"):
        per_b = {}
        for b in (1, 4):
            q = jnp.asarray(rng.standard_normal((b, t_len, h, d)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((b, t_len, hkv, d)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((b, t_len, hkv, d)), jnp.bfloat16)
            full = np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, causal_segment_mask(jnp.zeros(q.shape[:2], jnp.int32)),
                                                                   scale=d ** -0.5, impl=impl))(q, k, v))
            step = jax.jit(lambda q1, k, v, slot: attention(q1, k, v, cache_mask(slot, k.shape[1]), scale=d ** -0.5, impl=impl))
            differing = 0
            for t in (0, t_len // 2, t_len - 1):
                slot = jnp.full((b, 1), t, jnp.int32)
                one = np.asarray(step(q[:, t : t + 1], k, v, slot))
                differing += _diff(one[:, 0], full[:, t])
            per_b[b] = differing
        rows.append({"op": f"attention {impl} (decode step vs full forward)", "differing_by_batch": per_b})
        log(f"{'attention ' + impl + ' decode vs full':40s} " + "  ".join(f"B={m}: {dd}" for m, dd in per_b.items()))
    return rows


def run(small: bool, log=print) -> dict:
    import jaxrl_fp8  # noqa: F401  (first: it sets the XLA flags the contract needs before JAX starts a backend)
    import jax

    s = _shapes(small)
    batches = BATCHES[small]
    t0 = time.time()
    rows = audit_rows(s, batches, log) + audit_grouped(s, batches, log) + audit_attention(s, log)
    dev = jax.devices()[0]
    return {
        "check": "row invariance of the forward's ops (differing elements; 0 = invariant)",
        "device": getattr(dev, "device_kind", dev.platform) if dev.platform != "cpu" else f"cpu ({platform.machine()})",
        "platform": dev.platform,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "shapes": s,
        "batches": list(batches),
        "rows": rows,
        "seconds": time.time() - t0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU-sized shapes and batches")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    result = run(args.small, log=lambda m: print(m, flush=True))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
        print(args.out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
