"""Every training rank gets the same publication outcome (RFC §6).

The trainer may call the publisher from every rank. One rank (src) runs the publication; the
outcome — COMMITTED, REJECTED (e.g. CAPACITY_ERROR), FAILED_CLEAN or UNKNOWN — is broadcast to all
ranks over their torch.distributed group. src always reaches the broadcast, whatever happened, so no
rank is left waiting in the collective. An exception out of the publication is an UNKNOWN outcome on
every rank: where it was raised, a call may have landed, so no rank may take it for a clean failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.publisher import PublishOutcome, PublishStatus


def publish_on_every_rank(
    rank: int,
    group: Any,
    version: VersionKey,
    run_publication: Callable[[], PublishOutcome] | None,
    src: int = 0,
) -> PublishOutcome:
    import torch.distributed as dist

    box: list[PublishOutcome | None] = [None]
    if rank == src:
        try:
            if run_publication is None:
                raise ValueError("the source rank must run the publication")
            box[0] = run_publication()
        except Exception as exc:  # an outcome too: every rank must learn it, as unknown
            box[0] = PublishOutcome(PublishStatus.UNKNOWN, version, reason=type(exc).__name__, detail=str(exc))
    dist.broadcast_object_list(box, src=src, group=group)
    outcome = box[0]
    assert outcome is not None
    return outcome
