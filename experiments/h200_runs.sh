#!/usr/bin/env bash
# The H200 measurements, one stage per call (each fits a 10-minute device command), outputs under $OUT.
#   bash experiments/h200_runs.sh tests      # every -m gpu test (kernels, ops, converters), one log
#   bash experiments/h200_runs.sh gemm       # experiments/benchmarks/gemm.py: dense, MoE (fwd + wgrad), linear fwd+bwd, torch anchors
#   bash experiments/h200_runs.sh wgrad      # (< 8 min): the FP8 and BF16 MoE wgrad kernels' GPU tests, their timing
#                                            # (persistent kernel configs, gather kernels, transposed_ragged_dot_mgpu) and
#                                            # the torch anchors
#   bash experiments/h200_runs.sh breakdown  # FP8 linear fwd+bwd component times (incl. the GEMM tile variants)
#   bash experiments/h200_runs.sh quantize   # FP8 / MXFP8 quantize GPU bit tests + their benchmark (copy anchor)
#   bash experiments/h200_runs.sh nvfp4      # NVFP4: GPU bit tests (v14, v12), the version / tiling sweep, SASS, ncu
#   bash experiments/h200_runs.sh bandwidth  # every quantizer: wall-clock rounds + CUPTI kernel time, 256 MiB and 1 GiB
#   bash experiments/h200_runs.sh decode     # embedded engine decode, BF16 vs FP8, batch 1 / 32 / 256, roofline
#   bash experiments/h200_runs.sh rollout_workload [RECIPES]  # issue 22's RL rollout (64 x 16 rows, lengths to 8k):
#                                            # continuous vs static, decode step vs roofline; RECIPES default bf16,fp8_block
#                                            # (one recipe per call if both do not fit: bf16, then fp8_block,
#                                            # appended into one $OUT/rollout_workload_h200.json); ROLLOUT_WORKLOAD_ARGS
#                                            # adds flags, e.g. "--schedulers continuous --passes 2": the FP8 / BF16
#                                            # steady ratio from a second pass on compiled programs (~6-7 min for both, estimated)
#   bash experiments/h200_runs.sh rollout_workload_fast [RECIPES]  # the same workload on the non-bitwise engine
#                                            # (--mode fast: JAXRL_FP8_HIGH_PRECISION=xla, cuBLAS dots), continuous only
#                                            # (~4 min for both recipes) -> $OUT/rollout_workload_fast_h200.json; then
#                                            # rollout_workload.py --merge results/rollout_workload_h200.json,<that> --out ...
#   bash experiments/h200_runs.sh mismatch moe-60M   # one size of the mismatch study (append into $OUT/mismatch_h200)
#   bash experiments/h200_runs.sh curves     # recipe curves (short RL runs, identical seeds)
#   bash experiments/h200_runs.sh diag       # GPU vs CPU bits of the XLA quantizers per XLA flag set (experiments/checks)
#   bash experiments/h200_runs.sh invariance # which forward ops are row invariant on the GPU (experiments/checks)
#   bash experiments/h200_runs.sh parallel 540   # the whole mismatch sweep and the recipe curves at once (below)
#   bash experiments/h200_runs.sh rl_step    # issue 23's RL step yardstick, 1k responses (bf16, fp8_block, then mixed)
#   bash experiments/h200_runs.sh rl_step_long  # the same at 4k responses (bf16, fp8_block, then mixed if time is left)
#   bash experiments/h200_runs.sh rl_step_accum # 1k responses as an RL recipe runs them: 4 optimizer updates a step
#                                            # (minibatches of 16 rows, gradients accumulated over micro-batches of 4,
#                                            # the loss's logits in chunks of 2048 positions; 6 layers: 112-119 GB measured on 2026-12-05,
#                                            # before train.run dropped its float32 model copy: ~17 GB less expected;
#                                            # 3 layers on a card under 100 GB, named by the card: rl_step_h100_1k_accum)
#                                            # instead of 32 updates of 2 rows
#   bash experiments/h200_runs.sh rl_step_onpolicy # the same 64 rows as ONE optimizer update a step (16 micro-batches of
#                                            # 4 rows): slime's on-policy default (--num-steps-per-rollout 1), where the
#                                            # per-update work (AdamW, FP8 weight quantization, gradient norm) is paid
#                                            # once a step instead of 4 times -> its own JSON (points key on recipe+length)
#   bash experiments/h200_runs.sh kernels_vs_base  # decode attention + decode GEMMs of this tree vs a carried .base (below)
#   bash experiments/h200_runs.sh flash_dq   # the dq kernel's 64- vs 128-key steps, fwd+bwd TFLOP/s beside cuDNN
#   bash experiments/h200_runs.sh fp8_kv     # (~4 min) the FP8 KV cache: paged kernel GPU bit tests + decode step vs BF16 pages
#   bash experiments/h200_runs.sh fp8_kv_workload [TIMEOUT] [RECIPES] [PASSES]  # (~7 min) the rollout workload, bf16 / fp8_block_kv / fp8_block
#   bash experiments/h200_runs.sh dense_decode  # (~3 min) the FP8 dense kernel on the attention projections at decode
#                                            # rows (64 / 256): 64- and 32-wide column tiles, 4-8 stages, bits against the
#                                            # default -> $OUT/gemm_dense_decode_<card>.json
#   bash experiments/h200_runs.sh paged_stages  # (~2 min) the paged decode kernel at 1 / 2 / 3 pipeline stages (fewer
#                                            # leave shared memory for a second program per SM), batch 64 / 256, caches
#                                            # 512 / 1k / 4k, against the copy roofline -> $OUT/attention_paged_stages_<card>.json
#                                            # (results keep one attention_<card>.json: fold its points in, under `calls`)
#   bash experiments/h200_runs.sh sampler_workload  # (~7 min) the two-level sampler and the counted MoE dispatch: their
#                                            # GPU tests, the sampler beside its one-level anchor at 256 rows, the rollout
#                                            # workload (bf16, fp8_block; measured 2026-12-07 on an H100 in 324 s)
#   bash experiments/h200_runs.sh dense_decode  # (~2 min) the decode step's dense FP8 GEMM tilings, in-program timing
#   bash experiments/h200_runs.sh fp8_converters  # (~3 min) decode over FP8 pages with two converter warpgroups (keys,
#                                            # values; registers rebalanced; FlashConfig.paged_fp8_converters=2) beside one:
#                                            # the GPU bit tests of both, then decode attention at 64 / 256 rows, 512 / 1k / 4k
#                                            # caches, both counts in one process -> $OUT/attention_fp8_converters_<card>.json.
#                                            # If 2 wins: make it the default, then `pending` (the workload, three recipes)
#   bash experiments/h200_runs.sh wgrad_out   # (~3 min) the MoE wgrad kernels (FP8, BF16) storing BF16 as they finish a tile
#                                            # (out_dtype: the trainer's compute dtype) vs float32 (+ XLA's convert), 4 / 5
#                                            # stages, 16384 / 4096 tokens; GPU bit tests -> $OUT/gemm_wgrad_out_<card>.json
#   bash experiments/h200_runs.sh optimizer_step  # (~1 min) the update's non-finite skip: rl.trainer.apply_if_finite (a cond
#                                            # around AdamW) vs the where over both trees it replaced, 0.5 B float32 masters
#                                            # -> $OUT/optimizer_step_<card>.json
#   bash experiments/h200_runs.sh workload_depth [LAYERS]  # (~7 min estimated at 8) the rollout workload on a deeper
#                                            # slice (default 8 layers), bf16 + fp8_block, two passes: how much of the 4-layer
#                                            # slice's FP8 / BF16 gap is the step's shared BF16 part (lm_head, sampler, routing)
#                                            # -> $OUT/rollout_workload_<LAYERS>layers_<card>.json (fold under `calls`)
#   bash experiments/h200_runs.sh device_loops  # (~8 min) A/B: the decode while loop relaunched by the host every
#                                            # step (XLA's default) vs one CUDA graph with conditional nodes
#                                            # (--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL), bf16 + fp8_block;
#                                            # measured 2026-12-07: no difference
#   bash experiments/h200_runs.sh unmeasured # (~7 min) wgrad_out, optimizer_step, fp8_converters in one call (this tree's
#                                            # changes that no GPU has run yet)
#   bash experiments/h200_runs.sh pending    # (~9 min) what the last build left unmeasured: the rollout workload, three
#                                            # recipes, two passes (fp8_kv_workload 560 bf16,fp8_block_kv,fp8_block 2)
#   bash experiments/h200_runs.sh pending_decode  # (~6 min) the rollout side at once: the
#                                            # decode profile at 256 slots (the dense BF16 tilings inside the step), the
#                                            # paged kernel's pipeline depths (256 rows, 512 / 1k caches), then the rollout workload
#                                            # (its decode step also at 1280-token prompts, near the workload's mean cache) (continuous, both
#                                            # recipes, the warmed copy anchor) -> $OUT/step_profile_decode256_<card>.json,
#                                            # $OUT/attention_paged_stages_<card>.json, $OUT/rollout_workload_<card>.json,
#                                            # $OUT/decode_hlo.tgz (the decode programs' optimized HLO)
#   bash experiments/h200_runs.sh chains     # (~5 min) FP8 grouped forward / wgrad promotion chains: bit tests + timings
#   bash experiments/h200_runs.sh flash      # flash attention: GPU tests (kernels; rollout == trainer at 4k responses)
#   bash experiments/h200_runs.sh train_long # one fp8_block trainer step at T = 4k / 16k per attention impl (memory, time)
#   bash experiments/h200_runs.sh profile [DEADLINE_S]  # (~5-6 min of the 570 s default) where the time of one decode
#                                            # step (256 rows, 256-token prompts) and of one train update (2 x 1280 tokens)
#                                            # goes, per kernel: step_profile.py, bf16 + fp8_block, jax.profiler traces
#                                            # -> $OUT/step_profile_h200.json + .log. Estimate: 4 compiles (2 programs x
#                                            # 2 recipes) of ~60 s, model inits ~20 s, timed + profiled runs ~30 s.
#                                            # STEP_PROFILE_ARGS adds flags (e.g. "--programs decode" or "--trace-dir
#                                            # $OUT/step_profile_traces" to keep the raw traces); the update needs
#                                            # ml_collections (train_deps: carry .whl/)
#   bash experiments/h200_runs.sh decode_gemm  # (~4 min) the grouped FP8 kernel's narrow split for decode (64-row blocks, a
#                                            # column tile per warpgroup): its GPU bit tests, then gemm.py --suites decode
#                                            # (the expert GEMMs of a decode step at 64 / 256 rows: default vs narrow split vs
#                                            # our BF16 kernel, weight bytes against the copy bandwidth) -> $OUT/gemm_decode_h200.json
#   bash experiments/h200_runs.sh profile_kv  # (~3 min) where the FP8 KV cache's decode step goes: step_profile.py's decode
#                                            # program, fp8_block_kv beside fp8_block, 4 layers, 256 slots, 1280-token prompts, with
#                                            # the step's optimized HLO -> $OUT/step_profile_decode256_kv_<card>.json (results keep
#                                            # one step_profile_decode256_<card>.json: fold it in under `calls`)
#   bash experiments/h200_runs.sh ncu_decode  # (~4 min) Nsight Compute of the decode step's two FP8 kernels: the paged FP8
#                                            # attention (256 rows x 4k caches) and the grouped FP8 expert GEMM (gemm.py --suites
#                                            # decode): $OUT/ncu_<kernel>.txt (speed of light, memory, warp states) and where warps
#                                            # wait per SASS instruction ($OUT/ncu_<kernel>_stalls.txt from ncu_stalls.py, CSV beside),
#                                            # pipe utilization and instruction mix (which unit a converting warp waits on)
#   bash experiments/h200_runs.sh profile_decode  # (~8 min; PROFILE_SLOTS=64 for one) step_profile.py's decode program at 64 slots (rl_step's rollout:
#                                            # 1k responses) and at 256 slots (rollout_workload), 6 layers, bf16 + fp8_block,
#                                            # every kernel listed (--top 120) with the source lines it computes (--hlo-dump),
#                                            # the optimized HLO of decode_slots beside it
#                                            # -> $OUT/step_profile_decode{64,256}_<card>.json, $OUT/decode_hlo.tgz
#   bash experiments/h200_runs.sh profile_accum  # (~4 min) the update as rl_step_accum runs it (16 rows x 1280 tokens, 4 layers
#                                            # on an H200, 3 on a card under 100 GB (bf16 runs out of memory at 4 on an H100;
#                                            # PROFILE_LAYERS overrides),
#                                            # micro-batches of 4, logit chunks of 2048), bf16 + fp8_block, its optimized
#                                            # HLO beside it; every top kernel named by the source lines it computes
#                                            # (--hlo-dump) -> $OUT/step_profile_update_accum_<card>.json,
#                                            # $OUT/update_hlo_accum.tgz (carry .whl/); UPDATE_MICRO_BATCH=8 sets the
#                                            # micro-batch (-> step_profile_update_mb8_<card>.json, update_hlo_mb8.tgz)
#   bash experiments/h200_runs.sh update_mb  # (~4 min) profile_accum at micro-batches of 8 and of 16 rows (results keep
#                                            # one step_profile_update_accum_<card>.json: fold them in under `calls`)
# decode, rollout_workload, mismatch and profile write their JSON after every point / size, so a stage cut short keeps
# what it measured.
# The GPU image lacks ml_collections, grain (+ array_record, portpicker) and tensorboardX: download their wheels into
# .whl/ (the versions of .venv; `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 ...`), carry .whl and install them into a folder on PYTHONPATH first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (without grain and tensorboardX every training run - the recipe curves - stops at its first import). The rl_step
# and profile stages do this themselves when .whl/ was carried (train_deps below). Wheels (cp312, manylinux): grain 0.2.18,
# array_record 0.8.6, ml_collections 1.1.0, tensorboardX 2.6.5, portpicker 1.6.0, cloudpickle 3.1.3 (their other
# dependencies - absl-py, etils, protobuf, psutil, PyYAML, packaging, numpy - come with orbax / matplotlib on the image).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT" /tmp/jax_cache
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
quiet() { grep --line-buffered -v "Warning\|warn(\|slow_operation\|Constant folding\|This isn't\|If you'd\|^$"; }
STUDY_ARGS="--num-prompts 128 --max-new-tokens 64 --no-progress"
# Rollout groups of the study (recipes sharing a rollout format share one rollout).
GROUPS_ALL="bf16 bf16_train_fp8_rollout,fp8_block bf16_train_mxfp8_rollout,mxfp8 nvfp4"

