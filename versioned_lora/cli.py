"""``versioned-lora``: command-line entry points.

- ``versioned-lora engine --port P --model DIR [--from-peft-config ADAPTER_DIR | --max-lora-rank R
  --lora-target-modules M ...] [--ready-file F] [-- SGLANG_ARGS...]``: one SGLang engine with the versioned-lora
  patches, serving adapters of that rank and those modules; ready when F exists (or GET /health answers); SIGINT
  or SIGTERM stops it cleanly; with
  the managed set and no ``$VERSIONED_LORA_TOKEN``, a new token is written 0600 to ``<log>.token``; its
  capability key is ``--capability-key-file`` (or ``$VERSIONED_LORA_CAPABILITY_KEY_FILE``); without one a managed
  engine is not started (no key is invented: one deployment, one key, which the registry actor reads too).
- ``versioned-lora keygen PATH``: a new capability key, written 0600 to PATH (never over an existing file).
- ``versioned-lora fixtures [--fixture NAME]``: build (or find in the cache) a fixture model and adapters A, B, C
  (``tiny``, the default, ``qwen3-0.6b-shape`` or ``tiny-real-logits``).
- ``versioned-lora demo``: the main job on two local CPU engines.
- ``versioned-lora registry --journal PATH --engines NAME=URL,... [--detach]``: the registry actor, recording the
  engines' URLs, and ``versioned-lora status | publish | reclaim | resolve | diagram``: operating a running deployment
  with only the registry's address (``versioned_lora/ops/commands.py``, through ``versioned_lora.api``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from versioned_lora import capabilities
from versioned_lora.adapters.engine_process import (
    DEFAULT_PATCHES,
    EngineConfig,
    EngineProcess,
    EngineStartError,
    default_log_path,
)
from versioned_lora.spec.wire import SOURCE_ROOT_ENV, TOKEN_ENV, TOKEN_HEADER


def write_token_file(path: Path, token: str) -> Path:
    """Write `token` to `path`, readable by its owner only (0600 from its creation, never wider)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    staged.replace(path)
    return path


def engine_token(patches: tuple[str, ...], log_path: Path) -> tuple[dict[str, str], Path | None]:
    """The token a managed engine requires: $VERSIONED_LORA_TOKEN if set, else a new one written 0600
    beside the log (`<log>.token`). Returns the engine's env and the file written, if any."""
    if "managed" not in patches:
        return {}, None
    token = os.environ.get(TOKEN_ENV)
    if token:
        return {TOKEN_ENV: token}, None
    token = secrets.token_hex(32)
    return {TOKEN_ENV: token}, write_token_file(log_path.with_name(f"{log_path.name}.token"), token)


class NoCapabilityKey(SystemExit):
    """`versioned-lora engine` with the managed patch set and no key: a clear error, never an invented key (two
    engines inventing one each would hold two keys, and no registry could serve both: issue 41)."""


def engine_capability_key(patches: tuple[str, ...], given: str | None) -> dict[str, str]:
    """The capability key file a managed engine requires (docs/runbook.md, 'KEY_MISMATCH'): `given`, else
    $VERSIONED_LORA_CAPABILITY_KEY_FILE or $VERSIONED_LORA_CAPABILITY_KEY as set (inherited by the engine's
    process). Returns the engine's env; raises NoCapabilityKey when there is none."""
    if "managed" not in patches:
        return {}
    if given:
        return {capabilities.KEY_FILE_ENV: given}
    if os.environ.get(capabilities.KEY_FILE_ENV) or os.environ.get(capabilities.KEY_ENV):
        return {}  # inherited by the engine's process
    raise NoCapabilityKey(
        "versioned-lora engine: a managed engine needs the deployment's capability key, the file the registry "
        "actor reads too (create_registry_actor(capability_key_file=...)). Make one once per deployment with "
        "`versioned-lora keygen PATH`, then give it to every engine with --capability-key-file PATH (or "
        f"${capabilities.KEY_FILE_ENV}=PATH) and to the registry.")


