"""Unloads and cleanups need the registry's word (issue 19 part 1), on a real engine started with a capability
key, and end to end through the Ray registry actor, which reads the same key from its own file.

A forged, another version's, another epoch's, another action's and a missing capability are typed refusals
(403) that change nothing: the adapter stays READY, nothing is unloaded. A valid one is accepted. A restarted
engine checks them the same way. The test process never reads the key: a child process writes the key file,
the engine and the registry actor read it; the Publisher and the Reclaimer only pass on what the registry
answered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import PROMPT, TEST_ENGINE_ARGS, TEST_TOKEN, client_for, managed_view, publish_from_disk, run

from versioned_lora import capabilities
from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_process import (
    DEFAULT_PATCHES,
    EngineConfig,
    EngineProcess,
    free_port_block,
    start_all,
)
from versioned_lora.adapters.engine_staging import EngineStaging
from versioned_lora.adapters.ray_registry import RayRegistry, create_registry_actor
from versioned_lora.adapters.sglang_client import ManagedRefusal
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.capabilities import Action, mint
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import Publisher, PublishStatus
from versioned_lora.runtime.reclaimer import Reclaimer, ReclaimStatus
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.wire import SOURCE_ROOT_ENV, TOKEN_ENV, TOKEN_HEADER


@pytest.fixture(scope="module")
def keyed(fixtures: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, Path]]:
    """One engine started with a capability key file that a child process wrote (this process never reads it,
    except where a test forges with it on purpose: `_key`)."""
    directory = tmp_path_factory.mktemp("capability")
    key_file = directory / "capability.key"
    subprocess.run([sys.executable, "-c", "import sys, pathlib; from versioned_lora.capabilities import "
                    "write_key_file; write_key_file(pathlib.Path(sys.argv[1]))", str(key_file)], check=True)
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    config = EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(), log_path=directory / "keyed.log",
                          extra_args=TEST_ENGINE_ARGS,
                          env={TOKEN_ENV: TEST_TOKEN, capabilities.KEY_FILE_ENV: str(key_file),
                               SOURCE_ROOT_ENV: str(fixtures.root)})  # the disk-sourced begins read the fixtures
    (engine,) = start_all([config])
    try:
        yield engine, key_file
    finally:
        engine.stop()


def _key(key_file: Path) -> bytes:
    # Only to mint the valid and the near-miss capabilities this test sends by hand.
    return capabilities.parse_key(key_file.read_text())


async def _refusal(call: Any) -> tuple[int, str]:
    with pytest.raises(ManagedRefusal) as refused:
        await call
    return refused.value.status_code, refused.value.reason


async def _assert_every_wrong_capability_is_refused(client: Any, key: bytes, action: Action, staged: Any,
                                                    other: Any, reference: str, call: Any) -> None:
    name = staged.name
    wrong = {
        "missing": None,
        "forged": capabilities.PREFIX + "0" * 64,
        "garbage": "not-a-capability",
        "other_version": mint(key, action, other.name, reference),
        "other_epoch": mint(key, action, name.replace("relax_policy_lora@1-", "relax_policy_lora@2-"), reference),
        "other_action": mint(key, Action.RECLAIM if action is Action.CLEANUP else Action.CLEANUP, name, reference),
        "other_reference": mint(key, action, name, reference + "x"),
        "other_key": mint(bytes(32), action, name, reference),
    }
    before = (await managed_view(client, name), (await client.status())["audit"]["physical_unload"])
    for kind, capability in wrong.items():
        status, reason = await _refusal(call(capability))
        expected = "CAPABILITY_MISSING" if capability is None else "CAPABILITY_INVALID"
        assert (status, reason) == (403, expected), kind
        after = (await managed_view(client, name), (await client.status())["audit"]["physical_unload"])
        assert after == before, kind  # nothing changed


def test_a_keyed_engine_advertises_that_capabilities_are_required(keyed) -> None:
    engine, _ = keyed

    async def body() -> None:
        client = client_for(engine, sign=False)
        try:
            assert (await client.status())["protocol"]["capabilities_required"] is True
        finally:
            await client.aclose()

    run(body())


def test_a_default_engine_has_none_of_the_test_only_faults(keyed, fixtures) -> None:
    """The hold points and injected faults (the "test_faults" patch set, managed/hold_points.py) live only in engines a
    test starts with its flag (issue 41): this engine runs the default patch sets, so its status lists exactly
    those, shows no hold points, and the route that arms them does not exist (nothing can be armed)."""
    engine, _ = keyed

    async def body() -> None:
        client = client_for(engine, sign=False)
        try:
            status = await client.status()
            assert status["patch_sets"] == list(DEFAULT_PATCHES) and "test_faults" not in DEFAULT_PATCHES
            assert "hold_points" not in status
            name = lora_name(VersionKey(1, "hold"), "0" * 64)
            response = await client._http.post("/versioned_lora/test_hold", json={"point": "load", "lora_name": name},
                                               headers={TOKEN_HEADER: TEST_TOKEN})
            assert response.status_code == 404, response.text  # no such route
        finally:
            await client.aclose()

    run(body())


def test_reclaim_and_cleanup_need_a_valid_capability_for_that_exact_call(keyed, fixtures) -> None:
    engine, key_file = keyed
    key = _key(key_file)

    async def body() -> None:
        client = client_for(engine, sign=False)
        try:
            a = await publish_from_disk(client, fixtures.adapters["A"], "capA")
            b = await publish_from_disk(client, fixtures.adapters["B"], "capB")
            reclaim_id = f"reclaim-{uuid.uuid4().hex[:8]}"

            def reclaim(capability: str | None) -> Any:
                extra = {} if capability is None else {"capability": capability}
                return client.managed("reclaim", lora_name=a.name, reclaim_id=reclaim_id, wait_s=30, **extra)

            await _assert_every_wrong_capability_is_refused(client, key, Action.RECLAIM, a, b, reclaim_id, reclaim)
            done = await reclaim(mint(key, Action.RECLAIM, a.name, reclaim_id))
            assert done["adapter"]["state"] == "UNLOADED"

            def cleanup(capability: str | None) -> Any:
                extra = {} if capability is None else {"capability": capability}
                return client.managed("cleanup", lora_name=b.name, attempt_token=b.attempt_token, **extra)

            await _assert_every_wrong_capability_is_refused(client, key, Action.CLEANUP, b, a, b.attempt_token,
                                                            cleanup)
            cleaned = await cleanup(mint(key, Action.CLEANUP, b.name, b.attempt_token))
            assert cleaned["adapter"]["state"] == "CLEANED"
        finally:
            await client.aclose()

    run(body())


def test_the_registry_actor_signs_and_the_publisher_process_never_holds_the_key(keyed, fixtures, ray_cluster,
                                                                                tmp_path) -> None:
    engine, key_file = keyed
    assert capabilities.key_from_env() is None  # not in this (the publisher's and reclaimer's) process

    async def body() -> None:
        epoch = 40_000 + os.getpid() % 10_000
        handle = create_registry_actor(tmp_path / "registry.sqlite", name=f"registry-{uuid.uuid4().hex[:8]}",
                                       engines=("E0",), epoch=epoch, capability_key_file=key_file)
        registry = RayRegistry(handle)
        port = EngineStaging("E0", client_for(engine, sign=False), PROMPT, bucket_deadline_s=20.0)
        try:
            from versioned_lora.adapters.reference_forward import ReferenceModel, ReferenceProbeCheck

            probe = ReferenceProbeCheck(ReferenceModel(fixtures.model_dir), PROMPT)
            publisher = Publisher(registry, {"E0": port}, probe, Deadlines())
            reclaimer = Reclaimer(registry, {"E0": port}, Deadlines())
            await publisher.sync_incarnations()

            def candidate(label: str) -> tuple[VersionKey, Candidate]:
                snapshot = snapshot_from_adapter_dir(fixtures.adapters[label])
                version = VersionKey(epoch, label)
                return version, Candidate.build(lora_name(version, snapshot.digest), snapshot, 8 * 1024)

            a_version, a = candidate("A")
            b_version, b = candidate("B")
            assert (await publisher.publish(a_version, a)).committed
            assert (await publisher.publish(b_version, b)).committed
            reclaimed = await reclaimer.reclaim(a_version)  # the claim's answer carried the capability
            assert reclaimed.status is ReclaimStatus.RECLAIMED
            assert (await managed_view(port.client, a.lora_name))["state"] == "UNLOADED"  # type: ignore[index]

            c_version, c = candidate("C")
            publisher.probe_check = lambda *_: False  # a certain failure: abort, cleanup under the abort's word
            failed = await publisher.publish(c_version, c)
            assert failed.status is PublishStatus.FAILED_CLEAN
            assert (await managed_view(port.client, c.lora_name))["state"] == "CLEANED"  # type: ignore[index]
        finally:
            port.close()
            await port.client.aclose()
            import ray

            ray.kill(handle, no_restart=True)

    run(body())


def test_a_restarted_engine_checks_capabilities_the_same_way(keyed, fixtures) -> None:
    engine, key_file = keyed
    key = _key(key_file)
    engine.restart()

    async def body() -> None:
        client = client_for(engine, sign=False)
        try:
            a = await publish_from_disk(client, fixtures.adapters["A"], "capA2")
            b = await publish_from_disk(client, fixtures.adapters["B"], "capB2")
            reclaim_id = f"reclaim-{uuid.uuid4().hex[:8]}"

            def reclaim(capability: str | None) -> Any:
                extra = {} if capability is None else {"capability": capability}
                return client.managed("reclaim", lora_name=a.name, reclaim_id=reclaim_id, wait_s=30, **extra)

            await _assert_every_wrong_capability_is_refused(client, key, Action.RECLAIM, a, b, reclaim_id, reclaim)
            assert (await reclaim(mint(key, Action.RECLAIM, a.name, reclaim_id)))["adapter"]["state"] == "UNLOADED"
        finally:
            await client.aclose()

    run(body())

