"""`mypy --strict` is clean on spec/ and lifecycle/. No skip: a missing mypy fails this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mypy_strict_on_the_core() -> None:
    import mypy  # noqa: F401  (ImportError here is a failure, never a skip)

    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "versioned_lora/spec", "versioned_lora/lifecycle"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout
