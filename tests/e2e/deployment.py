"""One deployment as the e2e tests drive it: `demo.Stack` (a registry actor on real Ray, the Publisher and
Reclaimer over the two real engines) on the session's engines, with the tests' routing and one SessionBinder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_helpers import PROMPT, TEST_TOKEN, capability_key_file
from registry_faults import FaultyRegistryActor

from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.demo.stack import Stack
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import BackendRequest

_reference: ReferenceModel | None = None


def reference_model(model_dir: Path) -> ReferenceModel:
    """One reference model per test session (loading it takes seconds), shared by every deployment."""
    global _reference
    if _reference is None:
        _reference = ReferenceModel(model_dir)
    return _reference


def route_by_session_name(request: BackendRequest) -> int:
    """Sessions named '...@E1' go to E1, others to E0: the tests choose where each session runs."""
    return 1 if request.rid.split("/", 1)[0].endswith("@E1") else 0


# The library's default deadlines with more room where the suite's loaded 2-core host was seen to need it: the
# first begin on an engine (a transfer group formed, then `begin`) once took over 30 s in CI. Liveness bounds,
# not speed targets; the tests of a deadline set their own.
LOADED_HOST_DEADLINES = Deadlines(reserve=30.0, begin=90.0, bucket=60.0, commit=30.0, abort=30.0, report=30.0)


class Deployment(Stack):
    registry_actor = FaultyRegistryActor  # tests arm its hold at a point of a call (test_registry_kills.py)

    def __init__(self, engines: Any, fixtures: Any, tmp_path: Path, deadlines: Deadlines | None = None,
                 key_file: Path | None = None, capacity: int = 2) -> None:
        super().__init__(
            [engines.e0.url, engines.e1.url],
            TEST_TOKEN,
            tmp_path,
            fixtures,
            deadlines=deadlines or LOADED_HOST_DEADLINES,
            probe_prompt=PROMPT,
            reference=reference_model(fixtures.model_dir),
            route=route_by_session_name,
            bucket_deadline_s=20.0,
            # A long test generation can take minutes on a loaded 2-core host (see engine_helpers.client_for).
            client_timeout_s=600.0,
            # Read by the registry actor in its own process; this process's Publisher and Reclaimer never sign.
            capability_key_file=key_file or capability_key_file(),
            # The registry's capacity gates: the session's engines have slots for the largest K any test needs.
            capacity=capacity,
        )
        self.engines = engines
        self.binder = self.new_binder(self.backend, shard=0)


ENGINE_WIDE = ("pause_generation", "flush_cache", "abort_all", "base_weight_update", "continue_generation")


def engine_wide_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{engine}.{key}": after[engine][key] - before[engine][key] for engine in before for key in ENGINE_WIDE}


def unloads(audit: dict[str, dict[str, int]]) -> dict[str, int]:
    """Each engine's physical-unload count in an audit (`Deployment.audit()`)."""
    return {engine: counters["physical_unload"] for engine, counters in audit.items()}
