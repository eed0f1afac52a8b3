#!/usr/bin/env bash
# Rewrite requirements/cpu-lock.txt from the current .venv (after adding a dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
{
  sed -n '1,/^[^#]/{/^#/p}' requirements/cpu-lock.txt
  .venv/bin/python -m pip freeze --disable-pip-version-check \
    | grep -v -iE '^(-e|versioned-lora|torch==|torchvision==|torchaudio|sglang==|nvidia-(cu|nccl|nvjit|nvshmem|nvtx))'
} > requirements/cpu-lock.txt.new
mv requirements/cpu-lock.txt.new requirements/cpu-lock.txt
