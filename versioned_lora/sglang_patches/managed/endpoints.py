"""The managed endpoints under ``/versioned_lora/`` on SGLang's HTTP server. JSON in and out.

Every answer carries the engine ``incarnation``. Outcomes of the protocol are 200 with a ``result``;
expected refusals from the spec table (stale attempt, forged reclaim id, ...) are 409 with
``{"error": {"reason", "row", "message"}}``; bad input is refused before anything reads it, with
``{"error": {"reason", "field", "message"}}``: malformed bodies and fields 400 (each endpoint takes a fixed set of
fields, of exact types and bounds: `fields`), oversized bodies 413 (64 KiB; 16 MiB for ``begin``, which carries
the manifest), a bad or missing shared-secret token 401 (the token is required: the patch set does not start
without one) — and none of those change anything. A candidate refused after its load (a non-finite probe) is
422, and cleaned.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from fastapi import Request  # module level: FastAPI resolves the endpoint's annotation here

from versioned_lora import capabilities
from versioned_lora.adapters.manifest import KNOWN_HASH_KINDS, Manifest, ManifestError, UnsupportedManifest
from versioned_lora.adapters.transfer import BucketPlan, TransferError
from versioned_lora.sglang_patches.managed import audit, fields, metrics, staging_channel
from versioned_lora.sglang_patches.managed.engine_side import (
    CandidateRefused,
    ManagedEngine,
    ProtocolRefusal,
)
from versioned_lora.sglang_patches.managed.fields import BadRequest
from versioned_lora.sglang_patches.managed.guards import is_managed_name
from versioned_lora.sglang_patches.managed.staging import DiskSource, DistributedSource, StagingFailed, StagingSource
from versioned_lora.sglang_patches.managed.staging_channel import SchedulerCallFailed
from versioned_lora.sglang_patches.preflight import require_capability_key, require_token
from versioned_lora.spec.identities import InvalidIdentity, check_lora_name
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.wire import (
    MANAGED_PREFIX,
    PROTOCOL_VERSION,
    SOURCE_ROOT_ENV,
    TOKEN_HEADER,
    EngineRefusal,
    transfer_group_incarnation,
)

logger = logging.getLogger(__name__)

PREFIX = MANAGED_PREFIX.rstrip("/")
MAX_CONTROL_BODY = 64 * 1024  # control messages are small; tensors travel over torch.distributed
# `begin` carries the manifest, about 200 bytes a tensor: a LoRA on every linear module of an 8B model
# (504 tensors) is ~100 KB, a mixture-of-experts LoRA can be tens of thousands of tensors.
MAX_BEGIN_BODY = 16 * 1024 * 1024
MAX_BUCKET_BYTES = 512 * 1024 * 1024  # one bucket is one flat receive buffer in the scheduler
DEFAULT_BUCKET_DEADLINE_S = 30.0
SUPPORTED_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def _managed_name(body: dict[str, Any], digest: str | None = None) -> str:
    """The request's managed name, inside the name grammar (spec/identities.py); with `digest`, a name
    whose digest part is that digest's prefix."""
    name = fields.string(body, "lora_name", max_len=MAX_CONTROL_BODY)  # the grammar bounds it, with a reason
    if not is_managed_name(name):
        raise BadRequest(EngineRefusal.NOT_MANAGED,
                         f"{name[:80]!r} is not a versioned-lora managed name", field="lora_name")
    try:
        check_lora_name(name, digest)
    except InvalidIdentity as exc:
        digest_differs = digest is not None and exc.part == "digest"
        code = EngineRefusal.NAME_DIGEST_MISMATCH if digest_differs else EngineRefusal.INVALID_NAME
        raise BadRequest(code, str(exc), field="lora_name") from exc
    return name


def _attempt_token(body: dict[str, Any]) -> str:
    return fields.string(body, "attempt_token", fields.TOKEN_RE, max_len=256)


def _incarnation(body: dict[str, Any]) -> int:
    return fields.integer(body, "incarnation")


def source_roots() -> list[Path]:
    """The directory trees a disk-sourced `begin` may read: ``$VERSIONED_LORA_SOURCE_ROOT`` (`versioned-lora engine
    --source-root`), one path or several separated by ``os.pathsep``. None configured: none, and every
    disk-sourced `begin` is refused. The engine knows no fixture cache: where a deployment keeps its candidates
    is the deployment's to say (issue 46, item 5)."""
    configured = [part for part in os.environ.get(SOURCE_ROOT_ENV, "").split(os.pathsep) if part]
    return [Path(part).resolve() for part in configured]


