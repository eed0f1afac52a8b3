"""The recover driver (spec/drivers.py: machine `recover`), stepped by hand.

What `Publisher.recover` used to decide itself from a read of the registry, each a row now: nothing pending takes no
lease; the attempt a crashed publisher left is settled only under the lease; a LOADING attempt is committed only if
the snapshot store holds its bytes, else it is aborted (as an ABORTED one is, again); a settle whose outcome is
unknown is reported so. `model_checks/drivers.py` (scenarios `recover*`) runs these rows against the real registry.
"""

from __future__ import annotations

from lifecycle_driver import run_driver as _run

from versioned_lora.lifecycle.drivers import (
    DRIVERS,
    Answer,
    Call,
    Cancel,
    Lost,
    PendingAttempt,
    RecoverState,
    Refusal,
    Report,
    SettleAttempt,
    Start,
    TakeLease,
    ViewPending,
    committable,
    recover,
)
from versioned_lora.lifecycle.results import LeaseGranted
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.identities import VersionKey
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import VersionState

A, B = VersionKey(0, "A"), VersionKey(0, "B")
SERVED = PendingAttempt(A, VersionState.PUBLISHED, "ta", "name-A", True)
LOADING = PendingAttempt(B, VersionState.LOADING, "tb", "name-B", True)
GRANTED = LeaseGranted("recovering", 7, 30.0)
O = DriverOutcome  # noqa: E741


def _leasing(pending: PendingAttempt) -> RecoverState:
    state, fired, commands = _run(recover(), Start(), Answer(Call("pending"), (SERVED, pending)))
    assert fired == ["recover.start", "pending.found"]
    assert commands == [ViewPending(Call("pending")), TakeLease(Call("lease"))]
    return state


def test_nothing_pending_takes_no_lease() -> None:
    state, fired, commands = _run(recover(), Start(), Answer(Call("pending"), (SERVED,)))
    assert (state.phase, fired[-1], commands[-1]) == ("DONE", "pending.none", Report(O.RECOVERED))
    assert not any(isinstance(c, TakeLease) for c in commands)


def test_a_stored_loading_attempt_is_committed_under_the_lease() -> None:
    state, fired, commands = _run(_leasing(LOADING), Answer(Call("lease"), GRANTED))
    assert (state.phase, state.attempt, fired) == ("SETTLING", LOADING, ["lease.granted_commit"])
    assert commands == [SettleAttempt(Call("settle"), LOADING, True, 7)]
    state, fired, commands = _run(state, Answer(Call("settle"), O.COMMITTED))
    assert (state.phase, state.outcome, fired, commands) == ("DONE", O.COMMITTED, ["settled.known"],
                                                             [Report(O.RECOVERED)])


def test_an_attempt_the_store_lacks_or_already_aborted_is_aborted_never_committed() -> None:
    for pending in (PendingAttempt(B, VersionState.LOADING, "tb", "name-B", False),
                    PendingAttempt(B, VersionState.ABORTED, "tb", "name-B", True)):
        assert not committable(pending)
        _, fired, commands = _run(_leasing(pending), Answer(Call("lease"), GRANTED))
        assert (fired, commands) == (["lease.granted_abort"], [SettleAttempt(Call("settle"), pending, False, 7)])


def test_a_settle_whose_outcome_is_unknown_is_reported_unknown() -> None:
    state, _, _ = _run(_leasing(LOADING), Answer(Call("lease"), GRANTED))
    done, fired, commands = _run(state, Answer(Call("settle"), O.UNKNOWN))
    assert (done.outcome, fired, commands) == (O.UNKNOWN, ["settled.unknown"], [Report(O.UNKNOWN)])
    done, fired, commands = _run(state, Lost(Call("settle")))
    assert (done.outcome, fired, commands) == (None, ["settle.lost"], [Report(O.UNKNOWN)])


def test_another_publishers_lease_leaves_the_attempt_as_it_is() -> None:
    state, fired, commands = _run(_leasing(LOADING), Refusal(Call("lease"), Reason.LEASE_HELD))
    assert (state.phase, fired, commands) == ("DONE", ["lease.refused"], [Report(O.REJECTED, Reason.LEASE_HELD)])
    state, fired, commands = _run(_leasing(LOADING), Lost(Call("lease")))
    assert (state.phase, fired, commands) == ("DONE", ["lease.lost"], [Report(O.UNKNOWN)])


def test_an_unreadable_registry_or_a_cancel_settles_nothing() -> None:
    state, fired, commands = _run(recover(), Start(), Lost(Call("pending")))
    assert (state.attempt, fired[-1], commands[-1]) == (None, "pending.lost", Report(O.REJECTED))
    state, fired, commands = _run(_leasing(LOADING), Cancel())
    assert (state.phase, fired, commands) == ("DONE", ["recover.cancel"], [Report(O.UNKNOWN)])
    # The lease's answer after the cancel lands on a late row: nothing is settled on the strength of it.
    assert DRIVERS.step(state, Answer(Call("lease"), GRANTED)).commands == ()
