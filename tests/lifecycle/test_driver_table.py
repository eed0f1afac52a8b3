"""The driver table (spec/drivers.py) as data, and its step over every phase × input (h2 style).

Every (machine, phase, input) pair is covered by a row; an uncovered one is the one ProtocolError; every
row names guards and commands that exist; "late" rows change nothing; and, over every reachable driver
state and every input Hypothesis draws, `step` either fires a row of the right machine or raises the
ProtocolError (never another exception), and keys are derived from the state alone.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from versioned_lora.lifecycle.drivers import (
    BUILDERS,
    DRIVERS,
    GUARDS,
    Answer,
    Arm,
    Bind,
    Call,
    Cancel,
    CheckRefused,
    CleanupEngineState,
    Deadline,
    Disarm,
    Drivers,
    DropLink,
    Finish,
    Generate,
    GenerationState,
    Lost,
    PendingAttempt,
    ReadAttempt,
    ReclaimEngineState,
    Refusal,
    RehydrateState,
    Reply,
    Report,
    Resolve,
    StageEngine,
    StageEngineState,
    StageFailure,
    Start,
    Submit,
    Timer,
    confirmed_engines,
    failed_engines,
    is_done,
    publication,
    reclaim,
    recover,
    session,
    settle,
    stage,
    stage_phase,
    stage_phase_completed,
    stage_phase_moved,
    staging_started,
    subs_of,
    supervise,
)
from versioned_lora.lifecycle.effects import CapacityFreed, CleanupOnEngine, ReclaimOnEngine, StageOnEngine
from versioned_lora.lifecycle.errors import ProtocolError
from versioned_lora.lifecycle.results import (
    Aborted,
    Bound,
    Closed,
    Committed,
    LeaseGranted,
    ReclaimClaimed,
    ReclaimConfirmed,
    Recorded,
    Rejected,
    Reserved,
    Restarted,
)
from versioned_lora.spec.drivers import (
    DRIVER_ROWS,
    INPUTS,
    PHASES,
    Driver,
    DriverOutcome,
    Input,
    uncovered_driver_pairs,
)
from versioned_lora.spec.events import Reserve
from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.model import CommitReceipt
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import SAME, WILDCARD, PlacementState, VersionState

B = VersionKey(0, "B")
ENGINES = ("E0", "E1")


def test_every_pair_is_covered_or_cannot_happen_and_rows_name_what_exists() -> None:
    waits_for_settled = {(Driver.SETTLE, "CLEANING"), (Driver.RECLAIM, "RECLAIMING"), (Driver.STAGE, "BEGINNING"),
                         (Driver.STAGE, "TRANSFERRING"), (Driver.STAGE, "ENDING")}
    engine_inputs = {Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE}
    for machine, phase, inp in uncovered_driver_pairs():
        # spec/drivers.NOT_POSSIBLE: each uncovered pair is one an executor following driver_loop cannot reach
        assert (phase == "IDLE" and inp is not Input.START) or (inp is Input.START and phase != "IDLE") or (
            inp is Input.SETTLED and (machine, phase) not in waits_for_settled) or (
            machine is Driver.STAGE and inp in engine_inputs and phase != "DONE") or (
            machine is Driver.REHYDRATE and phase in ("READY", "FAILED")), (machine, phase, inp)
    ids = [r.id for r in DRIVER_ROWS]
    assert len(ids) == len(set(ids))
    for r in DRIVER_ROWS:
        assert set(r.expanded_sources()) <= set(PHASES[r.machine]), r.id
        assert r.target == SAME or r.target in PHASES[r.machine], r.id
        assert r.input in INPUTS[r.machine], r.id
        assert set(r.guards) <= GUARDS.keys() and set(r.commands) <= BUILDERS.keys(), r.id
        if r.sources == (WILDCARD,):
            assert not r.changes_state, f"{r.id}: only rows that change nothing may use the wildcard"


def test_an_uncovered_pair_is_the_protocol_error() -> None:
    rows = tuple(r for r in DRIVER_ROWS if r.id != "settle.late_cancel")
    assert (Driver.SETTLE, "DONE", "Cancel") not in uncovered_driver_pairs()
    assert (Driver.SETTLE, "DONE", "Cancel") in uncovered_driver_pairs(rows)
    done = attrs.evolve(settle(B, "t", commit=True), phase="DONE")
    with pytest.raises(ProtocolError):
        Drivers(rows).step(done, Cancel())
    assert DRIVERS.step(done, Cancel()).fired == ("settle.late_cancel",)


def test_rows_naming_an_unknown_guard_or_command_are_refused_at_compile_time() -> None:
    bad = attrs.evolve(DRIVER_ROWS[0], guards=("no_such_guard",), commands=("no_such_command",))
    with pytest.raises(ValueError, match=r"no_such_command.*no_such_guard"):
        Drivers((bad, *DRIVER_ROWS[1:]))


def test_an_abort_answer_that_is_no_registry_reply_names_no_cleanup() -> None:
    """An answer without a registry reply (an executor bug) cleans nothing: it lands on the late row."""
    aborting = DRIVERS.step(settle(B, "t", commit=False), Start()).state
    step = DRIVERS.step(aborting, Answer(Call("abort"), None))
    assert (step.fired, step.commands, step.state) == (("settle.late_reply",), (), aborting)


# ---------------------------------------------------------------- the data-loss rows, exactly


def _run(state, *inputs):
    fired: list[str] = []
    commands = []
    for inp in inputs:
        step = DRIVERS.step(state, inp)
        state, fired, commands = step.state, fired + list(step.fired), commands + list(step.commands)
    return state, fired, commands


READ = Answer(Call("revision"), 1)  # the registry's default revision, read before the commit


def test_a_fired_commit_deadline_is_unknown_and_never_an_abort() -> None:
    state, fired, commands = _run(settle(B, "t", commit=True), Start(), READ, Deadline(Timer("commit")),
                                  Lost(Call("commit")))
    assert fired == ["settle.commit", "revision.read", "commit.deadline", "commit.lost"]
    assert state.phase == "COMMIT_UNRESOLVED"
    assert [c for c in commands if isinstance(c, Report)] == [Report(DriverOutcome.UNKNOWN)]
    submits = [c for c in commands if isinstance(c, Submit)]
    assert [c.key for c in submits] == ["commit:t:1", "commit:t:1"]  # the same key, never an abort


def test_the_commit_deadline_already_in_the_inbox_does_not_end_the_abort_that_follows_its_refusal() -> None:
    """The commit's refusal was queued, then its timer fired before the driver stepped: the refusal starts the
    abort (under its own timer), and the stale commit Deadline lands late instead of ending that abort UNKNOWN."""
    refused = Answer(Call("commit"), Reply(Rejected(Reason.NOT_READY, "commit.not_ready")))
    state, fired, commands = _run(settle(B, "t", commit=True), Start(), READ, refused, Deadline(Timer("commit")))
    assert fired == ["settle.commit", "revision.read", "commit.refused", "settle.late_timer"]
    assert state.phase == "ABORTING"
    assert Disarm(Timer("commit")) in commands and Arm(Timer("abort"), "abort") in commands
    assert not [c for c in commands if isinstance(c, Report)]
    state, fired, _ = _run(state, Deadline(Timer("abort")))
    assert fired == ["abort.deadline"] and state.phase == "DONE"


def test_the_revision_is_read_again_after_a_loss_and_no_commit_is_sent_before_it_is_read() -> None:
    """Rows revision.*: the commit's key names the revision it expects, so nothing is sent before the read; a read
    never answered by the commit's deadline aborts (certainly not committed); a cancelled read leaves the attempt."""
    state, fired, commands = _run(settle(B, "t", commit=True), Start(), Lost(Call("revision")))
    assert fired == ["settle.commit", "revision.lost"] and state.phase == "VIEWING"
    assert [type(c).__name__ for c in commands] == ["ReadRevision", "Arm", "ReadRevision"]
    aborted, fired, commands = _run(state, Deadline(Timer("commit")), Answer(Call("revision"), 4))
    assert fired == ["revision.deadline", "settle.late_reply"] and aborted.phase == "ABORTING"
    assert [c.key for c in commands if isinstance(c, Submit)] == ["abort:t"]
    cancelled, fired, commands = _run(state, Cancel())
    assert fired == ["revision.cancel"] and cancelled.phase == "DONE"
    assert commands == [Report(DriverOutcome.UNKNOWN)]
    committing, fired, commands = _run(state, Answer(Call("revision"), 4))
    assert fired == ["revision.read"] and committing.phase == "COMMITTING"
    assert [c.key for c in commands if isinstance(c, Submit)] == ["commit:t:4"]


