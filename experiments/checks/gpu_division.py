"""Is float32 division IEEE (correctly rounded) under XLA:GPU, with and without an LLVM NVPTX option?

The contract (docs/decisions/0001) divides with IEEE float32 division. XLA:GPU lowers `a / b` to the approximate
`div.full.f32` by default (seen in the quantize kernels' PTX), so the contract jitted on the GPU would not give the
CPU's bits. This check runs, in fresh processes, (1) a raw division and (2) the contract's quantizers on the GPU,
against numpy / the CPU, once plainly and once with XLA_FLAGS=--xla_backend_extra_options=nvptx-prec-divf32=2.
Prints a table and writes experiments/benchmarks/results/gpu_division_<device>.json (or $OUT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, numpy as np, jax, jax.numpy as jnp
from jaxrl_fp8 import precision as P
rng = np.random.default_rng(0)
a = (rng.random(1 << 22) * 1000).astype(np.float32); b = (rng.random(1 << 22) * 10 + 0.1).astype(np.float32)
gpu = jax.devices()[0]; cpu = jax.devices("cpu")[0]
div = np.asarray(jax.jit(lambda a, b: a / b)(jax.device_put(a, gpu), jax.device_put(b, gpu)))
out = {"device": gpu.device_kind, "raw_div_mismatches": int((div.view(np.uint32) != (a / b).view(np.uint32)).sum()), "n": int(a.size)}
x = (rng.standard_normal((4096, 1024)) * np.exp2(rng.integers(-10, 10, (4096, 1)))).astype(np.float32)
for name, fn in [("fp8_per_token_group", lambda x: P.quantize_fp8_per_token_group(x)),
                 ("fp8_per_block", lambda x: P.quantize_fp8_per_block(x)),
                 ("mxfp8", lambda x: P.quantize_mxfp8(x)),
                 ("nvfp4", lambda x: P.quantize_nvfp4(x))]:
    g = jax.device_get(jax.jit(fn)(jax.device_put(x, gpu)))
    with jax.default_device(cpu):
        c = jax.device_get(jax.jit(fn)(jax.device_put(x, cpu)))
    bad = sum(int((np.asarray(gg).view(np.uint8) != np.asarray(cc).view(np.uint8)).sum()) for gg, cc in zip(g, c) if np.ndim(gg))
    out[name + "_mismatched_bytes"] = bad
print("RESULT" + json.dumps(out))
"""


def run(flags: str) -> dict:
    env = dict(os.environ)
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    if not line:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    return json.loads(line[0][6:])


def main():
    rows = {"default": run(""), "-nvptx-prec-divf32=2": run("--xla_backend_extra_options=-nvptx-prec-divf32=2")}
    for k, v in rows.items():
        print(f"{k:>22}: {v}")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_division_h200.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
