"""The trainer-facing API's pure parts (no Ray, no engine): engine lists, the four outcomes a trainer acts on, and
the engines' URLs a registry journal records beside its configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from versioned_lora.adapters.ray_registry import recorded_epoch
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.api import Outcome, PublishResult, engine_map
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.publisher import PublishOutcome, PublishStatus
from versioned_lora.spec.states import VersionState


def test_engines_are_named_in_order_or_by_their_given_names() -> None:
    assert engine_map("http://a:1,http://b:2") == {"E0": "http://a:1", "E1": "http://b:2"}
    assert engine_map(["http://a:1"]) == {"E0": "http://a:1"}
    assert engine_map("X=http://a:1,Y=http://b:2") == {"X": "http://a:1", "Y": "http://b:2"}
    assert engine_map({"E1": "u"}) == {"E1": "u"}
    with pytest.raises(ValueError, match="name every engine or none"):
        engine_map("X=http://a:1,http://b:2")


@pytest.mark.parametrize(("status", "reason", "state", "outcome", "resolves"), [
    (PublishStatus.COMMITTED, None, None, Outcome.COMMITTED, False),
    (PublishStatus.REJECTED, "CAPACITY_ERROR", None, Outcome.REFUSED, False),
    (PublishStatus.REJECTED, "COMMIT_UNRESOLVED", None, Outcome.UNKNOWN, True),
    (PublishStatus.FAILED_CLEAN, "PROBE_MISMATCH", None, Outcome.FAILED_CLEAN, False),
    (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN", None, Outcome.UNKNOWN, True),
    (PublishStatus.REPLAYED, None, VersionState.PUBLISHED, Outcome.COMMITTED, False),
    (PublishStatus.REPLAYED, None, VersionState.RECLAIMED, Outcome.REFUSED, False),
    (PublishStatus.REPLAYED, None, VersionState.LOADING, Outcome.UNKNOWN, True),
])
def test_each_publisher_status_folds_into_one_of_four_outcomes(
    status: PublishStatus, reason: str | None, state: VersionState | None, outcome: Outcome, resolves: bool
) -> None:
    result = PublishResult.of(PublishOutcome(status, VersionKey(7, "v"), reason=reason, version_state=state))
    assert (result.outcome, result.resolve is not None, result.status) == (outcome, resolves, str(status))
    assert result.committed is (outcome is Outcome.COMMITTED)


def test_a_journal_records_the_engines_urls_and_keeps_them_and_its_epoch(tmp_path: Path) -> None:
    journal = tmp_path / "registry.sqlite"
    assert recorded_epoch(journal) is None
    urls = {"E0": "http://127.0.0.1:1", "E1": "http://127.0.0.1:2"}
    core = RegistryCore(journal, epoch=42, engine_urls=urls, insecure=True)
    assert core.engine_urls() == urls
    core.close()
    again = RegistryCore(journal, epoch=42, insecure=True)  # restarted without URLs: the journal's are kept
    assert again.engine_urls() == urls
    again.close()
    assert recorded_epoch(journal) == 42
