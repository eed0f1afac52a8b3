"""The one place that turns the registry's state and each engine's `/versioned_lora/status` into rows.

`status_rows` is pure: a `PublicationView` and an `OperationsView` from the registry actor, and each
engine's raw status payload (or why it could not be read), in; plain JSON-able rows out. `versioned-lora
status` prints them (a rich table, or `--json`), and the demo's live view reads the same rows.

`blocking` lists what stops the next publication (or a reclaim) from going through, each with the command
that settles it; docs/runbook.md says what each kind means.

Bounded (issue 48): the registry's views hold every live version and the last few ended ones, and each
engine's rows hold the adapters that hold a slot or name a version shown; `--all` shows everything. So a long
run's status costs the same at step 1,000 as at step 10.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from versioned_lora.adapters.registry_core import OperationsView
from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient, UnknownOutcome
from versioned_lora.runtime.views import PublicationView, VersionView
from versioned_lora.spec.model import SLOT_HOLDING_ADAPTER_STATES
from versioned_lora.spec.states import PlacementState, VersionState

DIGEST_PREFIX = 12  # as in the managed name (spec/identities.py)
# What a RECLAIMED version's placements read: the registry keeps the placement it staged (its attempt and
# incarnation stay useful to an operator), but every engine confirmed the unload before the version got there.
RECLAIMED_PLACEMENT = "UNLOADED"


class BlockingKind:
    """What `blocking` entries name (docs/runbook.md has one section per kind)."""

    PUBLICATION_IN_FLIGHT = "PUBLICATION_IN_FLIGHT"  # LOADING, not READY everywhere
    READY_UNCOMMITTED = "READY_UNCOMMITTED"  # LOADING and READY everywhere: a commit is due or its reply was lost
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # a placement whose outcome could not be confirmed
    CLEANUP_PENDING = "CLEANUP_PENDING"  # ABORTED: some engine has not confirmed its cleanup
    RECLAIM_PENDING = "RECLAIM_PENDING"  # RECLAIMING: some engine has not confirmed its unload
    CAPACITY_FULL = "CAPACITY_FULL"  # every slot held: the next reserve is refused with CAPACITY_ERROR
    ENGINE_UNREACHABLE = "ENGINE_UNREACHABLE"  # its status could not be read
    INCARNATION_MISMATCH = "INCARNATION_MISMATCH"  # the engine restarted; the registry has not been told


@attrs.frozen
class EngineReading:
    """One engine's raw status payload, or why it could not be read."""

    name: str
    url: str
    status: Mapping[str, Any] | None
    error: str | None = None


def _version_row(version: VersionView, default: Any, confirmed: Sequence[str]) -> dict[str, Any]:
    return {
        "version_id": version.key.version_id,
        "epoch": version.key.epoch,
        "lora_name": version.lora_name,
        "digest_prefix": version.digest[:DIGEST_PREFIX],
        "state": str(version.state),
        "default": version.key == default,
        "session_refs": version.session_refs,
        "attempt_token": version.attempt_token,
        "reclaim_id": version.reclaim_id,
        "reclaim_confirmed": list(confirmed),
        "placements": {engine: {"state": (RECLAIMED_PLACEMENT if version.state is VersionState.RECLAIMED
                                          else str(p.state)),
                                "incarnation": p.incarnation, "attempt_token": p.attempt_token}
                       for engine, p in sorted(version.placements.items())},
    }