def test_a_refused_abort_cleans_nothing() -> None:
    refused = Answer(Call("abort"), Reply(Rejected(Reason.STALE_ATTEMPT, "abort.after_commit")))
    state, fired, commands = _run(settle(B, "t", commit=False), Start(), refused)
    assert fired == ["settle.abort", "abort.refused"]
    assert state.phase == "DONE" and not state.engines
    assert not [c for c in commands if type(c).__name__ == "CleanupEngine"]
    assert commands[-1] == Report(DriverOutcome.UNKNOWN, str(Reason.STALE_ATTEMPT))


def test_an_abort_cleans_exactly_what_its_answer_names() -> None:
    order = CleanupOnEngine("E1", B, "relax_policy_lora@0-B-x", "t")
    answer = Answer(Call("abort"), Reply(Aborted(B, "t", VersionState.ABORTED), (order,), ("cap-E1",)))
    state, _fired, commands = _run(settle(B, "t", commit=False), Start(), answer)
    cleanups = [c for c in commands if type(c).__name__ == "CleanupEngine"]
    assert [(c.engine, c.lora_name, c.capability) for c in cleanups] == [("E1", order.lora_name, "cap-E1")]
    freed = Answer(Call("cleaned", "E1"), Reply(Recorded(B, "E1", PlacementState.CLEANED), (CapacityFreed(B),)))
    state, more, commands = _run(state, Answer(Call("cleanup", "E1")), freed)
    assert more == ["clean.done", "cleaned.recorded", "cleaning.all_clean"]
    assert commands[-1] == Report(DriverOutcome.FAILED_CLEAN)


