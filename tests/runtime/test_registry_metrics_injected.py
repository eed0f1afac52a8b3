"""The registry's gauges over a run of publications and reclaims (issue 48): a reclaimed version's `session_refs`
series is set to 0 once and then never recorded again (Ray's agent drops a series its process stops recording),
while every live series is recorded again by each `refresh`; the gauges agree with a recount of the state.

The metrics are an injected recorder in place of `ray.util.metrics` (the real endpoint is tests/ops/test_metrics.py);
the registry is a real `RegistryCore` over SQLite, stepped as in test_bounded_views.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from lease_helpers import fence
from test_bounded_views import ENGINES, EPOCH, publish, reclaim

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.adapters.registry_metrics import RegistryMetrics
from versioned_lora.lifecycle import BindFirst, CloseAndRelease, OpenSession, RegistryEvent, SessionKey, VersionKey
from versioned_lora.runtime.interfaces import RegistryAnswer


class RecordedMetric:
    """Stands where a `ray.util.metrics` metric stands: keeps every recording."""

    def __init__(self, name: str, log: list[tuple[str, str, tuple[tuple[str, str], ...], float]]) -> None:
        self.name, self.log = name, log

    def _add(self, kind: str, value: float, tags: dict[str, str] | None) -> None:
        self.log.append((kind, self.name.removeprefix("versioned_lora_registry_"),
                         tuple(sorted((tags or {}).items())), value))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._add("set", value, tags)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._add("inc", value, tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._add("observe", value, tags)


class Observed:
    """A RegistryCore whose every call the metrics observe, as RegistryActor does."""

    def __init__(self, core: RegistryCore) -> None:
        self.core = core
        self.log: list[tuple[str, str, tuple[tuple[str, str], ...], float]] = []
        self.metrics = RegistryMetrics(lambda name: RecordedMetric(name, self.log))
        self.metrics.set_gauges(core.state(), core.view_index())

    def submit(self, key: str, events: Sequence[RegistryEvent]) -> tuple[RegistryAnswer, ...]:
        before, started = self.core.state(), time.perf_counter()
        answers = self.core.submit_batch(key, events)
        self.metrics.observe(before, self.core.state(), tuple(events), answers, time.perf_counter() - started,
                             self.core.view_index())
        return answers

    def refs_series(self, since: int = 0) -> dict[str, float]:
        """Each version's last `session_refs` value recorded in log entries from `since` on."""
        return {dict(tags)["version"]: value for kind, name, tags, value in self.log[since:]
                if kind == "set" and name == "session_refs"}


def test_a_reclaimed_version_reads_0_once_and_is_then_never_recorded_again_injected(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, capacity=2, epoch=EPOCH, insecure=True)
    lease = fence(core)
    observed = Observed(core)
    a, b = VersionKey(EPOCH, "a"), VersionKey(EPOCH, "b")

    publish(core, a, lease, observed.submit)
    session = SessionKey(EPOCH, 0, 0)
    observed.submit("bind", [OpenSession(session), BindFirst(session)])
    assert observed.refs_series() == {"a": 1}
    publish(core, b, lease, observed.submit)
    observed.submit("close", [CloseAndRelease(session)])
    assert observed.refs_series()["a"] == 0
    mark = len(observed.log)
    reclaim(core, a, observed.submit)
    assert observed.refs_series(mark) == {"a": 0, "b": 0}  # a freed its slot: recorded at 0 this once

    # From now on a's series is never recorded: Ray's agent lets it go; b's (live) is recorded at every refresh.
    mark = len(observed.log)
    observed.metrics.refresh()
    observed.metrics.refresh()
    assert observed.refs_series(mark) == {"b": 0}
    gauges = {(name, tags): value for kind, name, tags, value in observed.log[mark:] if kind == "set"}
    assert gauges[("versions", (("state", "RECLAIMED"),))] == 1
    assert gauges[("versions", (("state", "PUBLISHED"),))] == 1
    assert gauges[("capacity_used_slots", ())] == 1
    assert gauges[("open_sessions", ())] == 0
    core.close()