def _engine_row(reading: EngineReading, registry_incarnation: int | None,
                shown: frozenset[str] | None = None) -> dict[str, Any]:
    """`shown`: the managed names of the versions the registry's view holds; an adapter that holds no slot on the
    engine (UNLOADED, CLEANED, ABSENT) and names none of them is left out (counted in `adapters_left_out`).
    None: every adapter."""
    status = reading.status
    if status is None:
        return {"name": reading.name, "url": reading.url, "reachable": False, "error": reading.error,
                "incarnation": None, "registry_incarnation": registry_incarnation, "pid": None, "adapters": [],
                "adapters_left_out": 0}
    managed = {a["name"]: a for a in status.get("managed", [])}
    native = {a["name"]: a for a in status.get("adapters", [])}
    adapters = []
    left_out = 0
    for name in sorted(native.keys() | managed.keys()):
        stock, mine = native.get(name), managed.get(name)
        if (shown is not None and stock is None and mine is not None and name not in shown
                and mine["state"] not in SLOT_HOLDING_ADAPTER_STATES):
            left_out += 1
            continue
        adapters.append({
            "name": name,
            "lora_id": stock["lora_id"] if stock else (mine or {}).get("lora_id"),
            "pinned": bool(stock["pinned"]) if stock else bool((mine or {}).get("pinned")),
            "native_refcount": (stock.get("refcount") if stock else (mine or {}).get("native_refcount")),
            "managed_state": mine["state"] if mine else None,
        })
    return {"name": reading.name, "url": reading.url, "reachable": True, "error": None,
            "incarnation": status.get("incarnation"), "registry_incarnation": registry_incarnation,
            "pid": status.get("pid"), "adapters": adapters, "adapters_left_out": left_out}


