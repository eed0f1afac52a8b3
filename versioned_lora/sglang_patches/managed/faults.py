"""Test-only injected faults of the engine's own I/O (issue 41): what a real engine does not produce on demand.

- ``fail_load``: the next stock load of the named candidate inside `end` answers failure, as SGLang's
  `TokenizerManager.load_lora_adapter` does when its scheduler cannot load it (memory pressure, a bad tensor),
  without asking the scheduler: nothing is loaded;
- ``fail_unload``: the next physical unload of the named adapter answers failure, as
  `TokenizerManager.update_lora_adapter_communicator` does when `LoRAManager.unload_lora_adapter` fails, without
  asking the scheduler: the weights stay loaded and pinned there.

They exist only where hold points do (an engine started with the test-only patch set ``test_faults``), are armed and
released through the same test endpoint (``POST /versioned_lora/test_hold`` with ``point`` and ``lora_name``, then
``release: true``), and fire for that exact name on every call until released (a retry fails too, as it would while
the cause lasts). On any other engine arming one is refused (403 ``HOLD_POINTS_DISABLED``) and `trip` is always
False.
"""

from __future__ import annotations

from versioned_lora.sglang_patches.managed import hold_points

ENGINE_FAULTS = hold_points.ENGINE_FAULTS
FAIL_LOAD, FAIL_UNLOAD = ENGINE_FAULTS


def trip(fault: str, name: str) -> bool:
    """True for a call of `name` that reaches an armed `fault`: the caller then answers as SGLang's failure would.
    Armed faults live beside the hold points (`hold_points.HOLDS`)."""
    return hold_points.HOLDS.take(fault, name)
