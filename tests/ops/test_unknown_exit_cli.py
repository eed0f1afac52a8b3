"""`versioned-lora publish` whose reserve's answer does not come back in time exits 6 (UNKNOWN) and keeps the slot;
`resolve` then settles it (live deployment: real Ray registry actor, the session's two real engines).

Injected: the registry actor holds its answer to the CLI's reserve (`FaultyRegistryActor.arm_fault("after_commit")`,
tests/registry_faults.py, the test-only hold: the reserve is journaled, its reply waits) past the reserve deadline. To
make the reserve the next journaled call, the test takes the publisher lease for the CLI's holder name first, so the
CLI's own acquire is the holder's replay (a keep row, nothing journaled)."""

from __future__ import annotations

import asyncio

from engine_helpers import run
from lease_helpers import fence_of
from ops_helpers import cli_process, connection_args
from test_publication_e2e import deployed

from versioned_lora.lifecycle import VersionKey
from versioned_lora.ops.commands import Exit
from versioned_lora.spec.states import VersionState

HOLDER = "operator"
HOLD_S = 25.0  # past the CLI's reserve deadline (Deadlines.reserve, 10 s)


def test_a_publish_whose_reserve_answer_is_held_past_its_deadline_exits_unknown_and_resolve_settles_it(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            conn = connection_args(d, tmp_path)
            await fence_of(d.registry, HOLDER)
            begins = {e: x["managed_begin"] for e, x in (await d.audit()).items()}
            await d.handle.arm_fault.remote("after_commit", hold_s=HOLD_S, marker=str(tmp_path / "held"))
            unknown = await cli_process("publish", str(fixtures.adapters["A"]), "--version-id", "A",
                                        "--holder", HOLDER, *conn)
            assert unknown.code == Exit.UNKNOWN == 6, unknown.stdout + unknown.stderr
            receipt = unknown.receipt()
            assert (receipt["status"], receipt["reason"]) == ("UNKNOWN", "RESERVE_OUTCOME_UNKNOWN")
            assert (tmp_path / "held").exists()  # the hold was reached: the reserve is in the journal
            while (await d.registry.version_states([VersionKey(d.epoch, "A")])) == {}:
                await asyncio.sleep(0.5)  # answered once the hold ends
            view = await d.registry.publication_view()
            assert view.versions[VersionKey(d.epoch, "A")].state is VersionState.LOADING  # the slot is kept
            assert view.managed_count() == 1
            assert {e: x["managed_begin"] for e, x in (await d.audit()).items()} == begins  # nothing staged

            resolved = await cli_process("resolve", "--holder", HOLDER, *conn)
            assert resolved.code == Exit.OK, resolved.stdout + resolved.stderr
            assert resolved.receipt()["resolved"] == [
                # The table decided: the commit was refused (commit.not_ready), so the driver aborted and cleaned.
                {"version_id": "A", "action": "publication", "status": "FAILED_CLEAN", "reason": "NOT_READY"}]
            view = await d.registry.publication_view()
            assert view.versions[VersionKey(d.epoch, "A")].state is VersionState.FAILED_CLEAN
            assert view.managed_count() == 0 and view.lease_holder is None  # the slot is free, the lease released

    run(body())