def confined_source(raw: str) -> Path:
    """`raw` resolved (every symlink followed) to a directory inside one of `source_roots()`, whose files all
    resolve inside that root too: a link inside a root cannot make the engine read a file outside."""
    roots = source_roots()
    try:
        path = Path(raw).resolve(strict=True)
        entries = [entry.resolve(strict=True) for entry in path.iterdir()] if path.is_dir() else []
    except (OSError, RuntimeError, ValueError) as exc:
        raise BadRequest(EngineRefusal.SOURCE_PATH_REFUSED, f"source_path cannot be read: {type(exc).__name__}",
                         field="source_path") from exc
    inside = any(path.is_relative_to(root) and all(e.is_relative_to(root) for e in entries) for root in roots)
    if not path.is_dir() or not inside:
        allowed = os.pathsep.join(map(str, roots)) or "none configured: this engine reads no candidate from disk"
        raise BadRequest(EngineRefusal.SOURCE_PATH_REFUSED,
                         f"source_path must be a directory inside ${SOURCE_ROOT_ENV} ({allowed}), symlinks resolved",
                         field="source_path")
    return path


# The fields each endpoint reads; any other field is refused (UNKNOWN_FIELD).
_INIT_GROUP_FIELDS = frozenset({"group_name", "master_address", "master_port", "timeout_s"})
_BEGIN_FIELDS = frozenset({"lora_name", "attempt_token", "incarnation", "digest", "manifest", "source_path",
                           "max_bucket_bytes", "plan_digest", "group_name", "bucket_deadline_s"})
_BUCKET_FIELDS = frozenset({"lora_name", "attempt_token", "incarnation", "index"})
_END_FIELDS = frozenset({"lora_name", "attempt_token", "incarnation", "probe_input_ids"})
_CLEANUP_FIELDS = frozenset({"lora_name", "attempt_token", "capability"})
_RECLAIM_FIELDS = frozenset({"lora_name", "reclaim_id", "wait_s", "capability"})
MAX_PROBE_TOKENS = 256
MAX_WAIT_S = 600.0


