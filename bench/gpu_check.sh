#!/usr/bin/env bash
# GPU check, one prepared script (under 8 minutes): the GPU tests, then the benchmarks, a short table last.
#
#   1. pytest -m gpu tests/ops/test_gpu_ops.py: the Triton kernels, compiled for the GPU, bitwise against the
#      PyTorch reference and against vLLM's native code compiled by Inductor (Triton codegen; vLLM's few lines
#      are inlined in the test, vLLM need not be installed);
#   2. bench/bench_ops.py: every region, HF eager vs reference vs Triton (vs Liger if installed), do_bench;
#   3. bench/bench_model.py: fwd+bwd of Qwen3-1.7B/4B/8B and R1-Distill-Qwen-1.5B shapes (4 layers each,
#      2048-token sequences, the recipes' micro-batch), five conditions, checkpointing off and on;
#   4. bench/bench_tp.py: the TP-aligned row-parallel linear (PyTorch form and Triton kernel) against F.linear;
#   5. bench/summarize.py: the short table (also written to summary.md).
#
# Needs only python3 with torch (CUDA), triton and transformers, and this repository (found through
# PYTHONPATH: nothing is pip-installed, so the package's torch pin does not pull anything). Liger is optional:
# carry its wheel in .whl/ (here: `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# -d .whl liger-kernel==0.8.5`) and this script installs it into /tmp/site.
#
# Outputs go to $OUT when set (the device tool's folder), else bench/results/gpu-<UTC time>/: gpu_check.log,
# gpu_tests.log, gpu_tests.xml, bench_ops.json/.csv, bench_model.json/.csv, bench_tp.json/.csv, summary.md (10 files). Copy them to
# bench/results/gpu/ and the tables into docs/cost.md to commit them.
#
# Usage: bash bench/gpu_check.sh            (device tool: run(command="bash bench/gpu_check.sh", timeout_s=540,
#                                             carry=[".whl"] if a Liger wheel was downloaded))
# Budget (seconds, environment): GPU_CHECK_BUDGET (default 470) split as tests <= 190, ops <= 80, tp <= 40, the rest
# models.
# Exit status: 0 when every part finished and every GPU test passed, else 1 (the outputs are written either way).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-470}
DEADLINE=$((START + BUDGET))
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/roundalign-inductor}
export ROUNDALIGN_COMMIT=${ROUNDALIGN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

left() { echo $((DEADLINE - $(date +%s))); }
cap() { local want=$1 rest; rest=$(($(left) - ${2:-0})); if [ "$rest" -lt "$want" ]; then echo "$rest"; else echo "$want"; fi; }
declare -A STATUS

part() {  # part NAME LIMIT_SECONDS CMD...: run with a time box, record the exit status, never abort the script
  local name=$1 limit=$2
  shift 2
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped, $(left) s of the budget left"
    STATUS[$name]="skipped (budget)"
    return
  fi
  echo "== $name (time box ${limit} s, $(left) s left)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  local dt=$(($(date +%s) - t0))
  case $rc in
    0) STATUS[$name]="ok (${dt} s)" ;;
    124 | 137) STATUS[$name]="TIMED OUT after ${dt} s" ;;
    *) STATUS[$name]="exit $rc (${dt} s)" ;;
  esac
  echo "== $name: ${STATUS[$name]}"
}

echo "== gpu_check: $(date -u +%FT%TZ), commit $ROUNDALIGN_COMMIT, output $OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing carried wheels into /tmp/site: $(ls .whl)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# GPU_CHECK_DRY_RUN=1: exercise this script on a CPU (tests skip, benchmarks --quick); used by tests/test_bench.py.
QUICK=()
[ "${GPU_CHECK_DRY_RUN:-0}" = 1 ] && QUICK=(--quick)
if ! "$PY" - <<'PY'
import importlib.metadata as md
import os

import torch
import triton
import transformers

if os.environ.get("GPU_CHECK_DRY_RUN") != "1":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}; CUDA {torch.version.cuda}")
else:
    print("dry run: no GPU required")
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
for dist in ("liger-kernel", "vllm", "trl"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
import trl_roundalign.ops  # noqa: F401  (the package from this checkout)
PY
then
  echo "gpu_check: needs python3 with CUDA torch, triton and transformers (set PYTHON=...)"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true

tests_box=$(cap 190 200)
export GPU_TESTS_DEADLINE=$(($(date +%s) + tests_box - 30))
part gpu_tests "$tests_box" "$PY" -m pytest -m gpu tests/ops/test_gpu_ops.py -q -rfE -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" -o junit_family=xunit2 > >(tee "$OUT/gpu_tests.log") 2>&1
part bench_ops "$(cap 80 150)" "$PY" bench/bench_ops.py --out "$OUT" "${QUICK[@]}"
models_box=$(cap 400 65)
part bench_model "$models_box" "$PY" bench/bench_model.py --out "$OUT" --time-budget $((models_box - 40)) "${QUICK[@]}"
part bench_tp "$(cap 40 20)" "$PY" bench/bench_tp.py --out "$OUT" "${QUICK[@]}"

echo
echo "================ gpu_check summary ($(( $(date +%s) - START )) s) ================"
for name in gpu_tests bench_ops bench_model bench_tp; do
  printf '%-12s %s\n' "$name" "${STATUS[$name]:-not run}"
done
echo
timeout 60 "$PY" bench/summarize.py --dir "$OUT" --write "$OUT/summary.md"
RC=0
for name in gpu_tests bench_ops bench_model bench_tp; do
  case "${STATUS[$name]:-}" in ok*) ;; *) RC=1 ;; esac
done
# Let tee write the last lines of gpu_check.log before the caller collects $OUT.
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null || sleep 1
exit "$RC"
