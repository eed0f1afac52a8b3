"""The one error type: a (state, event) pair that no row covers is a bug in the caller."""

from __future__ import annotations


class ProtocolError(Exception):
    """Raised for a (state, event) pair no table row covers; the state is left unchanged.

    Expected refusals (late, duplicated, stale messages) are never raised: they are `Rejected` results.
    """

    def __init__(self, message: str, *, machine: str | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.machine = machine
        self.state = state
