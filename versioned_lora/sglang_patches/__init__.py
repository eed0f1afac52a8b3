"""Engine-side code that runs inside every SGLang 0.5.23 process.

Entry point: ``python -m versioned_lora.sglang_patches.server <sglang server args>`` (what the
engine launcher runs). It applies the patches named in ``VERSIONED_LORA_PATCHES`` in the server
process and, through wrapped child entry points (``process_entry``), in the scheduler and
detokenizer processes that SGLang spawns.
"""

from versioned_lora.sglang_patches.mechanism import (
    PATCHES_ENV,
    SUPPORTED_SGLANG_VERSION,
    UnsupportedSGLangVersion,
    applied_patches,
    require_supported_sglang,
)

__all__ = [
    "PATCHES_ENV",
    "SUPPORTED_SGLANG_VERSION",
    "UnsupportedSGLangVersion",
    "applied_patches",
    "require_supported_sglang",
]
