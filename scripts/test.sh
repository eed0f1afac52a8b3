#!/usr/bin/env bash
# The whole test suite: pure core, model checks, then everything against two real SGLang CPU
# engines and a local Ray cluster (the session fixtures in tests/conftest.py start them once).
# Budget: under 30 minutes and 12 GB on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
.venv/bin/python -m pytest "$@"
