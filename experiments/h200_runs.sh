#!/usr/bin/env bash
# The H200 measurements, one stage per call (each fits a 10-minute device command), outputs under $OUT.
#   bash experiments/h200_runs.sh tests      # every -m gpu test (kernels, ops, converters), one log
#   bash experiments/h200_runs.sh gemm       # experiments/benchmarks/gemm.py: dense, MoE (fwd + wgrad), linear fwd+bwd
#   bash experiments/h200_runs.sh breakdown  # FP8 linear fwd+bwd component times (incl. the GEMM tile variants)
#   bash experiments/h200_runs.sh quantize   # quantize bandwidth: NVFP4 / MXFP8 v1 vs v2 configs, copy anchor
#   bash experiments/h200_runs.sh decode     # embedded engine decode, BF16 vs FP8, batch 1 / 32 / 256, roofline
#   bash experiments/h200_runs.sh mismatch moe-60M   # one size of the mismatch study (append into $OUT/mismatch_h200)
#   bash experiments/h200_runs.sh curves     # recipe curves (short RL runs, identical seeds)
# decode and mismatch write their JSON after every point / size, so a stage cut short keeps what it measured.
# The GPU image lacks ml_collections (and grain): install their wheels into a folder on PYTHONPATH first.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT" /tmp/jax_cache
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
quiet() { grep -v "Warning\|warn(\|slow_operation\|Constant folding\|This isn't\|If you'd\|^$"; }
case "${1:-}" in
  tests) $PY -m pytest -v -m gpu tests -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
  gemm) $PY experiments/benchmarks/gemm.py --out "$OUT/gemm_h200.json" 2>&1 | quiet | tee "$OUT/gemm.log" ;;
  breakdown) $PY experiments/benchmarks/linear_breakdown.py --out "$OUT/linear_breakdown_h200.json" 2>&1 | quiet | tee "$OUT/breakdown.log" ;;
  quantize) $PY experiments/benchmarks/quantize.py --kernels nvfp4,mxfp8 --no-anchor-torch --out "$OUT/quantize_h200.json" 2>&1 | quiet | tee "$OUT/quantize.log" ;;
  decode) $PY experiments/benchmarks/decode.py --batches 1,32,256 --gen-len 64 --repeats 2 --out "$OUT/decode_h200.json" 2>&1 | quiet | tee "$OUT/decode.log" ;;
  mismatch) $PY experiments/mismatch_study.py --sizes "${2:?size name, e.g. moe-60M}" --num-prompts 128 --max-new-tokens 64 \
              --append --out "$OUT/mismatch_h200" --compile-cache /tmp/jax_cache --no-progress 2>&1 | tail -20 ;;
  curves) $PY experiments/recipe_curves.py --steps 100 --set data.prompts_per_step=64 --out "$OUT/recipe_curves_h200" \
              --runs-dir "$OUT/runs" --overwrite 2>&1 | tail -20 ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
