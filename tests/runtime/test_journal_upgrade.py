"""Upgrades: a journal written on commit a4d62f3 (the last main without a journal format, committed as a
fixture by `fixtures/record_journal.py`) replays under this code to the very state that code reached, and
answers its retried keys from the journal; a journal of an unknown format is refused, typed, with the path
docs/integration.md documents."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from versioned_lora.adapters.journal import FORMAT_VERSION, JournalFormatUnsupported
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import Commit, VersionKey

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

FIXTURES = Path(__file__).with_name("fixtures")
RECORDED = json.loads((FIXTURES / "journal-a4d62f3.json").read_text())


def recorded_journal(tmp_path: Path) -> Path:
    copy = tmp_path / "journal.sqlite"
    shutil.copy(FIXTURES / "journal-a4d62f3.sqlite", copy)
    return copy


def test_a_journal_written_on_a4d62f3_replays_to_the_same_state_and_answers_retries(tmp_path: Path) -> None:
    core = RegistryCore(recorded_journal(tmp_path), engines=RECORDED["engines"], epoch=RECORDED["epoch"],
                        insecure=True)
    try:
        assert core.recovery.replayed_calls > 0
        assert core.state_digest() == RECORDED["state_digest"]
        b = VersionKey(RECORDED["epoch"], "B")
        commit_b = Commit(b, core.state().versions[b].attempt_token, 1)  # the call the old code journaled
        again = core.submit("commit:B", commit_b)  # retried under its key
        recorded = dict(RECORDED["answers"])
        assert again.from_journal and repr(again.result) == recorded["commit:B"]
        assert core.publication_view().default == b
    finally:
        core.close()


def test_the_old_journal_is_read_as_format_1_and_left_as_it_is(tmp_path: Path) -> None:
    path = recorded_journal(tmp_path)
    core = RegistryCore(path, engines=RECORDED["engines"], epoch=RECORDED["epoch"], insecure=True)
    try:
        assert core.journal_format == 1
    finally:
        core.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT v FROM meta WHERE k='format'").fetchone() is None


def test_a_new_journal_records_its_format(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "new.sqlite", insecure=True)
    try:
        assert core.journal_format == FORMAT_VERSION
    finally:
        core.close()
    with sqlite3.connect(tmp_path / "new.sqlite") as db:
        assert db.execute("SELECT v FROM meta WHERE k='format'").fetchone() == (str(FORMAT_VERSION),)


def test_a_journal_of_an_unknown_format_is_refused_naming_the_upgrade_path(tmp_path: Path) -> None:
    path = recorded_journal(tmp_path)
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO meta (k, v) VALUES ('format', '99')")
    with pytest.raises(JournalFormatUnsupported) as refused:
        RegistryCore(path, engines=RECORDED["engines"], epoch=RECORDED["epoch"], insecure=True)
    assert refused.value.found == 99
    assert "start a new epoch" in str(refused.value) and "docs/integration.md" in str(refused.value)
