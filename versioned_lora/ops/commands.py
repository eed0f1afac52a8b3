"""`versioned-lora status | publish | reclaim | resolve | diagram`: operating a running deployment (issue 21).

Each command joins the Ray cluster (`--address`), finds the registry actor by name (`--name`, `--namespace`),
and reaches the engines over HTTP (`--engines URL,...`, in the registry's engine order; `--token-file F` for
the managed endpoints). `publish`, `reclaim` and `resolve` drive the library's own Publisher and Reclaimer.
Exit statuses are the `Exit` values (README, "Operating it").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from versioned_lora.adapters.ray_registry import REGISTRY_ACTOR_NAME, REGISTRY_NAMESPACE, RayRegistry
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.ops.status_render import render_status
from versioned_lora.ops.status_view import gather_status

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024


class Exit(IntEnum):
    """Exit statuses of `publish`, `reclaim` and `resolve` (2 is argparse's usage error)."""

    OK = 0  # publish: COMMITTED; reclaim: RECLAIMED (or nothing eligible); resolve: nothing left unsettled
    ERROR = 1  # could not run: registry or engines unreachable, bad input (a typed message says which)
    REJECTED_CAPACITY = 3  # publish: REJECTED with CAPACITY_ERROR (no begin reached any engine)
    REJECTED = 4  # publish: REJECTED for another reason; reclaim: the claim was refused (e.g. NOT_RECLAIMABLE)
    FAILED_CLEAN = 5  # publish: aborted and cleaned on every engine (the slot is free again)
    UNKNOWN = 6  # publish/reclaim/resolve: an outcome is not known yet; run `versioned-lora resolve` / reclaim again
    PENDING = 7  # reclaim: claimed, some engine has not confirmed its unload; publish: REPLAYED (already reserved)


class OperationError(Exception):
    """A command cannot run (no registry actor of that name, a token file missing, ...)."""


# ---------------------------------------------------------------- connection


def add_connection_arguments(parser: argparse.ArgumentParser, *, token: bool) -> None:
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    parser.add_argument("--namespace", default=REGISTRY_NAMESPACE, help=f"registry actor namespace "
                        f"(default {REGISTRY_NAMESPACE})")
    parser.add_argument("--name", default=REGISTRY_ACTOR_NAME, help=f"registry actor name (default "
                        f"{REGISTRY_ACTOR_NAME})")
    parser.add_argument("--engines", required=True, help="engine URLs, comma-separated, in the registry's engine "
                        "order (E0,E1,...)")
    parser.add_argument("--token-file", required=token, help="file holding the engines' managed-endpoint token"
                        + ("" if token else " (status reads only the open status endpoint)"))


def connect_registry(args: argparse.Namespace) -> RayRegistry:
    import ray

    if not ray.is_initialized():
        ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    try:
        return RayRegistry.find(args.name, args.namespace, retry_deadline_s=10.0)
    except ValueError as exc:  # ray.get_actor: no actor of that name in that namespace
        raise OperationError(f"no registry actor {args.name!r} in namespace {args.namespace!r}: {exc}") from exc


def read_token(args: argparse.Namespace) -> str | None:
    if not getattr(args, "token_file", None):
        return None
    path = Path(args.token_file)
    if not path.is_file():
        raise OperationError(f"token file {path} does not exist")
    return path.read_text().strip()


async def engine_clients(registry: RayRegistry, args: argparse.Namespace) -> dict[str, SGLangClient]:
    """The engines by the registry's names for them: `--engines` lists URLs in the registry's engine order."""
    urls = [u for u in args.engines.split(",") if u]
    view = await registry.publication_view()
    if len(urls) != len(view.engines):
        raise OperationError(f"--engines gives {len(urls)} URL(s); the registry has {len(view.engines)} engines "
                             f"({', '.join(view.engines)})")
    token = read_token(args)
    return {name: SGLangClient(url, timeout_s=600.0, token=token)
            for name, url in zip(view.engines, urls, strict=True)}


def _run(main: Callable[[], Any]) -> int:
    try:
        return int(asyncio.run(main()))
    except OperationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(Exit.ERROR)


# ---------------------------------------------------------------- status


def status(args: argparse.Namespace) -> int:
    async def main() -> int:
        registry = connect_registry(args)
        clients = await engine_clients(registry, args)
        console = Console()
        try:
            if args.json:
                rows = await gather_status(registry, clients, args.all)
                print(json.dumps(rows, indent=2, sort_keys=True))
                return int(Exit.OK)
            if not args.watch:
                console.print(render_status(await gather_status(registry, clients, args.all)))
                return int(Exit.OK)
            # Ctrl-C ends the watch between two refreshes, through the event loop (not a KeyboardInterrupt raised
            # wherever the main thread happens to be: inside a Ray call, it once left the process hanging).
            stopped = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stopped.set)

            async def pause() -> None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopped.wait(), args.interval)

            if not console.is_terminal:  # a pipe or a file: one full table per refresh, each under its time
                while not stopped.is_set():
                    console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
                    console.print(render_status(await gather_status(registry, clients, args.all)))
                    sys.stdout.flush()
                    await pause()
                return int(Exit.OK)
            with Live(render_status(await gather_status(registry, clients, args.all)), console=console,
                      auto_refresh=False) as live:
                while not stopped.is_set():
                    await pause()
                    live.update(render_status(await gather_status(registry, clients, args.all)), refresh=True)
            return int(Exit.OK)
        except KeyboardInterrupt:
            return int(Exit.OK)
        finally:
            for client in clients.values():
                await client.aclose()

    try:
        return _run(main)
    except KeyboardInterrupt:
        return int(Exit.OK)


