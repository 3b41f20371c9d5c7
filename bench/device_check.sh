#!/usr/bin/env bash
# The one prepared GPU check: build for sm_90, run the GPU tests and the GPU benchmark presets,
# and write logs and results into one folder ($OUT when set, else bench/results/device-<date>).
# Run from the repository root on a machine with an NVIDIA GPU:
#   MEMOPT_COMMIT=$(git rev-parse HEAD) bash bench/device_check.sh
# Each step has a time limit (STEP_TIMEOUT_<NAME> overrides it) so one slow step cannot eat the
# whole device session; a step that fails or times out is logged and the next one still runs.
# BENCH_SWEEPS=1 adds the depth and sequence-length sweeps of the harness (a few more minutes).
# DEVICE_CHECK_DRY_RUN=1 prints each step's command (one "step NAME: <shell-quoted argv>" line)
# and runs none: tests/test_device_check.py parses every one with its tool's own argument parser,
# so a misspelt option cannot cost a step of a device session.
# Back on the development machine, `python -m bench.collect <the fetched $OUT>` copies the run into
# bench/results/<gpu>-<date>/ with a summary README and updates the README's GPU results block
# (it unpacks $OUT/00-device-check.tgz itself when the fetched folder holds little else).
# After every step, everything in $OUT so far is (re)packed into $OUT/00-device-check.tgz (the
# device tool returns only the first files of $OUT by name: this one sorts first), and one line
# "name<TAB>rc<TAB>seconds" is appended to $OUT/steps.tsv (rc "skipped" for a step the budget cut).
# Exit status: 1 when a step that ran failed or timed out, 0 otherwise (skipped steps included).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/device-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export MEMOPT_BUILD_CUDA=1
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1

DRY_RUN="${DEVICE_CHECK_DRY_RUN:-0}"
ARCHIVE=00-device-check.tgz
PARTIAL="${OUT%/}.device-check.tgz.partial"  # beside $OUT, not in it: renamed over $ARCHIVE once whole
pack() {  # (re)pack $OUT into $OUT/$ARCHIVE, atomically: a run cut at any point returns the last one
  [ "$DRY_RUN" = 1 ] && return 0
  # Written outside $OUT: a file created in the folder tar reads changes the folder under it, and
  # GNU tar then exits 1 ("file changed as we read it"), which is also all that status means.
  tar czf "$PARTIAL" -C "$OUT" --exclude "$ARCHIVE" . 2>/dev/null
  if [ $? -le 1 ] && [ -s "$PARTIAL" ]; then
    mv -f "$PARTIAL" "$OUT/$ARCHIVE"
  else
    rm -f "$PARTIAL"
  fi
}
[ "$DRY_RUN" = 1 ] || {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # The device machine gets a copy of the work tree whose .git, if any, may be stale: pass
  # MEMOPT_COMMIT there (it wins here and in every results file, bench.compare.git_commit).
  echo "commit: ${MEMOPT_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/environment.txt"
[ "$DRY_RUN" = 1 ] || { printf 'name\trc\tseconds\n' > "$OUT/steps.tsv"; pack; }

status=0
# A device session is short (15 minutes including a cold start of several): every step's limit is
# cut to what is left of DEVICE_CHECK_BUDGET seconds, and the steps run in order of what the open
# targets need: the block harness and its profile, the GPU tests, the attention benchmark, then
# the rest. A step with under 20 s left (after 15 s kept for packing and the tool's return) is
# skipped and says so; a skipped step does not make the script fail.
BUDGET="${DEVICE_CHECK_BUDGET:-540}"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, keep going
  local name=$1 limit=$2; shift 2
  if [ "$DRY_RUN" = 1 ]; then
    printf 'step %s:' "$name"; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  local left=$((BUDGET - SECONDS - 15))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, the device-check budget (${BUDGET}s) is spent" | tee "$OUT/$name.log"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    pack
    return 0
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  # SIGINT, not timeout's SIGTERM: pytest then prints its failure summary and writes its junit
  # file, and a Python benchmark its traceback (where it was), before the step ends.
  timeout -s INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 8 "$OUT/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/steps.tsv"
  pack
  [ $rc -eq 0 ] || status=1
  return $rc
}

# pip's editable install needs a recent setuptools; an in-place build needs nothing more. Both
# through `python -m`: a bare `pip` on PATH can belong to another interpreter than the tests'.
step build 240 bash -c "python -m pip install --no-build-isolation --no-deps -e . || python setup.py build_ext --inplace" \
  || { echo "build failed"; exit 1; }
step build_info 60 python -c "import memopt; print(memopt.build_info())"
# The harness's GPU preset (bf16, d_model 2048, 16 heads, seq 2048, 4 layers, torch.compile
# included): FusedCheckpointBlock's policies against eager, checkpoint and selective checkpointing,
# each configuration's gradients checked against eager's. Issue 14's targets are judged on it.
# Every configuration but memopt-compile (a second inductor compile would risk the step's limit;
# run it with --configs memopt-compile when a session has time to spare).
step bench_h200 "${STEP_TIMEOUT_BENCH_H200:-300}" python -m bench --preset h200 --out "$OUT" --no-progress \
  --configs eager-math,eager-sdpa,torch-checkpoint,torch-selective,torch-compile,memopt-none,memopt-selective,memopt-full,memopt-offload,memopt-wrap