# parallel DEADLINE_S: the study's four sizes (the two largest split by rollout group) and the five recipe runs as
# separate processes at once. Compilation is host-bound and single-threaded while the GPU idles, so 16 processes
# on the 16-core host finish in about the time of the longest. Jobs still running at the deadline are stopped;
# what finished is merged (one mismatch_h200/, one recipe_curves_h200/) and packed into $OUT/parallel.tar.gz.
# PARALLEL_TESTS="tests/..." also runs those -m gpu tests alongside (log: parts/gpu_tests.log). Timing caveat: the recipe runs share the GPU and the host with the other jobs, so their step times are upper bounds.
parallel() {
  local deadline=$(( $(date +%s) + ${1:?deadline seconds} )) parts="$OUT/parts" pids=() job
  mkdir -p "$parts"
  # 16 processes share the GPU's memory: no preallocation, memory returned when freed (the BFC allocator kept
  # it and CUDA graphs needed more: 10 of 16 jobs ran out of memory on the H200 with preallocation off alone)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer="
  launch() {  # PARALLEL_ONLY="name name ..." runs only those jobs (a rerun of the ones a call did not finish)
    local name=$1; shift
    [ -n "${PARALLEL_ONLY:-}" ] && [[ " $PARALLEL_ONLY " != *" $name "* ]] && return 0
    setsid "$@" > "$parts/$name.log" 2>&1 & pids+=($!)
  }
  launch moe-60M $PY experiments/mismatch_study.py --sizes moe-60M $STUDY_ARGS --out "$parts/moe-60M"
  launch moe-400M_a $PY experiments/mismatch_study.py --sizes moe-400M --recipes bf16,bf16_train_fp8_rollout,fp8_block $STUDY_ARGS --out "$parts/moe-400M_a"
  launch moe-400M_b $PY experiments/mismatch_study.py --sizes moe-400M --recipes bf16_train_mxfp8_rollout,mxfp8,nvfp4 $STUDY_ARGS --out "$parts/moe-400M_b"
  for size in moe-1.5B moe-3.7B; do
    local i=0
    for group in $GROUPS_ALL; do
      i=$((i + 1)); launch "${size}_g$i" $PY experiments/mismatch_study.py --sizes $size --recipes $group $STUDY_ARGS --out "$parts/${size}_g$i"
    done
  done
  for recipe in bf16 bf16_train_fp8_rollout fp8_block mxfp8 nvfp4; do
    launch "curves_$recipe" $PY experiments/recipe_curves.py --recipes $recipe --steps 100 --set data.prompts_per_step=64 \
      --out "$parts/curves_$recipe" --runs-dir "$OUT/runs" --overwrite
  done
  [ -n "${PARALLEL_TESTS:-}" ] && launch gpu_tests $PY -m pytest -v -s -m gpu $PARALLEL_TESTS -p no:cacheprovider --durations=20
  while [ $(date +%s) -lt $deadline ]; do
    local alive=0
    for job in "${pids[@]}"; do kill -0 "$job" 2>/dev/null && alive=$((alive + 1)); done
    [ $alive -eq 0 ] && break
    sleep 5
  done
  for job in "${pids[@]}"; do kill -0 "$job" 2>/dev/null && { echo "stopping job $job at the deadline"; kill -- -"$job"; }; done
  sleep 2
  local dirs finished=""
  dirs=$(ls -d "$parts"/moe-*/ 2>/dev/null | while read -r d; do [ -f "$d/mismatch.json" ] && printf '%s,' "${d%/}"; done)
  [ -n "$dirs" ] && $PY experiments/mismatch_study.py --merge "${dirs%,}" --out "$OUT/mismatch_h200" 2>&1 | quiet
  for recipe in bf16 bf16_train_fp8_rollout fp8_block mxfp8 nvfp4; do
    [ -f "$parts/curves_$recipe/recipe_curves.json" ] && finished="$finished,$recipe"
  done
  [ -n "$finished" ] && $PY experiments/recipe_curves.py --from-runs --recipes "${finished#,}" --steps 100 \
      --set data.prompts_per_step=64 --runs-dir "$OUT/runs" --out "$OUT/recipe_curves_h200" 2>&1 | quiet
  tail -n 3 "$parts"/*.log
  (cd "$OUT" && tar czf parallel.tar.gz --exclude='checkpoints' --exclude='*.orbax*' mismatch_h200 recipe_curves_h200 parts \
     $(find runs -name 'metrics.jsonl' 2>/dev/null) 2>/dev/null; ls -la parallel.tar.gz)
}

# ncu_nvfp4 IMPL ROWS CTAS [SCHEDULE]: Nsight Compute of one NVFP4 call on the 256 MiB bf16 benchmark input
# (experiments/benchmarks/profile_one.py), with per-SM active cycles and why warps wait, per issued instruction;
# the report goes to $OUT/ncu_nvfp4_IMPL_rROWS_cCTAS[_dynamic].txt
STALLS=$(for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle membar not_selected \
           selected dispatch_stall no_instruction branch_resolving sleeping; do
           printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' "$r"; done | sed 's/,$//')
ncu_nvfp4() {
  local sched="${4:-static}" rep="$OUT/ncu_nvfp4_$1_r$2_c$3$([ "${4:-static}" = static ] || echo "_$4").txt"
  timeout 120 ncu --kernel-name regex:quantize_nvfp4 --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      --section SchedulerStats --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
      --section LaunchStats --metrics sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_elapsed.max,$STALLS \
      $PY experiments/benchmarks/profile_one.py --impl "$1" --rows "$2" --ctas-per-sm "$3" --schedule "$sched" > "$rep" 2>&1
  grep -E "sm__cycles|stalled_(barrier|long_sc|wait|math|mio)|Registers Per|Achieved Active|Issue Slots Busy|Executed Ipc A|Duration|pipeline" \
      "$rep" | head -20
}

# the training loop's imports (grain, ml_collections, tensorboardX): from the carried .whl/ when the image lacks them
train_deps() {
  if ! $PY -c "import grain, ml_collections, tensorboardX" 2>/dev/null; then
    ls .whl/*.whl > /dev/null 2>&1 || { echo "error: grain / ml_collections / tensorboardX missing and no .whl/ carried"; return 1; }
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING" | tail -3
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    $PY -c "import grain, ml_collections, tensorboardX" || return 1
  fi
}
# rl_step LENGTH DEADLINE_S NAME: issue 23's yardstick at one response length (experiments/benchmarks/rl_step.py):
# every point a process of its own (its peak memory its own), JSON after every point, points that would not finish
# before the deadline skipped and recorded; preallocating 94 % of the GPU (the default 75 % leaves ~35 GB unused).
# the accumulated steps' depth: 6 layers on an H200 (112-119 GB measured with the float32 copy train.run no longer
# keeps), 3 on a card under 100 GB (an H100: ~11 GB a layer beyond ~30 GB of head, embedding and activations)
card_mib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1; }
accum_layers() { [ "$(card_mib)" -ge 100000 ] 2>/dev/null && echo 6 || echo 3; }
card_name() { [ "$(card_mib)" -ge 100000 ] 2>/dev/null && echo h200 || echo h100; }

rl_step() {
  train_deps || return 1
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} timeout $(( $2 + 30 )) \
    $PY experiments/benchmarks/rl_step.py --response-lengths "$1" --recipes "${RL_STEP_RECIPES:-bf16,fp8_block,bf16_train_fp8_rollout}" \
      --time-budget "$2" --compile-cache /tmp/jax_cache --runs-dir "$OUT/rl_step_runs" --out "$OUT/$3.json" \
      ${RL_STEP_ARGS:-} 2>&1 | quiet | tee "$OUT/$3.log" | grep -E '^\[rl_step\]|^recipe|^---|^(bf16|fp8)|tokens:|rror' 
}

case "${1:-}" in
  rl_step) rl_step 1024 "${2:-540}" rl_step_h200_1k ;;
  rl_step_long) rl_step 4096 "${2:-540}" rl_step_h200_4k ;;
  rl_step_accum) RL_STEP_ARGS="--layers $(accum_layers) --batch 16 --micro-batch 4 --logit-chunk 2048 ${RL_STEP_ARGS:-}" \
      rl_step 1024 "${2:-540}" "rl_step_$(card_name)_1k_accum" ;;
  rl_step_onpolicy) RL_STEP_ARGS="--layers $(accum_layers) --batch 64 --micro-batch 4 --logit-chunk 2048 ${RL_STEP_ARGS:-}" \
      rl_step 1024 "${2:-540}" "rl_step_$(card_name)_1k_onpolicy" ;;
  parallel) parallel "${2:-540}" ;;
  flash) $PY -m pytest -v -s -m gpu tests/pallas_kernels/test_attention.py tests/rollout/test_flash_rollout_gpu.py \
      tests/model/test_flash_attention.py -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/flash_gpu_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|bit-identical" ;;
  profile)  # the update program imports jaxrl_fp8.config (ml_collections); without it only its points fail
    train_deps || echo "warning: no ml_collections: the update points will fail (carry .whl/)"
    XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache \
      timeout "${2:-570}" $PY experiments/benchmarks/step_profile.py --out "$OUT/step_profile_h200.json" \
      ${STEP_PROFILE_ARGS:-} 2>&1 | quiet | tee "$OUT/step_profile.log" ;;
  profile_accum) train_deps || exit 1
    name=$([ -n "${UPDATE_MICRO_BATCH:-}" ] && echo "mb$UPDATE_MICRO_BATCH" || echo accum)
    XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache \
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=/tmp/update_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=_update" \
      timeout "${2:-400}" $PY experiments/benchmarks/step_profile.py --programs update --recipes bf16,fp8_block \
      --layers "${PROFILE_LAYERS:-$([ "$(card_name)" = h200 ] && echo 4 || echo 3)}" --update-rows 16 \
      --update-micro-batch "${UPDATE_MICRO_BATCH:-4}" --update-logit-chunk 2048 --top 120 --hlo-dump /tmp/update_hlo \
      --out "$OUT/step_profile_update_${name}_$(card_name).json" 2>&1 | quiet | tee "$OUT/step_profile_update_$name.log"
    mkdir -p /tmp/update_hlo_kept && cp /tmp/update_hlo/*_update*after_optimizations.txt /tmp/update_hlo_kept/ 2>/dev/null
    tar czf "$OUT/update_hlo_$name.tgz" -C /tmp update_hlo_kept && rm -rf /tmp/update_hlo /tmp/update_hlo_kept ;;
  kernels_vs_base)  # (~5 min) a kernel change against the build before it, in the same call: the attention / grouped GEMM
                    # GPU bit tests, then the decode attention points and the decode GEMM suite in .base (carried:
                    # `git archive <commit> src pallas_kernels experiments/benchmarks | tar -x -C .base`) and in this
                    # tree -> $OUT/{attention_decode,gemm_decode}_{base,new}.json
    timeout 200 $PY -m pytest -v -m gpu tests/pallas_kernels/test_attention.py tests/pallas_kernels/test_gemm_grouped.py \
        tests/pallas_kernels/test_gemm_grouped_bf16.py -p no:cacheprovider 2>&1 | tee "$OUT/kernels_gpu_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|bit-identical"
    for tree in .base .; do
      name=$([ "$tree" = . ] && echo new || echo base)
      [ -d "$tree/pallas_kernels" ] || { echo "no $tree tree: skipped"; continue; }
      (cd "$tree" && PYTHONPATH=src:. timeout 100 $PY experiments/benchmarks/attention.py --skip train \
          --decode-batches 64,256 --out "$OUT/attention_decode_$name.json" 2>&1 | quiet | grep -E "^decode" )
      (cd "$tree" && PYTHONPATH=src:. timeout 100 $PY experiments/benchmarks/gemm.py --suites decode \
          --out "$OUT/gemm_decode_$name.json" 2>&1 | quiet | tail -12 )
    done ;;
  update_mb)  # (~4 min) the accumulated update at micro-batches of 8 and 16 rows (of 16): does the FP8 update's lead
              # over BF16 grow with the experts' rows per GEMM? -> $OUT/step_profile_update_mb{8,16}_<card>.json
    for mb in 8 16; do UPDATE_MICRO_BATCH=$mb bash "$0" profile_accum 200; done ;;
  sampler_workload)  # (~7 min) the two-level sampler and counted dispatch where the targets are measured: the sampling
    # tests and the rollout == trainer -m gpu test on the GPU, the sampler beside its one-level anchor at 256 rows,
    # then the rollout workload (bf16, fp8_block; continuous, one pass; its decode step at 256-token caches)
    timeout 120 $PY -m pytest -q tests/rollout/test_embedded_sampling.py tests/model/test_moe.py \
      tests/rollout/test_embedded_mismatch_gpu.py -p no:cacheprovider --tb=short 2>&1 | quiet | tee "$OUT/sampler_tests.log" | tail -4
    cp "experiments/benchmarks/results/vocab_side_$(card_name).json" "$OUT/" 2>/dev/null
    timeout 80 $PY experiments/benchmarks/vocab_side.py --parts noise --rows 256 \
      --out "$OUT/vocab_side_$(card_name).json" 2>&1 | quiet | grep -E "^noise|rror"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout "${2:-330}" $PY experiments/benchmarks/rollout_workload.py \
      --recipes bf16,fp8_block --schedulers continuous --out "$OUT/rollout_workload_$(card_name).json" 2>&1 | quiet | tail -14 ;;
  unmeasured)  # (~7 min) what this tree changed without a GPU, most important first: the wgrad kernels' BF16 store (on by
               # default in the trainer: its GPU bits), the optimizer's skip, then the two-converter FP8 pages candidate
    bash "$0" wgrad_out; bash "$0" optimizer_step; bash "$0" fp8_converters ;;
  pending)  # (~9 min) the rollout workload with three recipes, two passes, and the decode step as the difference of a
            # 64- and a 32-token run (medians of three), decode loops split from the rest of each pass
    bash "$0" fp8_kv_workload 560 bf16,fp8_block_kv,fp8_block 2 ;;
  fp8_converters)  # (~3 min) the paged kernel over FP8 pages with one and with two converter warpgroups: GPU bits, timing
    timeout 150 $PY -m pytest -q -m gpu tests/pallas_kernels/test_attention.py -k "fp8_pages" -p no:cacheprovider \
      --tb=short 2>&1 | tee "$OUT/fp8_converters_gpu_tests.log" | tail -3
    timeout 150 $PY experiments/benchmarks/attention.py --skip train --decode-batches 64,256 \
      --decode-lengths 512,1024,4096 --fp8-kv --fp8-converters 1,2 --out "$OUT/attention_fp8_converters_$(card_name).json" \
      2>&1 | quiet | grep -E "^decode.*fp8|rror" ;;
  wgrad_out)  # (~3 min) the MoE wgrad kernels storing BF16 (out_dtype, the trainer's compute dtype) vs float32: GPU bits, timing
    timeout 150 $PY -m pytest -q -m gpu tests/pallas_kernels/test_gemm_grouped_wgrad.py -k "bfloat16" -p no:cacheprovider \
      --tb=short 2>&1 | tee "$OUT/wgrad_out_gpu_tests.log" | tail -3
    timeout 240 $PY experiments/benchmarks/gemm.py --suites wgrad_out --out "$OUT/gemm_wgrad_out_$(card_name).json" 2>&1 \
      | quiet | grep -E "wgrad_|rror|copy" ;;
  optimizer_step)  # (~1 min) AdamW's non-finite skip, cond vs where, 0.5 B float32 masters (6 GB of state, fits an H100)
    timeout 120 $PY experiments/benchmarks/optimizer_step.py --params 536870912 --leaves 4 \
      --out "$OUT/optimizer_step_$(card_name).json" 2>&1 | quiet | tail -5 ;;
  workload_depth)  # the rollout workload on a deeper Qwen3-30B-A3B-shaped slice, bf16 + fp8_block, two passes
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout 560 $PY experiments/benchmarks/rollout_workload.py --layers "${2:-8}" \
      --recipes bf16,fp8_block --schedulers continuous --passes 2 \
      --out "$OUT/rollout_workload_${2:-8}layers_$(card_name).json" 2>&1 | quiet | tail -12 ;;
  chains)  # (~5 min) promotion chains (a K block promoted under the next one's wgmma) in the FP8 grouped forward and
           # weight gradient: their GPU bit tests, then the grouped forward (chains of 2 / 1) and the wgrad suite
           # (chains 1 / 2 beside transposed_ragged_dot_mgpu, our BF16 wgrad) on the MoE shapes
    timeout 150 $PY -m pytest -q -m gpu tests/pallas_kernels/test_gemm_grouped.py tests/pallas_kernels/test_gemm_grouped_wgrad.py \
      -k "moe_shapes" -p no:cacheprovider --tb=short 2>&1 | quiet | tee "$OUT/chains_gpu_tests.log" | tail -3
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 220 $PY experiments/benchmarks/gemm.py --suites grouped,wgrad --quick \
      --out "$OUT/gemm_chains_$(card_name).json" 2>&1 | quiet | tee "$OUT/gemm_chains.log" | grep -E "^ours|^transposed|rror" ;;
  flash_dq)  # (~3 min) the backward's dq kernel at 64- and 128-key steps (FlashConfig.bwd_dq_keys) beside cuDNN, T = 4k / 16k
    timeout 400 $PY experiments/benchmarks/attention.py --skip decode --lengths 4096,16384 --bwd-dq-keys 64,128 \
        --out "$OUT/attention_dq_variants_h200.json" 2>&1 | quiet | grep -E "^train" ;;
  pending_decode)
    PROFILE_SLOTS=256 bash "$0" profile_decode 120
    (cd /tmp/decode_hlo && tar czf "$OUT/decode_hlo.tgz" $(ls | grep -E "decode_slots.*after_optimizations.txt$" | head -4))
    timeout 90 $PY experiments/benchmarks/attention.py --skip train --decode-batches 256 --decode-lengths 512,1024 \
      --paged-stages 1,2 --out "$OUT/attention_paged_stages_$(card_name).json" 2>&1 | quiet \
      | grep -E "^decode"
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout 330 $PY experiments/benchmarks/rollout_workload.py --recipes bf16,fp8_block \
      --schedulers continuous --step-prompt-lens 1280 --out "$OUT/rollout_workload_$(card_name).json" 2>&1 | quiet | tail -8 ;;
  dense_decode) timeout 300 $PY experiments/benchmarks/gemm.py --suites dense_decode \
      --out "$OUT/gemm_dense_decode_$(card_name).json" 2>&1 | quiet | grep -E "^ours|rror" ;;
  fp8_kv)  # (~4 min) the FP8 KV cache (kv_cache="fp8"): the paged kernel's GPU bit tests (FP8 pages == BF16 pages of the
    # dequantized values == the forward over fake-quantized keys, 4k rows), then its decode step beside BF16 pages
    # (batch 64 / 256, caches 512 / 1k / 4k, copy roofline) -> $OUT/attention_fp8_kv_<card>.json
    timeout 200 $PY -m pytest -q -m gpu tests/pallas_kernels/test_attention.py -k "long_rows or fp8" -p no:cacheprovider \
      2>&1 | tee "$OUT/fp8_kv_gpu_tests.log" | grep -E "passed|failed|rror"
    timeout 200 $PY experiments/benchmarks/attention.py --skip train --decode-batches 64,256 --decode-lengths 512,1024,4096 \
      --fp8-kv --out "$OUT/attention_fp8_kv_$(card_name).json" 2>&1 | quiet | grep -E "^decode|rror" ;;
  device_loops)  # (~8 min) A/B of where the decode loop's host round trip goes: XLA's default command buffers (the
    # while loop's body is one CUDA graph; the host reads the loop predicate and relaunches every step) against
    # +WHILE,+CONDITIONAL (the whole loop one graph with conditional nodes, no host per step). Same bits by construction.
    # A shortened workload (256 rows, responses up to 2k) and the 256-row decode step, fp8_block and bf16, each setting
    # its own process. Measured 2026-12-07 (H100, results/rollout_workload_loops_h100.json): no difference, default kept
    for where in host device; do
      flags=""; [ "$where" = device ] && flags="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout "${2:-270}" \
        $PY experiments/benchmarks/rollout_workload.py --recipes fp8_block,bf16 --schedulers continuous --prompts 16 \
        --max-len 2048 --median-len 512 --out "$OUT/rollout_workload_loops_${where}_$(card_name).json" 2>&1 | quiet \
        | grep -E "continuous|decode step|over_bf16|rror" | sed "s/^/$where: /"
    done ;;
  fp8_kv_workload)  # (~7 min) the rollout workload with bf16, fp8_block and fp8_block_kv (continuous; decode step also at
    # 1280-token prompts) -> $OUT/rollout_workload_<card>.json (fp8_kv_over_bf16 beside fp8_over_bf16)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout "${2:-540}" $PY experiments/benchmarks/rollout_workload.py \
      --recipes "${3:-bf16,fp8_block_kv,fp8_block}" --schedulers continuous --passes "${4:-1}" \
      $([ "${4:-1}" = 1 ] && echo --step-prompt-lens 1280) \
      --out "$OUT/rollout_workload_$(card_name).json" 2>&1 | quiet | tail -12 ;;
  paged_stages) timeout 300 $PY experiments/benchmarks/attention.py --skip train --decode-batches 64,256 \
      --decode-lengths 512,1024,4096 --paged-stages 1,2 --out "$OUT/attention_paged_stages_$(card_name).json" 2>&1 | quiet \
      | grep -E "^decode" ;;
  decode_gemm) timeout 200 $PY -m pytest -v -m gpu tests/pallas_kernels/test_gemm_grouped.py -p no:cacheprovider \
      2>&1 | tee "$OUT/decode_gemm_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
    timeout 300 $PY experiments/benchmarks/gemm.py --suites decode --out "$OUT/gemm_decode_h200.json" 2>&1 | quiet \
      | tee "$OUT/gemm_decode.log" ;;
  profile_kv)  # the decode step's kernels for fp8_block_kv beside fp8_block, with their optimized HLO (decode_kv_hlo.tgz)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 \
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=/tmp/decode_kv_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_slots" \
      timeout "${2:-240}" $PY experiments/benchmarks/step_profile.py --programs decode \
      --recipes fp8_block_kv,fp8_block --layers 4 --slots 256 --prompt-len 1280 --max-len 8192 --top 80 \
      --hlo-dump /tmp/decode_kv_hlo --out "$OUT/step_profile_decode256_kv_$(card_name).json" 2>&1 | quiet | tail -40
    mkdir -p /tmp/decode_kv_hlo_kept && cp /tmp/decode_kv_hlo/*decode_slots*after_optimizations.txt /tmp/decode_kv_hlo_kept/ 2>/dev/null
    tar czf "$OUT/decode_kv_hlo.tgz" -C /tmp decode_kv_hlo_kept ;;
  ncu_decode)
    for spec in "attention_paged_fp8|experiments/benchmarks/attention.py --skip train --decode-batches 256 --decode-lengths 4096 --fp8-kv --out /tmp/ncu_attention.json" \
                "gemm_grouped_fp8|experiments/benchmarks/gemm.py --suites decode --out /tmp/ncu_gemm.json"; do
      name=${spec%%|*}
      timeout 200 ncu -f --kernel-name "regex:${name}_mosaic" --launch-skip 4 --launch-count 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats \
          --section Occupancy --section SourceCounters --section ComputeWorkloadAnalysis --section InstructionStats \
          -o "/tmp/ncu_$name" $PY ${spec#*|} > "/tmp/ncu_${name}_run.log" 2>&1
      ncu -i "/tmp/ncu_$name.ncu-rep" --page details > "$OUT/ncu_$name.txt" 2>&1
      ncu -i "/tmp/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_sass.csv" 2>&1
      [ -f "/tmp/ncu_$name.ncu-rep" ] || { tail -20 "/tmp/ncu_${name}_run.log" | tee "$OUT/ncu_${name}_run.log"; continue; }
      $PY experiments/benchmarks/ncu_stalls.py "$OUT/ncu_${name}_sass.csv" --top 25 --context 3 > "$OUT/ncu_${name}_stalls.txt"
      head -30 "$OUT/ncu_${name}_stalls.txt"
      grep -E "Duration|DRAM Throughput|Registers Per|Achieved Active|Eligible Warps" "$OUT/ncu_$name.txt"
    done ;;
  profile_decode)
    for slots in ${PROFILE_SLOTS:-64 256}; do
      len=$([ $slots = 64 ] && echo 1024 || echo 8192)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache \
        XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=/tmp/decode_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_slots" \
        timeout "${2:-270}" $PY experiments/benchmarks/step_profile.py --programs decode --recipes bf16,fp8_block --layers 6 \
        --slots $slots --max-len $len --top 120 --hlo-dump /tmp/decode_hlo \
        --out "$OUT/step_profile_decode${slots}_$(card_name).json" 2>&1 | quiet \
        | tee "$OUT/step_profile_decode${slots}.log" | tail -30
    done
    mkdir -p /tmp/decode_hlo_kept && cp /tmp/decode_hlo/*decode_slots*after_optimizations.txt /tmp/decode_hlo_kept/ 2>/dev/null
    tar czf "$OUT/decode_hlo.tgz" -C /tmp decode_hlo_kept ;;
  train_long) XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout "${2:-540}" $PY experiments/benchmarks/train_step_long.py \
      --out "$OUT/train_step_long_h200.json" 2>&1 | quiet | tee "$OUT/train_step_long.log" ;;
  invariance) $PY experiments/checks/row_invariance.py --out "$OUT/row_invariance_h200.json" 2>&1 | quiet | tee "$OUT/invariance.log" ;;
  diag) $PY experiments/checks/nvfp4_gpu_diag.py --out "$OUT" --quick 2>&1 | quiet | tee "$OUT/diag.log" ;;
  tests) $PY -m pytest -v -m gpu tests -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
  gemm) $PY experiments/benchmarks/gemm.py --out "$OUT/gemm_h200.json" 2>&1 | quiet | tee "$OUT/gemm.log" ;;
  wgrad)  # $OUT/wgrad_gpu_tests.log, $OUT/gemm_wgrad_h200.json (+ gemm_wgrad.log); the torch anchors run in a child
          # process, so JAX takes 60 % of the GPU's memory instead of 75 % (leaves torch ~50 GB)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
    timeout 180 $PY -m pytest -v -m gpu tests/pallas_kernels/test_gemm_grouped_wgrad.py tests/ops/test_kernel_backends.py \
        -k "wgrad or (gpu_mosaic_linear_and_grouped and fp8)" -p no:cacheprovider --durations=10 \
        2>&1 | tee "$OUT/wgrad_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout"
    timeout 270 $PY experiments/benchmarks/gemm.py --suites wgrad,torch --out "$OUT/gemm_wgrad_h200.json" 2>&1 | quiet \
        | tee "$OUT/gemm_wgrad.log" ;;
  breakdown) $PY experiments/benchmarks/linear_breakdown.py --out "$OUT/linear_breakdown_h200.json" 2>&1 | quiet | tee "$OUT/breakdown.log" ;;
  nvfp4)  # NVFP4: the GPU bit tests of both versions, the version / tiling sweep against the copy anchor, their SASS,
          # and Nsight Compute of the default (per-SM active cycles: how evenly the persistent grid loads the SMs)
    timeout 240 $PY -m pytest -v -m gpu tests/pallas_kernels/test_quantize.py -p no:cacheprovider \
        -k "reciprocal or markstein or nvfp4" 2>&1 | tee "$OUT/nvfp4_gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed"
    timeout 200 $PY experiments/benchmarks/quantize.py --kernels nvfp4 --no-anchor-torch --out "$OUT/quantize_nvfp4_h200.json" \
        2>&1 | quiet | tee "$OUT/quantize_nvfp4.log"
    timeout 90 $PY experiments/benchmarks/sass.py --variants nvfp4,nvfp4_f32,nvfp4_v12,nvfp4_v12_f32 \
        --out "$OUT/sass_nvfp4_h200.json" 2>&1 | quiet | tail -10
    ncu_nvfp4 v14 1024 2 dynamic ;;
  quantize)  # the FP8 / MXFP8 quantize GPU bit tests and their benchmark against the copy anchor measured in the same
             # run (results/quantize_h200.json); NVFP4 is the nvfp4 stage's (both together pass the 10-minute limit)
    timeout 150 $PY -m pytest -v -m gpu tests/pallas_kernels/test_quantize.py -p no:cacheprovider -k "not nvfp4" \
        2>&1 | tee "$OUT/quantize_gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed"
    timeout 400 $PY experiments/benchmarks/quantize.py --kernels fp8_per_token_group,mxfp8,fp8_per_block --rounds 5 \
        --out "$OUT/quantize_h200.json" 2>&1 | quiet | tee "$OUT/quantize.log" ;;
  bandwidth)  # the bandwidth table of decision record 0006: the NVFP4 sweep, then FP8 / MXFP8, each with 5 interleaved
              # wall-clock rounds and every config's CUPTI kernel time against the copy's, 256 MiB and 1 GiB inputs
    timeout 280 $PY experiments/benchmarks/quantize.py --kernels nvfp4 --no-anchor-torch --rounds 5 \
        --out "$OUT/quantize_nvfp4_h200.json" 2>&1 | quiet | tee "$OUT/quantize_nvfp4.log" | tail -8
    timeout 280 $PY experiments/benchmarks/quantize.py --kernels fp8_per_token_group,mxfp8,fp8_per_block --rounds 5 \
        --out "$OUT/quantize_h200.json" 2>&1 | quiet | tee "$OUT/quantize.log" | tail -12 ;;
  rollout_workload) r="${2:-bf16,fp8_block}"
              $PY experiments/benchmarks/rollout_workload.py --recipes "$r" --append --out "$OUT/rollout_workload_h200.json" \
              ${ROLLOUT_WORKLOAD_ARGS:-} 2>&1 \
              | quiet | tee "$OUT/rollout_workload_${r/,/_}.log" ;;
  rollout_workload_fast) r="${2:-bf16,fp8_block}"
              $PY experiments/benchmarks/rollout_workload.py --mode fast --schedulers continuous --recipes "$r" \
              --out "$OUT/rollout_workload_fast_h200.json" 2>&1 | quiet | tee "$OUT/rollout_workload_fast_${r/,/_}.log" ;;
  decode) $PY experiments/benchmarks/decode.py --batches 1,32,256 --gen-len 64 --repeats 2 --out "$OUT/decode_h200.json" 2>&1 | quiet | tee "$OUT/decode.log" ;;
  mismatch) $PY experiments/mismatch_study.py --sizes "${2:?size name, e.g. moe-60M}" --num-prompts 128 --max-new-tokens 64 \
              --append --out "$OUT/mismatch_h200" --compile-cache /tmp/jax_cache --no-progress 2>&1 | tail -20 ;;
  curves) $PY experiments/recipe_curves.py --steps 100 --set data.prompts_per_step=64 --out "$OUT/recipe_curves_h200" \
              --runs-dir "$OUT/runs" --overwrite 2>&1 | tail -20 ;;
  *) sed -n '2,/^# decode, rollout_workload, mismatch and profile/p' "$0"; exit 2 ;;
esac
