"""Capabilities (issue 19 part 1): minted by the registry only for a cleanup of an aborted attempt and a
reclaim of a claimed version, checkable by an engine with the shared key alone, never journaled signed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from lease_helpers import fence

from versioned_lora import capabilities
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.capabilities import Action, mint, verify
from versioned_lora.lifecycle import Abort, ClaimReclaim, Commit, RecordPrepared, RecordReady, Reserve, VersionKey
from versioned_lora.lifecycle.effects import CleanupOnEngine, ReclaimOnEngine

KEY = bytes(range(32))
NAME = "relax_policy_lora@7-A-0123456789ab"


def test_a_capability_is_bound_to_its_action_name_and_reference() -> None:
    capability = mint(KEY, Action.RECLAIM, NAME, "reclaim@7-A")
    assert verify(KEY, capability, Action.RECLAIM, NAME, "reclaim@7-A")
    assert not verify(KEY, capability, Action.CLEANUP, NAME, "reclaim@7-A")  # another action
    assert not verify(KEY, capability, Action.RECLAIM, NAME.replace("@7-", "@8-"), "reclaim@7-A")  # another epoch
    assert not verify(KEY, capability, Action.RECLAIM, NAME.replace("-A-", "-B-"), "reclaim@7-A")  # another version
    assert not verify(KEY, capability, Action.RECLAIM, NAME, "reclaim@7-B")  # another reclaim id
    assert not verify(bytes(32), capability, Action.RECLAIM, NAME, "reclaim@7-A")  # another key
    for forged in (None, "", 7, capability[:-1], capability.upper(), "vlcap1." + "0" * 64, capability + "0"):
        assert not verify(KEY, forged, Action.RECLAIM, NAME, "reclaim@7-A")


def test_keys_are_hex_of_at_least_32_bytes() -> None:
    assert len(capabilities.parse_key(capabilities.new_key())) == 32
    with pytest.raises(capabilities.CapabilityKeyError):
        capabilities.parse_key("zz")
    with pytest.raises(capabilities.CapabilityKeyError):
        capabilities.parse_key("00" * 16)
    assert capabilities.key_from_env({}) is None


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def _ready(core: RegistryCore, version: VersionKey) -> str:
    token = core.submit(f"reserve:{version.version_id}",
                        Reserve(version, _digest(version.version_id), fence(core))).result
    for engine in ("E0", "E1"):
        core.submit(f"p:{version.version_id}:{engine}",
                    RecordPrepared(version, token.attempt_token, engine, 0, _digest(version.version_id)))
        core.submit(f"r:{version.version_id}:{engine}",
                    RecordReady(version, token.attempt_token, engine, 0, _digest(version.version_id)))
    return str(token.attempt_token)


def test_the_registry_signs_cleanups_of_aborted_attempts_and_reclaims_of_claimed_versions(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", capability_key=KEY)
    a, b = VersionKey(0, "A"), VersionKey(0, "B")
    reserved = core.submit("reserve:A", Reserve(a, _digest("A"), fence(core)))
    assert all(capability is None for capability in reserved.capabilities)  # never at reserve
    token_a = _ready(core, a)
    core.submit("commit:A", Commit(a, token_a, 0, fence(core)))
    token_b = _ready(core, b)
    core.submit("commit:B", Commit(b, token_b, 1, fence(core)))
    assert core.submit("abort:A", Abort(a, token_a)).effects == ()  # a committed version: no cleanup at all

    claim = core.submit("claim:A", ClaimReclaim(a))
    reclaims = [(e, cap) for e, cap in zip(claim.effects, claim.capabilities, strict=True)
                if isinstance(e, ReclaimOnEngine)]
    assert len(reclaims) == 2
    for effect, capability in reclaims:
        assert verify(KEY, capability, Action.RECLAIM, effect.lora_name, effect.reclaim_id)
        assert not verify(KEY, capability, Action.CLEANUP, effect.lora_name, effect.reclaim_id)
    stored = core._journal.lookup("claim:A")
    assert stored is not None and all(answer.capabilities == () for answer in stored.answers)  # unsigned
    replay = core.submit("claim:A", ClaimReclaim(a))  # answered from the journal, signed again
    assert replay.from_journal and replay.capabilities == claim.capabilities
    core.close()

    rotated = bytes(reversed(range(32)))  # a key change: the replayed answer carries the new key's capability
    core = RegistryCore(tmp_path / "j.sqlite", capability_key=rotated)
    replay = core.submit("claim:A", ClaimReclaim(a))
    effect, capability = replay.effects[0], replay.capabilities[0]
    assert isinstance(effect, ReclaimOnEngine) and verify(rotated, capability, Action.RECLAIM, effect.lora_name,
                                                          effect.reclaim_id)
    core.close()


def test_an_abort_signs_the_cleanup_of_its_own_attempt_only(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", capability_key=KEY)
    a = VersionKey(0, "A")
    token = _ready(core, a)
    aborted = core.submit("abort:A", Abort(a, token))
    cleanups = [(e, cap) for e, cap in zip(aborted.effects, aborted.capabilities, strict=True)
                if isinstance(e, CleanupOnEngine)]
    assert {e.engine for e, _ in cleanups} == {"E0", "E1"}
    for effect, capability in cleanups:
        assert verify(KEY, capability, Action.CLEANUP, effect.lora_name, effect.attempt_token)
        assert not verify(KEY, capability, Action.RECLAIM, effect.lora_name, effect.attempt_token)
    core.close()


def test_without_a_key_answers_carry_no_capabilities(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a registry built insecure (this test's, on purpose: issue 41) runs without a key."""
    monkeypatch.delenv(capabilities.KEY_ENV, raising=False)
    monkeypatch.delenv(capabilities.KEY_FILE_ENV, raising=False)
    core = RegistryCore(tmp_path / "j.sqlite", capability_key=None, insecure=True)
    a = VersionKey(0, "A")
    aborted = core.submit("abort:A", Abort(a, _ready(core, a)))
    assert aborted.effects and aborted.capabilities == () and aborted.key_ids == ()
    core.close()
