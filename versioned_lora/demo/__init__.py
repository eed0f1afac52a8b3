"""`versioned-lora demo`: the main job on two local CPU engines (issue 9; the run itself is `demo/app.py`).

This package's own import is light on purpose (argparse only): the CLI builds every subcommand's parser on each
call, and a `versioned-lora publish` must not load the demo's stack or the fixtures module (issue 46, item 5).
Only `run_demo` (lazily, `app.py`) and `demo/defaults.py` reach `versioned_lora.fixtures`.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run_demo"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="report directory (default runs/demo)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of traffic, roughly (default 90)")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop agentic sessions in flight")
    parser.add_argument("--turns", type=int, default=3, help="generations per session (tool turns between)")
    parser.add_argument("--engines", help="attach to running engines: URL0,URL1 (default: start two)")
    parser.add_argument("--token", help="managed-endpoint token of the attached engines")
    parser.add_argument("--capability-key-file", help="the capability key file the attached engines were started "
                        "with (the registry actor reads it; docs/integration.md, 'Capabilities')")
    parser.add_argument("--no-live", action="store_true", help="no live view (logs one line per step instead)")
    parser.add_argument("--capacity", type=int, default=2, metavar="K",
                        help="the registry's capacity K, the window of versions held (default 2); started engines get "
                        "K + 1 loaded-adapter slots, attached ones (--engines) must have been started with at least "
                        "that many (versioned-lora engine --capacity K)")


def run_demo(args: argparse.Namespace) -> int:
    from versioned_lora.demo.app import run_demo as run

    return run(args)