# Where each configuration's step time goes, by kernel category (why "none" is slower than eager).
step profile_h200 "${STEP_TIMEOUT_PROFILE:-90}" python -m bench.profile --preset h200 --out "$OUT/profile_h200.json"
# Files whose GPU tests have never run (or cover code changed since the last run) come first, so a
# step cut by its time limit still reports them: offload, wrap and the block changed since the
# last GPU run; then activation and the block's forward without a graph (bias_act_fwd_inplace, a
# CUDA kernel never run), attention (the Triton grid's batch and head axes, the tile table chosen
# from the arguments' alignment), the chunked LM-head loss (its GPU tests never ran; half weights
# now take a vocabulary-blocked backward), norm.
first_tests=(tests/test_offload.py tests/test_wrap.py tests/test_wrap_swap.py tests/test_block.py
  tests/test_activation.py tests/test_block_inference.py tests/test_attention.py tests/test_cross_entropy.py
  tests/test_norm.py)
gpu_test_files=("${first_tests[@]}")
for f in tests/test_*.py; do
  case " ${first_tests[*]} " in *" $f "*) ;; *) gpu_test_files+=("$f") ;; esac
done
# -v names each test as it starts: a test that hangs (a stream wait that never ends) is the last line,
# and faulthandler dumps every thread's stack after 120 s in one test. --maxfail: a broken build
# fails every test; fifty say so as well as all of them would.
step gpu_tests "${STEP_TIMEOUT_GPU_TESTS:-200}" python -m pytest -v -m gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
  --maxfail=50 -o faulthandler_timeout=120 --durations=15 "${gpu_test_files[@]}"
# One sequence length and the block preset's head_dim (128): the preset's eight cases times ten
# providers ran past 90 s at seq 4096 alone. Both dropout rates (0 and 0.1) stay.
step bench_attention "${STEP_TIMEOUT_BENCH_ATTENTION:-150}" python -m bench.attention --preset h200 \
  --seqs "${ATTENTION_SEQS:-4096}" --head-dims "${ATTENTION_HEAD_DIMS:-128}" --out "$OUT/attention_h200.json"
# Llama-3-8B's grouped-query attention (32 / 8 heads, seq 4096): "auto" runs memopt's Triton
# kernels for grouped heads on CUDA; this measures them against SDPA's own grouped-query path.
step bench_attention_gqa "${STEP_TIMEOUT_BENCH_ATTENTION_GQA:-60}" python -m bench.attention --preset h200-gqa \
  --out "$OUT/attention_h200_gqa.json"
step bench_offload "${STEP_TIMEOUT_BENCH_OFFLOAD:-180}" python -m bench.offload --preset h200 \
  --out "$OUT/offload-h200.json"
# memopt.wrap and memopt.plan on a Hugging Face Llama (hidden 2048, 16 layers, seq 2048, batch 4,
# bf16) against Hugging Face's own checkpointing; fails when a plan's measured bytes exceed its budget.
step bench_wrap_h200 "${STEP_TIMEOUT_BENCH_WRAP:-150}" python -m bench.wrap --preset h200 --out "$OUT/wrap_h200.json"
step kernels_h200 "${STEP_TIMEOUT_KERNELS_H200:-150}" python -m bench.kernels --preset h200 --out "$OUT" --no-progress
# The chunked LM-head loss (memopt.linear_cross_entropy) against F.linear + F.cross_entropy: time
# and the allocator's peak at Llama-3-sized vocabularies.
step cross_entropy_h200 "${STEP_TIMEOUT_CROSS_ENTROPY:-90}" python -m bench.cross_entropy --preset h200 --out "$OUT"
# The same with the LM head frozen (LoRA), where memopt forms the hidden gradient in the forward
# (two matmuls, as eager): one token count, no compile.
step cross_entropy_h200_frozen "${STEP_TIMEOUT_CROSS_ENTROPY_FROZEN:-45}" python -m bench.cross_entropy --preset h200 \
  --frozen-weight --tokens 16384 --no-compile --out "$OUT"
if [ "${BENCH_SWEEPS:-0}" = 1 ]; then
  sweep_configs=eager-sdpa,torch-checkpoint,torch-selective,memopt-selective,memopt-full,memopt-offload
  for sweep in layers seq; do
    step "sweep_$sweep" "${STEP_TIMEOUT_SWEEP:-240}" python -m bench --preset h200 --sweep "$sweep" \
      --configs "$sweep_configs" --no-compile --repeats 5 --out "$OUT" --no-progress
  done
fi
# The device tool returns only so many files (the first by name) and empties $OUT for its next
# call: everything this run wrote is in the archive, named to come first, packed once more here
# (`python -m bench.collect` on the fetched folder unpacks it).
pack
exit $status
