"""A small local Ray cluster for the runtime tests, started once per test session.

Kept small on purpose (2 CPUs, ~200 MB object store): the machine is shared with engine tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

# Shared helpers of this directory (registry_helpers.py), importable like tests/lifecycle's driver.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=200 * 1024 * 1024,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()