def _blocking(view: PublicationView, ops: OperationsView, engines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def block(kind: str, detail: str, run: str, version: str | None = None, engine: str | None = None) -> None:
        found.append({"kind": kind, "version": version, "engine": engine, "detail": detail, "run": run})

    for key, version in sorted(view.versions.items()):
        vid = key.version_id
        unknown = sorted(e for e, p in version.placements.items() if p.state is PlacementState.UNKNOWN)
        for name in unknown:
            block(BlockingKind.OUTCOME_UNKNOWN, f"{vid} on {name}: an outcome there could not be confirmed; "
                  "the slot stays taken", "versioned-lora resolve", vid, name)
        if version.state is VersionState.LOADING:
            not_ready = sorted(e for e, p in version.placements.items() if p.state is not PlacementState.READY)
            if not_ready:
                block(BlockingKind.PUBLICATION_IN_FLIGHT, f"{vid} is being staged (not READY on "
                      f"{', '.join(not_ready)}); if its publisher is gone, resolve aborts and cleans it",
                      "versioned-lora resolve", vid)
            else:
                block(BlockingKind.READY_UNCOMMITTED, f"{vid} is READY everywhere but not committed (a commit due, "
                      "or its reply lost)", "versioned-lora resolve", vid)
        elif version.state is VersionState.ABORTED:
            pending = sorted(e for e, p in version.placements.items()
                             if p.state not in (PlacementState.CLEANED, PlacementState.ABSENT))
            block(BlockingKind.CLEANUP_PENDING, f"{vid} was aborted; cleanup not confirmed by "
                  f"{', '.join(pending) or 'the registry'}", "versioned-lora resolve", vid)
        elif version.state is VersionState.RECLAIMING:
            confirmed = set(ops.reclaim_confirmed.get(key, ()))
            missing = [e for e in view.engines if e not in confirmed]
            block(BlockingKind.RECLAIM_PENDING, f"{vid} is claimed (reclaim {version.reclaim_id}); unload not "
                  f"confirmed by {', '.join(missing)}", f"versioned-lora reclaim --version {vid}", vid)
    if ops.occupied >= ops.capacity:
        eligible = sorted(k.version_id for k, v in view.versions.items()
                          if v.state is VersionState.RETIRED and v.session_refs == 0)
        hint = (f"retired with no session refs: {', '.join(eligible)}" if eligible
                else "no retired version is free of sessions yet")
        block(BlockingKind.CAPACITY_FULL, f"{ops.occupied}/{ops.capacity} slots held; the next reserve is refused "
              f"with CAPACITY_ERROR ({hint})", "versioned-lora reclaim", None)
    for row in engines:
        if not row["reachable"]:
            block(BlockingKind.ENGINE_UNREACHABLE, f"{row['name']} ({row['url']}): {row['error']}",
                  "check the engine process and its log", None, row["name"])
        elif row["registry_incarnation"] is not None and row["incarnation"] != row["registry_incarnation"]:
            block(BlockingKind.INCARNATION_MISMATCH, f"{row['name']} runs incarnation {row['incarnation']}, "
                  f"the registry knows {row['registry_incarnation']}", "versioned-lora resolve", None,
                  row["name"])
    return found


def status_rows(view: PublicationView, ops: OperationsView, readings: Sequence[EngineReading],
                all_versions: bool = False) -> dict[str, Any]:
    """Every row `versioned-lora status` shows, as plain JSON-able values. Unless `all_versions`, an engine's
    adapters that hold no slot are shown only for the versions `view` holds."""
    default = view.versions.get(view.default) if view.default is not None else None
    versions = [_version_row(v, view.default, ops.reclaim_confirmed.get(k, ()))
                for k, v in sorted(view.versions.items())]
    shown = None if all_versions else frozenset(v.lora_name for v in view.versions.values())
    engines = [_engine_row(r, view.incarnations.get(r.name), shown) for r in readings]
    reclaims = [
        {"version_id": v["version_id"], "reclaim_id": v["reclaim_id"], "state": v["state"],
         "engines": {e: {"confirmed": e in v["reclaim_confirmed"],
                         "managed_state": _managed_state(engines, e, v["lora_name"])} for e in view.engines}}
        for v in versions if v["state"] == VersionState.RECLAIMING
    ]
    return {
        "registry": {
            "epoch": ops.epoch,
            "default": None if default is None else {"version_id": default.key.version_id,
                                                     "lora_name": default.lora_name},
            "default_revision": view.default_revision,
            "capacity": {"used": ops.occupied, "total": ops.capacity},
            "open_sessions": ops.open_sessions,
            # Ended versions (RECLAIMED, FAILED_CLEAN) left out of `versions`: `status --all` lists them.
            "versions_left_out": view.ended_left_out,
            "engines": list(view.engines),
            "incarnations": dict(sorted(view.incarnations.items())),
            # Who may publish now: a publication by anyone else is refused (LEASE_HELD) until the holder
            # releases it or stops renewing it for its ttl, or an operator takes it over (`publish --take-over`).
            "lease": {"holder": view.lease_holder, "fence": view.lease_fence,
                      "expires_in_s": None if ops.lease_expires_in_s is None else round(ops.lease_expires_in_s, 1)},
        },
        "versions": versions,
        "reclaims": reclaims,
        "engines": engines,
        "blocking": _blocking(view, ops, engines),
    }


def _managed_state(engines: Sequence[dict[str, Any]], name: str, lora_name: str) -> str | None:
    for engine in engines:
        if engine["name"] == name:
            return next((a["managed_state"] for a in engine["adapters"] if a["name"] == lora_name), None)
    return None


async def read_engine(name: str, client: SGLangClient) -> EngineReading:
    try:
        return EngineReading(name, client.base_url, await client.status())
    except (UnknownOutcome, EngineHTTPError, ValueError) as exc:
        return EngineReading(name, client.base_url, None, f"{type(exc).__name__}: {exc}"[:300])


async def gather_status(registry: Any, clients: Mapping[str, SGLangClient],
                        all_versions: bool = False) -> dict[str, Any]:
    """Read the registry (`publication_view`, `operations_view`) and every engine, and build the rows."""
    view = await registry.publication_view(all_versions)
    ops = await registry.operations_view(all_versions)
    readings = [await read_engine(name, client) for name, client in clients.items()]
    return status_rows(view, ops, readings, all_versions)


def held_per_engine(rows: Mapping[str, Any]) -> tuple[int, ...]:
    """Managed adapters each engine still holds memory for (the demo samples this)."""
    return tuple(sum(1 for a in e["adapters"] if a["managed_state"] in SLOT_HOLDING_ADAPTER_STATES)
                 for e in rows["engines"])
