"""``python -m versioned_lora.sglang_patches.server [sglang server args]``: SGLang with our patches.

Equivalent to ``python -m sglang.launch_server`` except that the patch sets named in
``VERSIONED_LORA_PATCHES`` are applied here and in every spawned child (see ``process_entry``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from versioned_lora.sglang_patches import preflight
from versioned_lora.sglang_patches.apply import apply_requested_patches
from versioned_lora.sglang_patches.mechanism import replace_attribute, requested_patch_sets, require_supported_sglang
from versioned_lora.spec.wire import EXIT_WITH_PARENT_ENV, STANDBY_FILE_ENV

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0


def exit_with_parent() -> None:
    """Stop this engine once its parent process is gone: a test run or CLI killed with SIGKILL never runs its
    own cleanup, and the engine (started in a session of its own) would hold its ports and ~3 GB on. The
    parent is gone when this process is re-parented (its parent pid changes; a pid, unlike the parent link,
    can be reused). Stops the whole process group (server, scheduler, detokenizer): SIGTERM, then SIGKILL."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.warning("versioned-lora: the process that started this engine (pid %d) is gone; stopping", parent)
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="vlora-exit-with-parent", daemon=True).start()


class ServeWhenActivated:
    """A warm standby (``$VERSIONED_LORA_STANDBY_FILE``): the engine starts as usual (model loaded, scheduler and
    detokenizer running) and then, instead of binding its HTTP port, writes ``<file>.ready`` and waits until
    ``<file>`` names the port to serve on. A replacement for a dead engine is then one HTTP bind and a warmup away
    (`EngineProcess.start_standby` and `activate`), not a cold start of 25-60 s on a CPU host.

    Replaces ``sglang.srt.entrypoints.http_server._setup_and_run_http_server`` (SGLang 0.5.23), which
    ``launch_server`` calls once its subprocesses are up and which binds uvicorn to the serving config's port:
    the port is set in the published serving config (``get_serving().port``, through
    ``RuntimeContext.override``) and in ``server_args`` (the warmup request's URL) before the original runs."""

    def __init__(self, activation: Path, original: Any) -> None:
        self.activation = activation
        self.original = original

    def __call__(self, server_args: Any, *args: Any, **kwargs: Any) -> Any:
        import msgspec
        from sglang.srt.runtime_context import get_context

        self.activation.with_name(self.activation.name + ".ready").write_text(str(os.getpid()))
        while not self.activation.exists():  # written whole by a rename (EngineProcess.activate)
            time.sleep(0.2)
        port = int(self.activation.read_text())
        logger.info("versioned-lora: standby activated on port %d", port)
        # The resolved config through its own override (provenance recorded); `server_args` is sealed once
        # resolved (ServerArgs.__setattr__) but its `url()` still builds the warmup request's address from its
        # `port`, so that one field is written past the seal with the Struct's own setter.
        get_context().override("versioned-lora standby activation", port=port)
        msgspec.Struct.__setattr__(server_args, "port", port)
        return self.original(server_args, *args, **kwargs)


def wait_for_activation(activation: Path) -> None:
    from sglang.srt.entrypoints import http_server

    replace_attribute("standby", http_server, "_setup_and_run_http_server",
                      ServeWhenActivated(activation, http_server._setup_and_run_http_server),
                      why="a warm standby binds its HTTP port only once it is told which")


def main(argv: list[str] | None = None) -> None:
    require_supported_sglang()
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        exit_with_parent()
    preflight.check(requested_patch_sets())  # before SGLang's imports: a refusal in a second, not after ~20 s
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from versioned_lora.sglang_patches import process_entry

    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    apply_requested_patches(role="server")
    standby = os.environ.get(STANDBY_FILE_ENV)
    if standby:
        wait_for_activation(Path(standby))
    launch_server(
        server_args,
        run_scheduler_process_func=process_entry.run_scheduler_process,
        run_detokenizer_process_func=process_entry.run_detokenizer_process,
    )


if __name__ == "__main__":
    main()
