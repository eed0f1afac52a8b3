"""``python -m versioned_lora.sglang_patches.server [sglang server args]``: SGLang with our patches.

Equivalent to ``python -m sglang.launch_server`` except that the patch sets named in
``VERSIONED_LORA_PATCHES`` are applied here and in every spawned child (see ``process_entry``).
"""

from __future__ import annotations

import sys

from versioned_lora.sglang_patches.apply import apply_requested_patches
from versioned_lora.sglang_patches.mechanism import require_supported_sglang


def main(argv: list[str] | None = None) -> None:
    require_supported_sglang()
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
