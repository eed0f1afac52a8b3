"""A small local Ray cluster for the runtime tests, started once per test session.

Kept small on purpose (2 CPUs, ~200 MB object store): the machine is shared with engine tests."""

from __future__ import annotations

import sys
from pathlib import Path

# Shared helpers of this directory (registry_helpers.py), importable like tests/lifecycle's driver.
sys.path.insert(0, str(Path(__file__).parent))
