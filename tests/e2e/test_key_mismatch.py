"""One key per deployment, checked before anything moves (issue 41, item 4), against the two real engines: the
session's engines were started with the suite's key; a registry started with another key is a deployment whose
registry cannot sign anything those engines accept. Every port compares the registry's key id (in its answers)
with the engine's (in `/versioned_lora/status`) before its first call to an engine incarnation: a mismatch is
`KEY_MISMATCH`, naming both ids, before any `begin`, cleanup or reclaim reaches the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deployment import Deployment
from engine_helpers import capability_key_file, client_for, run

from versioned_lora.capabilities import key_id, parse_key, write_key_file
from versioned_lora.runtime.interfaces import EngineRefused
from versioned_lora.spec.states import VersionState


class RefusalsSeen:
    """A real engine port, observed: the reason of every refusal its reclaims raised (the port's or the engine's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.refused: list[str] = []

    async def reclaim(self, *args: Any, **kwargs: Any) -> bool:
        try:
            return bool(await self.inner.reclaim(*args, **kwargs))
        except EngineRefused as refused:
            self.refused.append(refused.reason)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_registry_with_another_key_is_refused_key_mismatch_before_any_begin(
    engines, fixtures, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    other_key = write_key_file(tmp_path / "other.key")

    async def body() -> None:
        d = Deployment(engines, fixtures, tmp_path, key_file=other_key)
        try:
            await d.publisher.sync_incarnations()
            a_version, a = d.candidate("A")
            before = await d.audit()
            refused = await d.publisher.publish(a_version, a)
            assert refused.status != "COMMITTED" and refused.detail.startswith("KEY_MISMATCH: engine E"), refused
            after = await d.audit()
            assert {e: c["managed_begin"] for e, c in after.items()} == {
                e: c["managed_begin"] for e, c in before.items()}  # no begin reached either engine
            # Both ids named (never a key): the engine's, as its status advertises it, and the registry's.
            engine_id = key_id(parse_key(capability_key_file().read_text()))
            registry_id = key_id(parse_key(other_key.read_text()))
            assert engine_id in refused.detail and registry_id in refused.detail, refused.detail
            for client in d.clients.values():
                protocol = (await client.status())["protocol"]
                assert (protocol["key_id"], protocol["key_ids"]) == (engine_id, [engine_id])
            assert await d.registry.key_ids() == (registry_id,)
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is not VersionState.PUBLISHED and view.default is None, view
            for client in d.clients.values():  # nothing staged: no stash, no managed adapter of this epoch
                status = await client.status()
                assert not [m for m in status["managed"] if str(d.epoch) in m["name"]], status["managed"]
        finally:
            for deployment_client in d.clients.values():  # teardown (not the protocol), signed with the suite's key
                async with client_for(deployment_client.base_url) as client:
                    for adapter in (await client.status())["managed"]:
                        if adapter["state"] in ("READY", "STAGING") and str(d.epoch) in adapter["name"]:
                            await client.managed("reclaim", lora_name=adapter["name"], reclaim_id="teardown",
                                                 wait_s=60)
            await d.close()

    run(body())


def test_a_reclaim_by_a_registry_of_another_key_is_refused_key_mismatch_before_the_engine_is_asked(
    engines, fixtures, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    """A version the registry (another key) holds published on both engines, claimed: each reclaim is refused by
    the port, KEY_MISMATCH, not by the engine (which would answer CAPABILITY_INVALID to a capability it cannot
    verify): the engine is never asked."""
    import hashlib

    from lease_helpers import fence

    from versioned_lora.adapters.engine_staging import staging_ports
    from versioned_lora.adapters.ray_registry import LocalRegistry
    from versioned_lora.adapters.registry_core import RegistryCore
    from versioned_lora.capabilities import new_key, parse_key
    from versioned_lora.lifecycle import Commit, RecordPrepared, RecordReady, Reserve, VersionKey
    from versioned_lora.runtime.reclaimer import Reclaimer

    core = RegistryCore(tmp_path / "j.sqlite", capability_key=parse_key(new_key()))
    lease = fence(core)
    version = VersionKey(0, "A")
    for revision, label in enumerate("AB"):  # A published, then retired by B: reclaimable
        key, digest = VersionKey(0, label), hashlib.sha256(label.encode()).hexdigest()
        token = core.submit(f"reserve:{label}", Reserve(key, digest, lease)).result.attempt_token  # type: ignore[union-attr]
        for engine in ("E0", "E1"):
            core.submit(f"p:{label}:{engine}", RecordPrepared(key, token, engine, 0, digest))
            core.submit(f"r:{label}:{engine}", RecordReady(key, token, engine, 0, digest))
        core.submit(f"commit:{label}", Commit(key, token, revision, lease))

    async def body() -> None:
        clients = {name: client_for(engine, sign=False) for name, engine in zip(("E0", "E1"), engines, strict=True)}
        ports = {name: RefusalsSeen(port) for name, port in staging_ports(clients, [1, 2, 3]).items()}
        outcome = await Reclaimer(LocalRegistry(core), ports).reclaim(version)
        assert outcome.status == "PENDING" and outcome.confirmed == (), outcome  # claimed; no engine unloaded
        assert {name: port.refused for name, port in ports.items()} == {
            "E0": ["KEY_MISMATCH"], "E1": ["KEY_MISMATCH"]}  # refused by the port, not by the engine
        for client in clients.values():
            await client.aclose()

    run(body())
