"""The vocabulary side of one decode step, per part: the lm_head product and the sampler's noise.

A decode step of 256 rows spends ~0.8 ms of ~4 ms on the vocabulary (H100 profile, results/
step_profile_decode256_h100.json): the BF16 lm_head product ([rows, 2048] x [151936, 2048]^T, row invariant on our
grouped BF16 kernel) and the sampler's Gumbel noise over [rows, 151936] (one fused reduce). This script times, at
decode row counts and in one run:

  * lm_head: our BF16 kernel per tiling (bits compared with the default tiling: a tiling never changes a row's
    K order, so every tiling must give the same bits), cuBLAS (XLA dot, not row invariant) as the anchor, and
    the weight-read time at the copy bandwidth measured in the same run;
  * noise: the drawn token argmax(z + gumbel) per noise generator (counter-based bits + the two logs), each
    decomposed into bits only / logs only, and the whole plain sampler.

    python experiments/benchmarks/vocab_side.py --out experiments/benchmarks/results/vocab_side_<card>.json
    python experiments/benchmarks/vocab_side.py --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from timing import bench, run_header, write_results  # noqa: E402

from jaxrl_fp8.rollout import sampling  # noqa: E402

U32 = jnp.uint32
F32 = jnp.float32


def copy_bandwidth(mib: int = 1024) -> float:
    x = jnp.ones((mib * 2**20 // 4,), F32)
    f = jax.jit(lambda a: a + 1.0)
    t, _ = bench(f, x, iters=10)
    return 2 * x.nbytes / t


# --- noise generators -------------------------------------------------------------------------------------------

def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * U32(0xC2B2AE35)
    return h ^ (h >> 16)


def mix32_bits(keys, vocab):
    """Two murmur3 finalisers of (index, row key): ~14 integer ops an element."""
    kd = jax.random.key_data(keys).astype(U32)  # [B, 2]
    i = jnp.arange(vocab, dtype=U32)[None, :]
    return _fmix32(_fmix32(i * U32(0x9E3779B9) + kd[:, :1]) ^ kd[:, 1:])


def _mulhilo(a, b):
    p = a.astype(jnp.uint64) * jnp.uint64(b)
    return (p >> 32).astype(U32), p.astype(U32)


def philox_bits(keys, vocab):
    """Philox4x32-10 (cuRAND's / PyTorch's generator): counter (index // 4, row word, 0, 0), key = the row key."""
    kd = jax.random.key_data(keys).astype(U32)
    b = kd.shape[0]
    n4 = -(-vocab // 4)
    c0 = jnp.broadcast_to(jnp.arange(n4, dtype=U32)[None, :], (b, n4))
    c1 = jnp.zeros_like(c0)
    c2 = jnp.zeros_like(c0)
    c3 = jnp.zeros_like(c0)
    k0 = jnp.broadcast_to(kd[:, :1], (b, n4))
    k1 = jnp.broadcast_to(kd[:, 1:], (b, n4))
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + U32(0x9E3779B9)
        k1 = k1 + U32(0xBB67AE85)
    return jnp.stack([c0, c1, c2, c3], axis=-1).reshape(b, 4 * n4)[:, :vocab]


def threefry_bits(keys, vocab):
    return jax.vmap(lambda k: jax.random.bits(k, (vocab,), U32))(keys)


def uniform_from_bits(bits):
    """(0, 1]: the top 23 bits as a float32 mantissa in [1, 2), minus 1, mapped away from 0."""
    f = jax.lax.bitcast_convert_type((bits >> 9) | U32(0x3F800000), F32) - 1.0
    return jnp.maximum(f, jnp.finfo(F32).tiny)


def gumbel(u):
    return -jnp.log(-jnp.log(u))


NOISE = {"threefry": threefry_bits, "mix32": mix32_bits, "philox": philox_bits}


def noise_points(rows_list, vocab, out):
    key = jax.random.key(0)
    for rows in rows_list:
        z = jax.random.normal(key, (rows, vocab), F32) * 3
        keys = sampling.row_keys(jnp.arange(rows), jnp.full((rows,), 7))
        current = jax.jit(lambda z, keys: jnp.argmax(z + sampling.gumbel_noise(keys, vocab), -1))
        t, _ = bench(current, z, keys)
        out.append({"kind": "noise", "variant": "current (gumbel_noise)", "rows": rows, "median_ms": t * 1e3})
        print(f"noise rows {rows:4d} current           {t * 1e3:.4f} ms")
        for name, bits_fn in NOISE.items():
            draw = jax.jit(lambda z, keys, f=bits_fn: jnp.argmax(z + gumbel(uniform_from_bits(f(keys, vocab))), -1))
            bits_only = jax.jit(lambda z, keys, f=bits_fn: jnp.argmax(z + (f(keys, vocab) >> 9).astype(F32), -1))
            try:
                t, _ = bench(draw, z, keys)
                tb, _ = bench(bits_only, z, keys)
            except Exception as e:  # noqa: BLE001
                out.append({"kind": "noise", "variant": name, "rows": rows, "error": repr(e)[:300]})
                continue
            out.append({"kind": "noise", "variant": name, "rows": rows, "median_ms": t * 1e3, "bits_only_ms": tb * 1e3})
            print(f"noise rows {rows:4d} {name:16s}  {t * 1e3:.4f} ms (bits only {tb * 1e3:.4f})")
        logs_only = jax.jit(lambda z: jnp.argmax(z + gumbel(jnp.abs(z) * 1e-3 + 1e-6), -1))
        t, _ = bench(logs_only, z)
        out.append({"kind": "noise", "variant": "logs only (no bits)", "rows": rows, "median_ms": t * 1e3})
        plain = jax.jit(lambda z, keys: sampling.sample_with_logprobs(z, 1.0, 0, 1.0, jnp.arange(z.shape[0]),
                                                                        jnp.full((z.shape[0],), 7), plain=True))
        t, _ = bench(plain, z, keys)
        out.append({"kind": "noise", "variant": "whole plain sampler (current)", "rows": rows, "median_ms": t * 1e3})
        print(f"noise rows {rows:4d} logs-only / whole sampler: {out[-2]['median_ms']:.4f} / {t * 1e3:.4f} ms")


# --- lm_head ------------------------------------------------------------------------------------------------------

def head_points(rows_list, vocab, hidden, bw, out, interpret: bool):
    from pallas_kernels import gemm_grouped_bf16 as g

    C = g.Bf16GroupedConfig
    configs = [C(), C(64, 128, 4, 16, 1), C(64, 128, 6, 16, 0), C(128, 128, 2, 16, 0), C(64, 256, 2, 16, 0),
               C(128, 64, 3, 16, 0), C(64, 64, 6, 16, 0)]
    key = jax.random.key(1)
    w = (jax.random.normal(key, (vocab, hidden), F32) * 0.02).astype(jnp.bfloat16)
    for rows in rows_list:
        x = jax.random.normal(jax.random.key(rows), (rows, hidden), F32).astype(jnp.bfloat16)
        sizes = jnp.asarray([rows], jnp.int32)
        ref = None
        roof = w.nbytes / bw * 1e3
        cublas = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32))
        if not interpret:
            t, _ = bench(cublas, x, w)
            out.append({"kind": "lm_head", "impl": "cuBLAS (XLA dot)", "rows": rows, "median_ms": t * 1e3,
                        "weight_read_ms_at_copy_bw": roof})
            print(f"lm_head rows {rows:4d} cuBLAS {t * 1e3:.4f} ms (weight read at copy bw {roof:.4f} ms)")
        for cfg in configs:
            if vocab % cfg.tile_n:
                continue
            f = jax.jit(lambda x, w, cfg=cfg: g.grouped_matmul(x, w[None], sizes, config=cfg, interpret=interpret))
            label = f"ours {cfg.tile_m}x{cfg.tile_n} s{cfg.max_concurrent_steps} w{cfg.grid_tile_width} minor{cfg.grid_minor_dim}"
            try:
                y = np.asarray(f(x, w))
                t, _ = bench(f, x, w, iters=5 if interpret else 20, reps=1 if interpret else 5)
            except Exception as e:  # noqa: BLE001
                out.append({"kind": "lm_head", "impl": label, "rows": rows, "error": traceback.format_exc()[-400:]})
                print(f"lm_head rows {rows:4d} {label}: {repr(e)[:200]}")
                continue
            ref = y if ref is None else ref
            same = bool(np.array_equal(y.view(np.uint32), ref.view(np.uint32)))
            out.append({"kind": "lm_head", "impl": label, "rows": rows, "median_ms": t * 1e3, "bitwise_vs_default": same,
                        "fraction_of_copy_roofline": roof / (t * 1e3)})
            print(f"lm_head rows {rows:4d} {label:32s} {t * 1e3:.4f} ms  bitwise {same}  {roof / (t * 1e3):.2f} of roofline")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256", help="decode row counts")
    p.add_argument("--parts", default="head,noise", help="comma list of head, noise")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: vocab 1024, hidden 128, the kernel interpreted")
    p.add_argument("--out", default=None, help="JSON path (written after each part)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    vocab, hidden = (1024, 128) if args.tiny else (151936, 2048)
    result = run_header("vocab_side.py", argv)
    result.update({"vocab": vocab, "hidden": hidden, "rows": rows, "points": []})
    bw = copy_bandwidth(64 if args.tiny else 1024)
    result["copy_bytes_per_s"] = bw
    parts = args.parts.split(",")
    if "noise" in parts:
        noise_points(rows, vocab, result["points"])
        if args.out:
            write_results(args.out, result)
    if "head" in parts:
        head_points(rows, vocab, hidden, bw, result["points"], interpret=args.tiny)
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
