"""The registry actor's metrics, through Ray's metrics API (`ray.util.metrics`): Ray's metrics agent serves
them on each node's Prometheus endpoint (`ray.nodes()[i]["MetricsExportPort"]`), prefixed `ray_`.

Every series carries a `registry` label, the actor's name. Everything is derived from what one call did to the
registry: the state before and after it, its events and answers. Labels are bounded: a version id, a state,
an outcome, a reason (enums of the table), never a session or request id. A retried key answered from the
journal counts nothing again.

Gauges are bounded too (issue 48): `session_refs` has a series only for versions that hold a slot. Ray 2.60's
metrics agent evicts a gauge series that its process has not recorded for two export intervals (20 s by
default), and keeps one that it keeps recording: so the live gauges are recorded again every `REFRESH_S`
(`refresh`, from a thread of the actor's process), and a version that freed its slot is set to 0 once and then
never recorded again: its series leaves the endpoint. Gauges are read from the registry's `ViewIndex`, never by
walking every version or session.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from versioned_lora.lifecycle import RegistryEvent, RegistryState, Rejected, VersionState
from versioned_lora.runtime.interfaces import RegistryAnswer
from versioned_lora.runtime.views import ViewIndex
from versioned_lora.spec.events import BindFirst, ClaimReclaim, CloseAndRelease, Reserve
from versioned_lora.spec.model import session_refs
from versioned_lora.spec.states import PSEUDO_STATES, Machine

PREFIX = "versioned_lora_registry"
CALL_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STORED_VERSION_STATES = tuple(s for s in VersionState if s not in PSEUDO_STATES[Machine.VERSION])
# Seconds between two recordings of the live gauges: under half Ray's default export interval (10 s), so a
# live series is recorded in every export and never ages out of the agent (its TTL: two export intervals).
REFRESH_S = 4.0
# A version entering one of these states ends (or settles) a publication or a reclaim: that outcome is counted.
PUBLICATION_OUTCOMES = {VersionState.PUBLISHED: "committed", VersionState.ABORTED: "aborted",
                        VersionState.FAILED_CLEAN: "failed_clean"}
RECLAIM_OUTCOMES = {VersionState.RECLAIMING: "claimed", VersionState.RECLAIMED: "reclaimed"}

# name -> (kind, description, tag keys): the README lists the same names (with Ray's `ray_` prefix).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{PREFIX}_versions": ("gauge", "versions known to the registry, by state", ("state",)),
    f"{PREFIX}_session_refs": ("gauge", "sessions bound to a version that holds a slot", ("version",)),
    f"{PREFIX}_capacity_used_slots": ("gauge", "managed slots held (versions in an occupying state)", ()),
    f"{PREFIX}_capacity_slots": ("gauge", "managed slots in all (the registry's capacity)", ()),
    f"{PREFIX}_open_sessions": ("gauge", "sessions open, bound or finalizing", ()),
    f"{PREFIX}_publications_total": ("counter", "publication outcomes (committed, aborted, failed_clean, "
                                     "rejected)", ("outcome", "reason")),
    f"{PREFIX}_reclaims_total": ("counter", "reclaim outcomes (claimed, reclaimed, rejected)", ("outcome", "reason")),
    f"{PREFIX}_binds_total": ("counter", "first binds of sessions, by result (bound, rejected)", ("result",)),
    f"{PREFIX}_closes_total": ("counter", "session closes that released a session ref", ()),
    f"{PREFIX}_call_seconds": ("histogram", "time the actor spent on one submit call", ()),
}


def ray_metric(name: str, registry: str) -> Any:
    """One of `METRICS` as a Ray metric; every series carries `registry` (the actor's name: one per deployment)."""
    from ray.util import metrics

    kind, description, tags = METRICS[name]
    keys = ("registry", *tags)
    metric: Any
    if kind == "gauge":
        metric = metrics.Gauge(name, description=description, tag_keys=keys)
    elif kind == "counter":
        metric = metrics.Counter(name, description=description, tag_keys=keys)
    else:
        metric = metrics.Histogram(name, description=description, boundaries=list(CALL_SECONDS_BUCKETS),
                                   tag_keys=keys)
    metric.set_default_tags({"registry": registry})
    return metric


GaugeKey = tuple[str, tuple[tuple[str, str], ...]]  # (suffix, tags)


class RegistryMetrics:
    def __init__(self, make: Callable[[str], Any]) -> None:
        self._m = {name: make(name) for name in METRICS}
        # Every live gauge series and its value: what `refresh` records again. A series not in here is not
        # recorded, and Ray's agent drops it.
        self._gauges: dict[GaugeKey, float] = {}
        self._lock = threading.Lock()  # `refresh` runs on a thread of its own

    def _metric(self, suffix: str) -> Any:
        return self._m[f"{PREFIX}_{suffix}"]

    def _record(self, values: dict[GaugeKey, float]) -> None:
        for (suffix, tags), value in values.items():
            if tags:
                self._metric(suffix).set(value, tags=dict(tags))
            else:
                self._metric(suffix).set(value)

    def refresh(self) -> None:
        """Record every live gauge again (`REFRESH_S`), so none ages out of Ray's agent while it is live."""
        with self._lock:
            values = dict(self._gauges)
        self._record(values)

    def observe(self, before: RegistryState, after: RegistryState, events: Sequence[RegistryEvent],
                answers: Sequence[RegistryAnswer], seconds: float, index: ViewIndex) -> None:
        self._metric("call_seconds").observe(seconds)
        # One increment per label set and call, not per event: a call carries up to 256 binds.
        counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        for event, answer in zip(events, answers, strict=False):
            if not answer.from_journal:
                self._count_result(event, answer, counts)
        if after is not before:
            self._count_transitions(before, after, counts)
        for (suffix, tags), count in counts.items():
            if tags:
                self._metric(suffix).inc(count, tags=dict(tags))
            else:
                self._metric(suffix).inc(count)
        if after is not before:
            self.set_gauges(after, index)

    def set_gauges(self, state: RegistryState, index: ViewIndex) -> None:
        """Every gauge from `index` (kept by the registry as its state changes): O(live versions), whatever the
        sessions and the versions that ended. A version that freed its slot since the last call reads 0 once."""
        counts = dict.fromkeys(STORED_VERSION_STATES, 0)
        counts.update(index.ended_by_state)
        live = [state.versions[key] for key in index.live]
        for version in live:
            counts[version.state] += 1
        values: dict[GaugeKey, float] = {("versions", (("state", str(s)),)): n for s, n in counts.items()}
        values["capacity_used_slots", ()] = len(live)  # every live version holds one slot
        values["capacity_slots", ()] = state.config.capacity
        values["open_sessions", ()] = index.open_sessions
        for version in live:
            values["session_refs", (("version", version.key.version_id),)] = session_refs(state, version.key)
        with self._lock:
            freed = {key: 0.0 for key in self._gauges if key not in values}  # recorded once more, then no more
            self._gauges = values
        self._record({**freed, **values})

    @staticmethod
    def _count_result(event: RegistryEvent, answer: RegistryAnswer, counts: Counter[Any]) -> None:
        rejected = isinstance(answer.result, Rejected)
        reason = str(answer.result.reason) if isinstance(answer.result, Rejected) else "none"
        if isinstance(event, Reserve) and rejected:
            counts["publications_total", (("outcome", "rejected"), ("reason", reason))] += 1
        elif isinstance(event, ClaimReclaim) and rejected:
            counts["reclaims_total", (("outcome", "rejected"), ("reason", reason))] += 1
        elif isinstance(event, BindFirst):
            counts["binds_total", (("result", "rejected" if rejected else "bound"),)] += 1
        elif isinstance(event, CloseAndRelease) and getattr(answer.result, "released", False):
            counts["closes_total", ()] += 1

    @staticmethod
    def _count_transitions(before: RegistryState, after: RegistryState, counts: Counter[Any]) -> None:
        if after.versions is before.versions:  # a call of binds and closes: no version moved
            return
        for key, version in after.versions.items():
            old = before.versions.get(key)
            if old is not None and old.state is version.state:
                continue
            if version.state in PUBLICATION_OUTCOMES:
                outcome = PUBLICATION_OUTCOMES[version.state]
                counts["publications_total", (("outcome", outcome), ("reason", "none"))] += 1
            elif version.state in RECLAIM_OUTCOMES:
                counts["reclaims_total", (("outcome", RECLAIM_OUTCOMES[version.state]), ("reason", "none"))] += 1
