"""A non-source training rank: joins the ranks' gloo group and waits for each publication outcome.

argv: master port, rank, world size, number of publications. Prints one line per outcome.
"""

from __future__ import annotations

import datetime
import json
import sys

from versioned_lora.adapters.rank_outcome import publish_on_every_rank
from versioned_lora.adapters.transfer import init_transfer_group
from versioned_lora.lifecycle import VersionKey

if __name__ == "__main__":
    port, rank, world, count = (int(a) for a in sys.argv[1:5])
    group = init_transfer_group(master_address="127.0.0.1", master_port=port, rank=rank, world_size=world,
                                group_name="trainer-ranks", device="cpu", timeout=datetime.timedelta(seconds=300))
    for _ in range(count):
        outcome = publish_on_every_rank(rank, group, VersionKey(0, "?"), None)
        print(json.dumps({"status": outcome.status, "reason": outcome.reason, "version": list(outcome.version)}),
              flush=True)
