"""``versioned-lora``: command-line entry points.

- ``versioned-lora engine --port P --model DIR``: one SGLang engine with the versioned-lora patches.
- ``versioned-lora fixtures [--fixture NAME]``: build (or find in the cache) a fixture model and adapters A, B, C
  (``tiny``, the default, or ``qwen3-0.6b-shape``).
- ``versioned-lora demo``: the main job on two local CPU engines.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from versioned_lora.adapters.engine_process import DEFAULT_PATCHES, EngineConfig, EngineProcess
from versioned_lora.fixtures import FIXTURE_NAMES, TINY, build_fixtures


def _engine(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else build_fixtures().model_dir
    engine = EngineProcess(
        EngineConfig(
            model_dir=model_dir,
            port=args.port,
            host=args.host,
            patches=tuple(p for p in args.patches.split(",") if p),
            cpu=not args.gpu,
            log_path=Path(args.log) if args.log else None,
        )
    )
    # SIGTERM while starting: leave through an exception, so `start` stops the half-started server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    engine.start()
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
        engine.stop()
    return 0


def _fixtures(args: argparse.Namespace) -> int:
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

    engine = sub.add_parser("engine", help="run one patched SGLang engine")
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--model", help="model directory (default: the tiny Qwen3 fixture)")
    engine.add_argument("--patches", default=",".join(DEFAULT_PATCHES), help="comma-separated patch sets")
    engine.add_argument("--gpu", action="store_true", help="serve on CUDA (default: the CPU configuration)")
    engine.add_argument("--log", help="log file (default /tmp/versioned_lora_engine_<port>.log)")
    engine.set_defaults(func=_engine)

    fixtures = sub.add_parser("fixtures", help="build a fixture Qwen3 and its adapters A, B, C")
    fixtures.add_argument("--fixture", choices=FIXTURE_NAMES, default=TINY,
                          help="tiny (default) or qwen3-0.6b-shape (Qwen3-0.6B dimensions; r=64, 7 linear modules)")
    fixtures.set_defaults(func=_fixtures)

    demo = sub.add_parser("demo", help="the end-to-end demo on two local CPU engines")
    from versioned_lora.demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