def test_a_lost_claim_reclaims_nothing() -> None:
    _state, fired, commands = _run(reclaim(B), Start(), Lost(Call("claim")), Deadline(Timer("claim")))
    assert fired == ["reclaim.start", "claim.lost", "claim.deadline"]
    assert not [c for c in commands if type(c).__name__ == "ReclaimEngine"]
    assert commands[-1] == Report(DriverOutcome.UNKNOWN)


def test_a_reclaim_unloads_and_confirms_exactly_the_engines_its_claim_names() -> None:
    orders = tuple(ReclaimOnEngine(e, B, f"n-{e}", "rid") for e in ENGINES)
    claimed = Answer(Call("claim"), Reply(ReclaimClaimed(B, "rid", VersionState.RECLAIMING), orders, ("c0", "c1")))
    state, fired, commands = _run(reclaim(B), Start(), claimed)
    sent = [c for c in commands if type(c).__name__ == "ReclaimEngine"]
    assert [(c.engine, c.reclaim_id, c.capability) for c in sent] == [("E0", "rid", "c0"), ("E1", "rid", "c1")]
    confirms = {"E0": VersionState.RECLAIMING, "E1": VersionState.RECLAIMED}  # the last confirm frees the slot
    for engine, after in confirms.items():
        unload = Call("reclaim", engine)
        state, more, commands = _run(state, Answer(unload, False), Answer(unload, True),
                                     Answer(Call("confirm", engine), Reply(ReclaimConfirmed(B, engine, after))))
        fired += more
        assert any(isinstance(c, Submit) and c.key == f"confirm:rid:{engine}" for c in commands)
    assert fired[-2:] == ["confirm.done", "reclaiming.all_confirmed"] and "unload.draining" in fired
    assert is_done(state) and confirmed_engines(state) == ENGINES and state.reclaim_id == "rid"
    assert commands[-1] == Report(DriverOutcome.RECLAIMED)


@attrs.frozen
class Receipt:  # an engine's `end` answer as the stage driver reads it (runtime.interfaces.ReadyReceipt's fields)
    incarnation: int
    digest: str


_STAGES = tuple(StageOnEngine(e, B, f"n-{e}", "t", 1, "d") for e in ENGINES)


def test_a_publication_stages_exactly_the_engines_its_reserve_names_and_a_lost_reserve_retries_the_same_key() -> None:
    answer = Answer(Call("reserve"), Reply(Reserved(B, "n-E0", "t", VersionState.LOADING), _STAGES[:1]))
    state, fired, commands = _run(publication(B, "d", "n-E0", 2, "reserve:B:k"), Start(), Lost(Call("reserve")),
                                  answer)
    assert fired == ["reserve.start", "reserve.lost", "reserve.reserved"]
    assert [c.key for c in commands if isinstance(c, Submit)] == ["reserve:B:k", "reserve:B:k"]
    assert [(c.call.op, c.engine) for c in commands if isinstance(c, StageEngine)] == [("begin", "E0")]
    assert state.attempt_token == "t" and set(state.engines) == {"E0"}