@attrs.define
class ManagedAPI:
    engine: ManagedEngine
    # The registry's key (versioned_lora.capabilities): a cleanup or reclaim is carried out only on a valid
    # capability for that exact name, action and attempt/reclaim id (issue 19: a reclaim with another
    # version's reclaim id unloaded the live default). Required, read once, at start.
    # During a rotation (capabilities.KeyRing) the previous key is accepted too, until its stated time.
    capability_key: capabilities.KeyRing = attrs.field(factory=lambda: require_capability_key())

    def _authorize(self, body: dict[str, Any], action: capabilities.Action, name: str, reference: str) -> None:
        given = body.get("capability")
        if given is None:
            raise BadRequest(EngineRefusal.CAPABILITY_MISSING,
                             f"{action} of {name!r} needs the registry's capability", 403,
                             field="capability")
        if not capabilities.verify_any(self.capability_key, given, action, name, reference):
            raise BadRequest(EngineRefusal.CAPABILITY_INVALID,
                             f"the capability is not the registry's for {action} of {name!r} "
                             f"under {reference!r}", 403, field="capability")

    async def init_group(self, body: dict[str, Any]) -> Any:
        """Join this engine's two-rank transfer group (rank 1); the publisher joins as rank 0
        concurrently. One group per engine incarnation, so one engine's death cannot break another's."""
        fields.only(body, _INIT_GROUP_FIELDS, "init_group")
        name = fields.string(body, "group_name", fields.TOKEN_RE, max_len=256)
        named_for = transfer_group_incarnation(name)
        if named_for is None:
            raise BadRequest(EngineRefusal.MALFORMED_REQUEST,
                             f"field 'group_name' must be vlora-<incarnation>-<nonce>, got {name[:80]!r}",
                             field="group_name")
        if named_for != self.engine.incarnation:
            raise BadRequest(Reason.STALE_INCARNATION,
                             f"group {name!r} is named for incarnation {named_for}, not {self.engine.incarnation}",
                             409, field="group_name")
        master_address = fields.string(body, "master_address", fields.HOST_RE, max_len=255)
        master_port = fields.integer(body, "master_port", 1, 65535)
        timeout_s = fields.number(body, "timeout_s", 0.0, MAX_WAIT_S, low_open=True)
        await staging_channel.call("init_group", name=name, master_address=master_address,
                                   master_port=master_port, timeout_s=timeout_s)
        answer = await staging_channel.poll("poll_group", lambda a: a["state"] != "JOINING", timeout_s, name=name)
        if answer is None or answer["state"] != "READY":
            raise BadRequest(EngineRefusal.GROUP_FAILED, f"transfer group {name!r} did not form: {answer}", status=502)
        return {"group": name, "state": "READY"}

    async def begin(self, body: dict[str, Any]) -> Any:
        audit.COUNTS["managed_begin"] += 1  # every begin that reached this engine, accepted or not
        fields.only(body, _BEGIN_FIELDS, "begin")
        _managed_name(body)
        try:
            manifest = Manifest.from_json(fields.string(body, "manifest", max_len=MAX_BEGIN_BODY))
        except UnsupportedManifest as exc:  # a format version or hash kind this engine does not know
            raise BadRequest(EngineRefusal.UNSUPPORTED_MANIFEST, str(exc)) from exc
        except ManifestError as exc:
            raise BadRequest(EngineRefusal.MALFORMED_MANIFEST, str(exc), field="manifest") from exc
        digest = fields.string(body, "digest", fields.HEX64_RE, max_len=64)
        if manifest.digest != digest:
            raise BadRequest(EngineRefusal.DIGEST_MISMATCH, f"manifest digest {manifest.digest} != declared {digest}",
                             field="digest")
        name = _managed_name(body, digest)  # its digest part is the manifest's
        identity: dict[str, Any] = {
            "lora_name": name,
            "attempt_token": _attempt_token(body),
            "incarnation": _incarnation(body),
            "digest": digest,
            "manifest": manifest,
        }
        source: StagingSource
        if "source_path" in body:
            path = confined_source(fields.string(body, "source_path", max_len=4096))
            source = DiskSource(**identity, path=path)
        else:
            plan = self._plan(body, manifest)
            source = DistributedSource(
                **identity, plan_json=plan.to_json(), bucket_count=len(plan.buckets),
                group_name=fields.string(body, "group_name", fields.TOKEN_RE, max_len=256),
                bucket_deadline_s=fields.number(body, "bucket_deadline_s", 0.0, MAX_WAIT_S,
                                                default=DEFAULT_BUCKET_DEADLINE_S, low_open=True),
            )
        self._check_resources(manifest, source)
        return await self.engine.begin(source)

    def _plan(self, body: dict[str, Any], manifest: Manifest) -> BucketPlan:
        max_bucket_bytes = body.get("max_bucket_bytes")
        if type(max_bucket_bytes) is int and not 0 < max_bucket_bytes <= MAX_BUCKET_BYTES:
            raise BadRequest(EngineRefusal.BUCKET_TOO_LARGE,
                             f"max_bucket_bytes {max_bucket_bytes} not in (0, {MAX_BUCKET_BYTES}]",
                             field="max_bucket_bytes")
        max_bucket_bytes = fields.integer(body, "max_bucket_bytes", 1, MAX_BUCKET_BYTES)
        plan_digest = fields.string(body, "plan_digest", fields.HEX64_RE, max_len=64)
        try:
            plan = BucketPlan.build(manifest, max_bucket_bytes)
        except TransferError as exc:
            raise BadRequest(EngineRefusal.BUCKET_TOO_LARGE, str(exc), field="max_bucket_bytes") from exc
        if plan.digest() != plan_digest:
            raise BadRequest(EngineRefusal.PLAN_MISMATCH,
                             "the publisher's bucket plan differs from the one rebuilt here",
                             field="plan_digest")
        return plan

    def _check_resources(self, manifest: Manifest, source: StagingSource) -> None:
        """PREPARED only if this engine can hold the candidate: a free pinned slot, a rank and target
        modules the server was started for, and dtypes its LoRA loader takes. Asked only of a begin the table
        would stage (`ManagedEngine.opens_stash`): a replayed, stale or late begin gets the table's answer,
        never NO_FREE_SLOT."""
        from sglang.srt.runtime_context import get_lora

        if not self.engine.opens_stash(source):
            return
        lora = get_lora()
        config = manifest.serving_config
        if int(config.get("r", 0)) > int(lora.max_lora_rank or 0):
            raise BadRequest(EngineRefusal.UNSUPPORTED_ADAPTER,
                             f"rank {config.get('r')} > max_lora_rank {lora.max_lora_rank}")
        served = set(lora.lora_target_modules or ())
        wanted = config.get("target_modules") or ()
        wanted = {wanted} if isinstance(wanted, str) else set(wanted)  # a regex string names no module set
        if served and "all" not in served and not wanted <= served:
            raise BadRequest(EngineRefusal.UNSUPPORTED_ADAPTER,
                             f"target modules {sorted(wanted - served)} not served here")
        dtypes = {entry.dtype for entry in manifest.tensors}
        if not dtypes <= SUPPORTED_DTYPES:
            raise BadRequest(EngineRefusal.UNSUPPORTED_ADAPTER,
                             f"dtypes {sorted(dtypes - SUPPORTED_DTYPES)} not supported")
        if lora.max_loaded_loras is not None and self.engine.staging_reservations() >= lora.max_loaded_loras - 1:
            # One slot stays free for the stock path (RFC: 2 pinned managed + 1 free of 3).
            raise BadRequest(EngineRefusal.NO_FREE_SLOT, "every managed slot on this engine is taken", status=409)

    async def receive_bucket(self, body: dict[str, Any]) -> Any:
        fields.only(body, _BUCKET_FIELDS, "receive_bucket")
        return await self.engine.receive_bucket(
            _managed_name(body), _attempt_token(body), _incarnation(body), fields.integer(body, "index", 0, 2**31 - 1),
        )

    async def end(self, body: dict[str, Any]) -> Any:
        fields.only(body, _END_FIELDS, "end")
        name, attempt_token, incarnation = _managed_name(body), _attempt_token(body), _incarnation(body)
        # Checked before the step: an out-of-vocabulary probe reached the embedding layer of a loaded candidate
        # and took the scheduler down (issue 19).
        tm = self.engine.tm
        probe = fields.token_ids(body.get("probe_input_ids", [1, 2, 3, 4]), "probe_input_ids",
                                 int(tm.model_config.vocab_size), min(MAX_PROBE_TOKENS, int(tm.context_len) - 2))
        return await self.engine.end(name, attempt_token, incarnation, probe)

    async def cleanup(self, body: dict[str, Any]) -> Any:
        fields.only(body, _CLEANUP_FIELDS, "cleanup")
        name, attempt_token = _managed_name(body), _attempt_token(body)
        self._authorize(body, capabilities.Action.CLEANUP, name, attempt_token)
        return await self.engine.cleanup(name, attempt_token)

    async def reclaim(self, body: dict[str, Any]) -> Any:
        fields.only(body, _RECLAIM_FIELDS, "reclaim")
        name = _managed_name(body)
        reclaim_id = fields.string(body, "reclaim_id", fields.TOKEN_RE, max_len=256)
        wait_s = fields.number(body, "wait_s", 0.0, MAX_WAIT_S, default=0.0)
        self._authorize(body, capabilities.Action.RECLAIM, name, reclaim_id)
        return await self.engine.reclaim(name, reclaim_id, wait_s)


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


