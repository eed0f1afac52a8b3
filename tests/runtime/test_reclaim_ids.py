"""Reclaim ids cannot be computed from a version's name (issue 19): each journal mints a random salt once and
keys its registry's reclaim ids with it; a registry recovered from the journal issues the same ids; a journal
written before salts existed keeps the unsalted ids its engines hold."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

from lease_helpers import fence
from test_journal_upgrade import RECORDED, recorded_journal

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import (
    ClaimReclaim,
    Commit,
    ReclaimClaimed,
    RecordPrepared,
    RecordReady,
    Reserve,
    VersionKey,
)
from versioned_lora.spec.identities import RECLAIM_SALT_LEN, lora_name, reclaim_id

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

A, B = VersionKey(7, "A"), VersionKey(7, "B")


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def _publish(core: RegistryCore, version: VersionKey, revision: int) -> None:
    digest = _digest(version.version_id)
    token = core.submit(f"reserve:{version.version_id}", Reserve(version, digest, fence(core))).result.attempt_token
    for engine in ("E0", "E1"):
        core.submit(f"p:{version.version_id}:{engine}", RecordPrepared(version, token, engine, 0, digest))
        core.submit(f"r:{version.version_id}:{engine}", RecordReady(version, token, engine, 0, digest))
    core.submit(f"commit:{version.version_id}", Commit(version, token, revision, fence(core)))


def _claim(core: RegistryCore, version: VersionKey) -> str:
    result = core.submit(f"claim:{version.version_id}", ClaimReclaim(version)).result
    assert isinstance(result, ReclaimClaimed), result
    return result.reclaim_id


def _claimed_a(path: Path) -> str:
    core = RegistryCore(path, capacity=3, epoch=7, insecure=True)
    try:
        _publish(core, A, 0)
        _publish(core, B, 1)  # A retired: claimable
        return _claim(core, A)
    finally:
        core.close()


def test_two_registries_issue_different_ids_for_the_same_version_and_neither_is_the_names(tmp_path: Path) -> None:
    first, second = _claimed_a(tmp_path / "one.sqlite"), _claimed_a(tmp_path / "two.sqlite")
    assert first != second
    unsalted = reclaim_id(A)
    for issued in (first, second):
        assert issued.startswith(f"{unsalted}-") and len(issued) == len(unsalted) + 1 + RECLAIM_SALT_LEN
        assert issued.rsplit("-", 1)[1] not in lora_name(A, _digest("A"))


def test_a_recovered_registry_issues_the_same_ids(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    issued = _claimed_a(path)
    with sqlite3.connect(path) as db:
        (salt,) = db.execute("SELECT v FROM meta WHERE k='id_salt'").fetchone()
    assert len(salt) == 32 and issued == reclaim_id(A, salt)
    core = RegistryCore(path, capacity=3, epoch=7, insecure=True)  # recovered from the journal
    try:
        assert core.state().versions[A].reclaim_id == issued
        assert _claim(core, A) == issued  # the retried claim, answered from the journal
        _publish(core, VersionKey(7, "C"), 2)  # B retired: a claim minted after the recovery is salted the same
        assert _claim(core, B) == reclaim_id(B, salt)
    finally:
        core.close()


def test_a_journal_written_before_salts_keeps_its_unsalted_ids(tmp_path: Path) -> None:
    path = recorded_journal(tmp_path)
    core = RegistryCore(path, engines=RECORDED["engines"], epoch=RECORDED["epoch"], insecure=True)
    try:
        claimed = [v for v in core.state().versions.values() if v.reclaim_id is not None]
        assert claimed and all(v.reclaim_id == reclaim_id(v.key) for v in claimed)
        assert core.state_digest() == RECORDED["state_digest"]
    finally:
        core.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT v FROM meta WHERE k='id_salt'").fetchone() is None  # not rewritten
