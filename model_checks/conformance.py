"""The model side of the engine conformance test: what the engine-side machine (the table, through
`engine_step`) predicts a real engine shows after each operation of a sequence.

Operations (what tests/model_checks/test_engine_conformance.py does to a real engine):
  publish         begin + end of a managed version staged from disk (no buckets)
  generate        a short request: acquire then release
  start_long      a long request starts: acquire (its release comes with finish_long)
  finish_long     the long request ends: release
  reclaim <id>    the managed reclaim endpoint
  generate_refused a request for the name that must be refused (VERSION_UNAVAILABLE)

Observation after each op: (adapter state, refcount, loaded in SGLang, physical unloads so far,
reclaim receipt id). As in the engine, `wait_for_unload` returning is FinishUnload, run by the
engine itself as soon as the adapter is UNREGISTERED.
"""

from __future__ import annotations

from typing import NamedTuple

from model_checks.drivers import carried_out
from versioned_lora.lifecycle import (
    AcquireRequest,
    AdapterState,
    BeginStaging,
    EndStaging,
    FinishUnload,
    PhysicalUnload,
    ReclaimAdapter,
    Rejected,
    ReleaseRequest,
    engine_step,
    initial_engine_state,
)


class Observation(NamedTuple):
    state: str
    refcount: int
    loaded: bool
    physical_unloads: int
    receipt: str | None


def expected_observations(ops: list[tuple[str, ...]], name: str, token: str, digest: str,
                          incarnation: int) -> list[Observation]:
    state = initial_engine_state("E0", incarnation)
    unloads, loaded, receipt = 0, False, None
    out = []
    for op in ops:
        kind = op[0]
        events: list[object] = []
        if kind == "publish":
            events = [BeginStaging(name, token, incarnation, digest, 0), EndStaging(name, token, incarnation, True)]
        elif kind == "generate":
            events = [AcquireRequest(name), ReleaseRequest(name)]
        elif kind in ("start_long", "generate_refused"):
            events = [AcquireRequest(name)]
        elif kind == "finish_long":
            events = [ReleaseRequest(name)]
        elif kind == "reclaim":
            events = [ReclaimAdapter(name, op[1])]
        for event in events:
            # The engine's executor reports each load's and unload's outcome (they succeed here) as an input.
            state, result = carried_out(engine_step, *engine_step(state, event))  # type: ignore[arg-type]
            if kind == "generate_refused":
                assert isinstance(result, Rejected)
            if kind == "publish" and not isinstance(result, Rejected):
                loaded = True
            adapter = state.adapters[name]
            if adapter.state is AdapterState.UNREGISTERED:  # the engine's own wait_for_unload returned
                state, _, effects = engine_step(state, FinishUnload(name, adapter.reclaim_id or ""))
                if any(isinstance(x, PhysicalUnload) for x in effects):
                    unloads, loaded, receipt = unloads + 1, False, adapter.reclaim_id
                state, _ = carried_out(engine_step, state, None, effects)  # type: ignore[arg-type]
        adapter = state.adapters[name]
        out.append(Observation(str(adapter.state), adapter.native_refs, loaded, unloads, receipt))
    return out


CONFORMANCE_SEQUENCE: list[tuple[str, ...]] = [
    ("publish",),
    ("generate",),
    ("start_long",),
    ("reclaim", "r-conf"),  # in use: DRAINING, still loaded and pinned
    ("generate_refused",),  # unregistered: new requests fail
    ("reclaim", "r-conf"),  # replay: nothing changes
    ("finish_long",),  # last release: drained, unloaded exactly once
    ("reclaim", "r-conf"),  # replay after unload: same receipt
    ("generate_refused",),  # never reloaded
]
