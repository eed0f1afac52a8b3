"""A window of K versions, end to end (issue 46, item 4): one knob, the registry's capacity K, on the session's
engines (started with the largest K + 1 any test needs: tests/conftest.py, SHARED_ENGINE_CAPACITY), with the real Ray
registry actor, Publisher, Reclaimer, SessionBinder and the two real SGLang CPU engines. Asserts outcomes, never
timings."""

from __future__ import annotations

import asyncio

from engine_helpers import PROMPT, hold_scheduler, run, wait_until
from test_publication_e2e import deployed

from versioned_lora.adapters.engine_process import loaded_adapter_slots
from versioned_lora.runtime.interfaces import BackendRequest
from versioned_lora.runtime.reclaimer import ReclaimStatus

K = 3
LATE_TOKENS = 1500  # the late request's length: it holds the oldest version on E0 while E0's scheduler is paused


def test_window_of_three_versions_holds_three_refuses_a_fourth_and_reclaims_the_oldest_only_when_free(
    engines, fixtures, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    assert loaded_adapter_slots(K) <= loaded_adapter_slots(engines.e0.config.capacity)  # the engines have room

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path, capacity=K) as d:
            # Three versions, each the default in turn, each with a session bound to it (on E0, E1, E0).
            window = [d.candidate(label, adapter) for label, adapter in (("V1", "A"), ("V2", "B"), ("V3", "C"))]
            sessions = []
            for i, (version, candidate) in enumerate(window):
                assert (await d.publisher.publish(version, candidate)).committed, version
                key = d.binder.open(f"S{i + 1}@E{i % 2}")
                assert (await d.binder.bind_first(key)).version == version
                await d.binder.generate(key, PROMPT, 2)
                sessions.append(key)
            view = await d.registry.publication_view()
            assert view.managed_count() == K and view.default == window[-1][0]
            for client in d.clients.values():  # all three live, pinned, on both engines
                ready = {m["name"] for m in (await client.status())["managed"] if m["state"] == "READY"}
                assert ready >= {c.lora_name for _, c in window}
            for key in sessions:  # every session still served by its own version
                served = await d.binder.generate(key, PROMPT, 2)
                assert served.output_ids

            # The fourth is refused at capacity by the registry, before any begin reaches an engine.
            v4, c4 = d.candidate("V4", "A")
            before = await d.audit()
            refused = await d.publisher.publish(v4, c4)
            assert (refused.status, refused.reason) == ("REJECTED", "CAPACITY_ERROR"), refused
            assert {e: a["managed_begin"] for e, a in (await d.audit()).items()} == {
                e: a["managed_begin"] for e, a in before.items()}

            # The oldest, V1, is not reclaimable while its session is open ...
            (v1, c1), s1 = window[0], sessions[0]
            not_yet = await d.reclaimer.reclaim(v1)
            assert (not_yet.status, not_yet.reason) == (ReclaimStatus.REJECTED, "NOT_RECLAIMABLE"), not_yet
            await d.binder.finish(s1)
            assert (await d.registry.publication_view()).versions[v1].session_refs == 0

            # ... nor unloaded while a request for it is still in flight on E0 (one the session layer sent before a
            # close it did not see): SGLang's native refcount holds V1 there. E0's scheduler is paused in place (the
            # request keeps its reference) so the reclaim lands while it holds V1, however slow the host.
            e0 = d.clients["E0"]
            late = asyncio.create_task(d.backend.generate(BackendRequest(
                "late/window", tuple(PROMPT), c1.lora_name, LATE_TOKENS, {"ignore_eos": True}, frozenset({"E0"}))))

            async def native(state: str | None = None) -> bool:
                view = next(m for m in (await e0.status())["managed"] if m["name"] == c1.lora_name)
                return int(view["native_refcount"]) == 1 and (state is None or view["state"] == state)

            await wait_until(native, timeout_s=60)
            await hold_scheduler(e0, True)
            try:
                unloads = {e: a["physical_unload"] for e, a in (await d.audit()).items()}
                reclaim = asyncio.create_task(d.reclaimer.reclaim(v1))
                await wait_until(lambda: native("DRAINING"), timeout_s=60)
                assert (await d.audit())["E0"]["physical_unload"] == unloads["E0"]  # not under a request
                assert not reclaim.done() and not late.done()
            finally:
                await hold_scheduler(e0, False)
            assert len((await late).output_ids) == LATE_TOKENS  # served to its end by V1
            outcome = await reclaim
            assert outcome.status is ReclaimStatus.RECLAIMED and set(outcome.confirmed) == {"E0", "E1"}, outcome
            after = {e: a["physical_unload"] for e, a in (await d.audit()).items()}
            assert after == {e: n + 1 for e, n in unloads.items()}  # V1 unloaded once per engine, after it ended

            # The window has room again: the fourth commits, and V2's and V3's sessions are served as before.
            assert (await d.publisher.publish(v4, c4)).committed
            view = await d.registry.publication_view()
            assert view.managed_count() == K and view.default == v4
            for key in sessions[1:]:
                assert (await d.binder.generate(key, PROMPT, 2)).output_ids
                await d.binder.finish(key)

    run(body())
