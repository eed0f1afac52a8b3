"""Every phase deadline fires (RFC §7.3): reserve, begin, a bucket, end, commit, cleanup, reclaim and the
run's maximum no-progress interval, each on the real stack (Ray registry actor, two real engines, Publisher,
Reclaimer), each ending as the protocol says.

A slow reply is injected (a real engine or registry cannot be made slow on demand): `SlowReplies` lets the
call run for real and holds its reply past the deadline, so the deadline fires while the reply is in flight,
the hard case. A staging call (begin, bucket, end) that misses its deadline leaves the version uncommitted:
abort, and the abort's answer cleans every engine (FAILED_CLEAN, slot free). A registry call that may have
landed (reserve, commit) is an unknown outcome: the slot stays taken until the same call resolves it. A
cleanup or a reclaim cut off by its deadline keeps the slot until a later call confirms it. Never is a
resource released on an unknown outcome.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from deployment import unloads
from engine_helpers import run
from test_publication_e2e import deployed

from versioned_lora.lifecycle import Reserve
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.spec.states import VersionState

SHORT = 1.5  # the deadline under test
SLOW = 4.0  # how long the injected reply is held: past SHORT


class SlowReplies:
    """Fault injection: the first `count` calls of `method` on the wrapped port (an engine's staging port or
    the registry port) run for real; their replies are held `SLOW` seconds before they are returned."""

    def __init__(self, inner: Any, method: str, count: int = 1, when: Any = None) -> None:
        self.inner, self.method, self.left, self.when = inner, method, count, when
        self.held = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        async def slow(*args: Any, **kwargs: Any) -> Any:
            answer = await attribute(*args, **kwargs)
            if self.left > 0 and (self.when is None or self.when(*args, **kwargs)):
                self.left -= 1
                self.held += 1
                await asyncio.sleep(SLOW)
            return answer

        return slow


def deadlines(**short: float) -> Deadlines:
    return Deadlines(**{"commit": 5.0, "cleanup": 20.0, "reclaim": 30.0, **short})


async def managed_count(d: Any) -> int:
    return (await d.registry.publication_view()).managed_count()


@pytest.mark.parametrize("phase", ["begin", "bucket", "end"])
def test_injected_slow_staging_reply_past_its_deadline_aborts_and_cleans_everywhere(
    engines, fixtures, tmp_path, phase
) -> None:
    method = {"begin": "begin", "bucket": "transfer_bucket", "end": "end"}[phase]

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            b_version, b = d.candidate("B")
            assert b.bucket_count >= 2
            slow = SlowReplies(d.ports["E1"], method,
                               when=(lambda c, t, index: index == 1) if phase == "bucket" else None)
            d.publisher.engines["E1"] = slow
            d.publisher.deadlines = deadlines(**{phase: SHORT})
            outcome = await d.publisher.publish(b_version, b)
            assert slow.held == 1
            assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "PhaseDeadlineMissed")
            assert f"phase {phase}" in outcome.detail
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.default == a_version
            assert await managed_count(d) == 1  # the slot is free again
            for client in d.clients.values():
                states = {m["name"]: m["state"] for m in (await client.status())["managed"]}
                assert states[b.lora_name] == "CLEANED" and states[a.lora_name] == "READY"

    run(body())


def test_injected_slow_reserve_reply_is_unknown_and_keeps_its_slot_until_the_same_reserve(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            slow = SlowReplies(d.registry, "submit", when=lambda event, key=None: isinstance(event, Reserve))
            d.publisher.registry = slow
            d.publisher.deadlines = deadlines(reserve=SHORT)
            before = await d.audit()
            outcome = await d.publisher.publish(a_version, a)
            assert (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "RESERVE_OUTCOME_UNKNOWN")
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.LOADING and view.managed_count() == 1
            after = await d.audit()
            assert all(after[e]["managed_begin"] == before[e]["managed_begin"] for e in before)  # nothing staged
            again = await d.publisher.publish(a_version, a)  # the same reserve key: its journaled answer
            assert again.committed and again.attempt_token == view.versions[a_version].attempt_token

    run(body())


def test_injected_slow_commit_reply_is_unknown_then_resolved_by_the_same_commit(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            slow = SlowReplies(d.registry, "submit", when=lambda event, key=None: str(key).startswith("commit:"))
            d.publisher.registry = slow
            d.publisher.deadlines = deadlines(commit=SHORT)
            before = unloads(await d.audit())
            outcome = await d.publisher.publish(a_version, a)
            assert (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN")
            assert (await d.registry.publication_view()).default == a_version  # it landed meanwhile
            resolved = await d.publisher.resolve()
            assert resolved is not None and resolved.committed and resolved.default_revision == 1
            assert unloads(await d.audit()) == before

    run(body())


def test_injected_slow_cleanup_reply_keeps_the_slot_until_a_later_call_confirms(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            b_version, b = d.candidate("B")
            d.publisher.probe_check = lambda *_: False  # a certain failure at end: abort and clean
            slow = SlowReplies(d.ports["E1"], "cleanup")
            d.publisher.engines["E1"] = slow
            d.publisher.deadlines = deadlines(cleanup=SHORT)
            outcome = await d.publisher.publish(b_version, b)
            assert outcome.status is PublishStatus.UNKNOWN and slow.held == 1
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.ABORTED and view.managed_count() == 2
            recovered = await d.publisher.recover()  # the same abort: its cleanups, asked again
            assert [o.status for o in recovered] == [PublishStatus.FAILED_CLEAN]
            assert await managed_count(d) == 1

    run(body())


def test_injected_slow_reclaim_reply_keeps_the_slot_until_a_later_call_confirms(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            assert (await d.publisher.publish(b_version, b)).committed
            slow = SlowReplies(d.ports["E1"], "reclaim")
            d.reclaimer.engines["E1"] = slow
            d.reclaimer.deadlines = deadlines(reclaim=SHORT)
            before = unloads(await d.audit())
            first = await d.reclaimer.reclaim(a_version)
            assert (first.status, first.confirmed) == (ReclaimStatus.PENDING, ("E0",)) and slow.held == 1
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.RECLAIMING and view.managed_count() == 2
            done = await d.reclaimer.reclaim(a_version)  # the same claim and reclaim id: E1 answers its replay
            assert done.status is ReclaimStatus.RECLAIMED and set(done.confirmed) == {"E0", "E1"}
            assert unloads(await d.audit()) == {e: n + 1 for e, n in before.items()}  # each engine unloaded A once
            assert await managed_count(d) == 1

    run(body())


def test_injected_no_progress_past_the_runs_bound_aborts_and_cleans(engines, fixtures, tmp_path) -> None:
    """Each phase within its own deadline, but nothing completes for longer than `max_no_progress`."""

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            b_version, b = d.candidate("B")
            slow = SlowReplies(d.ports["E1"], "transfer_bucket", when=lambda c, t, index: index == 1)
            d.publisher.engines["E1"] = slow
            d.publisher.deadlines = deadlines(bucket=60.0, max_no_progress=SHORT)
            outcome = await d.publisher.publish(b_version, b)
            assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "PhaseDeadlineMissed")
            assert "phase bucket_1 missed its max_no_progress bound (1.5s" in outcome.detail  # the run's bound fired
            assert await managed_count(d) == 1

    run(body())
