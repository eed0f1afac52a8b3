"""The trainer-facing API on a fresh deployment (real Ray, the session's two real engines, a registry the API
starts): publish a directory and a live PEFT model, sessions pinned to their version across tool turns, a typed
capacity refusal, a wait for a slot that the reclaim loop frees, every retired version reclaimed. The caller's
code (`trainer_api_caller.py`) imports only the package's top level."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

from engine_helpers import capability_key_file, client_for, run
from ops_helpers import token_file
from trainer_api_caller import run as caller_run

from versioned_lora import Outcome, stop_registry


def test_the_caller_imports_nothing_from_adapters_lifecycle_or_spec() -> None:
    tree = ast.parse((Path(__file__).parent / "trainer_api_caller.py").read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {m for m in modules if m.split(".")[0] == "versioned_lora"}
    assert ours == {"versioned_lora"}, ours


def test_a_trainer_publishes_through_the_top_level_api_on_a_fresh_deployment(engines, fixtures, tmp_path) -> None:
    registry = f"trainer-api-{uuid.uuid4().hex[:8]}"
    urls = [engines.e0.url, engines.e1.url]

    async def body() -> dict:  # type: ignore[type-arg]
        try:
            return await caller_run(journal=tmp_path / "registry.sqlite", engines=urls,
                                    token_file=token_file(tmp_path), key_file=capability_key_file(),
                                    model_dir=fixtures.model_dir, adapters=fixtures.adapters, registry=registry)
        finally:
            # Test teardown (not the protocol): unload what this deployment left, so later tests find free slots.
            for url in urls:
                async with client_for(url) as client:
                    for adapter in (await client.status())["managed"]:
                        if adapter["state"] in ("READY", "STAGING") and f"@{epoch_of(tmp_path)}-" in adapter["name"]:
                            await client.managed("reclaim", lora_name=adapter["name"], reclaim_id="teardown",
                                                 wait_s=60)

    try:
        seen = run(body())
    finally:
        stop_registry(registry, address=None)
    assert seen["v1"].outcome is Outcome.COMMITTED and seen["v2"].outcome is Outcome.COMMITTED, seen
    refused = seen["v3_refused"]
    assert (refused.outcome, refused.code) == (Outcome.REFUSED, "CAPACITY_ERROR"), refused
    assert seen["v3"].outcome is Outcome.COMMITTED, seen["v3"]
    assert seen["default"] == "v3"
    first_version, first_names = seen["sessions"]["first"]
    second_version, second_names = seen["sessions"]["second"]
    assert (first_version, len(first_names)) == ("v1", 1) and (second_version, len(second_names)) == ("v2", 1)
    assert first_names[0] == seen["v1"].lora_name and second_names[0] == seen["v2"].lora_name
    assert seen["reclaimed"] is True
    # The phases were reported under the version being published (the callback's first argument).
    assert ("v1", "commit") in seen["phases"] and ("v3", "commit") in seen["phases"]


def epoch_of(tmp_path: Path) -> int:
    from versioned_lora.adapters.ray_registry import recorded_epoch

    epoch = recorded_epoch(tmp_path / "registry.sqlite")
    assert epoch is not None
    return epoch
