"""The publish driver (spec/drivers.py: machine `publish`), stepped by hand.

What `Publisher._publish` used to decide itself once the staging ended, each a row now: a staging that succeeded is
committed only once the snapshot store holds its bytes; a failed staging, or bytes the store could not take, is
aborted (never committed); a reserve refused or replayed ends the publication with nothing to settle; a reserve whose
answer is unknown settles nothing. `model_checks/drivers.py` (scenarios `publish*`) runs these rows against the real
registry and engine tables.
"""

from __future__ import annotations

from lifecycle_driver import run_driver as _run

from versioned_lora.lifecycle.drivers import (
    Answer,
    Call,
    Cancel,
    Lost,
    PendingAttempt,
    PublisherState,
    PublishState,
    Refusal,
    Report,
    RunStage,
    SettleAttempt,
    StageResult,
    Start,
    WaitStored,
    publish,
)
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.identities import VersionKey
from versioned_lora.spec.states import VersionState

B = VersionKey(0, "B")
O = DriverOutcome  # noqa: E741
NAME, TOKEN, FENCE, DIGEST = "name-B", "tb", 3, "dB"
ATTEMPT = PendingAttempt(B, VersionState.LOADING, TOKEN, NAME, True)


def _staged(outcome: DriverOutcome, token: str = TOKEN) -> tuple[PublishState, list[str], list[object]]:
    state, fired, commands = _run(publish(B, NAME, FENCE, DIGEST), Start(),
                                  Answer(Call("stage"), StageResult(outcome, token)))
    assert (fired[0], commands[0]) == ("publish.start", RunStage(Call("stage"), B, DIGEST, NAME, FENCE, ""))
    return state, fired[1:], commands[1:]


def test_a_staged_attempt_is_committed_only_once_its_bytes_are_stored() -> None:
    state, fired, commands = _staged(O.STAGED)
    assert (state.phase, fired, commands) == ("STORING", ["publish.staged"], [WaitStored(Call("store"))])
    state, fired, commands = _run(state, Answer(Call("store")))
    assert (state.phase, fired) == ("SETTLING", ["publish.stored"])
    assert commands == [SettleAttempt(Call("settle"), ATTEMPT, True, FENCE)]
    state, fired, commands = _run(state, Answer(Call("settle"), O.COMMITTED))
    assert (state.phase, state.outcome, commands) == ("DONE", O.COMMITTED, [Report(O.COMMITTED)])


def test_bytes_the_store_could_not_take_are_aborted_never_committed() -> None:
    for failed in (Refusal(Call("store"), "OSError"), Lost(Call("store"))):
        state, _, _ = _staged(O.STAGED)
        state, fired, commands = _run(state, failed)
        assert state.phase == "SETTLING" and commands == [SettleAttempt(Call("settle"), ATTEMPT, False, FENCE)], fired
        state, fired, commands = _run(state, Answer(Call("settle"), O.FAILED_CLEAN))
        assert (fired, commands) == (["publish.cleaned"], [Report(O.FAILED_CLEAN, state.reason)])


def test_a_failed_staging_is_aborted_and_its_unknown_settle_reported() -> None:
    state, fired, commands = _staged(O.STAGE_FAILED)
    assert (fired, commands) == (["publish.stage_failed"], [SettleAttempt(Call("settle"), ATTEMPT, False, FENCE)])
    state, fired, commands = _run(state, Answer(Call("settle"), O.UNKNOWN))  # the abort's reply lost: nothing cleaned
    assert (state.phase, fired, commands) == ("DONE", ["publish.settle_unknown"], [Report(O.UNKNOWN)])


def test_a_reserve_refused_replayed_or_unknown_settles_nothing() -> None:
    for outcome, row in ((O.REJECTED, "publish.rejected"), (O.REPLAYED, "publish.replayed"),
                         (O.UNKNOWN, "publish.stage_unknown")):
        state, fired, commands = _staged(outcome, "" if outcome is not O.REPLAYED else TOKEN)
        assert (state.phase, fired, commands) == ("DONE", [row], [Report(outcome)])


def test_a_caller_that_gives_up_ends_the_publication_and_late_answers_change_nothing() -> None:
    state, _, _ = _staged(O.STAGED)
    state, fired, commands = _run(state, Cancel(), Answer(Call("store")), Lost(Call("settle")), Cancel())
    assert (state.phase, fired) == ("DONE", ["publish.cancel", "publish.late_reply", "publish.late_lost",
                                              "publish.late_cancel"])
    assert commands == [Report(O.UNKNOWN)]


def test_a_reserve_left_unknown_is_sent_again_for_the_same_content_only() -> None:
    """The reserve-key retry policy is driver state (rows reserve.deadline, publish.stage_unknown): a publisher carries
    the key of a reserve whose outcome is unknown to the next publication of the same content, and drops it once that
    publication knows its outcome; other content starts with no key (its stage driver derives one, reserve_key)."""
    fresh = PublisherState()
    assert fresh.publication(B, DIGEST, NAME, FENCE) == publish(B, NAME, FENCE, DIGEST)
    state, _, _ = _run(fresh.publication(B, DIGEST, NAME, FENCE), Start(),
                       Answer(Call("stage"), StageResult(O.UNKNOWN, "", "reserve:0:B:dB:none")))
    kept = fresh.after(state)
    again = kept.publication(B, DIGEST, NAME, FENCE)
    assert again.reserve_key == "reserve:0:B:dB:none" and kept.publication(B, "other", NAME, FENCE).reserve_key == ""
    _, _, commands = _run(again, Start())
    assert commands == [RunStage(Call("stage"), B, DIGEST, NAME, FENCE, "reserve:0:B:dB:none")]
    state, _, _ = _run(again, Start(), Answer(Call("stage"), StageResult(O.REPLAYED, TOKEN, "reserve:0:B:dB:none")))
    assert kept.after(state) == fresh and fresh.after(state) is fresh  # known now: nothing to send again
    cancelled, _, _ = _run(again, Start(), Cancel())  # a publication the caller left keeps no key (recover settles)
    assert kept.after(cancelled) == fresh
