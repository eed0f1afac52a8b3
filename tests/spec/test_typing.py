"""`mypy --strict` is clean on spec/, lifecycle/, runtime/, adapters/ and capabilities (what `make lint`
checks). No skip: a missing mypy fails this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


STRICT = ("versioned_lora/spec", "versioned_lora/lifecycle", "versioned_lora/runtime", "versioned_lora/adapters",
          "versioned_lora/capabilities.py")


def test_mypy_strict_on_the_core_the_runtime_and_the_adapters() -> None:
    import mypy  # noqa: F401  (ImportError here is a failure, never a skip)

    assert all(path in (REPO / "Makefile").read_text() for path in STRICT)  # `make lint` checks the same
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *STRICT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout
