"""End-to-end tests: real Ray, the two real CPU engines, gloo transfer groups."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest


@pytest.fixture(autouse=True)
def _ray(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Every e2e test runs against the session's local Ray cluster."""
    return None