def token_matches(given: str, secret: str) -> bool:
    # Constant-time in the secret's content; bytes, so a non-ASCII header cannot raise.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode("utf-8"))


def install(app: Any, engine: ManagedEngine) -> None:
    from fastapi.responses import ORJSONResponse

    api = ManagedAPI(engine)
    secret = require_token()

    def envelope(status: int, **payload: Any) -> Any:
        return ORJSONResponse({"incarnation": engine.incarnation, **payload}, status_code=status)

    def refusal(path: str, status: int, error: dict[str, Any]) -> Any:
        # Counted for /metrics (managed/metrics.py): the endpoint is one of the fixed routes below.
        metrics.count_refusal(path.rsplit("/", 1)[-1], error.get("reason"))
        return envelope(status, error=error)

    def route(
        handler: Callable[[dict[str, Any]], Any], max_body: int = MAX_CONTROL_BODY
    ) -> Callable[[Request], Awaitable[Any]]:
        def too_large(path: str, size: int) -> Any:
            return refusal(path, 413,
                           {"reason": EngineRefusal.BODY_TOO_LARGE, "message": f"{size} bytes > {max_body}"})

        async def endpoint(request: Request) -> Any:
            if not token_matches(request.headers.get(TOKEN_HEADER, ""), secret):
                return refusal(request.url.path, 401,
                               {"reason": EngineRefusal.UNAUTHORIZED, "message": "bad or missing token"})
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_body:  # refused before reading it
                return too_large(request.url.path, int(declared))
            raw = await request.body()
            if len(raw) > max_body:
                return too_large(request.url.path, len(raw))
            body: Any = None
            try:
                import orjson

                body = orjson.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest(EngineRefusal.MALFORMED_REQUEST,
                                     f"body must be a JSON object, got {type(body).__name__}")
                result = handler(body)
                if isinstance(result, Awaitable):
                    result = await result
            except BadRequest as exc:
                return refusal(request.url.path, exc.status, exc.payload())
            except ProtocolRefusal as exc:
                return refusal(request.url.path, 409, {"reason": str(exc.rejected.reason), "row": exc.rejected.row,
                                                       "message": str(exc)})
            except CandidateRefused as exc:
                return refusal(request.url.path, 422, {"reason": exc.code, "message": str(exc)})
            except StagingFailed as exc:
                return refusal(request.url.path, 504 if exc.code == EngineRefusal.BUCKET_DEADLINE else 502,
                               {"reason": exc.code, "message": str(exc)})
            except SchedulerCallFailed as exc:
                return refusal(request.url.path, 500,
                               {"reason": EngineRefusal.SCHEDULER_CALL_FAILED, "message": str(exc)})
            except ValueError as exc:  # orjson.JSONDecodeError is a ValueError: not JSON, NaN, non-UTF-8, too deep
                return refusal(request.url.path, 400, {"reason": EngineRefusal.MALFORMED_REQUEST, "message": str(exc)})
            except Exception as exc:  # a bug: still a typed answer, never a raw traceback past the handler
                logger.exception("versioned-lora managed endpoint %s failed", request.url.path)
                return refusal(request.url.path, 500,
                               {"reason": EngineRefusal.INTERNAL_ERROR, "message": f"{type(exc).__name__}: {exc}"})
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
    _ROUTES.append(lambda path, handler: app.add_api_route(f"{PREFIX}/{path}", route(handler), methods=["POST"]))


