"""`versioned-lora status --json` after each step of the demo's scenario, from a child process, against the
registry's raw `publication_view()`, each engine's raw `/versioned_lora/status`, and what the scenario knows
it produced. The expected rows are built here from the raw payloads, not by the shared view code
(`versioned_lora/ops/status_view.py`) the command uses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

from engine_helpers import run
from ops_helpers import cli, connection_args
from test_publication_e2e import deployed

from versioned_lora.lifecycle import ClaimReclaim
from versioned_lora.spec.states import VersionState


def raw_versions(view: Any) -> dict[str, dict[str, Any]]:
    """A RECLAIMED version's placements read UNLOADED (every engine confirmed its unload to get there)."""
    return {
        key.version_id: {
            "version_id": key.version_id, "epoch": key.epoch, "lora_name": v.lora_name, "digest_prefix": v.digest[:12],
            "state": str(v.state), "default": key == view.default, "session_refs": v.session_refs,
            "attempt_token": v.attempt_token, "reclaim_id": v.reclaim_id,
            "placements": {e: {"state": "UNLOADED" if v.state is VersionState.RECLAIMED else str(p.state),
                               "incarnation": p.incarnation, "attempt_token": p.attempt_token}
                           for e, p in v.placements.items()},
        }
        for key, v in view.versions.items()
    }


def raw_adapters(status: dict[str, Any], view: Any = None) -> dict[str, dict[str, Any]]:
    """Per adapter name: SGLang's LoRARegistry entry (lora_id, pinned, refcount) and the managed state. With
    `view` (status without --all): a managed adapter that holds no slot (UNLOADED, CLEANED, ABSENT) and names no
    version of the view is left out; the engines here also hold earlier tests' unloaded versions."""
    native = {a["name"]: a for a in status["adapters"]}
    managed = {a["name"]: a for a in status["managed"]}
    if view is not None:
        names = {v.lora_name for v in view.versions.values()}
        managed = {n: a for n, a in managed.items()
                   if n in native or n in names or a["state"] not in ("UNLOADED", "CLEANED", "ABSENT")}
    return {
        name: {
            "name": name,
            "lora_id": native[name]["lora_id"] if name in native else managed[name]["lora_id"],
            "pinned": native[name]["pinned"] if name in native else managed[name]["pinned"],
            "native_refcount": native[name]["refcount"] if name in native else managed[name]["native_refcount"],
            "managed_state": managed[name]["state"] if name in managed else None,
        }
        for name in native.keys() | managed.keys()
    }


async def check_against_raw(d: Any, tmp_path: Any, *flags: str) -> dict[str, Any]:
    """Run `status --json`; require every row to equal the raw registry and engine state read right after."""
    out = await cli("status", "--json", *flags, *connection_args(d, tmp_path, token=False))
    assert out.code == 0, out.stderr
    rows = out.json()
    everything = "--all" in flags
    view = await d.registry.publication_view(everything)
    assert rows["registry"]["default_revision"] == view.default_revision
    assert rows["registry"]["engines"] == list(view.engines)
    assert rows["registry"]["incarnations"] == dict(view.incarnations)
    lease = rows["registry"]["lease"]
    assert (lease["holder"], lease["fence"]) == (view.lease_holder, view.lease_fence)
    expected = raw_versions(view)
    got = {v["version_id"]: {k: x for k, x in v.items() if k != "reclaim_confirmed"} for v in rows["versions"]}
    assert got == expected
    for engine, client in d.clients.items():
        status = await client.status()
        row = next(e for e in rows["engines"] if e["name"] == engine)
        assert row["reachable"] and row["url"] == client.base_url
        assert row["incarnation"] == status["incarnation"] and row["pid"] == status["pid"]
        assert row["registry_incarnation"] == view.incarnations[engine]
        assert {a["name"]: a for a in row["adapters"]} == raw_adapters(status, None if everything else view)
    return rows


def adapter_row(rows: dict[str, Any], engine: str, lora_name: str) -> dict[str, Any] | None:
    engine_row = next(e for e in rows["engines"] if e["name"] == engine)
    return next((a for a in engine_row["adapters"] if a["name"] == lora_name), None)


def corrupt_transfers_to(d: Any, engine: str, candidate: Any) -> Any:
    """Fault injection (as the demo's step 5): `engine`'s port sends one altered element of the first tensor
    under the candidate's unchanged manifest. Returns the function that restores the port."""
    port = d.ports[engine]
    tensors = dict(candidate.snapshot.tensors)
    first = candidate.plan.buckets[0].slots[0].name
    altered = tensors[first].clone()
    altered.view(-1)[0] += 1.0
    tensors[first] = altered
    original = port.transfer_bucket

    async def corrupted(cand: Any, attempt_token: str, index: int) -> None:
        link = await port.link()
        await port._call(link.transfer_bucket(cand, attempt_token, index, tensors=tensors))

    port.transfer_bucket = corrupted

    def restore() -> None:
        port.transfer_bucket = original

    return restore


