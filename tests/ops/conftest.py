"""Operating the library from the command line (issue 21): `versioned-lora status/publish/reclaim/resolve`
run as child processes against a live deployment (real Ray, the session's two real engines)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))  # deployment.py, test_publication_e2e.deployed

import pytest


@pytest.fixture(autouse=True)
def _ray(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Every test here runs against the session's local Ray cluster (the CLI joins it by its GCS address)."""
    return None
