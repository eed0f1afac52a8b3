"""Apply the patch sets requested through ``VERSIONED_LORA_PATCHES`` in the current process."""

from __future__ import annotations

import importlib
import logging

from versioned_lora.sglang_patches.mechanism import requested_patch_sets, require_supported_sglang

logger = logging.getLogger(__name__)

# patch set name -> module with an ``apply(role)``-compatible ``apply`` function.
# Each set decides itself whether it applies in a given role and on this host.
PATCH_SET_MODULES = {
    "cpu": "versioned_lora.sglang_patches.cpu_compat",
    "introspection": "versioned_lora.sglang_patches.introspection",
    "managed": "versioned_lora.sglang_patches.managed",
    # Test-only (issue 41): hold points and injected faults. Never in DEFAULT_PATCHES; after "managed", whose
    # endpoints it extends.
    "test_faults": "versioned_lora.sglang_patches.managed.hold_points",
}


def apply_requested_patches(role: str) -> list[str]:
    names = requested_patch_sets()
    if not names:
        return []
    require_supported_sglang()
    unknown = [name for name in names if name not in PATCH_SET_MODULES]
    if unknown:
        raise ValueError(f"unknown versioned-lora patch sets {unknown}; known: {sorted(PATCH_SET_MODULES)}")
    for name in names:
        module = importlib.import_module(PATCH_SET_MODULES[name])
        module.apply(role)
    logger.info("versioned-lora patches applied in %s: %s", role, names)
    return names
