"""What `status` lists as blocking, for the registry states a live publication passes through only briefly: a
real `RegistryCore` (SQLite journal) stepped through the table's own events, and an engine whose port nobody
listens on (read over real HTTP). No Ray, no SGLang."""

from __future__ import annotations

import asyncio
import hashlib
import socket

from lease_helpers import fence

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.lifecycle import Abort, RecordUnknown, Reserve, VersionKey
from versioned_lora.ops.status_view import BlockingKind, read_engine, status_rows

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # bound and released: nothing listens there


def kinds(core: RegistryCore, readings: list) -> list[tuple[str, str | None, str | None]]:  # type: ignore[type-arg]
    rows = status_rows(core.publication_view(), core.operations_view(), readings)
    return [(b["kind"], b["version"], b["engine"]) for b in rows["blocking"]]


def test_staging_aborted_unknown_and_unreachable_are_each_listed_with_what_to_run(tmp_path) -> None:
    core = RegistryCore(tmp_path / "journal.sqlite", engines=("E0", "E1"), capacity=2, epoch=7, insecure=True)
    digest = hashlib.sha256(b"A").hexdigest()
    a = VersionKey(7, "A")
    reserved = core.submit("reserve:A", Reserve(a, digest, fence(core)))
    assert kinds(core, []) == [(BlockingKind.PUBLICATION_IN_FLIGHT, "A", None)]

    async def unreachable() -> object:
        async with SGLangClient(closed_port_url(), timeout_s=5.0) as client:
            return await read_engine("E1", client)

    reading = asyncio.run(unreachable())
    assert reading.status is None and reading.error
    assert kinds(core, [reading]) == [(BlockingKind.PUBLICATION_IN_FLIGHT, "A", None),
                                      (BlockingKind.ENGINE_UNREACHABLE, None, "E1")]

    token = reserved.result.attempt_token
    core.submit("unknown:A:E1", RecordUnknown(a, token, "E1"))  # E1's outcome could not be confirmed
    rows = status_rows(core.publication_view(), core.operations_view(), [])
    assert [(b["kind"], b["engine"], b["run"]) for b in rows["blocking"]] == [
        (BlockingKind.OUTCOME_UNKNOWN, "E1", "versioned-lora resolve"),
        (BlockingKind.PUBLICATION_IN_FLIGHT, None, "versioned-lora resolve")]
    assert rows["versions"][0]["placements"]["E1"]["state"] == "UNKNOWN"
    core.submit("abort:A", Abort(a, token))
    rows = status_rows(core.publication_view(), core.operations_view(), [])
    assert [(b["kind"], b["version"]) for b in rows["blocking"]] == [(BlockingKind.CLEANUP_PENDING, "A")]
    assert rows["blocking"][0]["detail"] == "A was aborted; cleanup not confirmed by E0, E1"
    assert rows["registry"]["capacity"] == {"used": 1, "total": 2}
    core.close()
