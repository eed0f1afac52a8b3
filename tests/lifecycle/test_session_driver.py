"""The session driver (spec/drivers.py: machines `session` and `generation`), stepped by hand.

What `SessionBinder` used to decide itself, each a row now: one bind per session under a key derived from the
session key; nothing dispatched while the binding is unknown; a generation goes only where the registry's view
says and is never resent after an unknown outcome; the close aborts what is live, runs the local cleanup and
releases once; every caller's request is answered by one report to its subject. Over every reachable state and
every input, `test_driver_table.py`'s Hypothesis test steps these machines too.
"""

from __future__ import annotations

from typing import Any

from lifecycle_driver import run_driver as _run

from versioned_lora.lifecycle.drivers import (
    AbortGeneration,
    Answer,
    Arm,
    Bind,
    Call,
    Cancel,
    Deadline,
    Finish,
    Generate,
    HangUp,
    LocalCleanup,
    Lost,
    Refusal,
    Reply,
    Report,
    Resolve,
    SendGeneration,
    SessionState,
    Submit,
    Timer,
    ViewDispatch,
    aborted_requests,
    in_flight_rid,
    requests_in_flight,
    session,
    unresolved_requests,
)
from versioned_lora.lifecycle.results import Bound, Closed, Rejected
from versioned_lora.spec.drivers import DriverOutcome, SessionRefusal
from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.reasons import Reason

KEY = SessionKey(0, 3, 7)
A = VersionKey(0, "A")
BOUND = Reply(Bound(KEY, A, "name-A"))
O = DriverOutcome  # noqa: E741


def _reports(commands: list[Any]) -> list[tuple[DriverOutcome, str | None, str]]:
    return [(c.outcome, c.reason, c.subject) for c in commands if isinstance(c, Report)]


def _bound(cleanup: bool = False) -> SessionState:
    state, _, _ = _run(session(KEY, cleanup=cleanup), Bind(), Answer(Call("bind"), BOUND))
    assert state.phase == "BOUND" and state.version == A and state.lora_name == "name-A"
    return state


def test_one_bind_per_session_under_a_key_of_the_session_and_every_waiter_told_once() -> None:
    state, fired, commands = _run(session(KEY), Bind(), Bind())
    (submit,) = [c for c in commands if isinstance(c, Submit)]
    assert submit.key == "bind:0:3:7" and fired == ["bind.start", "bind.waiting"]
    state, fired, commands = _run(state, Lost(Call("bind")))
    assert [c.key for c in commands if isinstance(c, Submit)] == ["bind:0:3:7"]  # the same call again
    state, fired, commands = _run(state, Answer(Call("bind"), BOUND), Bind())
    assert _reports(commands) == [(O.BOUND, None, "bind"), (O.BOUND, None, "bind")]
    assert not any(isinstance(c, Submit) for c in commands)  # a later Bind asks nobody


def test_a_bind_past_its_deadline_is_unknown_dispatches_nothing_and_its_late_answer_binds() -> None:
    state, _, commands = _run(session(KEY), Bind(), Deadline(Timer("bind")))
    assert state.phase == "BIND_UNKNOWN" and _reports(commands)[-1] == (O.UNKNOWN, None, "bind")
    state, fired, commands = _run(state, Generate("r0"))
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.NOT_BOUND, "r0")] and not state.requests
    state, fired, commands = _run(state, Bind())
    assert state.phase == "BINDING" and [type(c) for c in commands] == [Arm]  # its own deadline
    state, fired, commands = _run(state, Answer(Call("bind"), BOUND))
    assert state.phase == "BOUND" and fired == ["bind.bound"]


def test_a_refused_bind_binds_nothing_and_a_later_bind_asks_again() -> None:
    no_default = Reply(Rejected(Reason.NO_PUBLISHED_VERSION, "bind.no_default"))
    state, fired, commands = _run(session(KEY), Bind(), Answer(Call("bind"), no_default))
    assert state.phase == "OPEN" and _reports(commands)[-1] == (O.REJECTED, Reason.NO_PUBLISHED_VERSION, "bind")
    state, fired, commands = _run(state, Bind())
    assert fired == ["bind.start"]


def test_a_generation_goes_only_where_the_view_says_and_is_redispatched_only_after_a_version_refusal() -> None:
    state, fired, commands = _run(_bound(), Generate("r0"))
    assert commands == [ViewDispatch(Call("view", "r0"), A)] and requests_in_flight(state) == ("r0",)
    state, fired, commands = _run(state, Answer(Call("view", "r0"), frozenset({"E0", "E1"})))
    assert commands == [SendGeneration(Call("generate", "r0"), "r0", "name-A", frozenset({"E0", "E1"}))]
    assert in_flight_rid(state, "r0") == "r0" and in_flight_rid(state, "nope") is None
    refused = Refusal(Call("generate", "r0"), Reason.VERSION_UNAVAILABLE, origin="E1")
    state, fired, commands = _run(state, refused)
    assert fired == ["generate.redispatch"]
    assert commands == [SendGeneration(Call("generate", "r0"), "r0~1", "name-A", frozenset({"E0"}))]
    state, fired, commands = _run(state, Refusal(Call("generate", "r0"), Reason.VERSION_UNAVAILABLE, origin="E0"))
    assert fired == ["generate.refused", "session.settled"]
    assert _reports(commands) == [(O.REJECTED, Reason.VERSION_UNAVAILABLE, "r0")]
    state, fired, commands = _run(state, Generate("r0"))
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.RID_IN_USE, "r0")]


