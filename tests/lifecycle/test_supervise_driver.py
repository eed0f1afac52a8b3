"""The restart supervisor's driver (spec/drivers.py: machines `supervise` and `rehydrate`), stepped by hand.

What `RestartSupervisor` used to decide itself, each a row now: the incarnation is read from the engine and reported
under one key per engine and incarnation; exactly the versions the registry's answer stages on that engine are
rehydrated, except the attempts its own Publisher stages (left, with the cleanups and reclaims, to their own
drivers); a version READY there already is not staged twice; a rehydrate that fails says why and the others go on;
an adoption whose answer did not come in time stages nothing. Over every reachable state and every input,
`test_driver_table.py`'s Hypothesis test steps these machines too; `model_checks/drivers.py` (scenarios
`supervise*`) runs them against the real registry and engine tables.
"""

from __future__ import annotations

from lifecycle_driver import run_driver as _run

from versioned_lora.lifecycle.drivers import (
    DRIVERS,
    Answer,
    Arm,
    Call,
    Cancel,
    Deadline,
    Disarm,
    Lost,
    ReadIncarnation,
    Refusal,
    Rehydrate,
    Reply,
    Report,
    Start,
    Submit,
    SuperviseState,
    Timer,
    ViewPlacement,
    failed_rehydrates,
    rehydrated_versions,
    restarted_key,
    supervise,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine, ReclaimOnEngine, StageOnEngine
from versioned_lora.lifecycle.results import Rejected, Restarted
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.events import EngineRestarted
from versioned_lora.spec.identities import VersionKey
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import PlacementState

A, B, C = VersionKey(0, "A"), VersionKey(0, "B"), VersionKey(0, "C")
STAGE_A = StageOnEngine("E1", A, "name-A", "ta", 4, "a" * 64)
STAGE_B = StageOnEngine("E1", B, "name-B", "tb", 4, "b" * 64)
STAGE_C = StageOnEngine("E1", C, "name-C", "tc", 4, "c" * 64)  # the attempt this process's Publisher stages
CLEANUP = CleanupOnEngine("E1", C, "name-C", "old")
RECLAIM = ReclaimOnEngine("E1", VersionKey(0, "Z"), "name-Z", "rid")
ANSWER = Reply(Restarted("E1", 4), (STAGE_A, STAGE_B, STAGE_C, CLEANUP, RECLAIM))
O = DriverOutcome  # noqa: E741


def _adopting() -> SuperviseState:
    state, _, _ = _run(supervise("E1", frozenset({"tc"})), Start(), Answer(Call("incarnation"), 4))
    return state


def test_the_incarnation_read_is_reported_under_one_key_per_engine_and_incarnation() -> None:
    state, fired, commands = _run(supervise("E1"), Start())
    assert (state.phase, fired) == ("ASKING", ["supervise.start"])
    assert commands == [ReadIncarnation(Call("incarnation"), "E1"), Arm(Timer("incarnation"), "report")]
    state, fired, commands = _run(state, Answer(Call("incarnation"), 4))
    report = Submit(Call("restarted"), EngineRestarted("E1", 4), restarted_key("E1", 4))
    assert (state.phase, state.incarnation, fired) == ("ADOPTING", 4, ["incarnation.read"])
    assert commands == [Disarm(Timer("incarnation")), report, Arm(Timer("restarted"), "report")]
    # A lost reply: the same key again, under the deadline already armed.
    _, fired, commands = _run(state, Lost(Call("restarted")))
    assert (fired, commands) == (["adopt.lost"], [report])


def test_exactly_the_versions_owed_are_rehydrated_and_the_rest_is_left_to_its_own_driver() -> None:
    state, fired, commands = _run(_adopting(), Answer(Call("restarted"), ANSWER))
    assert (state.phase, fired) == ("REHYDRATING", ["adopt.rehydrate"])
    assert commands == [Disarm(Timer("restarted")), ViewPlacement(Call("placement", "ta"), A, "E1"),
                        ViewPlacement(Call("placement", "tb"), B, "E1")]
    assert sorted(state.rehydrates) == ["ta", "tb"]  # not "tc": its own publication stages it
    assert state.left == (STAGE_C, CLEANUP, RECLAIM)
    # A is READY there already (a reconcile asked again): nothing is staged for it; B is staged, then READY.
    state, fired, commands = _run(state, Answer(Call("placement", "ta"), PlacementState.READY),
                                  Answer(Call("placement", "tb"), PlacementState.BEGUN))
    assert fired == ["placement.ready", "rehydrating.waiting", "placement.stage"]
    assert commands == [Rehydrate(Call("rehydrate", "tb"), STAGE_B)]
    state, fired, commands = _run(state, Answer(Call("rehydrate", "tb"), True))
    assert fired == ["rehydrate.ready", "rehydrating.done"]
    assert commands == [Report(O.RECONCILED)]
    assert (state.phase, rehydrated_versions(state), failed_rehydrates(state)) == ("DONE", (A, B), ())


def test_a_failed_rehydrate_says_why_and_the_others_go_on() -> None:
    state, _, _ = _run(_adopting(), Answer(Call("restarted"), ANSWER),
                       Answer(Call("placement", "ta"), PlacementState.BEGUN),
                       Lost(Call("placement", "tb")))
    assert state.phase == "REHYDRATING"
    state, fired, commands = _run(state, Refusal(Call("rehydrate", "ta"), "SnapshotMissing"))
    assert fired == ["rehydrate.refused", "rehydrating.done"] and commands == [Report(O.RECONCILED)]
    assert rehydrated_versions(state) == ()
    assert failed_rehydrates(state) == ((A, "SnapshotMissing"), (B, "Lost"))
    # A late answer lands on a late row of the finished supervisor.
    assert DRIVERS.step(state, Answer(Call("rehydrate", "ta"), True)).fired == ("supervise.late_reply",)


def test_a_rehydrate_lost_on_its_way_is_not_known_to_be_ready() -> None:
    state, fired, _ = _run(_adopting(), Answer(Call("restarted"), Reply(Restarted("E1", 4), (STAGE_A,))),
                           Answer(Call("placement", "ta"), PlacementState.BEGUN), Lost(Call("rehydrate", "ta")))
    assert fired[-2:] == ["rehydrate.lost", "rehydrating.done"]
    assert failed_rehydrates(state) == ((A, "Lost"),)


def test_nothing_owed_ends_reconciled_with_everything_left() -> None:
    own_only = Reply(Restarted("E1", 4), (STAGE_C,))
    state, fired, commands = _run(_adopting(), Answer(Call("restarted"), own_only))
    assert (state.phase, fired, commands) == ("DONE", ["adopt.nothing"], [Disarm(Timer("restarted")),
                                                                          Report(O.RECONCILED)])
    assert state.left == (STAGE_C,) and not state.rehydrates


def test_an_adoption_not_answered_in_time_stages_nothing() -> None:
    state, fired, commands = _run(_adopting(), Deadline(Timer("restarted")))
    assert (state.phase, fired, commands) == ("DONE", ["adopt.deadline"], [Report(O.UNKNOWN)])
    # Its answer, when it comes, lands late: nothing is staged on the strength of it.
    assert DRIVERS.step(state, Answer(Call("restarted"), ANSWER)).commands == ()


def test_a_stale_incarnation_or_an_engine_that_does_not_answer_adopts_nothing() -> None:
    stale = Reply(Rejected(Reason.STALE_INCARNATION, "restart.stale"))
    state, fired, commands = _run(_adopting(), Answer(Call("restarted"), stale))
    assert (fired, commands) == (["adopt.refused"], [Disarm(Timer("restarted")),
                                                     Report(O.REJECTED, Reason.STALE_INCARNATION)])
    for inp, row in ((Lost(Call("incarnation")), "incarnation.lost"),
                     (Refusal(Call("incarnation"), "UNKNOWN"), "incarnation.refused"),
                     (Deadline(Timer("incarnation")), "incarnation.deadline")):
        state, fired, commands = _run(supervise("E1"), Start(), inp)
        assert (state.phase, fired[-1], commands[-1].outcome) == ("DONE", row, O.REJECTED)


def test_a_cancel_ends_the_supervisor_unknown_and_a_late_timer_changes_nothing() -> None:
    state, fired, commands = _run(_adopting(), Deadline(Timer("incarnation")))
    assert (state.phase, fired, commands) == ("ADOPTING", ["supervise.late_timer"], [])
    state, fired, commands = _run(state, Cancel())
    assert (state.phase, fired, commands) == ("DONE", ["supervise.cancel"], [Report(O.UNKNOWN)])
