"""One key per deployment (issue 41, item 4): a registry does not start without the capability key engines check
its capabilities with, unless it is built with an explicit `insecure=True` (tests that say so), and it names its key
by id (a hash of the key, never the key) in every answer, where the engine ports read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from versioned_lora import capabilities
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import AcquireLease

KEY = bytes(range(32))


def test_a_registry_without_a_key_refuses_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(capabilities.KEY_ENV, raising=False)
    monkeypatch.delenv(capabilities.KEY_FILE_ENV, raising=False)
    with pytest.raises(capabilities.CapabilityKeyError, match="needs the deployment's capability key"):
        RegistryCore(tmp_path / "j.sqlite")
    assert not (tmp_path / "j.sqlite").exists()  # refused before anything moved: not even a journal


def test_an_insecure_registry_runs_keyless_and_names_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyless on purpose (this test says so): it starts, and its answers name no key id, so every engine port
    refuses it (KEY_MISMATCH)."""
    monkeypatch.delenv(capabilities.KEY_ENV, raising=False)
    monkeypatch.delenv(capabilities.KEY_FILE_ENV, raising=False)
    core = RegistryCore(tmp_path / "j.sqlite", insecure=True)
    answer = core.submit("lease", AcquireLease("p", 60.0))
    assert answer.key_ids == () and core.key_ids() == ()
    core.close()


def test_every_answer_names_the_registry_key_by_its_id_never_the_key(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "j.sqlite", capability_key=KEY)
    answer = core.submit("lease", AcquireLease("p", 60.0))
    kid = capabilities.key_id(KEY)
    assert answer.key_ids == (kid,) == core.key_ids() and kid.startswith("kid-") and KEY.hex() not in kid
    assert core.submit("lease", AcquireLease("p", 60.0)).key_ids == (kid,)  # a replay too
    assert capabilities.key_id(bytes(32)) != kid
    stored = core._journal.lookup("lease")
    assert stored is not None and all(a.key_ids == () for a in stored.answers)  # never journaled
    core.close()


def test_a_key_from_the_environment_is_the_registry_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = capabilities.write_key_file(tmp_path / "deployment.key")
    monkeypatch.delenv(capabilities.KEY_ENV, raising=False)
    monkeypatch.setenv(capabilities.KEY_FILE_ENV, str(path))
    core = RegistryCore(tmp_path / "j.sqlite")
    assert core.key_ids() == (capabilities.key_id(capabilities.parse_key(path.read_text())),)
    core.close()


OLD, NEW = bytes(range(32)), bytes(range(1, 33))


def test_rotation_a_previous_key_is_accepted_and_signed_under_until_its_stated_time() -> None:
    """A rotation window: the ring signs under both keys and accepts either; from its end on only the new key."""
    ring = capabilities.KeyRing(NEW, OLD, previous_until=1000.0)
    name, ref = "relax_policy_lora@7-A-0123456789ab", "reclaim@7-A"
    assert ring.ids(999.0) == (capabilities.key_id(NEW), capabilities.key_id(OLD))
    assert ring.ids(1000.0) == (capabilities.key_id(NEW),)
    both = capabilities.mint_all(ring, capabilities.Action.RECLAIM, name, ref, now=999.0)
    old_only = capabilities.KeyRing(OLD)  # an engine (or registry) not rotated yet
    new_only = capabilities.KeyRing(NEW)
    # Inside the window: what the rotated registry signs, an engine on either key accepts; and a rotated engine
    # accepts what a registry still on the old key signs.
    assert capabilities.verify_any(old_only, both, capabilities.Action.RECLAIM, name, ref)
    assert capabilities.verify_any(new_only, both, capabilities.Action.RECLAIM, name, ref)
    signed_old = capabilities.mint_all(old_only, capabilities.Action.RECLAIM, name, ref)
    assert capabilities.verify_any(ring, signed_old, capabilities.Action.RECLAIM, name, ref, now=999.0)
    # After it: the old key's capability is refused, and the ring signs under the new key alone.
    assert not capabilities.verify_any(ring, signed_old, capabilities.Action.RECLAIM, name, ref, now=1000.0)
    assert capabilities.mint_all(ring, capabilities.Action.RECLAIM, name, ref, now=1000.0).count(",") == 0
    assert not capabilities.verify_any(ring, both, capabilities.Action.CLEANUP, name, ref, now=999.0)  # bound still
    assert not capabilities.verify_any(ring, both + "," + both, capabilities.Action.RECLAIM, name, ref, now=999.0)


def test_rotation_is_configured_with_a_stated_window(tmp_path: Path) -> None:
    new, old = (capabilities.write_key_file(tmp_path / n) for n in ("new.key", "old.key"))
    env = {capabilities.KEY_FILE_ENV: str(new), capabilities.PREVIOUS_KEY_FILE_ENV: str(old)}
    with pytest.raises(capabilities.CapabilityKeyError, match="UNTIL"):
        capabilities.keyring_from_env(env)  # a previous key without its window
    ring = capabilities.keyring_from_env({**env, capabilities.PREVIOUS_KEY_UNTIL_ENV: "2026-12-08T00:00:00+00:00"})
    assert ring is not None and ring.previous_until == 1796688000.0
    assert ring.previous == capabilities.parse_key(old.read_text())
    with pytest.raises(capabilities.CapabilityKeyError, match="time zone"):
        capabilities.keyring_from_env({**env, capabilities.PREVIOUS_KEY_UNTIL_ENV: "2026-12-08T00:00:00"})
    assert capabilities.keyring_from_env({}) is None


def test_a_rotating_registry_signs_under_both_keys_and_names_both_ids(tmp_path: Path) -> None:
    import time

    core = RegistryCore(tmp_path / "j.sqlite", capability_key=capabilities.KeyRing(NEW, OLD, time.time() + 3600))
    answer = core.submit("lease", AcquireLease("p", 60.0))
    assert answer.key_ids == (capabilities.key_id(NEW), capabilities.key_id(OLD))
    core.close()


def test_create_registry_actor_without_a_key_file_is_refused_before_any_actor_exists(tmp_path: Path) -> None:
    from versioned_lora.adapters.ray_registry import create_registry_actor

    with pytest.raises(capabilities.KeyRequired, match="versioned-lora keygen PATH"):
        create_registry_actor(tmp_path / "registry.sqlite")
    assert not (tmp_path / "registry.sqlite").exists()