def test_a_publication_reads_the_versions_last_attempt_and_reserves_under_the_key_that_derives() -> None:
    """No clock, no uuid: the reserve's key names the version's last attempt the registry held when read, so a version
    aborted and cleaned since (a new last attempt) is reserved under a new key, and the same read derives the same key
    (two publishers stepped from the same state send the same reserve)."""
    read = ReadAttempt(Call("attempt"), B)
    state, fired, commands = _run(publication(B, "d", "n-E0", 2, ""), Start(), Lost(Call("attempt")),
                                  Answer(Call("attempt"), ""))
    assert fired == ["reserve.view", "attempt.lost", "attempt.read"]
    assert commands == [read, Arm(Timer("reserve"), "reserve"), read,
                        Submit(Call("reserve"), Reserve(B, "d"), "reserve:0:B:d:none")]
    assert (state.phase, state.reserve_key) == ("RESERVING", "reserve:0:B:d:none")
    again, _, _ = _run(publication(B, "d", "n-E0", 2, ""), Start(), Answer(Call("attempt"), ""))
    assert again == state
    _, _, commands = _run(publication(B, "d", "n-E0", 2, ""), Start(), Answer(Call("attempt"), "t1"))
    assert commands[-1].key == "reserve:0:B:d:t1"
    for inp, row, outcome in ((Refusal(Call("attempt"), "BROKEN"), "attempt.refused", DriverOutcome.REJECTED),
                              (Deadline(Timer("reserve")), "attempt.deadline", DriverOutcome.UNKNOWN),
                              (Cancel(), "attempt.cancel", DriverOutcome.UNKNOWN)):
        state, fired, commands = _run(publication(B, "d", "n-E0", 2, ""), Start(), inp)
        assert (state.phase, fired[-1], state.reserve_key) == ("DONE", row, ""), fired
        assert commands[-1].outcome is outcome and not [c for c in commands if isinstance(c, Submit)]


def test_a_reserve_under_another_name_stages_nothing_and_fails_the_attempt() -> None:
    answer = Answer(Call("reserve"), Reply(Reserved(B, "n-E0", "t", VersionState.LOADING), _STAGES))
    state, fired, commands = _run(publication(B, "d", "other-name", 2, "k"), Start(), answer)
    assert fired == ["reserve.start", "reserve.unstageable"] and state.attempt_token == "t"
    assert not [c for c in commands if isinstance(c, StageEngine)]
    assert commands[-1] == Report(DriverOutcome.STAGE_FAILED)


def test_bucket_one_goes_to_no_engine_before_bucket_zero_landed_on_every_engine() -> None:
    state, fired, commands = _run(stage(B, "t", 2, _STAGES), Start(),
                                  *(Answer(Call("begin", e)) for e in ENGINES),
                                  *(Answer(Call("prepared", e), Reply(Recorded(B, e, PlacementState.PREPARED)))
                                    for e in ENGINES),
                                  Answer(Call("bucket", "E0")))
    buckets = [(c.engine, c.index) for c in commands if isinstance(c, StageEngine) and c.call.op == "bucket"]
    assert buckets == [("E0", 0), ("E1", 0)] and fired[-2:] == ["bucket.landed", "stage.waiting"]
    state, more, commands = _run(state, Answer(Call("bucket", "E1")))
    assert more == ["bucket.landed", "transfer.next_bucket"]
    assert [(c.engine, c.index) for c in commands if isinstance(c, StageEngine)] == [("E0", 1), ("E1", 1)]


