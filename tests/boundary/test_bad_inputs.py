"""Every row of table.py against the real engines and the real Ray registry actor (issue 19).

Each case asserts: a typed error whose reason is the row's and that names what was wrong; E0's status and the
registry's state equal before and after; E0 still serving, with the same greedy logprobs for the managed version
and the base model as before the suite. The summary test (last in this module) prints
``bad_input_kinds=N typed=T unchanged=U crashed=0`` and checks that no engine logged an unretrieved task exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import torch
from conftest import REGISTRY_EPOCH, Boundary, log_text_since
from engine_helpers import PROMPT, TEST_TOKEN, client_for, publish_from_disk
from table import DROP, ROWS, Row

from versioned_lora.adapters.manifest import manifest_from_tensors
from versioned_lora.adapters.snapshot import SnapshotError, snapshot_from_tensors
from versioned_lora.adapters.transfer import BucketPlan
from versioned_lora.lifecycle import Reserve, VersionKey
from versioned_lora.spec.identities import InvalidIdentity, lora_name
from versioned_lora.spec.wire import TOKEN_HEADER

MANAGED = {"begin", "receive_bucket", "end", "cleanup", "reclaim", "init_group"}
RESULTS: dict[str, dict[str, bool]] = {}


@attrs.frozen
class Outcome:
    status: int | None
    reason: str | None
    field: str | None
    message: str


# ---------------------------------------------------------------- requests of each endpoint


def _fresh(ctx: Boundary, digest: str) -> str:
    return lora_name(VersionKey(1, "bnd-fresh"), digest)


def _bases(ctx: Boundary) -> dict[str, dict[str, Any]]:
    inc = ctx.m.incarnation
    c = ctx.candidate
    begin = {"lora_name": _fresh(ctx, c.digest), "attempt_token": "bnd-attempt", "incarnation": inc,
             "digest": c.digest, "manifest": c.manifest.to_json(), "source_path": str(ctx.candidate_dir)}
    dist = {k: v for k, v in begin.items() if k != "source_path"}
    dist.update(max_bucket_bytes=1 << 20, plan_digest=BucketPlan.build(c.manifest, 1 << 20).digest(),
                group_name=f"vlora-{inc}-bnd", bucket_deadline_s=5.0)
    m = {"lora_name": ctx.m.name, "attempt_token": ctx.m.attempt_token, "incarnation": inc}
    return {
        "begin": begin,
        "begin_dist": dist,
        "end": {**m, "probe_input_ids": list(PROMPT)},
        "receive_bucket": {**m, "index": 0},
        "cleanup": {"lora_name": ctx.m.name, "attempt_token": "bnd-other-attempt"},
        "reclaim": {"lora_name": ctx.m.name, "reclaim_id": "bnd-reclaim", "wait_s": 0},
        "init_group": {"group_name": f"vlora-{inc}-bnd", "master_address": "127.0.0.1", "master_port": 29999,
                       "timeout_s": 0.5},
        "generate": {"input_ids": list(PROMPT), "lora_path": ctx.m.name, "sampling_params": {"max_new_tokens": 2}},
        "generate_base": {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 2}},
        "route": {},
        "test_hold": {"point": "load", "lora_name": ctx.m.name},
    }


def _substitutions(ctx: Boundary) -> dict[str, str]:
    digest = ctx.candidate.digest
    fresh = _fresh(ctx, digest)
    return {
        "$FRESH_OTHER_DIGEST": _fresh(ctx, "0" * 64),
        "$FRESH_UPPER": fresh[:-12] + digest[:12].upper(),
        "$DIGEST12": digest[:12],
        "$M_LORA_ID": ctx.m_lora_id,
        "$M": ctx.m.name,
        "$INC": str(ctx.m.incarnation),
        "$ROOT": str(ctx.root),
        "$ESCAPE_LINK": str(ctx.root / "boundary-escape-link"),
        "$ESCAPE_FILE_DIR": str(ctx.root / "boundary-escape-file"),
        "$TOKEN_PREFIX": TEST_TOKEN[:-1],
    }


def _fill(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, replacement in subs.items():  # longest keys first: "$M_LORA_ID" before "$M"
            value = value.replace(key, replacement)
        return value
    if isinstance(value, bytes):
        return _fill(value.decode("latin-1"), subs).encode("latin-1")
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    return value


def _candidate_variant(ctx: Boundary, kind: str) -> dict[str, Any]:
    """A manifest an engine must refuse as UNSUPPORTED_ADAPTER (built past the snapshot builder's checks)."""
    config = dict(ctx.candidate.serving_config)
    tensors = {name: t.clone() for name, t in ctx.candidate.tensors.items()}
    if kind == "rank16":
        config["r"] = 16
        tensors = {n: (torch.zeros(16, t.shape[1]) if "lora_A" in n else torch.zeros(t.shape[0], 16)).to(t.dtype)
                   for n, t in tensors.items()}
    elif kind == "k_proj":
        config["target_modules"] = sorted({*config["target_modules"], "k_proj"})
    elif kind == "float64":
        tensors = {n: t.to(torch.float64) for n, t in tensors.items()}
    manifest = manifest_from_tensors(tensors, config)
    return {"lora_name": lora_name(VersionKey(1, f"bnd-{kind}"), manifest.digest), "digest": manifest.digest,
            "manifest": manifest.to_json()}


def _http_outcome(response: httpx.Response) -> Outcome:
    try:
        payload = response.json()
    except ValueError:
        return Outcome(response.status_code, None, None, response.text[:500])
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message", ""))
        reason = error.get("reason") or message.partition(":")[0] or None
        return Outcome(response.status_code, reason, error.get("field"), message)
    if isinstance(payload, dict) and payload.get("object") == "error" and "validation error" in str(
            payload.get("message")):  # SGLang's answer to a body its request dataclass does not parse
        return Outcome(response.status_code, "MALFORMED_REQUEST", None, str(payload["message"]))
    if isinstance(payload, dict) and "detail" in payload:  # FastAPI's own request validation
        return Outcome(response.status_code, "MALFORMED_REQUEST", None, json.dumps(payload["detail"]))
    return Outcome(response.status_code, None, None, json.dumps(payload)[:500])


def send(ctx: Boundary, row: Row) -> Outcome:
    subs = _substitutions(ctx)
    if row.endpoint == "reserve":
        return _reserve(ctx, row)
    if row.endpoint == "snapshot":
        return _snapshot(ctx, row)
    headers = {TOKEN_HEADER: TEST_TOKEN} if row.headers is None else _fill(row.headers, subs)
    headers = {key: value.encode("latin-1") for key, value in headers.items()}  # a non-ASCII token travels too
    path = "/generate" if row.endpoint == "generate" else f"/versioned_lora/{row.endpoint}"
    if row.raw is not None:
        content = _fill(row.raw, subs) if len(row.raw) < 1 << 20 else row.raw
    else:
        body = dict(_bases(ctx)[row.base])
        overrides = dict(row.set)
        variant = overrides.pop("$CANDIDATE", None)
        if variant is not None:
            body.update(_candidate_variant(ctx, variant))
        for key, value in overrides.items():
            if value is DROP:
                body.pop(key, None)
            else:
                body[key] = _fill(value, subs)
        path = body.pop("$PATH", path)  # a `route` row names the serving route it is sent to
        content = json.dumps(body).encode()
    with httpx.Client(base_url=ctx.url, timeout=120.0) as client:
        response = client.post(path, content=content,
                               headers={"content-type": b"application/json", **headers})
    return _http_outcome(response)


def _reserve(ctx: Boundary, row: Row) -> Outcome:
    # REGISTRY_EPOCH is imported with the module, at collection: by the time a test runs, the module named
    # `conftest` in sys.modules is whichever directory's conftest pytest imported last (the full suite's
    # tests/zz_scale), so an import here found no REGISTRY_EPOCH and every reserve case failed in `make test`.
    values = {"epoch": REGISTRY_EPOCH, "version_id": "B", "digest": "b" * 64, **row.set}
    event = Reserve(VersionKey(values["epoch"], values["version_id"]), values["digest"])

    async def submit() -> Outcome:
        try:
            answer = await ctx.registry.submit(event)
        except InvalidIdentity as exc:
            return Outcome(None, "INVALID_IDENTITY", exc.part, str(exc))
        return Outcome(None, None, None, f"accepted: {answer.result!r}")

    return asyncio.run(submit())


def _snapshot(ctx: Boundary, row: Row) -> Outcome:
    tensors = {name: t.clone() for name, t in ctx.candidate.tensors.items()}
    names = sorted(tensors)
    a_name = next(n for n in names if "lora_A" in n)
    b_name = next(n for n in names if "lora_B" in n)
    fault = row.set["fault"]
    if fault == "nan":
        tensors[a_name][0, 0] = float("nan")
    elif fault == "inf":
        tensors[b_name][0, 0] = float("inf")
    elif fault == "int32":
        tensors[a_name] = tensors[a_name].to(torch.int32)
    elif fault == "float64":
        tensors[b_name] = tensors[b_name].to(torch.float64)
    elif fault == "rank":
        tensors[a_name] = torch.zeros(4, tensors[a_name].shape[1], dtype=tensors[a_name].dtype)
    elif fault == "3d":
        tensors[a_name] = tensors[a_name].unsqueeze(0)
    elif fault == "empty":
        tensors = {}
    try:
        snapshot_from_tensors(tensors, ctx.candidate.adapter_config())
    except SnapshotError as exc:
        return Outcome(None, "SNAPSHOT_REFUSED", None, str(exc))
    return Outcome(None, None, None, "snapshot accepted")


# ---------------------------------------------------------------- per-row context steps


@contextlib.contextmanager
def setup_step(ctx: Boundary, name: str | None) -> Iterator[None]:
    if name is None:
        yield
    elif name == "escape_link":
        link = ctx.root / "boundary-escape-link"
        link.unlink(missing_ok=True)
        link.symlink_to("/etc", target_is_directory=True)
        try:
            yield
        finally:
            link.unlink()
    elif name == "escape_file_link":
        # Every file of C, the weights a link to a copy outside the root.
        outside = Path(f"/tmp/boundary-outside-{uuid.uuid4().hex[:6]}")
        outside.mkdir()
        inside = ctx.root / "boundary-escape-file"
        shutil.rmtree(inside, ignore_errors=True)
        inside.mkdir()
        for item in ctx.candidate_dir.iterdir():
            if item.name == "adapter_model.safetensors":
                shutil.copy2(item, outside / item.name)
                (inside / item.name).symlink_to(outside / item.name)
            else:
                shutil.copy2(item, inside / item.name)
        try:
            yield
        finally:
            shutil.rmtree(inside, ignore_errors=True)
            shutil.rmtree(outside, ignore_errors=True)
    elif name == "fill_slots":
        async def publish() -> list[Any]:
            # Every managed slot the engine has left: K of its K + 1 loaded-adapter slots, K the capacity the
            # session's engines were started for; the module's own version holds one.
            async with client_for(ctx.engine) as client:
                held = [a for a in (await client.status())["managed"] if a["state"] in ("STAGING", "READY")]
                return [await publish_from_disk(client, ctx.fill_dir, "bndfill")
                        for _ in range(ctx.engine.config.capacity - len(held))]

        async def reclaim(fills: list[Any]) -> None:
            async with client_for(ctx.engine) as client:
                for staged in fills:
                    await client.managed("reclaim", lora_name=staged.name, reclaim_id="bnd-fill-reclaim", wait_s=60)

        fills = asyncio.run(publish())
        try:
            yield
        finally:
            asyncio.run(reclaim(fills))
    else:
        raise AssertionError(f"no setup step {name!r}")


# ---------------------------------------------------------------- the cases


def _named(row: Row, outcome: Outcome) -> bool:
    wanted = row.field.split(".")[-1] if row.names is None else row.names
    return wanted == "" or outcome.field == wanted or wanted.lower() in outcome.message.lower()


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input(boundary: Boundary, row: Row) -> None:
    with setup_step(boundary, row.setup):
        before = (boundary.status(), boundary.registry_state())
        outcome = send(boundary, row)
        after = (boundary.status(), boundary.registry_state())
    serving = boundary.serving()
    typed = (
        outcome.reason == row.reason
        and (outcome.status is None or 400 <= outcome.status < 500)
        and _named(row, outcome)
    )
    unchanged = before == after and serving == boundary.baseline
    RESULTS[row.id] = {"typed": typed, "unchanged": unchanged}
    assert typed, f"{row.id}: wanted {row.reason} naming {row.names or row.field!r}, got {outcome}"
    assert before[0] == after[0], f"{row.id}: the engine's status changed"
    assert before[1] == after[1], f"{row.id}: the registry's state changed"
    assert serving == boundary.baseline, f"{row.id}: serving changed: {serving} != {boundary.baseline}"


def test_summary(boundary: Boundary, engines: Any) -> None:
    """Runs after every row (pytest keeps a module's order): all N typed, all N unchanged, no engine down, no
    unretrieved task exception in the engines' logs over the suite."""
    n = len(ROWS)
    typed = sum(r["typed"] for r in RESULTS.values())
    unchanged = sum(r["unchanged"] for r in RESULTS.values())
    crashed = 0
    for engine in engines:
        alive = engine._proc is not None and engine._proc.poll() is None
        healthy = alive and httpx.get(f"{engine.url}/health", timeout=30).status_code == 200
        crashed += not healthy
    print(f"\nbad_input_kinds={n} typed={typed} unchanged={unchanged} crashed={crashed}")
    assert len(RESULTS) == n, f"{n - len(RESULTS)} rows did not run (run the whole module)"
    assert typed == unchanged == n and crashed == 0
    assert n >= 60
    logs = log_text_since(boundary.log_offsets)
    assert "Task exception was never retrieved" not in logs