# ---------------------------------------------------------------- publish / reclaim / resolve


class PhaseDisplay:
    """The Publisher's `on_phase` callback, as a progress bar over the phases it will report:
    reserve, begin, one per bucket, end, commit."""

    def __init__(self, progress: Progress, version_id: str, bucket_count: int) -> None:
        self.expected = ["reserve", "begin", *(f"bucket_{i}" for i in range(bucket_count)), "end", "commit"]
        self.progress = progress
        self.done: list[tuple[str, float]] = []
        self.title = f"publish {version_id}"
        self.task = progress.add_task(f"{self.title}: reserve", total=len(self.expected))

    def __call__(self, _version: str, phase: str, seconds: float) -> None:
        self.done.append((phase, seconds))
        upcoming = self.expected[len(self.done)] if len(self.done) < len(self.expected) else "done"
        label = f"bucket {phase.split('_')[1]}/{len(self.expected) - 4}" if phase.startswith("bucket_") else phase
        self.progress.console.print(f"  {label:<14} {seconds:8.3f} s")
        self.progress.update(self.task, advance=1, description=f"{self.title}: {upcoming}")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=False)


def probe_prompt() -> list[int]:
    """The demo's probe prompt (the tiny fixture's: 20 ids, inside any vocabulary), from demo/ lazily: no
    module outside fixtures.py and demo/ imports the fixtures module (issue 46, item 5)."""
    from versioned_lora.demo.defaults import TINY_PROBE_PROMPT

    return list(TINY_PROBE_PROMPT)


def _ports(clients: dict[str, SGLangClient]) -> dict[str, Any]:
    from versioned_lora.adapters.engine_staging import EngineStaging

    return {name: EngineStaging(name, client, probe_prompt()) for name, client in clients.items()}


def default_holder() -> str:
    """This command's name as a holder of the publisher lease: not a trainer's (`Publisher`'s default), so a
    publication from the command line beside a running trainer is refused while the trainer holds the lease."""
    return f"cli@{socket.gethostname()}:{os.getpid()}"


def _publisher(registry: RayRegistry, ports: dict[str, Any], args: argparse.Namespace,
               on_phase: Callable[[str, str, float], None] | None = None) -> Any:
    """The Publisher over this deployment (its probe check runs the reference forward of the base model)."""
    from versioned_lora.adapters.reference_forward import ReferenceModel, ReferenceProbeCheck
    from versioned_lora.demo.defaults import build_fixtures
    from versioned_lora.runtime.publisher import Publisher

    model_dir = Path(args.model) if args.model else build_fixtures().model_dir
    probe_check = ReferenceProbeCheck(ReferenceModel(model_dir), probe_prompt())
    return Publisher(registry, ports, probe_check, on_phase=on_phase, holder=args.holder or default_holder(),
                     lease_ttl_s=args.lease_ttl, snapshots=_snapshots(args))


def _snapshots(args: argparse.Namespace) -> Any:
    """The deployment's snapshot store (`--snapshots`), or None."""
    from versioned_lora.adapters.snapshot_store import SnapshotStore

    return SnapshotStore(args.snapshots, args.bucket_bytes) if args.snapshots else None


