"""`versioned-lora status | publish | reclaim | resolve | diagram`: operating a running deployment (issue 21).

Each command joins the Ray cluster (`--address`), finds the registry actor by name (`--name`, `--namespace`),
and reaches the engines over HTTP at the URLs the registry recorded (or `--engines URL,...`, in the registry's
engine order; `--token-file F` for the managed endpoints), all through the library's API (`versioned_lora.api`,
`connect`): nothing here builds a protocol object.
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

from versioned_lora.api import (
    DEFAULT_BUCKET_BYTES,
    REGISTRY_ACTOR_NAME,
    REGISTRY_NAMESPACE,
    Deployment,
    DeploymentError,
    InvalidSource,
    connect,
    start_registry,
    stop_registry,
)
from versioned_lora.ops.status_render import render_status


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


# The connection settings, written once: in a profile (a TOML file named by --profile or $VERSIONED_LORA_PROFILE,
# which `versioned-lora registry --write-profile PATH` writes), or per setting in an environment variable. A flag
# wins over its environment variable, which wins over the profile, which wins over the built-in default.
ADDRESS_ENV, REGISTRY_ENV = "VERSIONED_LORA_ADDRESS", "VERSIONED_LORA_REGISTRY"
NAMESPACE_ENV, TOKEN_FILE_ENV = "VERSIONED_LORA_NAMESPACE", "VERSIONED_LORA_TOKEN_FILE"
PROFILE_ENV = "VERSIONED_LORA_PROFILE"
# Every setting a profile may hold, with its type and its built-in default (None: none).
PROFILE_SETTINGS: dict[str, tuple[type, Any]] = {
    "address": (str, "auto"), "name": (str, REGISTRY_ACTOR_NAME), "namespace": (str, REGISTRY_NAMESPACE),
    "engines": (str, None), "token_file": (str, None), "probe_ids": (str, None), "probe_file": (str, None),
    "probe_top_logit": (float, None), "reference_model": (str, None),
}


def add_connection_arguments(parser: argparse.ArgumentParser, *, token: bool) -> None:
    env = os.environ
    parser.add_argument("--profile", default=env.get(PROFILE_ENV), metavar="PATH", help=f"a TOML file of these "
                        f"settings, written once (default: ${PROFILE_ENV}; `versioned-lora registry --write-profile` "
                        f"writes one)")
    parser.add_argument("--address", default=env.get(ADDRESS_ENV), help=f"Ray cluster address (default: "
                        f"${ADDRESS_ENV}, else the profile's, else auto)")
    parser.add_argument("--namespace", default=env.get(NAMESPACE_ENV), help=f"registry actor namespace (default: "
                        f"${NAMESPACE_ENV}, else the profile's, else {REGISTRY_NAMESPACE})")
    parser.add_argument("--name", default=env.get(REGISTRY_ENV), help=f"registry actor name (default: "
                        f"${REGISTRY_ENV}, else the profile's, else {REGISTRY_ACTOR_NAME})")
    parser.add_argument("--engines", help="engine URLs, comma-separated, in the registry's engine order (E0,E1,...), "
                        "or NAME=URL,... (default: the profile's, else the URLs the registry recorded)")
    parser.add_argument("--token-file", default=env.get(TOKEN_FILE_ENV),
                        help=f"file holding the engines' managed-endpoint token (default: ${TOKEN_FILE_ENV}, else the "
                        f"profile's)" + ("; needed" if token else "; status reads only the open status endpoint"))
    parser.set_defaults(needs_token=token)


def read_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A profile's settings, checked: an unknown key or a value of the wrong type is an OperationError."""
    import tomllib

    try:
        with open(path, "rb") as file:
            profile = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise OperationError(f"cannot read the profile {path}: {exc}") from exc
    unknown = sorted(set(profile) - set(PROFILE_SETTINGS))
    if unknown:
        raise OperationError(f"profile {path}: unknown setting(s) {unknown}; known: {sorted(PROFILE_SETTINGS)}")
    for key, value in profile.items():
        kind = PROFILE_SETTINGS[key][0]
        if not isinstance(value, kind) and not (kind is float and isinstance(value, int) and
                                                not isinstance(value, bool)):
            raise OperationError(f"profile {path}: {key} must be a {kind.__name__}, got {value!r}")
    return {key: float(value) if PROFILE_SETTINGS[key][0] is float else value for key, value in profile.items()}


