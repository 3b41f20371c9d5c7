#!/usr/bin/env bash
# The one prepared GPU check: build for sm_90, run the GPU tests and the GPU benchmark preset,
# and write logs and results into one folder ($OUT when set, else bench/results/device-<date>).
# Run from the repository root on a machine with an NVIDIA GPU:  bash bench/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/device-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export MEMOPT_BUILD_CUDA=1
export TRITON_INTERPRET=0

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/environment.txt"

status=0
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember failures, keep going
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 5 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

step build pip install --no-build-isolation --no-deps -v -e . || { echo "build failed"; exit 1; }
step build_info python -c "import memopt; print(memopt.build_info())"
step gpu_tests python -m pytest -q -m gpu -x --junitxml="$OUT/gpu_tests.xml"
# memopt.checkpoint/wrap lean on torch.utils.checkpoint internals that changed between 2.11 and
# 2.14: run their CPU tests against this machine's torch too.
step wrap_torch_compat python -m pytest -q -x tests/test_checkpoint.py tests/test_wrap.py tests/test_distributed.py
step bench python -m bench
exit $status