def test_a_deadline_of_an_earlier_call_never_fails_the_next_one() -> None:
    """The begin's timer fired while its answer was already in the inbox: that Deadline, arriving once bucket 0 is
    in flight, is late (each timer names its call), not bucket 0's deadline."""
    state, _, _ = _run(stage(B, "t", 2, _STAGES), Start(), *(Answer(Call("begin", e)) for e in ENGINES),
                       *(Answer(Call("prepared", e), Reply(Recorded(B, e, PlacementState.PREPARED))) for e in ENGINES))
    assert {e.phase for e in state.engines.values()} == {"SENDING"}
    state, fired, _ = _run(state, Deadline(Timer("begin", "E1")), Deadline(Timer("bucket", "E1", 1)))
    assert fired == ["stage_engine.late_timer", "stage_engine.late_timer"] and state.engines["E1"].phase == "SENDING"
    state, fired, commands = _run(state, Deadline(Timer("bucket", "E1", 0)))
    assert fired == ["bucket.deadline", "stage.waiting"] and any(type(c).__name__ == "DropLink" for c in commands)


def test_a_bucket_refused_lost_or_past_its_deadline_drops_the_link() -> None:
    """The bucket's send goes out beside its `receive_bucket` request: whatever the engine answered but "stashed",
    the send may still wait in the group for a receive the engine never posted, so the group is never used again
    (the next collective on it would pair with that send)."""
    prepared = (Answer(Call("prepared", e), Reply(Recorded(B, e, PlacementState.PREPARED))) for e in ENGINES)
    sending, _, _ = _run(stage(B, "t", 2, _STAGES), Start(), *(Answer(Call("begin", e)) for e in ENGINES), *prepared)
    for outcome, row in ((Refusal(Call("bucket", "E1"), "STALE_ATTEMPT"), "bucket.refused"),
                         (Lost(Call("bucket", "E1")), "bucket.lost"),
                         (Deadline(Timer("bucket", "E1", 0)), "bucket.deadline")):
        _, fired, commands = _run(sending, outcome)
        assert fired[0] == row and [c.engine for c in commands if isinstance(c, DropLink)] == ["E1"], row
    _, fired, commands = _run(sending, Answer(Call("bucket", "E1")))
    assert fired[0] == "bucket.landed" and not any(isinstance(c, DropLink) for c in commands)


def test_staging_fails_once_every_engine_settled_and_says_why() -> None:
    state, fired, commands = _run(stage(B, "t", 1, _STAGES), Start(),
                                  Refusal(Call("begin", "E1"), "STALE_INCARNATION"))
    assert fired[-2:] == ["begin.refused", "stage.waiting"] and not any(isinstance(c, Report) for c in commands)
    state, fired, commands = _run(state, Answer(Call("begin", "E0")),
                                  Answer(Call("prepared", "E0"), Reply(Recorded(B, "E0", PlacementState.PREPARED))))
    assert fired[-2:] == ["prepared.recorded", "stage.failed"]
    assert commands[-1] == Report(DriverOutcome.STAGE_FAILED)
    assert failed_engines(state) == ("E1",)
    failure = state.engines["E1"].failure
    assert failure is not None and (failure.op, failure.reason) == ("begin", "STALE_INCARNATION")


def test_ready_is_recorded_only_after_the_probe_matched() -> None:
    state, _, _ = _run(stage(B, "t", 1, _STAGES), Start(), *(Answer(Call("begin", e)) for e in ENGINES),
                       *(Answer(Call("prepared", e), Reply(Recorded(B, e, PlacementState.PREPARED))) for e in ENGINES),
                       *(Answer(Call("bucket", e)) for e in ENGINES))
    state, fired, commands = _run(state, Answer(Call("end", "E0"), Receipt(1, "d")),
                                  Answer(Call("probe", "E0"), False))
    assert fired == ["end.answered", "probe.mismatch", "stage.waiting"]
    assert not any(isinstance(c, Submit) for c in commands)
    state, fired, commands = _run(state, Answer(Call("end", "E1"), Receipt(1, "d")),
                                  Answer(Call("probe", "E1"), True))
    (ready,) = [c for c in commands if isinstance(c, Submit)]
    assert ready.key == "ready:t:E1:1" and fired == ["end.answered", "probe.matches"]
    # A plain False is the probe's mismatch: no code of its own (the publisher's PROBE_MISMATCH).
    assert state.engines["E0"].failure == StageFailure(Input.ANSWER, "probe", None)