async def _take_over_first(publisher: Any, args: argparse.Namespace, console: Console) -> None:
    """`--take-over`: end whatever lease is live now and take it (lease.take_over), before anything else."""
    if args.take_over:
        granted = await publisher.acquire_lease(take_over=True)
        console.print(f"publisher lease taken over: {granted!r}")


def _reclaimer(registry: RayRegistry, ports: dict[str, Any]) -> Any:
    from versioned_lora.runtime.reclaimer import Reclaimer

    return Reclaimer(registry, ports)


async def _close(ports: dict[str, Any], clients: dict[str, SGLangClient]) -> None:
    for port in ports.values():
        port.close()
    for client in clients.values():
        await client.aclose()


def publish_exit(status: str, reason: str | None) -> Exit:
    if status == "COMMITTED":
        return Exit.OK
    if status == "REJECTED":
        return Exit.REJECTED_CAPACITY if reason == "CAPACITY_ERROR" else Exit.REJECTED
    return {"FAILED_CLEAN": Exit.FAILED_CLEAN, "UNKNOWN": Exit.UNKNOWN, "REPLAYED": Exit.PENDING}[status]


def reclaim_exit(status: str) -> Exit:
    return {"RECLAIMED": Exit.OK, "REJECTED": Exit.REJECTED, "PENDING": Exit.PENDING, "UNKNOWN": Exit.UNKNOWN}[status]


def publish(args: argparse.Namespace) -> int:
    async def main() -> int:
        from versioned_lora.adapters.engine_link import Candidate
        from versioned_lora.adapters.snapshot import SnapshotError, snapshot_from_adapter_dir
        from versioned_lora.lifecycle import VersionKey
        from versioned_lora.spec.identities import InvalidIdentity, check_version_identity, lora_name

        console = Console()
        registry = connect_registry(args)
        ops = await registry.operations_view()
        version = VersionKey(ops.epoch, args.version_id)
        try:
            snapshot = snapshot_from_adapter_dir(args.peft_dir)
            check_version_identity(version, snapshot.digest)
        except (SnapshotError, InvalidIdentity) as exc:
            raise OperationError(f"{type(exc).__name__}: {exc}") from exc
        candidate = Candidate.build(lora_name(version, snapshot.digest), snapshot, args.bucket_bytes)
        console.print(f"snapshot {args.peft_dir}: digest {snapshot.digest[:12]}..., {len(snapshot.tensors)} tensors, "
                      f"{candidate.bucket_count} bucket(s); name {candidate.lora_name}")
        clients = await engine_clients(registry, args)
        ports = _ports(clients)
        try:
            with _progress(console) as progress:
                display = PhaseDisplay(progress, args.version_id, candidate.bucket_count)
                publisher = _publisher(registry, ports, args, on_phase=display)
                publisher.probe_check.reference(candidate)
                await _take_over_first(publisher, args, console)
                await publisher.sync_incarnations()
                outcome = await publisher.publish(version, candidate)
                if str(outcome.status) != "UNKNOWN":  # an unknown outcome keeps it: `resolve --holder` finishes
                    await publisher.release_lease()  # under the same fence (until the lease's ttl runs out)
        finally:
            await _close(ports, clients)
        code = publish_exit(str(outcome.status), outcome.reason)
        receipt = {"status": str(outcome.status), "reason": outcome.reason, "version_id": version.version_id,
                   "epoch": version.epoch, "lora_name": outcome.lora_name, "attempt_token": outcome.attempt_token,
                   "default_revision": outcome.default_revision, "version_state": outcome.version_state,
                   "phases": [[phase, seconds] for phase, seconds in outcome.phases.items()],  # in order
                   "detail": outcome.detail, "exit": int(code)}
        style = "green" if code is Exit.OK else "red"
        console.print(f"[{style}]{outcome.status}[/{style}]" + (f" {outcome.reason}" if outcome.reason else "")
                      + (f" default revision {outcome.default_revision}" if outcome.default_revision else ""))
        print("RECEIPT " + json.dumps(receipt, sort_keys=True, default=str), flush=True)
        return int(code)

    return _run(main)