def test_status_json_after_each_demo_step_equals_raw_state_and_the_scenario_with_injected_corrupt_bytes(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            c_version, c = d.candidate("C")
            incarnations = {e: (await client.status())["incarnation"] for e, client in d.clients.items()}

            # 1. bootstrap A
            assert (await d.publisher.publish(a_version, a)).committed
            rows = await check_against_raw(d, tmp_path)
            assert rows["registry"]["epoch"] == d.epoch
            assert rows["registry"]["default"] == {"version_id": "A", "lora_name": a.lora_name}
            assert rows["registry"]["capacity"] == {"used": 1, "total": 2}
            (row_a,) = rows["versions"]
            assert (row_a["state"], row_a["digest_prefix"], row_a["session_refs"]) == ("PUBLISHED", a.digest[:12], 0)
            assert {e: (p["state"], p["incarnation"]) for e, p in row_a["placements"].items()} == {
                e: ("READY", incarnations[e]) for e in ("E0", "E1")}
            for engine in ("E0", "E1"):
                assert adapter_row(rows, engine, a.lora_name) | {"lora_id": None} == {
                    "name": a.lora_name, "lora_id": None, "pinned": True, "native_refcount": 0,
                    "managed_state": "READY"}
            assert rows["blocking"] == [] and rows["reclaims"] == []

            # 2. a session binds A
            session = d.binder.open("S_ops@E0")
            assert (await d.binder.bind_first(session)).version == a_version
            rows = await check_against_raw(d, tmp_path)
            assert rows["versions"][0]["session_refs"] == 1 and rows["registry"]["open_sessions"] == 1

            # 3. publish B: the default moves, A keeps its session ref, every slot is held
            assert (await d.publisher.publish(b_version, b)).committed
            rows = await check_against_raw(d, tmp_path)
            assert rows["registry"]["default"]["version_id"] == "B"
            assert [(v["version_id"], v["state"], v["session_refs"]) for v in rows["versions"]] == [
                ("A", "RETIRED", 1), ("B", "PUBLISHED", 0)]
            assert rows["registry"]["capacity"] == {"used": 2, "total": 2}
            assert [(x["kind"], x["run"]) for x in rows["blocking"]] == [("CAPACITY_FULL", "versioned-lora reclaim")]
            assert "no retired version is free of sessions yet" in rows["blocking"][0]["detail"]

            # 4. C is refused at capacity: nothing about it is stored
            outcome = await d.publisher.publish(c_version, c)
            assert (outcome.status, outcome.reason) == ("REJECTED", "CAPACITY_ERROR")
            rows = await check_against_raw(d, tmp_path)
            assert [v["version_id"] for v in rows["versions"]] == ["A", "B"]

            # 5. the session ends: A is free of sessions, the capacity row names it
            assert (await d.binder.finish(session)).released
            rows = await check_against_raw(d, tmp_path)
            assert rows["versions"][0]["session_refs"] == 0 and rows["registry"]["open_sessions"] == 0
            assert "retired with no session refs: A" in rows["blocking"][0]["detail"]

            # 6. A is claimed (the Reclaimer's own claim call), no engine has unloaded yet: a reclaim in progress
            claim = await d.registry.submit(ClaimReclaim(a_version), key=f"claim:{d.epoch}:A")
            rows = await check_against_raw(d, tmp_path)
            assert rows["reclaims"] == [{"version_id": "A", "reclaim_id": claim.result.reclaim_id,
                                         "state": "RECLAIMING",
                                         "engines": {e: {"confirmed": False, "managed_state": "READY"}
                                                     for e in ("E0", "E1")}}]
            assert [(x["kind"], x["version"], x["run"]) for x in rows["blocking"]] == [
                ("RECLAIM_PENDING", "A", "versioned-lora reclaim --version A"), ("CAPACITY_FULL", None,
                                                                                 "versioned-lora reclaim")]
            finished = await cli("reclaim", "--version", "A", *connection_args(d, tmp_path))
            assert finished.code == 0, finished.stdout + finished.stderr
            rows = await check_against_raw(d, tmp_path)
            assert rows["versions"][0]["state"] == "RECLAIMED"
            assert rows["versions"][0]["reclaim_confirmed"] == ["E0", "E1"]
            assert {adapter_row(rows, e, a.lora_name)["managed_state"] for e in ("E0", "E1")} == {"UNLOADED"}
            assert rows["reclaims"] == [] and rows["blocking"] == []
            assert rows["registry"]["capacity"] == {"used": 1, "total": 2}
            assert {p["state"] for p in rows["versions"][0]["placements"].values()} == {"UNLOADED"}
            every = await check_against_raw(d, tmp_path, "--all")  # every adapter the engines report
            assert every["versions"] == rows["versions"] and every["registry"]["versions_left_out"] == 0

            # 7. C with altered bytes to E1 (injected): refused at end, aborted, cleaned on both engines
            restore = corrupt_transfers_to(d, "E1", c)
            try:
                outcome = await d.publisher.publish(c_version, c)
            finally:
                restore()
            assert outcome.status == "FAILED_CLEAN", outcome
            rows = await check_against_raw(d, tmp_path)
            row_c = next(v for v in rows["versions"] if v["version_id"] == "C")
            assert row_c["state"] == str(VersionState.FAILED_CLEAN) and row_c["digest_prefix"] == c.digest[:12]
            assert {p["state"] for p in row_c["placements"].values()} == {"CLEANED"}
            assert rows["registry"]["capacity"] == {"used": 1, "total": 2} and rows["blocking"] == []
            assert rows["registry"]["default"]["version_id"] == "B"

    run(body())


def test_status_terminal_table_names_versions_engines_and_what_blocks(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            session = d.binder.open("S_table@E1")
            await d.binder.bind_first(session)
            assert (await d.publisher.publish(b_version, b)).committed
            out = await cli("status", *connection_args(d, tmp_path, token=False))
            assert out.code == 0, out.stderr
            text = out.stdout
            assert f"epoch {d.epoch}" in text and "default B (revision 2)" in text and "capacity 2/2" in text
            assert a.lora_name in text and b.lora_name in text and a.digest[:12] in text
            assert "CAPACITY_FULL" in text and "RETIRED" in text and "PUBLISHED" in text
            await d.binder.finish(session)

    run(body())


def test_status_watch_refreshes_until_interrupted(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
            # A plain Popen read by threads, not asyncio's subprocess: twice in the full suite the child exited
            # (on SIGINT) and asyncio never reported it, and the test waited until pytest-timeout's signal.
            with (tmp_path / "watch.stderr").open("w") as stderr:
                child = subprocess.Popen(
                    [sys.executable, "-m", "versioned_lora.cli", "status", "--watch", "--interval", "0.5",
                     *connection_args(d, tmp_path, token=False)],
                    env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
            seen = ""

            async def read_until(text: str) -> None:
                nonlocal seen
                assert child.stdout is not None
                while text not in seen:
                    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 120)
                    if not line:  # the child exited: say what it printed, rather than read an empty pipe forever
                        raise AssertionError(f"status --watch ended before {text!r}: {seen[-2000:]}")
                    seen += line

            # The child's refreshes are read while B is published: a pipe nobody reads fills, and the child
            # would block on its write.
            reader: asyncio.Task[None] | None = None
            try:
                await read_until("default A (revision 1)")
                reader = asyncio.create_task(read_until("default B (revision 2)"))  # a later refresh
                assert (await asyncio.wait_for(d.publisher.publish(b_version, b), 300)).committed
                await asyncio.wait_for(reader, 120)
                # Keep draining its output until it ends: a child blocked writing to a full pipe nobody reads
                # never gets back to its event loop, and Ctrl-C (asyncio's SIGINT handler) waits for that loop.
                assert child.stdout is not None
                rest = asyncio.create_task(asyncio.to_thread(child.stdout.read))
                child.send_signal(signal.SIGINT)
                assert await asyncio.to_thread(child.wait, 60) == 0
                seen += await asyncio.wait_for(rest, 60)
            finally:
                if reader is not None and not reader.done():
                    reader.cancel()
                if child.poll() is None:
                    child.kill()
                    child.wait(30)
            assert seen.count("--- ") >= 2

    run(body())


def test_status_refuses_an_unknown_registry_name_with_a_typed_error(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            args = connection_args(d, tmp_path, token=False)
            args[args.index("--name") + 1] = "no-such-registry"
            out = await cli("status", "--json", *args)
            assert out.code == 1 and "no registry actor 'no-such-registry'" in out.stderr, out.stderr
            args = connection_args(d, tmp_path, token=False)
            args[args.index("--engines") + 1] = d.clients["E0"].base_url  # one URL for a two-engine registry
            out = await cli("status", "--json", *args)
            assert out.code == 1 and "gives 1 URL(s); the registry has 2 engines" in out.stderr, out.stderr

    run(body())
