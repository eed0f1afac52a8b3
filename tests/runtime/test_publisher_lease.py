"""The publisher lease in the registry process and in the Publisher (issue 21): one publisher at a time, refused
before it reserves anything; the registry's own timer expires a lease its holder stopped renewing; a take-over
ends the live lease at once; whatever the old fence still carries is refused. The in-process registry
(`RegistryCore` with its journal) and the real Publisher; nothing reaches an engine in these cases (each is
refused before a begin), so the Publisher gets no engine ports at all. The same against the live stack, through
the command line: tests/ops/test_publisher_lease_cli.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.ray_registry import LocalRegistry
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.fixtures import build_fixtures
from versioned_lora.lifecycle import (
    AcquireLease,
    Commit,
    LeaseGranted,
    Rejected,
    RenewLease,
    Reserve,
    VersionKey,
)
from versioned_lora.runtime.publisher import DEFAULT_HOLDER, Publisher, PublishStatus
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.reasons import Reason

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

A, B = VersionKey(0, "A"), VersionKey(0, "B")


def candidate(version: VersionKey, adapter: str) -> Candidate:
    snapshot = snapshot_from_adapter_dir(build_fixtures().adapters[adapter])
    return Candidate.build(lora_name(version, snapshot.digest), snapshot, 1 << 20)


def never_probed(*_: object) -> bool:
    raise AssertionError("no probe: every case here is refused before any engine is asked")


def publisher(core: RegistryCore, holder: str) -> Publisher:
    return Publisher(LocalRegistry(core), {}, never_probed, holder=holder)


def test_a_new_registry_requires_the_lease_and_an_old_journal_keeps_what_it_was_begun_with(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    assert core.state().config.publisher_lease
    refused = core.submit("r", Reserve(A, candidate(A, "A").digest)).result
    assert refused == Rejected(Reason.NOT_LEASE_HOLDER, "reserve.no_lease")
    core.close()
    # The journal's recorded configuration decides, not the constructor's default: reopened as it was begun.
    assert RegistryCore(tmp_path / "j.sqlite", publisher_lease=False, insecure=True).state().config.publisher_lease


def test_a_second_publisher_is_refused_before_it_reserves_and_takes_over_when_told(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    trainer, cli = publisher(core, DEFAULT_HOLDER), publisher(core, "cli@test")

    async def body() -> None:
        granted = await trainer.acquire_lease()
        assert granted == LeaseGranted(DEFAULT_HOLDER, 1, trainer.lease_ttl_s) and trainer.fence == 1
        before, calls = core.state_digest(), core.journal_stats()["calls"]
        outcome = await cli.publish(B, candidate(B, "B"))
        assert (outcome.status, outcome.reason) == (PublishStatus.REJECTED, "LEASE_HELD")
        assert outcome.phases == {} and outcome.attempt_token is None  # no reserve was sent
        assert (core.state_digest(), core.journal_stats()["calls"]) == (before, calls)
        assert (await trainer.acquire_lease()).fence == 1  # the holder asking again keeps its fence

        taken = await cli.acquire_lease(take_over=True)
        assert taken == LeaseGranted("cli@test", 2, cli.lease_ttl_s)
        # The trainer's fence is dead: its reserve, its commit and its renewal are refused by the registry.
        digest = candidate(A, "A").digest
        assert core.submit("r1", Reserve(A, digest, 1)).result == Rejected(Reason.NOT_LEASE_HOLDER, "reserve.no_lease")
        assert core.submit("n1", RenewLease(DEFAULT_HOLDER, 1)).result.reason is Reason.NOT_LEASE_HOLDER
        reserved = core.submit("r2", Reserve(A, digest, 2)).result
        stale_commit = core.submit("c1", Commit(A, reserved.attempt_token, 0, 1)).result
        assert stale_commit == Rejected(Reason.NOT_LEASE_HOLDER, "commit.no_lease")
        outcome = await trainer.publish(B, candidate(B, "B"))  # asks for the lease again: another holds it
        assert (outcome.status, outcome.reason) == (PublishStatus.REJECTED, "LEASE_HELD")

        await cli.release_lease()
        assert core.publication_view().lease_holder is None and cli.fence is None
        assert (await trainer.acquire_lease()).fence == 3  # free again: a new grant, a new fence

    asyncio.run(body())


def test_the_registry_expires_a_lease_its_holder_stopped_renewing_and_never_one_it_renews(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    assert core.submit("a1", AcquireLease("p", 2.0)).result == LeaseGranted("p", 1, 2.0)
    time.sleep(1.2)
    assert isinstance(core.submit("n1", RenewLease("p", 1)).result, LeaseGranted)  # re-armed: 2 s from now
    time.sleep(1.2)  # 2.4 s after the grant, 1.2 s after the renewal
    assert core.submit("a2", AcquireLease("q", 2.0)).result == Rejected(Reason.LEASE_HELD, "lease.held")
    ops = core.operations_view()
    assert ops.lease_holder == "p" and ops.lease_expires_in_s is not None and 0 < ops.lease_expires_in_s < 1.0
    time.sleep(1.0)  # past the renewal's ttl: the next call finds the timer due, and the expiry is a row
    assert core.submit("a3", AcquireLease("q", 2.0)).result == LeaseGranted("q", 2, 2.0)
    assert core.journal_has("lease-expired:1")
    assert core.submit("r", Reserve(A, candidate(A, "A").digest, 1)).result.reason is Reason.NOT_LEASE_HOLDER


def test_a_recovered_registry_keeps_a_held_lease_for_a_whole_ttl(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    core.submit("a1", AcquireLease("p", 30.0))
    core.close()
    time.sleep(0.5)
    again = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    ops = again.operations_view()
    assert (ops.lease_holder, ops.lease_fence) == ("p", 1)
    assert ops.lease_expires_in_s is not None and ops.lease_expires_in_s > 29.0  # never sooner than before


def test_the_keeper_a_publication_runs_renews_past_the_ttl_and_stops_once_the_lease_is_taken_over(
        tmp_path: Path) -> None:
    """The lease keeper (spec/drivers.py, machine `lease`) on the real registry core: it holds the lease for several
    ttls by renewing alone, and the renewal after a take-over is refused (lease.renew_lost), which ends it and makes
    the publisher acquire again next time. The keeper is the one `publish` runs (`_keeper`), driven here without a
    publication, which would need engines."""
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    trainer = Publisher(LocalRegistry(core), {}, never_probed, holder=DEFAULT_HOLDER, lease_ttl_s=1.5)
    cli = publisher(core, "cli@test")

    async def body() -> None:
        keeper = trainer._keeper()
        assert await trainer._lease_answer(keeper) == LeaseGranted(DEFAULT_HOLDER, 1, 1.5) and trainer.fence == 1
        await asyncio.sleep(4.0)  # 2.7 ttls: only the renewals (every 0.5 s) keep it
        assert await cli.acquire_lease() == Rejected(Reason.LEASE_HELD, "lease.held")
        assert keeper.fired[:3] == ["keeper.start", "live.read", "acquire.granted"]
        assert keeper.fired.count("renew.renewed") >= 4
        assert not keeper.done
        assert (await cli.acquire_lease(take_over=True)).fence == 2
        final = await asyncio.wait_for(keeper.finished(), 5.0)
        assert (final.outcome, final.reason, keeper.fired[-1]) == (DriverOutcome.REJECTED, "NOT_LEASE_HOLDER",
                                                                    "renew.refused")
        assert trainer.fence is None  # the next publish asks for the lease again (and is refused: cli holds it)

        await cli.release_lease()
        stopped = trainer._keeper()  # a keeper its publication stops: no renewal after it, so the lease expires
        assert await trainer._lease_answer(stopped) == LeaseGranted(DEFAULT_HOLDER, 3, 1.5)
        stopped.cancel()
        assert (await stopped.finished()).outcome is DriverOutcome.STOPPED and stopped.fired[-1] == "keeper.stop"
        await asyncio.sleep(2.0)
        assert await cli.acquire_lease() == LeaseGranted("cli@test", 4, cli.lease_ttl_s)

    asyncio.run(body())


def test_a_publication_cancelled_while_it_waits_for_the_lease_leaves_no_keeper_renewing(tmp_path: Path) -> None:
    """The keeper is its own task: a caller that gives up before the lease is granted stops it (acquire.cancel), so
    no lease is renewed for a publication that is gone."""
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    submitted: list[object] = []

    class SlowToGrant(LocalRegistry):
        async def submit(self, event: Any, key: str | None = None) -> Any:
            submitted.append(event)
            if isinstance(event, AcquireLease):
                await asyncio.sleep(0.5)
            return await super().submit(event, key)

    trainer = Publisher(SlowToGrant(core), {}, never_probed, lease_ttl_s=0.3)

    async def body() -> None:
        task = asyncio.ensure_future(trainer.publish(B, candidate(B, "B")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)  # past the acquire's answer and three renewal periods
        assert [type(e) for e in submitted] == [AcquireLease] and trainer.fence is None

    asyncio.run(body())