def write_profile(path: str | os.PathLike[str], settings: dict[str, Any]) -> None:
    """Write a profile of `settings` (the keys of PROFILE_SETTINGS whose value is not None)."""
    lines = ["# versioned-lora profile: the connection settings every command reads (--profile or "
             f"${PROFILE_ENV}); a flag or an environment variable overrides each."]
    for key, value in settings.items():
        if key not in PROFILE_SETTINGS:
            raise ValueError(f"not a profile setting: {key}")
        if value is not None:
            lines.append(f"{key} = {json.dumps(value)}")  # a JSON string or number is a TOML one
    Path(path).write_text("\n".join(lines) + "\n")


def settle_connection(args: argparse.Namespace) -> None:
    """Fill every setting no flag or environment variable gave: from the profile, else the built-in default."""
    profile = read_profile(args.profile) if getattr(args, "profile", None) else {}
    if getattr(args, "probe_ids", None) or getattr(args, "probe_file", None):
        profile = {k: v for k, v in profile.items() if k not in ("probe_ids", "probe_file")}  # one probe: the flag's
    for key, (_, default) in PROFILE_SETTINGS.items():
        if hasattr(args, key) and getattr(args, key) is None:
            setattr(args, key, profile.get(key, default))
    if getattr(args, "needs_token", False) and not args.token_file:
        raise OperationError(f"this command needs the engines' token: --token-file, ${TOKEN_FILE_ENV}, or token_file "
                             f"in the profile")


async def connect_args(args: argparse.Namespace, *, probe: bool = False,
                       on_phase: Callable[[str, str, float], None] | None = None) -> Deployment:
    """The deployment these arguments name, through the library's API (`versioned_lora.connect`), with no reclaim
    loop (a command does what it is asked, once). `probe`: publishing or resolving (a probe check, the lease)."""
    settle_connection(args)
    kwargs: dict[str, Any] = {}
    if probe:
        kwargs.update(probe_prompt=probe_ids(args), probe_top_logit=args.probe_top_logit,
                      reference_model=args.reference_model, holder=args.holder or default_holder(),
                      lease_ttl_s=args.lease_ttl,
                      snapshots=args.snapshots, bucket_bytes=args.bucket_bytes, on_phase=on_phase)
    try:
        return await connect(address=args.address, registry=args.name, namespace=args.namespace,
                             engines=args.engines or None, token_file=getattr(args, "token_file", None),
                             auto_reclaim=False, **kwargs)
    except (DeploymentError, ValueError) as exc:
        raise OperationError(str(exc)) from exc


def _run(main: Callable[[], Any]) -> int:
    try:
        return int(asyncio.run(main()))
    except OperationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(Exit.ERROR)


# ---------------------------------------------------------------- status


def status(args: argparse.Namespace) -> int:
    async def main() -> int:
        deployment = await connect_args(args)
        console = Console()
        try:
            if args.json:
                rows = await deployment.status(args.all)
                print(json.dumps(rows, indent=2, sort_keys=True))
                return int(Exit.OK)
            if not args.watch:
                console.print(render_status(await deployment.status(args.all)))
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
                    console.print(render_status(await deployment.status(args.all)))
                    sys.stdout.flush()
                    await pause()
                return int(Exit.OK)
            with Live(render_status(await deployment.status(args.all)), console=console, auto_refresh=False) as live:
                while not stopped.is_set():
                    await pause()
                    live.update(render_status(await deployment.status(args.all)), refresh=True)
            return int(Exit.OK)
        except KeyboardInterrupt:
            return int(Exit.OK)
        finally:
            await deployment.close()

    try:
        return _run(main)
    except KeyboardInterrupt:
        return int(Exit.OK)


# ---------------------------------------------------------------- publish / reclaim / resolve


class PhaseDisplay:
    """The deployment's `on_phase` callback, as a progress bar over the phases it will report:
    reserve, begin, one per bucket, end, commit."""

    def __init__(self, progress: Progress, version_id: str) -> None:
        self.progress = progress
        self.version_id = version_id
        self.expected: list[str] = []
        self.done: list[tuple[str, float]] = []
        self.title = f"publish {version_id}"
        self.task = progress.add_task(f"{self.title}: reserve", total=None)

    def expect(self, bucket_count: int) -> None:
        self.expected = ["reserve", "begin", *(f"bucket_{i}" for i in range(bucket_count)), "end", "commit"]
        self.progress.update(self.task, total=len(self.expected))

    def __call__(self, _version: str, phase: str, seconds: float) -> None:
        self.done.append((phase, seconds))
        upcoming = self.expected[len(self.done)] if len(self.done) < len(self.expected) else "done"
        label = f"bucket {phase.split('_')[1]}/{len(self.expected) - 4}" if phase.startswith("bucket_") else phase
        self.progress.console.print(f"  {label:<14} {seconds:8.3f} s")
        self.progress.update(self.task, advance=1, description=f"{self.title}: {upcoming}")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=False)


