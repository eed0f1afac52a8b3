"""Manifest versions through the whole stack (issue 20, part 3): a new publication is manifest v2, a version
published as v1 is still accepted, and after an engine restart a v1 version is rehydrated as v1.

Real Ray registry actor, two real patched SGLang engines, the Publisher and the SessionBinder (the tests'
deployment, `demo.Stack`). Every publication's probe is checked against the reference forward (the
Publisher's probe check), and the managed begin refuses a name whose digest part is not the manifest's, so a
name READY on an engine is that manifest's, accepted there.
"""

from __future__ import annotations

import json

from engine_helpers import PROMPT, run
from test_publication_e2e import assert_matches_reference, deployed

from versioned_lora.adapters.manifest import MANIFEST_FORMAT, MANIFEST_FORMAT_V2, V2_HASH
from versioned_lora.adapters.snapshot import snapshot_for_digest, snapshot_from_adapter_dir


async def ready_names(d) -> dict[str, set[str]]:  # type: ignore[no-untyped-def]
    return {name: {a["name"] for a in (await client.status())["managed"] if a["state"] == "READY"}
            for name, client in d.clients.items()}  # fmt: skip


def test_a_new_publication_is_manifest_v2_and_a_v1_version_is_still_accepted(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A", snapshot=snapshot_from_adapter_dir(fixtures.adapters["A"],
                                                                               hash_kind="sha256"))  # fmt: skip
            assert a.snapshot.manifest.format == MANIFEST_FORMAT
            assert "hash" not in json.loads(a.snapshot.manifest.to_json())
            assert (await d.publisher.publish(a_version, a)).committed

            b_version, b = d.candidate("B")  # the default: what every new publication is
            raw = json.loads(b.snapshot.manifest.to_json())
            assert (raw["format"], raw["hash"]) == (MANIFEST_FORMAT_V2, V2_HASH)
            outcome = await d.publisher.publish(b_version, b)
            assert outcome.committed, outcome
            view = await d.registry.publication_view()
            assert view.default == b_version and view.versions[b_version].digest == b.digest
            assert (await d.registry.dispatch_view([a_version, b_version]))[b_version].engines == {"E0", "E1"}
            ready = await ready_names(d)
            assert all({a.lora_name, b.lora_name} <= names for names in ready.values()), ready

            # A new session binds B (v2) and is served B's numbers (the reference forward of B's snapshot).
            session = d.binder.open("S-v2@E1")
            served = await d.binder.generate(session, PROMPT, 4)
            assert_matches_reference(d, "B", list(PROMPT), served.logprobs, served.output_ids)
            await d.binder.finish(session)

    run(body())


def test_a_version_published_as_v1_is_rehydrated_as_v1(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A", snapshot=snapshot_from_adapter_dir(fixtures.adapters["A"],
                                                                               hash_kind="sha256"))  # fmt: skip
            assert (await d.publisher.publish(a_version, a)).committed

            engines.e1.restart()  # a new incarnation: A is ABSENT there
            await d.publisher.sync_incarnations()
            assert (await d.registry.dispatch_view([a_version]))[a_version].engines == {"E0"}

            # The publisher side rebuilt from the source, as after its own restart: today's default is v2, whose
            # digest is another version's; the registry's digest gives back A's v1 manifest, byte for byte.
            rebuilt = snapshot_from_adapter_dir(fixtures.adapters["A"])
            digest = (await d.registry.publication_view()).versions[a_version].digest
            assert rebuilt.manifest.format == MANIFEST_FORMAT_V2 and rebuilt.digest != digest == a.digest
            again = snapshot_for_digest(rebuilt, digest)
            assert again.manifest.to_json_bytes() == a.snapshot.manifest.to_json_bytes()
            assert again.manifest.format == MANIFEST_FORMAT
            _, candidate = d.candidate("A", snapshot=again)
            assert candidate.lora_name == a.lora_name

            await d.publisher.rehydrate(a_version, candidate, "E1")
            assert (await d.registry.dispatch_view([a_version]))[a_version].engines == {"E0", "E1"}
            assert a.lora_name in (await ready_names(d))["E1"]
            before = d.backend.sent.copy()
            session = d.binder.open("S-rehydrated@E1")  # the tests' router sends '...@E1' sessions to E1
            served = await d.binder.generate(session, PROMPT, 4)
            assert (d.backend.sent["E1"] - before["E1"], d.backend.sent["E0"] - before["E0"]) == (1, 0)
            assert_matches_reference(d, "A", list(PROMPT), served.logprobs, served.output_ids)
            await d.binder.finish(session)

    run(body())