def test_a_typed_refusal_of_the_served_check_is_the_engines_failure_with_its_code() -> None:
    """What the engine serves (issue 46, item 1): the check answers a `CheckRefused`; the same row as a probe that
    differs (never READY) records the refusal's code, which the publication's outcome carries."""
    state, _, _ = _run(stage(B, "t", 1, _STAGES), Start(), *(Answer(Call("begin", e)) for e in ENGINES),
                       *(Answer(Call("prepared", e), Reply(Recorded(B, e, PlacementState.PREPARED))) for e in ENGINES),
                       *(Answer(Call("bucket", e)) for e in ENGINES))
    refused = CheckRefused("SERVED_DIGEST_MISMATCH", "E0 holds x, the snapshot y")
    state, fired, commands = _run(state, Answer(Call("end", "E0"), Receipt(1, "d")),
                                  Answer(Call("probe", "E0"), refused))
    assert fired == ["end.answered", "probe.mismatch", "stage.waiting"]
    assert not any(isinstance(c, Submit) for c in commands)
    assert state.engines["E0"].failure == StageFailure(Input.ANSWER, "probe", "SERVED_DIGEST_MISMATCH")


# ---------------------------------------------------------------- every reachable state x every input

_ORDERS = {e: CleanupOnEngine(e, B, f"n-{e}", "t") for e in ENGINES}
_RECLAIMS = {e: ReclaimOnEngine(e, B, f"n-{e}", "rid") for e in ENGINES}
_REPLIES = [
    Reply(Committed(CommitReceipt(B, "t", 2, None))),
    Reply(Rejected(Reason.NOT_READY, "commit.not_ready")),
    Reply(Aborted(B, "t", VersionState.ABORTED), tuple(_ORDERS.values()), ("c0", "c1")),
    Reply(Aborted(B, "t", VersionState.FAILED_CLEAN)),
    Reply(ReclaimClaimed(B, "rid", VersionState.RECLAIMING), tuple(_RECLAIMS.values())),
    Reply(ReclaimClaimed(B, "rid", VersionState.RECLAIMED)),
    Reply(ReclaimConfirmed(B, "E0", VersionState.RECLAIMED)),
    Reply(Recorded(B, "E0", PlacementState.CLEANED), (CapacityFreed(B),)),
    Reply(Recorded(B, "E0", PlacementState.PREPARED)),
    Reply(Reserved(B, "n-E0", "t", VersionState.LOADING), _STAGES),
    Reply(Reserved(B, "n-E0", "t", VersionState.PUBLISHED)),
    Reply(Recorded(B, "E0", PlacementState.READY)),
    Receipt(1, "d"),
    None,
    True,
    False,
]
_CALLS = [Call(op, e) for op in ("reserve", "commit", "abort", "claim") for e in ("",)] + [
    Call(op, e) for op in ("cleanup", "cleaned", "unknown", "reclaim", "confirm", "begin", "prepared", "bucket", "end",
                           "probe", "ready") for e in ENGINES
]
_TIMERS = [Timer("reserve"), Timer("commit"), Timer("abort"), Timer("claim")]
_TIMERS += [Timer(n, e) for n in ("engine", "report", "backoff") for e in ENGINES]
_TIMERS += [Timer(n, e, i) for n in ("begin", "prepared", "bucket", "end", "ready") for e in ENGINES
            for i in (-1, 0, 1)]

_SESSION = SessionKey(0, 0, 1)
_CALLS += [Call(op) for op in ("bind", "begin_close", "close", "local_cleanup")]
_CALLS += [Call(op, rid) for op in ("view", "generate", "abort") for rid in ("r0", "r1")]
_REPLIES += [Reply(Bound(_SESSION, B, "n-B")), Reply(Closed(_SESSION, True)), frozenset({"E0", "E1"}), frozenset(),
             "response"]
_TIMERS += [Timer("bind"), Timer("close")]
_RIDS = st.sampled_from(["r0", "r1"])
# the restart supervisor: its read and report, and a rehydrate under the attempt token "t"
_REHYDRATE = StageOnEngine("E0", B, "n-B", "t", 2, "d")
_CALLS += [Call("incarnation"), Call("restarted"), Call("placement", "t"), Call("rehydrate", "t"), Call("revision")]
_REPLIES += [2, Reply(Restarted("E0", 2), (_REHYDRATE, _ORDERS["E0"])), Reply(Restarted("E0", 2)),
             PlacementState.READY, PlacementState.BEGUN]