def probe_ids(args: argparse.Namespace) -> list[int]:
    """The probe's token ids: `--probe-ids`, or `--probe-file` (ids separated by commas or whitespace; `#` starts a
    comment), else the fixtures' 20 ids (from demo/ lazily: no module outside fixtures.py and demo/ imports the
    fixtures module). The engines start with --skip-tokenizer-init: ids, never text, go on the wire."""
    if args.probe_ids and args.probe_file:
        raise OperationError("give --probe-ids or --probe-file, not both")
    text = args.probe_ids
    if args.probe_file:
        try:
            text = "\n".join(line.split("#", 1)[0] for line in Path(args.probe_file).read_text().splitlines())
        except OSError as exc:
            raise OperationError(f"cannot read --probe-file: {exc}") from exc
    if not text:
        from versioned_lora.demo.defaults import TINY_PROBE_PROMPT

        return list(TINY_PROBE_PROMPT)
    try:
        ids = [int(word) for word in text.replace(",", " ").split()]
    except ValueError as exc:
        raise OperationError(f"the probe must be token ids (integers): {exc}") from exc
    if len(ids) < 2 or any(i < 0 for i in ids):
        raise OperationError(f"the probe needs at least two token ids, none negative: {ids}")
    return ids


def default_holder() -> str:
    """This command's name as a holder of the publisher lease: not a trainer's (`connect`'s default), so a
    publication from the command line beside a running trainer is refused while the trainer holds the lease."""
    return f"cli@{socket.gethostname()}:{os.getpid()}"


async def _take_over_first(deployment: Deployment, args: argparse.Namespace, console: Console) -> None:
    """`--take-over`: end whatever lease is live now and take it (lease.take_over), before anything else."""
    if args.take_over:
        granted = await deployment.take_over_lease()
        console.print(f"publisher lease taken over: {granted!r}")


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
        console = Console()
        with _progress(console) as progress:
            display = PhaseDisplay(progress, args.version_id)
            deployment = await connect_args(args, probe=True, on_phase=display)
            try:
                try:
                    candidate = await asyncio.to_thread(deployment.prepare, args.version_id, args.peft_dir)
                except InvalidSource as exc:
                    raise OperationError(str(exc)) from exc
                progress.console.print(f"snapshot {args.peft_dir}: digest {candidate.digest[:12]}..., "
                                       f"{len(candidate.snapshot.tensors)} tensors, {candidate.bucket_count} "
                                       f"bucket(s); name {candidate.lora_name}")
                display.expect(candidate.bucket_count)
                await _take_over_first(deployment, args, progress.console)
                result = await deployment.publish(args.version_id, args.peft_dir, candidate=candidate,
                                                  wait_for_slot_s=args.wait_for_slot)
            finally:
                # an unknown outcome keeps the lease: `resolve --holder` finishes under the same fence
                await deployment.close()
        code = publish_exit(result.status, result.code if result.status != "REPLAYED" else None)
        receipt = {"status": result.status, "outcome": str(result.outcome),
                   "reason": result.code if result.status != "REPLAYED" else None,
                   "version_id": result.version_id, "epoch": result.epoch, "lora_name": result.lora_name,
                   "attempt_token": result.attempt_token, "default_revision": result.default_revision,
                   "version_state": result.version_state, "resolve": result.resolve,
                   "phases": [[phase, seconds] for phase, seconds in result.phases.items()],  # in order
                   "detail": result.detail, "exit": int(code)}
        style = "green" if code is Exit.OK else "red"
        console.print(f"[{style}]{result.status}[/{style}]" + (f" {result.code}" if result.code else "")
                      + (f" default revision {result.default_revision}" if result.default_revision else ""))
        print("RECEIPT " + json.dumps(receipt, sort_keys=True, default=str), flush=True)
        return int(code)

    return _run(main)


