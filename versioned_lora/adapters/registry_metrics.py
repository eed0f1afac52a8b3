"""The registry actor's metrics, through Ray's metrics API (`ray.util.metrics`): Ray's metrics agent serves
them on each node's Prometheus endpoint (`ray.nodes()[i]["MetricsExportPort"]`), prefixed `ray_`.

Every series carries a `registry` label, the actor's name. Everything is derived from what one call did to the
registry: the state before and after it, its events and answers. Labels are bounded: a version id, a state,
an outcome, a reason (enums of the table), never a session or request id. A retried key answered from the
journal counts nothing again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from versioned_lora.lifecycle import RegistryEvent, RegistryState, Rejected, VersionState
from versioned_lora.runtime.interfaces import RegistryAnswer
from versioned_lora.spec.events import BeginClose, BindFirst, ClaimReclaim, CloseAndRelease, OpenSession, Reserve
from versioned_lora.spec.model import OCCUPYING_STATES, occupied_slots, session_refs
from versioned_lora.spec.states import PSEUDO_STATES, Machine, SessionState

PREFIX = "versioned_lora_registry"
CALL_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STORED_VERSION_STATES = tuple(s for s in VersionState if s not in PSEUDO_STATES[Machine.VERSION])
OPEN_SESSION_STATES = frozenset({SessionState.OPEN, SessionState.BOUND, SessionState.FINALIZING})
SESSION_EVENTS = (OpenSession, BindFirst, BeginClose, CloseAndRelease)
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


class RegistryMetrics:
    def __init__(self, make: Callable[[str], Any]) -> None:
        self._m = {name: make(name) for name in METRICS}
        self._open_sessions: int | None = None  # counted once (start, recovery), then moved by each call's sessions
        self._ref_versions: set[str] = set()  # versions with a session_refs series, set to 0 once they free a slot

    def _metric(self, suffix: str) -> Any:
        return self._m[f"{PREFIX}_{suffix}"]

    def observe(self, before: RegistryState, after: RegistryState, events: Sequence[RegistryEvent],
                answers: Sequence[RegistryAnswer], seconds: float) -> None:
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
            self._move_open_sessions(before, after, events)
            self.set_gauges(after)

    def set_gauges(self, state: RegistryState) -> None:
        counts = dict.fromkeys(STORED_VERSION_STATES, 0)
        for version in state.versions.values():
            counts[version.state] += 1
        for version_state, count in counts.items():
            self._metric("versions").set(count, tags={"state": str(version_state)})
        self._metric("capacity_used_slots").set(occupied_slots(state))
        self._metric("capacity_slots").set(state.config.capacity)
        holding = {v.key.version_id: session_refs(state, v.key) for v in state.versions.values()
                   if v.state in OCCUPYING_STATES}
        for version_id in self._ref_versions - holding.keys():
            self._metric("session_refs").set(0, tags={"version": version_id})
        for version_id, refs in holding.items():
            self._metric("session_refs").set(refs, tags={"version": version_id})
        self._ref_versions = set(holding)
        if self._open_sessions is None:  # walks every session record: once, not per call (10^5 sessions: ~30 ms)
            self._open_sessions = sum(1 for s in state.sessions.values() if s.state in OPEN_SESSION_STATES)
        self._metric("open_sessions").set(self._open_sessions)

    def _move_open_sessions(self, before: RegistryState, after: RegistryState,
                            events: Sequence[RegistryEvent]) -> None:
        if self._open_sessions is None or after.sessions is before.sessions:
            return
        for key in {event.session for event in events if isinstance(event, SESSION_EVENTS)}:
            was, now = before.sessions.get(key), after.sessions.get(key)
            self._open_sessions += ((now is not None and now.state in OPEN_SESSION_STATES)
                                    - (was is not None and was.state in OPEN_SESSION_STATES))

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
