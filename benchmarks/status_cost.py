"""What `versioned-lora status --json` costs the registry as a run grows (issue 48): time and size of the rows
at 10^2, 10^4 and 10^5 open sessions, and after 10, 100 and 1,000 publications (each previous version reclaimed,
sessions coming and going).

On the registry core without engines or Ray, and that is what it measures: a real `RegistryCore` (SQLite
journal) driven through the table's events; `status_rows` over its `publication_view()` and
`operations_view()` (what the actor answers `status` with), serialised as `status --json` does. The engines'
rows are left out (no engine readings): their size is each engine's own adapter table. The Ray round trip
(pickling the two views) is not in the time. Not a test: nothing is asserted.

Runs against whichever checkout is first on PYTHONPATH (only APIs both sides of issue 48 have), so the same
script gives the figures before and after:

    PYTHONPATH=. python benchmarks/status_cost.py [--max-sessions 100000] [--publications 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import versioned_lora
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import (
    AcquireLease,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    RecordPrepared,
    RecordReady,
    Reserve,
    SessionKey,
    VersionKey,
)
from versioned_lora.ops.status_view import status_rows

ENGINES = ("E0", "E1")
EPOCH = 1
BATCH = 256  # the registry's MAX_BATCH
REPEATS = 25


class Run:
    def __init__(self, workdir: Path) -> None:
        self.core = RegistryCore(workdir / "journal.sqlite", engines=ENGINES, capacity=2, epoch=EPOCH)
        granted = self.core.submit("lease", AcquireLease("bench", 10_000.0)).result
        self.fence = granted.fence  # type: ignore[union-attr]
        self.published = 0
        self.next_seq = 0
        self.current: VersionKey | None = None

    def publish(self) -> None:
        """The next version, READY on both engines, committed; the previous one (free of sessions) reclaimed."""
        version = VersionKey(EPOCH, f"v{self.published:05d}")
        digest = hashlib.sha256(version.version_id.encode()).hexdigest()
        reserved = self.core.submit(f"r{version}", Reserve(version, digest, self.fence)).result
        token = reserved.attempt_token  # type: ignore[union-attr]
        self.core.submit_batch(f"p{version}", [kind(version, token, e, 0, digest)
                                               for e in ENGINES for kind in (RecordPrepared, RecordReady)])
        revision = self.core.publication_view().default_revision
        self.core.submit(f"c{version}", Commit(version, token, revision, self.fence))
        previous, self.current = self.current, version
        self.published += 1
        if previous is not None:
            claimed = self.core.submit(f"k{previous}", ClaimReclaim(previous)).result
            reclaim_id = claimed.reclaim_id  # type: ignore[union-attr]
            self.core.submit_batch(f"u{previous}", [ConfirmReclaim(previous, e, reclaim_id) for e in ENGINES])

    def bind(self, count: int) -> None:
        """`count` more sessions bound to the default (shards of 1,000, so the low-water marks stay apart)."""
        while count > 0:
            n = min(BATCH, count)
            keys = [SessionKey(EPOCH, (self.next_seq + i) // 1000, self.next_seq + i) for i in range(n)]
            self.core.submit_batch(f"b{self.next_seq}", [BindFirst(k) for k in keys])
            self.next_seq += n
            count -= n

    def churn(self) -> None:
        """One session bound to the current default, one closed: between publications, as traffic does."""
        key = SessionKey(EPOCH, 10_000, self.next_seq)
        self.next_seq += 1
        self.core.submit(f"b{key.seq}", BindFirst(key))
        self.core.submit(f"x{key.seq}", CloseAndRelease(key))

    def status(self) -> dict[str, Any]:
        times, size = [], 0
        for _ in range(REPEATS):
            started = time.perf_counter()
            text = json.dumps(status_rows(self.core.publication_view(), self.core.operations_view(), []),
                              indent=2, sort_keys=True)
            times.append(time.perf_counter() - started)
            size = len(text.encode())
        rows = json.loads(text)
        return {"status_ms_median": round(1000 * statistics.median(times), 3),
                "status_ms_max": round(1000 * max(times), 3), "json_bytes": size,
                "version_rows": len(rows["versions"]), "open_sessions": rows["registry"]["open_sessions"],
                "publications": self.published}


def commit_of(path: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-sessions", type=int, default=100_000)
    parser.add_argument("--publications", type=int, default=1000)
    args = parser.parse_args()
    source = Path(versioned_lora.__file__).resolve().parents[1]
    print(f"# versioned_lora from {source} at {commit_of(source)}; registry core in-process, no engines, no Ray",
          flush=True)
    figures: list[dict[str, Any]] = []

    def report(label: str, row: dict[str, Any]) -> None:
        row = {"point": label, **row}
        figures.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp))
        run.publish()
        for target in (100, 10_000, 100_000):
            if target > args.max_sessions:
                break
            run.bind(target - run.next_seq)
            report(f"sessions={target}", run.status())
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp))
        for target in (10, 100, 1000, 10_000):
            if target > args.publications:
                break
            while run.published < target:
                run.publish()
                run.churn()
            report(f"publications={target}", run.status())
    by = {f["point"]: f for f in figures}
    first, last = figures[0], figures[-1]
    print(f"status_ms first={first['status_ms_median']} last={last['status_ms_median']} "
          f"json_bytes first={first['json_bytes']} last={last['json_bytes']} points={len(by)}")


if __name__ == "__main__":
    main()
