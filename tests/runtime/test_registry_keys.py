"""One key per deployment (issue 41, item 4): a registry does not start without the capability key engines check
its capabilities with, unless it is built with an explicit `insecure=True` (tests that say so), and it names its key
by id (a hash of the key, never the key) in every answer, where the engine ports read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from versioned_lora import capabilities
from versioned_lora.adapters.ray_registry import RegistryCore
from versioned_lora.lifecycle import AcquireLease

KEY = bytes(range(32))


def test_a_registry_without_a_key_refuses_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(capabilities.KEY_ENV, raising=False)
    monkeypatch.delenv(capabilities.KEY_FILE_ENV, raising=False)
    with pytest.raises(capabilities.CapabilityKeyError, match="needs the deployment's capability key"):
        RegistryCore(tmp_path / "j.sqlite")
    assert not (tmp_path / "j.sqlite").exists()  # refused before anything moved: not even a journal
