"""The lease keeper (spec/drivers.py: machine `lease`), stepped by hand.

What `Publisher._keep_lease` used to decide itself, each a row now: the keeper reads the lease's fence first and
acquires under a key naming it (or, for an operator's take-over, takes that fence over), renewed a third of its ttl
apart under a key that names the fence, and the keeper ends when a renewal is refused (the lease expired or was taken
over) or when its caller stops it; a renewal whose reply is lost is asked again a period later.
`model_checks/drivers.py` (scenarios `lease`, `lease_take_over`) runs these rows against the real registry's lease
rows.
"""

from __future__ import annotations

from lifecycle_driver import run_driver as _run

from versioned_lora.lifecycle.drivers import (
    RENEW_PERIOD,
    Answer,
    Arm,
    Call,
    Cancel,
    Deadline,
    Disarm,
    LeaseState,
    Lost,
    ReadLiveFence,
    Reply,
    Report,
    Start,
    Submit,
    Timer,
    keep_lease,
    lease_lost,
)
from versioned_lora.lifecycle.results import LeaseGranted, Rejected
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.events import AcquireLease, RenewLease, TakeOverLease
from versioned_lora.spec.reasons import Reason

O = DriverOutcome  # noqa: E741
HOLDER, TTL = "trainer", 30.0
GRANTED = Answer(Call("acquire"), Reply(LeaseGranted(HOLDER, 4, TTL)))
READ = ReadLiveFence(Call("live_fence"))
RENEWED = Answer(Call("renew"), Reply(LeaseGranted(HOLDER, 4, TTL)))
RENEW = Submit(Call("renew"), RenewLease(HOLDER, 4), "renew:trainer:4")


def _holding() -> LeaseState:
    state, fired, commands = _run(keep_lease(HOLDER, TTL), Start(), Answer(Call("live_fence"), 3), GRANTED)
    assert fired == ["keeper.start", "live.read", "acquire.granted"]
    assert commands == [READ, Arm(Timer("acquire"), "acquire"),
                        Submit(Call("acquire"), AcquireLease(HOLDER, TTL), "lease:trainer:3"),
                        Disarm(Timer("acquire")), Arm(Timer("renew"), RENEW_PERIOD), Report(O.LEASED)]
    assert (state.phase, state.fence) == ("HOLDING", 4)
    return state


def test_the_lease_is_renewed_a_period_apart_under_a_key_naming_its_fence() -> None:
    state = _holding()
    state, fired, commands = _run(state, Deadline(Timer("renew")), RENEWED, Deadline(Timer("renew")))
    assert fired == ["hold.renew", "renew.renewed", "hold.renew"]
    assert commands == [RENEW, Arm(Timer("renew"), RENEW_PERIOD), RENEW]
    state, fired, commands = _run(state, Lost(Call("renew")))  # the registry unreachable: asked again a period on
    assert (state.phase, fired, commands) == ("HOLDING", ["renew.lost"], [Arm(Timer("renew"), RENEW_PERIOD)])


def test_a_refused_renewal_ends_the_keeper_and_marks_the_lease_lost() -> None:
    state, _, _ = _run(_holding(), Deadline(Timer("renew")))
    refused = Answer(Call("renew"), Reply(Rejected(Reason.NOT_LEASE_HOLDER, "lease.renew_lost")))
    state, fired, commands = _run(state, refused)
    assert (state.phase, fired, commands) == ("DONE", ["renew.refused"], [Report(O.REJECTED, "NOT_LEASE_HOLDER")])
    assert lease_lost(state)


def test_a_stopped_keeper_sends_nothing_more_and_late_inputs_change_nothing() -> None:
    state, fired, commands = _run(_holding(), Cancel(), Deadline(Timer("renew")), RENEWED, Lost(Call("renew")),
                                  Cancel())
    assert fired == ["keeper.stop", "keeper.late_timer", "keeper.late_reply", "keeper.late_lost", "keeper.late_cancel"]
    assert commands == [Report(O.STOPPED)] and not lease_lost(state)


def test_an_acquire_refused_unanswered_or_abandoned_holds_nothing() -> None:
    held = Answer(Call("acquire"), Reply(Rejected(Reason.LEASE_HELD, "lease.held")))
    for inputs, row, outcome in (((held,), "acquire.refused", O.REJECTED),
                                 ((Lost(Call("acquire")), Deadline(Timer("acquire"))), "acquire.deadline", O.UNKNOWN),
                                 ((Cancel(),), "acquire.cancel", O.UNKNOWN)):
        state, fired, commands = _run(keep_lease(HOLDER, TTL), Start(), Answer(Call("live_fence"), 0), *inputs)
        assert (state.phase, state.fence, fired[-1]) == ("DONE", 0, row), fired
        assert commands[-1].outcome is outcome and not lease_lost(state)


def test_a_take_over_reads_the_live_fence_first_and_ends_that_fence_only() -> None:
    """The fence taken over is the one the keeper read: the view read is a command of the keeper's own rows, under
    the acquire's deadline, retried when lost; none live (NO_FENCE read), the take-over is an ordinary acquire."""
    state, fired, commands = _run(keep_lease("cli", TTL, take_over=True), Start(), Lost(Call("live_fence")),
                                  Answer(Call("live_fence"), 4))
    assert fired == ["keeper.start", "live.lost", "live.read"]
    assert commands == [READ, Arm(Timer("acquire"), "acquire"), READ,
                        Submit(Call("acquire"), TakeOverLease("cli", 4, TTL), "take_over:cli:4")]
    assert (state.phase, state.live) == ("ACQUIRING", 4)
    _, _, commands = _run(keep_lease("cli", TTL, take_over=True), Start(), Answer(Call("live_fence"), 0))
    assert commands[-1] == Submit(Call("acquire"), AcquireLease("cli", TTL), "take_over:cli:0")


def test_a_take_over_whose_read_is_unanswered_or_abandoned_sends_nothing() -> None:
    for inputs, row in (((Deadline(Timer("acquire")),), "live.deadline"), ((Cancel(),), "live.cancel")):
        state, fired, commands = _run(keep_lease("cli", TTL, take_over=True), Start(), *inputs)
        assert (state.phase, fired[-1]) == ("DONE", row), fired
        assert commands[2:] == [Report(O.UNKNOWN)], commands
        late, fired, commands = _run(state, Answer(Call("live_fence"), 4))  # the read's answer after the caller left
        assert (late, fired, commands) == (state, ["keeper.late_reply"], [])


def test_the_acquire_key_names_the_fence_read_so_a_new_acquisition_is_a_new_call() -> None:
    """No clock, no uuid: the key is derived from the fence the keeper read. A grant is journaled only when it moves
    the fence on, so a key once granted is never derived again (the fence read has moved), while a retry after a lost
    reply is the same call; two keepers of the same holder that read the same fence send the same call."""
    _, _, commands = _run(keep_lease(HOLDER, TTL), Start(), Answer(Call("live_fence"), 0), Lost(Call("acquire")))
    assert [c.key for c in commands if isinstance(c, Submit)] == ["lease:trainer:0", "lease:trainer:0"]
    later, _, commands = _run(keep_lease(HOLDER, TTL), Start(), Answer(Call("live_fence"), 1))
    assert commands[-1] == Submit(Call("acquire"), AcquireLease(HOLDER, TTL), "lease:trainer:1")
    again, _, _ = _run(keep_lease(HOLDER, TTL), Start(), Answer(Call("live_fence"), 1))
    assert again == later
