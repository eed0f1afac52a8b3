"""`versioned-lora registry`: a registry started from the command line records the engines' URLs, so `status`,
`publish` and `reclaim` need only its address and name, or only the profile it wrote (`--write-profile`: the
connection settings written once); real Ray, the session's two real engines, child processes. In the foreground it
serves until SIGINT and stops without a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid

import ray
from engine_helpers import capability_key_file, client_for, run
from ops_helpers import cli, token_file

from versioned_lora import stop_registry
from versioned_lora.ops.commands import Exit


def test_a_detached_registry_is_used_with_only_its_address_or_its_profile_by_status_publish_and_reclaim(
    engines, fixtures, tmp_path
) -> None:
    address = ray.get_runtime_context().gcs_address
    name = f"cli-registry-{uuid.uuid4().hex[:8]}"
    where = ["--address", address, "--name", name]
    profile = tmp_path / "deployment.toml"

    async def body() -> None:
        started = await cli("registry", "--journal", str(tmp_path / "registry.sqlite"), "--engines",
                            f"E0={engines.e0.url},E1={engines.e1.url}", "--key-file", str(capability_key_file()),
                            "--detach", *where, "--write-profile", str(profile),
                            "--token-file", str(token_file(tmp_path)))
        assert started.code == 0, started.stdout + started.stderr
        info = json.loads(next(line for line in started.stdout.splitlines()
                               if line.startswith("REGISTRY "))[len("REGISTRY "):])
        assert info["engines"] == {"E0": engines.e0.url, "E1": engines.e1.url} and info["detached"] is True
        epoch = info["epoch"]
        try:
            status = await cli("status", "--json", *where)  # no --engines: the registry recorded them
            assert status.code == 0, status.stdout + status.stderr
            assert [e["name"] for e in status.json()["engines"]] == ["E0", "E1"]
            # Everything else from the profile alone: the address, the actor's name, the token file.
            assert f'name = "{name}"' in profile.read_text() and "token_file" in profile.read_text()
            for adapter, version_id in (("A", "v1"), ("B", "v2")):
                published = await cli("publish", str(fixtures.adapters[adapter]), "--version-id", version_id,
                                      "--profile", str(profile))
                assert published.code == Exit.OK, published.stdout + published.stderr
                assert published.receipt()["epoch"] == epoch
            reclaimed = await cli("reclaim", "--profile", str(profile))  # v1: RETIRED, no session ever held it
            assert reclaimed.code == Exit.OK, reclaimed.stdout + reclaimed.stderr
            assert [(r["version_id"], r["status"]) for r in reclaimed.receipt()["reclaims"]] == [("v1", "RECLAIMED")]
        finally:
            for url in (engines.e0.url, engines.e1.url):  # test teardown: free the slots for later tests
                async with client_for(url) as client:
                    for adapter in (await client.status())["managed"]:
                        if adapter["state"] in ("READY", "STAGING") and f"@{epoch}-" in adapter["name"]:
                            await client.managed("reclaim", lora_name=adapter["name"], reclaim_id="teardown",
                                                 wait_s=60)
            stop_registry(name, address=None)

    run(body())


def test_a_foreground_registry_serves_until_sigint_and_stops_without_a_traceback(engines, tmp_path) -> None:
    address = ray.get_runtime_context().gcs_address
    name = f"fg-registry-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}

    async def body() -> tuple[int, str, str, list[str]]:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "versioned_lora.cli", "registry", "--journal", str(tmp_path / "fg.sqlite"),
            "--engines", f"{engines.e0.url},{engines.e1.url}", "--key-file", str(capability_key_file()),
            "--address", address, "--name", name,
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        lines = []
        while True:  # until it says where it runs (or it ended)
            line = (await child.stdout.readline()).decode()
            lines.append(line)
            if not line or line.startswith("REGISTRY "):
                break
        status = await cli("status", "--json", "--address", address, "--name", name)
        assert status.code == 0, status.stdout + status.stderr
        child.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode is not None
        return child.returncode, "".join(lines) + out.decode(), err.decode(), [status.stdout]

    code, out, err, _ = run(body())
    assert code == 0, out + err
    assert "Traceback" not in out + err and "registry stopped" in out, out + err
    gone = run(cli("status", "--json", "--address", address, "--name", name))
    assert gone.code == Exit.ERROR and f"no registry actor {name!r}" in gone.stderr, gone.stderr
