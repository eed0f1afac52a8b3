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

from versioned_lora.sglang_patches.apply import apply_requested_patches
from versioned_lora.sglang_patches.mechanism import require_supported_sglang
from versioned_lora.spec.wire import EXIT_WITH_PARENT_ENV

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


def main(argv: list[str] | None = None) -> None:
    require_supported_sglang()
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        exit_with_parent()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from versioned_lora.sglang_patches import process_entry

    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    apply_requested_patches(role="server")
    launch_server(
        server_args,
        run_scheduler_process_func=process_entry.run_scheduler_process,
        run_detokenizer_process_func=process_entry.run_detokenizer_process,
    )


if __name__ == "__main__":
    main()
