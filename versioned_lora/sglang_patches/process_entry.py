"""Wrapped entry points for the processes SGLang spawns.

SGLang 0.5.23 starts its scheduler and detokenizer with ``multiprocessing`` in *spawn* mode
(``sglang.srt.entrypoints.engine._set_envs_and_config`` calls ``mp.set_start_method("spawn")``),
so a child starts from a fresh interpreter and patches applied in the server process do not
reach it. ``launch_server`` accepts the child targets as arguments
(``run_scheduler_process_func`` / ``run_detokenizer_process_func``); we pass these module-level
wrappers, which spawn pickles by reference, so the child imports this module, applies the patch
sets named in the inherited environment, then runs SGLang's own function.
"""

from __future__ import annotations

from typing import Any

from versioned_lora.sglang_patches.apply import apply_requested_patches


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    apply_requested_patches(role="scheduler")
    from sglang.srt.managers.scheduler import run_scheduler_process as stock

    return stock(*args, **kwargs)


def run_detokenizer_process(*args: Any, **kwargs: Any) -> Any:
    apply_requested_patches(role="detokenizer")
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as stock

    return stock(*args, **kwargs)
