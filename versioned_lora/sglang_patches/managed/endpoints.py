"""The managed endpoints under ``/versioned_lora/`` on SGLang's HTTP server. JSON in and out.

Every answer carries the engine ``incarnation``. Outcomes of the protocol are 200 with a ``result``;
expected refusals from the spec table (stale attempt, forged reclaim id, ...) are 409 with
``{"error": {"reason", "row", "message"}}``; malformed bodies are 400, oversized bodies 413 (64 KiB; 16 MiB
for ``begin``, which carries the manifest), a bad or missing shared-secret token 401 — and none of those
change anything.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from fastapi import Request  # module level: FastAPI resolves the endpoint's annotation here

from versioned_lora.adapters.manifest import Manifest, ManifestError, UnsupportedManifest
from versioned_lora.adapters.transfer import BucketPlan, TransferError
from versioned_lora.sglang_patches.managed import audit, staging_channel
from versioned_lora.sglang_patches.managed.engine_side import EngineOperationError, ManagedEngine, ProtocolRefusal
from versioned_lora.sglang_patches.managed.guards import is_managed_name
from versioned_lora.sglang_patches.managed.staging import DiskSource, DistributedSource, StagingFailed, StagingSource
from versioned_lora.sglang_patches.managed.staging_channel import SchedulerCallFailed

PREFIX = "/versioned_lora"
TOKEN_ENV = "VERSIONED_LORA_TOKEN"
TOKEN_HEADER = "x-versioned-lora-token"
MAX_CONTROL_BODY = 64 * 1024  # control messages are small; tensors travel over torch.distributed
# `begin` carries the manifest, about 200 bytes a tensor: a LoRA on every linear module of an 8B model
# (504 tensors) is ~100 KB, a mixture-of-experts LoRA can be tens of thousands of tensors.
MAX_BEGIN_BODY = 16 * 1024 * 1024
MAX_BUCKET_BYTES = 512 * 1024 * 1024  # one bucket is one flat receive buffer in the scheduler
DEFAULT_BUCKET_DEADLINE_S = 30.0
SUPPORTED_DTYPES = frozenset({"float32", "bfloat16", "float16"})


class BadRequest(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise BadRequest("MALFORMED_REQUEST", f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def _managed_name(body: dict[str, Any]) -> str:
    name = _field(body, "lora_name", str)
    if not is_managed_name(name):
        raise BadRequest("NOT_MANAGED", f"{name!r} is not a versioned-lora managed name")
    return name


@attrs.define
class ManagedAPI:
    engine: ManagedEngine

    async def init_group(self, body: dict[str, Any]) -> Any:
        """Join this engine's two-rank transfer group (rank 1); the publisher joins as rank 0
        concurrently. One group per engine incarnation, so one engine's death cannot break another's."""
        name = _field(body, "group_name", str)
        if str(self.engine.incarnation) not in name:
            raise BadRequest(
                "STALE_INCARNATION", f"group {name!r} is not named for incarnation {self.engine.incarnation}", 409
            )
        timeout_s = float(_field(body, "timeout_s", int | float))
        await staging_channel.call("init_group", name=name,
                                   master_address=_field(body, "master_address", str),
                                   master_port=_field(body, "master_port", int), timeout_s=timeout_s)
        answer = await staging_channel.poll("poll_group", lambda a: a["state"] != "JOINING", timeout_s, name=name)
        if answer is None or answer["state"] != "READY":
            raise BadRequest("GROUP_FAILED", f"transfer group {name!r} did not form: {answer}", status=502)
        return {"group": name, "state": "READY"}

    async def begin(self, body: dict[str, Any]) -> Any:
        audit.COUNTS["managed_begin"] += 1  # every begin that reached this engine, accepted or not
        name = _managed_name(body)
        try:
            manifest = Manifest.from_json(_field(body, "manifest", str))
        except UnsupportedManifest as exc:  # a format version or hash kind this engine does not know
            raise BadRequest("UNSUPPORTED_MANIFEST", str(exc)) from exc
        except ManifestError as exc:
            raise BadRequest("MALFORMED_MANIFEST", str(exc)) from exc
        digest = _field(body, "digest", str)
        if manifest.digest != digest:
            raise BadRequest("DIGEST_MISMATCH", f"manifest digest {manifest.digest} != declared {digest}")
        identity = {
            "lora_name": name,
            "attempt_token": _field(body, "attempt_token", str),
            "incarnation": _field(body, "incarnation", int),
            "digest": digest,
            "manifest": manifest,
        }
        self._check_resources(manifest, identity)
        source: StagingSource
        if "source_path" in body:
            source = DiskSource(**identity, path=Path(_field(body, "source_path", str)))
        else:
            plan = self._plan(body, manifest)
            source = DistributedSource(
                **identity, plan_json=plan.to_json(), bucket_count=len(plan.buckets),
                group_name=_field(body, "group_name", str),
                bucket_deadline_s=float(body.get("bucket_deadline_s", DEFAULT_BUCKET_DEADLINE_S)),
            )
        return await self.engine.begin(source)

    def _plan(self, body: dict[str, Any], manifest: Manifest) -> BucketPlan:
        max_bucket_bytes = _field(body, "max_bucket_bytes", int)
        if not 0 < max_bucket_bytes <= MAX_BUCKET_BYTES:
            raise BadRequest("BUCKET_TOO_LARGE", f"max_bucket_bytes {max_bucket_bytes} not in (0, {MAX_BUCKET_BYTES}]")
        try:
            plan = BucketPlan.build(manifest, max_bucket_bytes)
        except TransferError as exc:
            raise BadRequest("BUCKET_TOO_LARGE", str(exc)) from exc
        if plan.digest() != _field(body, "plan_digest", str):
            raise BadRequest("PLAN_MISMATCH", "the publisher's bucket plan differs from the one rebuilt here")
        return plan

    def _check_resources(self, manifest: Manifest, identity: dict[str, Any]) -> None:
        """PREPARED only if this engine can hold the candidate: a free pinned slot, a rank and target
        modules the server was started for, and dtypes its LoRA loader takes."""
        from sglang.srt.runtime_context import get_lora

        adapter = self.engine.adapter(identity["lora_name"])
        if adapter is not None and adapter.attempt_token == identity["attempt_token"]:
            return  # a replayed begin: the table answers it
        lora = get_lora()
        config = manifest.serving_config
        if int(config.get("r", 0)) > int(lora.max_lora_rank or 0):
            raise BadRequest("UNSUPPORTED_ADAPTER", f"rank {config.get('r')} > max_lora_rank {lora.max_lora_rank}")
        served = set(lora.lora_target_modules or ())
        wanted = set(config.get("target_modules") or ())
        if served and "all" not in served and not wanted <= served:
            raise BadRequest("UNSUPPORTED_ADAPTER", f"target modules {sorted(wanted - served)} not served here")
        dtypes = {entry.dtype for entry in manifest.tensors}
        if not dtypes <= SUPPORTED_DTYPES:
            raise BadRequest("UNSUPPORTED_ADAPTER", f"dtypes {sorted(dtypes - SUPPORTED_DTYPES)} not supported")
        if lora.max_loaded_loras is not None and self.engine.staging_reservations() >= lora.max_loaded_loras - 1:
            # One slot stays free for the stock path (RFC: 2 pinned managed + 1 free of 3).
            raise BadRequest("NO_FREE_SLOT", "every managed slot on this engine is taken", status=409)

    async def receive_bucket(self, body: dict[str, Any]) -> Any:
        return await self.engine.receive_bucket(
            _managed_name(body), _field(body, "attempt_token", str), _field(body, "incarnation", int),
            _field(body, "index", int),
        )

    async def end(self, body: dict[str, Any]) -> Any:
        probe = body.get("probe_input_ids", [1, 2, 3, 4])
        if not isinstance(probe, list) or not probe or not all(isinstance(t, int) for t in probe):
            raise BadRequest("MALFORMED_REQUEST", "probe_input_ids must be a non-empty list of token ids")
        return await self.engine.end(
            _managed_name(body), _field(body, "attempt_token", str), _field(body, "incarnation", int), probe
        )

    async def cleanup(self, body: dict[str, Any]) -> Any:
        return await self.engine.cleanup(_managed_name(body), _field(body, "attempt_token", str))

    async def reclaim(self, body: dict[str, Any]) -> Any:
        wait_s = body.get("wait_s", 0.0)
        if not isinstance(wait_s, int | float) or wait_s < 0 or wait_s > 600:
            raise BadRequest("MALFORMED_REQUEST", "wait_s must be a number in [0, 600]")
        return await self.engine.reclaim(_managed_name(body), _field(body, "reclaim_id", str), float(wait_s))


def _to_json(value: Any) -> Any:
    if attrs.has(type(value)):
        return {k: _to_json(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [_to_json(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value if not hasattr(value, "value") else str(value)
    return str(value)


def install(app: Any, engine: ManagedEngine) -> None:
    from fastapi.responses import ORJSONResponse

    api = ManagedAPI(engine)
    secret = os.environ.get(TOKEN_ENV) or None

    def envelope(status: int, **payload: Any) -> Any:
        return ORJSONResponse({"incarnation": engine.incarnation, **payload}, status_code=status)

    def route(
        handler: Callable[[dict[str, Any]], Any], max_body: int = MAX_CONTROL_BODY
    ) -> Callable[[Request], Awaitable[Any]]:
        def too_large(size: int) -> Any:
            return envelope(413, error={"reason": "BODY_TOO_LARGE", "message": f"{size} bytes > {max_body}"})

        async def endpoint(request: Request) -> Any:
            if secret is not None and not hmac.compare_digest(request.headers.get(TOKEN_HEADER, ""), secret):
                return envelope(401, error={"reason": "UNAUTHORIZED", "message": "bad or missing token"})
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_body:  # refused before reading it
                return too_large(int(declared))
            raw = await request.body()
            if len(raw) > max_body:
                return too_large(len(raw))
            try:
                import orjson

                body = orjson.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("MALFORMED_REQUEST", "body must be a JSON object")
                result = handler(body)
                if isinstance(result, Awaitable):
                    result = await result
            except BadRequest as exc:
                return envelope(exc.status, error={"reason": exc.code, "message": str(exc)})
            except ProtocolRefusal as exc:
                return envelope(409, error={"reason": str(exc.rejected.reason), "row": exc.rejected.row,
                                            "message": str(exc)})
            except EngineOperationError as exc:
                return envelope(500, error={"reason": exc.code, "message": str(exc)})
            except StagingFailed as exc:
                return envelope(504 if exc.code == "BUCKET_DEADLINE" else 502,
                                error={"reason": exc.code, "message": str(exc)})
            except SchedulerCallFailed as exc:
                return envelope(500, error={"reason": "SCHEDULER_CALL_FAILED", "message": str(exc)})
            except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
                return envelope(400, error={"reason": "MALFORMED_REQUEST", "message": str(exc)})
            return envelope(200, result=_to_json(result), adapter=_adapter_view(engine, body))

        return endpoint

    for path, handler in {
        "init_group": api.init_group,
        "receive_bucket": api.receive_bucket,
        "end": api.end,
        "cleanup": api.cleanup,
        "reclaim": api.reclaim,
    }.items():
        app.add_api_route(f"{PREFIX}/{path}", route(handler), methods=["POST"])
    app.add_api_route(f"{PREFIX}/begin", route(api.begin, MAX_BEGIN_BODY), methods=["POST"])


def _adapter_view(engine: ManagedEngine, body: dict[str, Any]) -> Any:
    name = body.get("lora_name")
    return next((a for a in engine.status()["managed"] if a["name"] == name), None)


async def status_extension(engine: ManagedEngine) -> dict[str, Any]:
    try:
        scheduler = await staging_channel.call("status")
    except SchedulerCallFailed as exc:
        scheduler = {"error": str(exc)}
    return {**engine.status(), "audit": audit.snapshot(), "staging": scheduler}