def reclaim(args: argparse.Namespace) -> int:
    async def main() -> int:
        from versioned_lora.lifecycle import VersionKey
        from versioned_lora.spec.states import VersionState

        console = Console()
        registry = connect_registry(args)
        view = await registry.publication_view()
        if args.version:
            targets = [k for k in view.versions if k.version_id == args.version]
            if not targets:
                raise OperationError(f"the registry knows no version {args.version!r}")
        else:  # every version the registry may let go now, and every claim not finished yet
            targets = sorted(k for k, v in view.versions.items() if v.state is VersionState.RECLAIMING
                             or (v.state is VersionState.RETIRED and v.session_refs == 0))
        if not targets:
            console.print("nothing eligible: no RETIRED version without session refs, no reclaim in progress")
            print("RECEIPT " + json.dumps({"reclaims": [], "exit": 0}), flush=True)
            return int(Exit.OK)
        clients = await engine_clients(registry, args)
        ports = _ports(clients)
        reclaimer = _reclaimer(registry, ports)
        outcomes = []
        try:
            with _progress(console) as progress:
                task = progress.add_task("reclaim", total=len(targets))
                for key in targets:
                    progress.update(task, description=f"reclaim {key.version_id}")
                    outcome = await reclaimer.reclaim(VersionKey(*key))
                    outcomes.append(outcome)
                    progress.console.print(f"  {key.version_id:<14} {outcome.status}"
                                           + (f" {outcome.reason}" if outcome.reason else "")
                                           + f" confirmed by {', '.join(outcome.confirmed) or 'none'}"
                                           + f" ({outcome.seconds:.2f} s)")
                    progress.advance(task)
        finally:
            await _close(ports, clients)
        codes = [reclaim_exit(str(o.status)) for o in outcomes]
        code = max(codes, key=lambda c: (c is not Exit.OK, c))
        print("RECEIPT " + json.dumps({"reclaims": [
            {"version_id": o.version.version_id, "status": str(o.status), "reason": o.reason,
             "reclaim_id": o.reclaim_id, "confirmed": list(o.confirmed), "seconds": o.seconds} for o in outcomes],
            "exit": int(code)}, sort_keys=True), flush=True)
        return int(code)

    return _run(main)


def resolve(args: argparse.Namespace) -> int:
    """Settle what unknown outcomes left, through the drivers, under the same keys: each engine's incarnation
    reported (with `--snapshots`, the restart supervisor also rehydrates a restarted engine with every version
    the registry's answer names, read from the store), the Publisher's recovery (a LOADING attempt's commit is
    sent and the table decides: committed if READY everywhere, else refused and aborted and cleaned; an ABORTED
    one is aborted again, its answer naming the cleanups), then every unfinished reclaim is claimed again (same
    claim key)."""

    async def main() -> int:
        from versioned_lora.spec.states import VersionState

        console = Console()
        registry = connect_registry(args)
        clients = await engine_clients(registry, args)
        ports = _ports(clients)
        publisher, reclaimer = _publisher(registry, ports, args), _reclaimer(registry, ports)
        lines: list[dict[str, Any]] = []

        def note(version_id: str, action: str, status: object, reason: str | None) -> None:
            lines.append({"version_id": version_id, "action": action, "status": str(status), "reason": reason})

        try:
            await _take_over_first(publisher, args, console)
            if publisher.snapshots is None:
                with console.status("syncing engine incarnations"):
                    await publisher.sync_incarnations()
            else:
                from versioned_lora.runtime.supervisor import ReconcileStatus, RestartSupervisor

                with console.status("syncing engine incarnations, rehydrating restarted engines"):
                    for reconciled in await RestartSupervisor(publisher).reconcile_all():
                        action = f"rehydrate {reconciled.engine}"
                        if reconciled.status is not ReconcileStatus.RECONCILED:  # nothing adopted, or not known
                            note("*", action, reconciled.status, reconciled.reason)
                        for key in reconciled.rehydrated:
                            note(key.version_id, action, "REHYDRATED", None)
                        for key, why in reconciled.failed:
                            note(key.version_id, action, "REHYDRATE_FAILED", why)
            with console.status("recovering pending publication attempts"):
                for outcome in await publisher.recover():
                    note(outcome.version.version_id, "publication", outcome.status, outcome.reason)
            view = await registry.publication_view()
            for key, version in sorted(view.versions.items()):
                if version.state is VersionState.RECLAIMING:
                    with console.status(f"finishing the reclaim of {key.version_id}"):
                        reclaimed = await reclaimer.reclaim(key)
                    note(key.version_id, "reclaim", reclaimed.status, reclaimed.reason)
            if not publisher.commit_unresolved:
                await publisher.release_lease()
        finally:
            await _close(ports, clients)
        for line in lines:
            console.print(f"  {line['action']:<12} {line['version_id']:<14} {line['status']}"
                          + (f" {line['reason']}" if line["reason"] else ""))
        if not lines:
            console.print("nothing to resolve")
        settled = {"COMMITTED", "FAILED_CLEAN", "RECLAIMED", "REHYDRATED"}
        code = Exit.OK if all(line["status"] in settled for line in lines) else Exit.UNKNOWN
        print("RECEIPT " + json.dumps({"resolved": lines, "exit": int(code)}, sort_keys=True), flush=True)
        return int(code)

    return _run(main)