def reclaim(args: argparse.Namespace) -> int:
    async def main() -> int:
        console = Console()
        deployment = await connect_args(args)
        try:
            if args.version:
                view = await deployment.registry.publication_view()
                if not any(k.version_id == args.version for k in view.versions):
                    raise OperationError(f"the registry knows no version {args.version!r}")
                targets = [args.version]
            else:  # every version the registry may let go now, and every claim not finished yet
                targets = await deployment.eligible()
            if not targets:
                console.print("nothing eligible: no RETIRED version without session refs, no reclaim in progress")
                print("RECEIPT " + json.dumps({"reclaims": [], "exit": 0}), flush=True)
                return int(Exit.OK)
            outcomes = []
            with _progress(console) as progress:
                task = progress.add_task("reclaim", total=len(targets))
                for version_id in targets:
                    progress.update(task, description=f"reclaim {version_id}")
                    outcome = await deployment.reclaim(version_id)
                    outcomes.append(outcome)
                    progress.console.print(f"  {version_id:<14} {outcome.status}"
                                           + (f" {outcome.reason}" if outcome.reason else "")
                                           + f" confirmed by {', '.join(outcome.confirmed) or 'none'}"
                                           + f" ({outcome.seconds:.2f} s)")
                    progress.advance(task)
        finally:
            await deployment.close()
        codes = [reclaim_exit(o.status) for o in outcomes]
        code = max(codes, key=lambda c: (c is not Exit.OK, c))
        print("RECEIPT " + json.dumps({"reclaims": [
            {"version_id": o.version_id, "status": o.status, "reason": o.reason,
             "reclaim_id": o.reclaim_id, "confirmed": list(o.confirmed), "seconds": o.seconds} for o in outcomes],
            "exit": int(code)}, sort_keys=True), flush=True)
        return int(code)

    return _run(main)


def resolve(args: argparse.Namespace) -> int:
    """Settle what unknown outcomes left, through the drivers, under the same keys (`Deployment.resolve`): each
    engine's incarnation reported (with `--snapshots`, the restart supervisor also rehydrates a restarted engine
    with every version the registry's answer names, read from the store), the Publisher's recovery (a LOADING
    attempt's commit is sent and the table decides: committed if READY everywhere, else refused and aborted and
    cleaned; an ABORTED one is aborted again, its answer naming the cleanups), then every unfinished reclaim is
    claimed again (same claim key)."""

    async def main() -> int:
        console = Console()
        deployment = await connect_args(args, probe=True)
        try:
            await _take_over_first(deployment, args, console)
            with console.status("settling: engine incarnations, pending attempts, unfinished reclaims"):
                resolved = await deployment.resolve()
        finally:
            await deployment.close()  # gives the lease back unless a commit is still unresolved
        lines = [{"version_id": r.version_id, "action": r.action, "status": r.status, "reason": r.reason}
                 for r in resolved]
        for line in lines:
            console.print(f"  {line['action']:<12} {line['version_id']:<14} {line['status']}"
                          + (f" {line['reason']}" if line["reason"] else ""))
        if not lines:
            console.print("nothing to resolve")
        code = Exit.OK if all(r.settled for r in resolved) else Exit.UNKNOWN
        print("RECEIPT " + json.dumps({"resolved": lines, "exit": int(code)}, sort_keys=True), flush=True)
        return int(code)

    return _run(main)


# ---------------------------------------------------------------- registry


