"""Routing by the table (RFC §5.3): requests for a version go only to engines where the registry has it READY
in the engine's current incarnation (`lifecycle.queries.servable_on`, read through the dispatch gate).

Real Ray registry actor, two real engines, the Publisher and the SessionBinder over SGLangBackend. E1 is
restarted (a new incarnation that holds nothing): before the registry adopts the new incarnation, E1's own
refusal (VERSION_UNAVAILABLE) sends the same binding to E0; once adopted, no request for A goes to E1 until
A's rehydrate there is READY; then E1 serves A again with the same numbers. The rehydrate is another process's
(`versioned-lora resolve --snapshots`: the restart supervisor over a new Publisher), reading A from the snapshot
store the test's Publisher wrote before its commit.
"""

from __future__ import annotations

from engine_helpers import PROMPT, run
from ops_helpers import cli, connection_args
from test_publication_e2e import deployed


def test_a_restarted_engine_gets_no_request_for_a_version_until_ready_there(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            sent = d.backend.sent
            first = d.binder.open("S1@E1")  # the tests' router sends '...@E1' sessions to E1
            reference = await d.binder.generate(first, PROMPT, 4)
            assert sent["E1"] == 1 and sent["E0"] == 0
            await d.binder.finish(first)

            engines.e1.restart()  # a new incarnation: A is ABSENT there
            # Not adopted yet: the registry still has A READY on E1, so the request goes there, is refused
            # (the request certainly did not run), and the same binding is sent to E0.
            before = sent.copy()
            second = d.binder.open("S2@E1")
            served = await d.binder.generate(second, PROMPT, 4)
            assert (served.output_ids, served.logprobs) == (reference.output_ids, reference.logprobs)
            assert (sent["E1"] - before["E1"], sent["E0"] - before["E0"], d.binder.redispatched) == (1, 1, 1)
            await d.binder.finish(second)

            await d.publisher.sync_incarnations()  # adopted: A's placement on E1 is a rehydrate attempt now
            assert (await d.registry.dispatch_view([a_version]))[a_version].engines == {"E0"}
            before = sent.copy()
            third = d.binder.open("S3@E1")
            served = await d.binder.generate(third, PROMPT, 4)
            assert (served.output_ids, served.logprobs) == (reference.output_ids, reference.logprobs)
            assert (sent["E1"] - before["E1"], sent["E0"] - before["E0"], d.binder.redispatched) == (0, 1, 1)

            # Rehydrated by another process that never saw A (the publisher that published it may be gone): the
            # operator's `versioned-lora resolve --snapshots DIR` runs the restart supervisor, which stages what the
            # registry's answer to E1's incarnation names, A's bytes read from the deployment's snapshot store by
            # the digest the registry holds, verified on read.
            assert d.snapshots.holds(a.digest)
            resolved = await cli("resolve", "--snapshots", str(d.snapshots.root), *connection_args(d, tmp_path))
            assert resolved.code == 0, resolved.stdout + resolved.stderr
            assert resolved.receipt()["resolved"] == [
                {"version_id": "A", "action": "rehydrate E1", "status": "REHYDRATED", "reason": None}]
            assert (await d.registry.dispatch_view([a_version]))[a_version].engines == {"E0", "E1"}
            before = sent.copy()
            fourth = d.binder.open("S4@E1")
            served = await d.binder.generate(fourth, PROMPT, 4)
            assert (served.output_ids, served.logprobs) == (reference.output_ids, reference.logprobs)
            assert (sent["E1"] - before["E1"], sent["E0"] - before["E0"]) == (1, 0)
            # The session bound while E1 was rehydrating stays on its version, now routed where it is sticky.
            again = await d.binder.generate(third, PROMPT, 4)
            assert (again.output_ids, again.logprobs) == (reference.output_ids, reference.logprobs)
            for key in (third, fourth):
                await d.binder.finish(key)

    run(body())