# How a later patch set adds a managed endpoint (token, body limits, typed envelope: the same `route` as above),
# e.g. the test-only `test_faults` set's `test_hold`. Set by `install`.
_ROUTES: list[Callable[[str, Callable[[dict[str, Any]], Any]], None]] = []


def add_managed_route(path: str, handler: Callable[[dict[str, Any]], Any]) -> None:
    """Serve ``/versioned_lora/<path>`` with `handler`, as the managed endpoints are served."""
    if not _ROUTES:
        raise RuntimeError(f"/versioned_lora/{path} needs the managed patch set, applied before it")
    _ROUTES[-1](path, handler)


def _adapter_view(engine: ManagedEngine, body: dict[str, Any]) -> Any:
    name = body.get("lora_name")
    return next((a for a in engine.status()["managed"] if a["name"] == name), None)


async def status_extension(engine: ManagedEngine) -> dict[str, Any]:
    try:
        scheduler = await staging_channel.call("status")
    except SchedulerCallFailed as exc:
        scheduler = {"error": str(exc)}
    return {**engine.status(), "audit": audit.snapshot(), "staging": scheduler, "protocol": protocol()}


def protocol() -> dict[str, Any]:
    """What a publisher checks before its first begin: the protocol version it speaks, the manifest formats
    and hash kinds this engine verifies, and whether reclaim/cleanup need a registry capability."""
    return {
        "version": PROTOCOL_VERSION,
        "manifest_formats": sorted(KNOWN_HASH_KINDS),
        "manifest_hash_kinds": sorted(set(KNOWN_HASH_KINDS.values())),
        "capabilities_required": True,  # always: a managed engine does not start without the key
        # The keys' ids (a hash of each, never a key), the current first and a previous one while its rotation
        # window is open: an engine port compares them with the registry's before its first call (KEY_MISMATCH).
        "key_id": capabilities.key_id(require_capability_key().current),
        "key_ids": list(require_capability_key().ids()),
    }