def _keygen(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists():
        print(f"versioned-lora keygen: {path} exists; a key is never overwritten (rotate: docs/runbook.md, "
              f"'KEY_MISMATCH')", file=sys.stderr)
        return 1
    capabilities.write_key_file(path)
    key_id = capabilities.key_id(capabilities.parse_key(path.read_text()))
    print(f"capability key written to {path} (mode 0600), key id {key_id}: give this file to the registry actor "
          f"and to every engine of the deployment", flush=True)
    return 0


def _fixture_model() -> Path:
    from versioned_lora.demo.defaults import build_fixtures

    return build_fixtures().model_dir


def engine_source_roots(given: list[str] | None) -> dict[str, str]:
    """The engine's env for `--source-root` (the trees a disk-sourced `begin` may read): none given, the engine
    inherits $VERSIONED_LORA_SOURCE_ROOT, and with neither it refuses every disk-sourced `begin`."""
    return {SOURCE_ROOT_ENV: os.pathsep.join(str(Path(root).resolve()) for root in given)} if given else {}


def lora_shape_from_peft_config(adapter_dir: str | Path) -> tuple[int, tuple[str, ...]]:
    """The rank and target modules an engine must be started with to serve the adapter in `adapter_dir` (its
    adapter_config.json: `r`, the largest of `rank_pattern`, and `target_modules`; PEFT's "all-linear" is
    SGLang's "all")."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist (--from-peft-config wants a PEFT adapter directory)")
    config = json.loads(path.read_text())
    rank = max([int(config.get("r", 8)), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):
        targets = ("all",) if targets == "all-linear" else (targets,)
    return rank, tuple(sorted(set(targets)))


def write_ready_file(path: Path, url: str, pid: int | None) -> None:
    """The readiness signal: written (aside, then renamed) once the engine answers its health check."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps({"url": url, "pid": pid}) + "\n")
    staged.replace(path)


def _engine(args: argparse.Namespace) -> int:
    try:
        return _serve_engine(args)
    except KeyboardInterrupt:  # Ctrl-C while starting: `start` already stopped the half-started server
        print("engine stopped before it was ready", file=sys.stderr, flush=True)
        return 130
    except EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


def _serve_engine(args: argparse.Namespace) -> int:
    rank, targets = args.max_lora_rank, tuple(args.lora_target_modules or ())
    if args.from_peft_config:
        peft_rank, peft_targets = lora_shape_from_peft_config(args.from_peft_config)
        rank, targets = rank or peft_rank, targets or peft_targets
    shape: dict[str, Any] = {"max_lora_rank": rank} if rank else {}
    shape.update({"lora_target_modules": targets} if targets else {})
    patches = tuple(p for p in args.patches.split(",") if p)
    key_env = engine_capability_key(patches, args.capability_key_file)  # first: without a key nothing is done
    model_dir = Path(args.model) if args.model else _fixture_model()
    log_path = Path(args.log) if args.log else default_log_path(args.port)
    env, token_file = engine_token(patches, log_path)
    env.update(engine_source_roots(args.source_root))
    if token_file is not None:
        print(f"managed-endpoint token written to {token_file} (mode 0600; send it as {TOKEN_HEADER})", flush=True)
    env.update(key_env)
    engine = EngineProcess(
        EngineConfig(
            model_dir=model_dir,
            port=args.port,
            host=args.host,
            patches=patches,
            cpu=not args.gpu,
            log_path=log_path,
            env=env,
            extra_args=(*(("--enable-metrics",) if args.enable_metrics else ()), *args.sglang_args),
            capacity=args.capacity,
            **shape,
        )
    )
    # SIGTERM while starting: leave through an exception, so `start` stops the half-started server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    engine.start(timeout_s=args.start_timeout)
    ready_file = Path(args.ready_file) if args.ready_file else None
    if ready_file is not None:
        write_ready_file(ready_file, engine.url, engine.pid)
    print(f"engine ready at {engine.url} (pid {engine.pid}); Ctrl-C stops it", flush=True)
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        engine.stop()
    print("engine stopped", flush=True)
    return 0


def _fixtures(args: argparse.Namespace) -> int:
    from versioned_lora.demo.defaults import FIXTURE_NAMES, build_fixtures

    if args.fixture not in FIXTURE_NAMES:
        print(f"unknown fixture {args.fixture!r}; known: {', '.join(FIXTURE_NAMES)}", file=sys.stderr)
        return 2
    fixtures = build_fixtures(fixture=args.fixture)
    print(f"fixture {fixtures.name} (engines: --max-lora-rank {fixtures.lora_rank} "
          f"--lora-target-modules {' '.join(fixtures.target_modules)})")
    print(f"model   {fixtures.model_dir}")
    for name, path in fixtures.adapters.items():
        print(f"adapter {name} {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from versioned_lora.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="versioned-lora")
    sub = parser.add_subparsers(dest="command", required=True)

    engine = sub.add_parser("engine", help="run one patched SGLang engine",
                            epilog="Arguments after a bare `--` go to SGLang's server unchanged, e.g. "
                            "`versioned-lora engine --port 30000 --model M --from-peft-config A -- "
                            "--max-running-requests 64`. Ready when --ready-file exists (or GET URL/health answers); "
                            "SIGINT or SIGTERM stops it cleanly (exit 0).")
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--model", help="model directory (default: the tiny Qwen3 fixture)")
    engine.add_argument("--patches", default=",".join(DEFAULT_PATCHES), help="comma-separated patch sets")
    engine.add_argument("--gpu", action="store_true", help="serve on CUDA (default: the CPU configuration)")
    engine.add_argument("--log", help="log file (default /tmp/versioned_lora_engine_<port>.log); a generated "
                        "token goes beside it, in <log>.token")
    engine.add_argument("--capability-key-file", help="the deployment's capability key file, the registry's too "
                        f"(default: ${capabilities.KEY_FILE_ENV}; required with the managed patch set: "
                        "`versioned-lora keygen PATH` makes one)")
    engine.add_argument("--capacity", type=int, default=2, metavar="K", help="the registry capacity K this engine "
                        "serves (default 2): it starts with K + 1 loaded-adapter slots, K for managed versions")
    engine.add_argument("--source-root", action="append", metavar="DIR",
                        help="a directory tree a disk-sourced begin may read (repeatable; default: "
                        f"${SOURCE_ROOT_ENV}; with neither, disk-sourced begins are refused)")
    engine.add_argument("--enable-metrics", action="store_true", help="SGLang's Prometheus /metrics, with the "
                        "managed patch's versioned_lora_engine_* series")
    engine.add_argument("--max-lora-rank", type=int, help="the largest LoRA rank it serves (default: the "
                        "--from-peft-config adapter's, else 8)")
    engine.add_argument("--lora-target-modules", nargs="+", metavar="MODULE", help="the modules adapters may "
                        "target, e.g. q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all (default: the "
                        "--from-peft-config adapter's, else q_proj v_proj)")
    engine.add_argument("--from-peft-config", metavar="ADAPTER_DIR", help="read --max-lora-rank and "
                        "--lora-target-modules from a PEFT adapter directory's adapter_config.json (the flags win)")
    engine.add_argument("--ready-file", metavar="PATH", help="written (JSON: url, pid) once the engine answers its "
                        "health check, removed when it stops: the readiness signal for scripts (or poll GET "
                        "URL/health, then URL/versioned_lora/status)")
    engine.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the engine to "
                        "become healthy (default 600)")
    engine.set_defaults(func=_engine, sglang_args=())

    keygen = sub.add_parser("keygen", help="write a new capability key (0600) for one deployment")
    keygen.add_argument("path", help="the key file to create (refused if it exists)")
    keygen.set_defaults(func=_keygen)

    fixtures = sub.add_parser("fixtures", help="build a fixture Qwen3 and its adapters A, B, C")
    fixtures.add_argument("--fixture", default="tiny", help="tiny (default), qwen3-0.6b-shape (Qwen3-0.6B "
                          "dimensions; r=64, 7 linear modules) or tiny-real-logits (top logits 20-30)")
    fixtures.set_defaults(func=_fixtures)

    demo = sub.add_parser("demo", help="the end-to-end demo on two local CPU engines")
    from versioned_lora.demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_demo)

    from versioned_lora.ops.commands import add_commands

    add_commands(sub)

    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare `--` goes to SGLang's server as it is (`versioned-lora engine ... -- --mem-fraction
    # 0.5`); only `engine` takes such arguments.
    passed: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if passed:
        if args.command != "engine":
            parser.error(f"arguments after `--` are SGLang server arguments, for `engine` only: {passed}")
        args.sglang_args = tuple(passed)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