_TIMERS += [Timer("incarnation"), Timer("restarted")]
# a recovery: the registry's versions (B pending, stored or not), the lease, the settle's outcome
_CALLS += [Call("pending"), Call("lease"), Call("settle")]
_REPLIES += [(PendingAttempt(B, VersionState.LOADING, "t", "n-B", True),),
             (PendingAttempt(B, VersionState.LOADING, "t", "n-B", False),),
             (PendingAttempt(B, VersionState.PUBLISHED, "t", "n-B", True),), (),
             LeaseGranted("me", 3, 10.0), DriverOutcome.COMMITTED, DriverOutcome.UNKNOWN]

inputs = st.one_of(
    st.just(Start()),
    st.just(Bind()),
    st.just(Finish()),
    st.builds(Generate, _RIDS),
    st.builds(Resolve, _RIDS),
    st.builds(Cancel, _RIDS),
    st.builds(Refusal, st.sampled_from(_CALLS), st.just(Reason.VERSION_UNAVAILABLE), st.sampled_from(ENGINES)),
    st.just(Cancel()),
    st.builds(Answer, st.sampled_from(_CALLS), st.sampled_from(_REPLIES)),
    st.builds(Refusal, st.sampled_from(_CALLS), st.sampled_from([Reason.IN_USE, Reason.NOT_RECLAIMABLE])),
    st.builds(Lost, st.sampled_from(_CALLS)),
    st.builds(Deadline, st.sampled_from(_TIMERS)),
)
starts = st.sampled_from([settle(B, "t", commit=True), settle(B, "t", commit=False), reclaim(B),
                          stage(B, "t", 2, _STAGES), publication(B, "d", "n-E0", 2, "reserve:B"),
                          session(_SESSION), session(_SESSION, cleanup=True), session(_SESSION, close_only=True),
                          attrs.evolve(session(_SESSION), phase="BOUND", version=B, lora_name="n-B"),
                          supervise("E0"), supervise("E0", frozenset({"t"})), recover()])


@settings(max_examples=800, deadline=None)
@given(start=starts, script=st.lists(inputs, max_size=12))
def test_step_over_reachable_states_and_every_input(start, script) -> None:
    state = start
    for inp in script:
        try:
            step = DRIVERS.step(state, inp)
        except ProtocolError:  # the one error; nothing else may escape
            continue
        assert step.fired and all(f in {r.id for r in DRIVER_ROWS} for f in step.fired)
        for sub in subs_of(step.state).values():
            assert isinstance(sub, (CleanupEngineState, ReclaimEngineState, StageEngineState, GenerationState,
                                    RehydrateState))
        # Determinism: the same state and input give the same step (keys come from the state only).
        assert DRIVERS.step(state, inp) == step
        # Once done, a driver stays done.
        if is_done(state):  # (a closed session still answers a finish with the close's report)
            assert step.state.phase == state.phase and all(isinstance(c, Report) for c in step.commands)
        state = step.state


def test_staging_without_a_bucket_or_an_engine_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="at least one bucket and one engine"):
        stage(B, "t", 0, _STAGES)
    with pytest.raises(ValueError, match="at least one bucket and one engine"):
        stage(B, "t", 1, ())
    with pytest.raises(ValueError, match="at least one bucket"):
        publication(B, "d", "n-E0", 0, "k")


def test_the_staging_phases_the_publisher_times_are_the_coordinators_moves() -> None:
    idle = stage(B, "t", 2, _STAGES)
    reserving = attrs.evolve(idle, phase="RESERVING")
    assert stage_phase(reserving) == "reserve" and stage_phase_completed(idle, reserving) is None
    beginning = attrs.evolve(reserving, phase="BEGINNING")
    assert staging_started(reserving, beginning) and not staging_started(beginning, beginning)
    assert stage_phase_completed(reserving, beginning) == "reserve"
    transferring = attrs.evolve(beginning, phase="TRANSFERRING", bucket=0)
    assert stage_phase_completed(beginning, transferring) == "begin"
    second = attrs.evolve(transferring, bucket=1)  # the next bucket: the same coordinator phase, a new timed one
    assert stage_phase_moved(transferring, second) and stage_phase_completed(transferring, second) == "bucket_0"
    assert not stage_phase_moved(second, second) and stage_phase_completed(second, second) is None
    failed = attrs.evolve(second, phase="DONE", engines=second.engines.set(
        "E0", StageEngineState("FAILED", second.engines["E0"].order)))
    assert stage_phase_completed(second, failed) is None  # nothing completes once an engine failed
    assert [stage_phase(second, op) for op in ("prepared", "bucket", "probe")] == ["begin", "bucket_1", "end"]
