"""Refusals that change something by design, or need a process of their own (issue 19):

- a candidate whose probe comes back non-finite is refused with PROBE_NOT_FINITE and cleaned again (its NaN
  weights pass the manifest, which checks bytes: built here past the snapshot builder's own check);
- a managed engine does not start without its token; `versioned-lora engine` writes a generated one 0600;
- `versioned-lora engine` invents no capability key (a clear error without one); `versioned-lora keygen` makes one;
- a disk-sourced begin inside the source root still works (the confinement refuses only what is outside).
"""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from pathlib import Path

import pytest
from conftest import Boundary
from engine_helpers import PROMPT, TEST_TOKEN, client_for, managed_view

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, EngineStartError, free_port_block
from versioned_lora.adapters.manifest import manifest_from_tensors
from versioned_lora.adapters.sglang_client import ManagedRefusal
from versioned_lora.adapters.snapshot import Snapshot
from versioned_lora.capabilities import KEY_ENV, KEY_FILE_ENV, key_id, parse_key
from versioned_lora.cli import NoCapabilityKey, engine_capability_key, engine_token, main
from versioned_lora.spec.identities import VersionKey, lora_name
from versioned_lora.spec.wire import TOKEN_ENV


def test_candidate_with_non_finite_probe_is_refused_and_cleaned(boundary: Boundary) -> None:
    tensors = {name: t.clone() for name, t in boundary.candidate.tensors.items()}
    for name in tensors:
        if "lora_B" in name:
            tensors[name].fill_(float("nan"))
    # The snapshot builder refuses these tensors (table.py, snapshot rows); a publisher that skipped it would
    # still meet the engine's own check.
    snapshot = Snapshot(tensors=tensors, manifest=manifest_from_tensors(tensors, boundary.candidate.serving_config))
    name = lora_name(VersionKey(1, f"nan-{uuid.uuid4().hex[:6]}"), snapshot.digest)
    candidate = Candidate.build(name, snapshot, 8 * 1024)
    attempt = f"attempt-{uuid.uuid4().hex[:8]}"

    async def body() -> None:
        async with client_for(boundary.engine) as client:
            link = await EngineLink.connect(client)
            try:
                await link.begin(candidate, attempt)
                for index in range(candidate.bucket_count):
                    await link.transfer_bucket(candidate, attempt, index)
                with pytest.raises(ManagedRefusal) as refused:
                    await link.end(candidate, attempt, PROMPT)
            finally:
                link.close()
            assert refused.value.reason == "PROBE_NOT_FINITE" and refused.value.status_code == 422
            assert name in str(refused.value)
            view = await managed_view(client, name)
            assert view is not None and view["state"] == "CLEANED" and view["pinned"] is False
            assert await client.adapter(name) is None  # unloaded from SGLang's registry
            staging = (await client.status())["staging"]
            assert attempt not in staging["stashes"]

    asyncio.run(body())
    assert boundary.serving() == boundary.baseline


def test_managed_engine_refuses_to_start_without_token(fixtures, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for token in ("", "short"):
        engine = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                            log_path=tmp_path / f"no-token-{len(token)}.log", env={TOKEN_ENV: token}))
        with pytest.raises(EngineStartError, match="MissingToken"):
            engine.start(timeout_s=240)
        assert engine._proc is not None and engine._proc.poll() is not None


def test_managed_engine_refuses_to_start_without_the_capability_key(fixtures, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                        log_path=tmp_path / "no-key.log", env={TOKEN_ENV: TEST_TOKEN}))
    with pytest.raises(EngineStartError, match="MissingCapabilityKey"):
        engine.start(timeout_s=240)
    assert engine._proc is not None and engine._proc.poll() is not None


def test_cli_engine_without_a_key_is_a_clear_error_and_invents_none(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One key per deployment (issue 41): `versioned-lora engine` no longer writes a key beside its log (two engines
    logging to two directories held two keys, and no registry could serve both); with no key it says how to give one,
    before anything is written or started."""
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    managed = ("cpu", "introspection", "managed")
    with pytest.raises(NoCapabilityKey, match=r"versioned-lora keygen PATH.*--capability-key-file PATH"):
        main(["engine", "--port", "1", "--model", str(tmp_path), "--log", str(tmp_path / "e0.log")])
    assert list(tmp_path.iterdir()) == []  # no key, no token file: nothing written
    assert engine_capability_key(managed, "/keys/k") == {KEY_FILE_ENV: "/keys/k"}
    assert engine_capability_key(("cpu", "introspection"), None) == {}  # no managed patch set: no key needed
    monkeypatch.setenv(KEY_FILE_ENV, "/from/the/environment")
    assert engine_capability_key(managed, None) == {}  # the engine inherits it


def test_cli_keygen_writes_a_key_readable_by_its_owner_only_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys" / "deployment.key"
    assert main(["keygen", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = parse_key(path.read_text())
    assert len(key) == 32 and key_id(key) in capsys.readouterr().out  # the id is printed, never the key
    assert main(["keygen", str(path)]) == 1 and parse_key(path.read_text()) == key  # refused: the key stays
    assert "exists" in capsys.readouterr().err


def test_cli_generates_a_token_file_readable_by_its_owner_only(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    log = tmp_path / "engine.log"
    env, written = engine_token(("cpu", "introspection", "managed"), log)
    assert written == tmp_path / "engine.log.token"
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    token = written.read_text().strip()
    assert env == {TOKEN_ENV: token} and len(token) == 64 and int(token, 16) >= 0
    again, _ = engine_token(("cpu", "introspection", "managed"), log)
    assert again[TOKEN_ENV] != token  # a new engine start, a new token
    assert engine_token(("cpu", "introspection"), log) == ({}, None)  # no managed endpoints, no token
    monkeypatch.setenv(TOKEN_ENV, "given-by-the-operator-0123")
    assert engine_token(("managed",), log) == ({TOKEN_ENV: "given-by-the-operator-0123"}, None)


def test_disk_begin_inside_the_source_root_still_stages(boundary: Boundary, scratch_dir: Path) -> None:
    """The confinement refuses paths outside the root (table.py); a copy of C inside it stages, then is cleaned."""
    import shutil

    for item in boundary.candidate_dir.iterdir():
        shutil.copy2(item, scratch_dir / item.name)
    name = lora_name(VersionKey(1, f"inroot-{uuid.uuid4().hex[:6]}"), boundary.candidate.digest)
    attempt = f"attempt-{uuid.uuid4().hex[:8]}"

    async def body() -> None:
        async with client_for(boundary.engine) as client:
            inc = (await client.status())["incarnation"]
            begun = await client.managed("begin", lora_name=name, attempt_token=attempt, incarnation=inc,
                                         digest=boundary.candidate.digest,
                                         manifest=boundary.candidate.manifest.to_json(), source_path=str(scratch_dir))
            assert begun["adapter"]["state"] == "STAGING"
            cleaned = await client.managed("cleanup", lora_name=name, attempt_token=attempt)
            assert cleaned["adapter"]["state"] == "CLEANED"

    asyncio.run(body())

