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

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.ray_registry import LocalRegistry, RegistryCore
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
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.reasons import Reason

A, B = VersionKey(0, "A"), VersionKey(0, "B")


def candidate(version: VersionKey, adapter: str) -> Candidate:
    snapshot = snapshot_from_adapter_dir(build_fixtures().adapters[adapter])
    return Candidate.build(lora_name(version, snapshot.digest), snapshot, 1 << 20)


def never_probed(*_: object) -> bool:
    raise AssertionError("no probe: every case here is refused before any engine is asked")


def publisher(core: RegistryCore, holder: str) -> Publisher:
    return Publisher(LocalRegistry(core), {}, never_probed, holder=holder)


def test_a_new_registry_requires_the_lease_and_an_old_journal_keeps_what_it_was_begun_with(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite")
    assert core.state().config.publisher_lease
    refused = core.submit("r", Reserve(A, candidate(A, "A").digest)).result
    assert refused == Rejected(Reason.NOT_LEASE_HOLDER, "reserve.no_lease")
    core.close()
    # The journal's recorded configuration decides, not the constructor's default: reopened as it was begun.
    assert RegistryCore(tmp_path / "j.sqlite", publisher_lease=False).state().config.publisher_lease


def test_a_second_publisher_is_refused_before_it_reserves_and_takes_over_when_told(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite")
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
    core = RegistryCore(tmp_path / "j.sqlite")
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
    core = RegistryCore(tmp_path / "j.sqlite")
    core.submit("a1", AcquireLease("p", 30.0))
    core.close()
    time.sleep(0.5)
    again = RegistryCore(tmp_path / "j.sqlite")
    ops = again.operations_view()
    assert (ops.lease_holder, ops.lease_fence) == ("p", 1)
    assert ops.lease_expires_in_s is not None and ops.lease_expires_in_s > 29.0  # never sooner than before