def registry(args: argparse.Namespace) -> int:
    """Start the registry actor over `--journal`, recording the engines' URLs; `--detach`: leave it running in the
    cluster and exit; otherwise serve in the foreground until SIGINT or SIGTERM, then end the actor (the journal
    stays: starting again recovers it)."""
    if args.detach and args.address == "local":
        print("error: --detach needs a cluster that outlives this command (--address auto or ADDRESS, after "
              "`ray start --head`)", file=sys.stderr)
        return int(Exit.ERROR)
    try:
        info = start_registry(args.journal, args.engines, key_file=args.key_file, capacity=args.capacity,
                              epoch=args.epoch, address=None if args.address == "local" else args.address,
                              name=args.name, namespace=args.namespace, detached=args.detach)
    except (ValueError, ConnectionError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(Exit.ERROR)
    engines = ",".join(f"{name}={url}" for name, url in info.engines.items())
    print(f"registry {info.name!r} (namespace {info.namespace!r}) at Ray address {info.address}: epoch {info.epoch}, "
          f"engines {engines}, journal {info.journal}" + ("; detached: `versioned-lora registry-stop` ends it"
                                                          if info.detached else ""), flush=True)
    print("REGISTRY " + json.dumps({"address": info.address, "name": info.name, "namespace": info.namespace,
                                    "epoch": info.epoch, "engines": dict(info.engines), "journal": info.journal,
                                    "detached": info.detached}, sort_keys=True), flush=True)
    if args.write_profile:
        write_profile(args.write_profile, {"address": info.address, "name": info.name, "namespace": info.namespace,
                                           "token_file": str(Path(args.token_file).resolve()) if args.token_file
                                           else None})
        print(f"profile written to {args.write_profile}: every other command needs only --profile "
              f"{args.write_profile} (or ${PROFILE_ENV})", flush=True)
    if args.detach:
        return int(Exit.OK)
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    while not stop:
        time.sleep(0.2)
    stop_registry(info.name, info.namespace, address=None)
    print("registry stopped (its journal keeps every call)", flush=True)
    return int(Exit.OK)


def registry_stop(args: argparse.Namespace) -> int:
    try:
        stop_registry(args.name, args.namespace, address=args.address)
    except ValueError as exc:
        print(f"error: no registry actor {args.name!r} in namespace {args.namespace!r}: {exc}", file=sys.stderr)
        return int(Exit.ERROR)
    print(f"registry {args.name!r} stopped", flush=True)
    return int(Exit.OK)


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


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--probe-ids", metavar="ID,ID,...", help="the probe's token ids, in the served model's "
                        "vocabulary (choose them for a real model; default: the fixtures' 20 ids, 10..29)")
    parser.add_argument("--probe-file", metavar="PATH", help="a file of the probe's token ids (commas or "
                        "whitespace between them; # starts a comment)")
    parser.add_argument("--probe-top-logit", type=float, metavar="M", help="the magnitude of the served model's "
                        "top logits, which the engines' agreement tolerance is derived from (default: 32)")
    parser.add_argument("--reference-model", metavar="DIR", help="check the engines' probe scores against a "
                        "forward of this base model instead of against each other (small models and tests)")


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
    add_probe_arguments(p)
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    p.add_argument("--wait-for-slot", type=float, metavar="SECONDS", help="refused for capacity: reclaim what is "
                   "eligible and wait up to SECONDS for a free slot, then publish (default: exit 3 at once)")
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
    add_probe_arguments(p)
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, help="bucket size of a rehydrate")
    add_lease_arguments(p)
    add_snapshots_argument(p)
    p.set_defaults(func=resolve)

    p = sub.add_parser("registry", help="run the registry actor over a journal, recording the engines' URLs")
    p.add_argument("--journal", required=True, metavar="PATH", help="the registry's SQLite journal (created if "
                   "absent; it keeps every call and the deployment's epoch)")
    p.add_argument("--engines", required=True, metavar="NAME=URL,...", help="the engines, named (E0=http://..."
                   ",E1=...) or as URLs in order (named E0, E1, ...)")
    p.add_argument("--key-file", help="the capability key file the engines were started with")
    p.add_argument("--capacity", type=int, default=2, help="managed adapter slots per engine (default 2)")
    p.add_argument("--epoch", type=int, help="the deployment epoch (default: the journal's, else the current Unix "
                   "time in microseconds: a fresh epoch per fresh journal)")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto, after `ray start --head`;"
                   " local: a cluster of this process's own, foreground only)")
    p.add_argument("--namespace", default=REGISTRY_NAMESPACE)
    p.add_argument("--name", default=REGISTRY_ACTOR_NAME)
    p.add_argument("--detach", action="store_true", help="leave the actor running in the cluster and exit "
                   "(default: serve in the foreground until Ctrl-C or SIGTERM)")
    p.add_argument("--write-profile", metavar="PATH", help="write the connection settings (the cluster's address, "
                   "the actor's name and namespace, --token-file if given) to a profile every other command reads")
    p.add_argument("--token-file", help="the engines' token file, recorded in the profile (the registry itself never "
                   "reads it)")
    p.set_defaults(func=registry)

    p = sub.add_parser("registry-stop", help="end a detached registry actor (its journal stays)")
    p.add_argument("--address", default="auto")
    p.add_argument("--namespace", default=REGISTRY_NAMESPACE)
    p.add_argument("--name", default=REGISTRY_ACTOR_NAME)
    p.set_defaults(func=registry_stop)

    p = sub.add_parser("diagram", help="print the Mermaid state diagram of the transition table")
    p.add_argument("machine", nargs="?", metavar="MACHINE", help=f"one of {', '.join(m.value for m in Machine)} "
                   "(default: all)")
    p.set_defaults(func=diagram)


__all__ = ["Exit", "OperationError", "add_commands", "mermaid", "publish_exit", "reclaim_exit", "registry"]