def test_a_version_servable_nowhere_is_refused_before_it_leaves() -> None:
    state, _, commands = _run(_bound(), Generate("r0"), Answer(Call("view", "r0"), frozenset()))
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.NOT_SERVABLE, "r0")]
    assert not any(isinstance(c, SendGeneration) for c in commands)
    state, _, commands = _run(state, Generate("r1"), Lost(Call("view", "r1")))
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.VIEW_UNAVAILABLE, "r1")]


def test_an_unknown_generation_is_never_resent_and_blocks_the_next_until_resolved() -> None:
    state, _, _ = _run(_bound(), Generate("r0"), Answer(Call("view", "r0"), frozenset({"E0"})))
    state, fired, commands = _run(state, Lost(Call("generate", "r0")))
    assert _reports(commands) == [(O.UNKNOWN, None, "r0")] and unresolved_requests(state) == ("r0",)
    state, fired, commands = _run(state, Generate("r1"))
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.UNRESOLVED_OUTCOME, "r1")]
    state, fired, commands = _run(state, Resolve("r0"), Lost(Call("abort", "r0")))
    assert commands[0] == AbortGeneration(Call("abort", "r0"), "r0") and _reports(commands) == [
        (O.UNKNOWN, None, "r0")]
    state, fired, commands = _run(state, Resolve("r0"), Answer(Call("abort", "r0")), Resolve("r0"), Resolve("x"))
    assert fired == ["resolve.start", "resolve.done", "session.settled", "resolve.known", "resolve.nothing"]
    assert unresolved_requests(state) == () and [r[0] for r in _reports(commands)] == [O.RESOLVED] * 3


def test_a_caller_that_goes_away_hangs_up_its_generation_and_its_outcome_is_unknown() -> None:
    state, _, _ = _run(_bound(), Generate("r0"), Answer(Call("view", "r0"), frozenset({"E0"})))
    state, fired, commands = _run(state, Cancel("r0"))
    assert commands == [HangUp(Call("generate", "r0")), Report(O.UNKNOWN, None, "r0")]
    state, fired, commands = _run(state, Generate("r1"), Cancel("r1"), Cancel("gone"))
    assert fired == ["generate.unresolved", "session.late_cancel", "session.late_cancel"]


def test_the_close_aborts_what_is_live_runs_the_cleanup_and_releases_once() -> None:
    state, _, _ = _run(_bound(cleanup=True), Generate("r0"), Answer(Call("view", "r0"), frozenset({"E0"})),
                       Generate("r1"))
    state, fired, commands = _run(state, Finish(), Generate("r2"), Bind())
    assert [c.key for c in commands if isinstance(c, Submit)] == ["bclose:0:3:7"]
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.SESSION_CLOSED, "r2"),
                                  (O.REJECTED, SessionRefusal.SESSION_CLOSED, "bind")]
    state, fired, commands = _run(state, Answer(Call("begin_close"), Reply(None)))
    assert state.phase == "ABORTING" and AbortGeneration(Call("abort", "r0"), "r0") in commands
    state, fired, commands = _run(state, Answer(Call("view", "r1"), frozenset({"E0"})))  # nothing is sent now
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.SESSION_CLOSED, "r1")]
    assert fired == ["view.closing", "drain.waiting"]
    state, fired, commands = _run(state, Answer(Call("generate", "r0"), "late"), Answer(Call("abort", "r0")))
    assert fired == ["generation.late_reply", "close_abort.answered", "drain.cleanup"]
    assert _reports(commands) == [(O.DROPPED, None, "r0")] and commands[-1] == LocalCleanup(Call("local_cleanup"))
    state, fired, commands = _run(state, Lost(Call("local_cleanup")), Finish())
    assert fired == ["cleanup.failed", "finish.retry_cleanup"]
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.CLEANUP_FAILED, "finish")]
    state, fired, commands = _run(state, Answer(Call("local_cleanup")), Lost(Call("close")))
    assert [c.key for c in commands if isinstance(c, Submit)] == ["close:0:3:7", "close:0:3:7"]
    state, fired, commands = _run(state, Answer(Call("close"), Reply(Closed(KEY, True))))
    assert state.phase == "CLOSED" and _reports(commands) == [(O.CLOSED, None, "finish")]
    assert aborted_requests(state) == ("r0",)


def test_a_close_past_its_deadline_is_unknown_and_goes_on_until_answered() -> None:
    state, fired, commands = _run(_bound(), Finish(), Deadline(Timer("close")), Finish(), Lost(Call("begin_close")))
    assert fired == ["finish.start", "closing.deadline", "finish.again", "closing.lost"]
    assert _reports(commands) == [(O.UNKNOWN, None, "finish")]
    state, fired, commands = _run(state, Answer(Call("begin_close"), Reply(None)), Deadline(Timer("close")),
                                  Answer(Call("close"), Reply(Closed(KEY, True))))
    assert fired == ["closing.release", "release.deadline", "release.closed"]
    assert _reports(commands) == [(O.UNKNOWN, None, "finish"), (O.CLOSED, None, "finish")]


def test_a_bind_in_flight_when_the_finish_starts_tells_its_waiters_the_session_closed() -> None:
    _, fired, commands = _run(session(KEY), Bind(), Finish(), Answer(Call("bind"), BOUND), Deadline(Timer("bind")))
    assert fired[1:] == ["finish.binding", "session.late_reply", "session.late_timer"]
    assert _reports(commands) == [(O.REJECTED, SessionRefusal.SESSION_CLOSED, "bind")]


def test_a_session_this_process_does_not_hold_only_sends_the_close_under_its_own_key() -> None:
    state, fired, commands = _run(session(KEY, close_only=True), Finish())
    assert fired[0] == "finish.close_only" and state.phase == "RELEASING"
    assert [c.key for c in commands if isinstance(c, Submit)] == ["close-again:0:3:7"]
