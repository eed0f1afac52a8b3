#!/usr/bin/env bash
# The whole test suite: pure core, model checks, then everything against two real SGLang CPU
# engines and a local Ray cluster (the session fixtures in tests/conftest.py start them once).
# Budget: under 30 minutes and 12 GB on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The pure core must keep 100% statement and branch coverage: the run fails under it. tests/lifecycle
# alone reaches it, so any run that includes that folder passes (tests/lifecycle/test_coverage_policy.py).
.venv/bin/python -m pytest --cov=versioned_lora/lifecycle --cov-branch --cov-report=term-missing \
    --cov-fail-under=100 "$@"