# ---------------------------------------------------------------- diagram


def mermaid(machine: str | None) -> str:
    """The Mermaid state diagram(s) of the table, as `spec.render` draws them for docs/state-machines.md."""
    from versioned_lora.spec.render import render_state_machines
    from versioned_lora.spec.states import Machine

    document = render_state_machines()
    blocks: dict[str, str] = {}
    for section in document.split("\n## ")[1:]:
        name, _, rest = section.partition("\n")
        blocks[name.strip()] = rest.split("```mermaid\n", 1)[1].split("```", 1)[0]
    if machine is None:
        return "\n".join(f"%% {name}\n{block}" for name, block in blocks.items())
    if machine not in blocks:
        raise OperationError(f"unknown machine {machine!r}; one of {', '.join(m.value for m in Machine)}")
    return blocks[machine]


def diagram(args: argparse.Namespace) -> int:
    try:
        sys.stdout.write(mermaid(args.machine))
    except OperationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(Exit.ERROR)
    return int(Exit.OK)


# ---------------------------------------------------------------- argparse


def add_lease_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--holder", help="this publisher's name for the publisher lease (default: cli@HOST:PID; a "
                   "trainer's Publisher is 'publisher')")
    p.add_argument("--take-over", action="store_true", help="end the live publisher lease at once and take it "
                   "(its holder is known to be gone); without it, a lease held by another is refused (exit 4)")
    p.add_argument("--lease-ttl", type=float, default=60.0, help="seconds the lease lasts without a renewal")


def add_snapshots_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshots", metavar="DIR", help="the deployment's snapshot store: publish writes the version "
                   "there before its commit; resolve rehydrates restarted engines from it (default: none)")


def add_commands(sub: Any) -> None:
    from versioned_lora.spec.states import Machine

    p = sub.add_parser("status", help="versions, placements, reclaims, engines, and what blocks the next publication")
    add_connection_arguments(p, token=False)
    p.add_argument("--json", action="store_true", help="the rows as JSON (for scripts)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--all", action="store_true", help="every version of the epoch and every adapter each engine "
                   "reports (default: live versions, the last few ended ones, and what they name on the engines)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=status)

    p = sub.add_parser("publish", help="publish a PEFT adapter directory as a new version")
    p.add_argument("peft_dir", metavar="PEFT_DIR")
    p.add_argument("--version-id", required=True)
    add_connection_arguments(p, token=True)
    p.add_argument("--model", help="base model directory for the probe's reference forward (default: tiny fixture)")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    add_lease_arguments(p)
    add_snapshots_argument(p)
    p.set_defaults(func=publish)

    p = sub.add_parser("reclaim", help="claim and reclaim what is eligible (or one version)")
    p.add_argument("--version", help="version id (default: every RETIRED version without session refs, and "
                   "every reclaim in progress)")
    add_connection_arguments(p, token=True)
    p.set_defaults(func=reclaim)

    p = sub.add_parser("resolve", help="settle unknown outcomes: recover pending attempts, finish reclaims")
    add_connection_arguments(p, token=True)
    p.add_argument("--model", help="base model directory for the probe's reference forward (default: tiny fixture)")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, help="bucket size of a rehydrate")
    add_lease_arguments(p)
    add_snapshots_argument(p)
    p.set_defaults(func=resolve)

    p = sub.add_parser("diagram", help="print the Mermaid state diagram of the transition table")
    p.add_argument("machine", nargs="?", metavar="MACHINE", help=f"one of {', '.join(m.value for m in Machine)} "
                   "(default: all)")
    p.set_defaults(func=diagram)


__all__ = ["Exit", "OperationError", "add_commands", "mermaid", "publish_exit", "reclaim_exit"]
