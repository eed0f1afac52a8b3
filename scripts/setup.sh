#!/usr/bin/env bash
# Create .venv/ in the repo root and install everything the demo and the tests need, on a CPU-only
# host. Idempotent: a second run only checks what is already there.
#
# GPU users do not need this script: `pip install sglang==0.5.23 versioned-lora[runtime]`
# (SGLang's own dependency tree brings its CUDA kernels).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# 1. torch first, pinned to what sglang 0.5.23 was built against.
"${PIP[@]}" install torch==2.14.1 torchvision==0.29.1
# 2. sglang without its dependency tree (several GB of CUDA kernels we cannot use on CPU) ...
"${PIP[@]}" install --no-deps sglang==0.5.23
# 3. ... plus, pinned, the runtime packages it imports on CPU and this project's own dependencies.
"${PIP[@]}" install -r requirements/cpu-lock.txt torch==2.14.1
# 4. the project itself, editable, with its test extras (already satisfied by the lock).
"${PIP[@]}" install --no-deps -e .

.venv/bin/python -c "import sglang, torch, ray, peft; print('setup ok: sglang', sglang.__version__, 'torch', torch.__version__)"
