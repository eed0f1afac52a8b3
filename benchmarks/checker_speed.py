"""The compiled model checker against the interpreted one, on the same bound, in the same run.

Each round runs `python -m model_checks <bound>` twice, in alternating order: once with the
compiled package (the repo's, as scripts/build_checker.py left it) and once with a copy of its .py
files alone (`model_checks.native.package_copy`). Both must report the same counts (else it
stops: they would not be checking the same model). Prints each run's states/s and the median ratio.
Not a test: nothing is timed against a threshold. The last line is machine-readable:

    compiled_states_per_s=… interpreted_states_per_s=… speedup=… distinct=… rounds=…

    python benchmarks/checker_speed.py [--rounds 3] [-- <model_checks bound arguments>]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_checks import native  # noqa: E402
from model_checks.report import summary_fields  # noqa: E402

DEFAULT_BOUND = "--engines 2 --versions 2 --sessions 2 --drops 0 --dups 0 --crashes 0 --failures 0 --bootstrapped"


def run(where: Path, bound: list[str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-m", "model_checks", *bound, "--no-progress"], cwd=where, env=env,
                         capture_output=True, text=True, check=True).stdout
    return summary_fields(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("bound", nargs="*", help="model_checks bound arguments (after --)")
    ns = p.parse_args()
    bound = ns.bound or DEFAULT_BOUND.split()
    if not native.is_compiled():
        raise SystemExit("the checker is not compiled: run scripts/build_checker.py first")
    rates: dict[str, list[float]] = {"compiled": [], "interpreted": []}
    with tempfile.TemporaryDirectory(prefix="checker-speed-") as tmp:
        where = {"compiled": ROOT, "interpreted": native.package_copy(Path(tmp), compiled=False)}
        counts = None
        for r in range(ns.rounds):
            order = ("compiled", "interpreted") if r % 2 == 0 else ("interpreted", "compiled")
            for kind in order:
                got = run(where[kind], bound)
                key = (got["generated"], got["distinct"], got["depth"], got["rows_fired"], got["violations"])
                if counts is not None and key != counts:
                    raise SystemExit(f"{kind} explored something else: {key} != {counts}")
                counts = key
                rates[kind].append(float(got["states_per_s"]))
                print(f"round {r + 1} {kind:11s} sec={got['sec']} states_per_s={got['states_per_s']}", flush=True)
    assert counts is not None
    compiled, interpreted = statistics.median(rates["compiled"]), statistics.median(rates["interpreted"])
    print(f"bound: {' '.join(bound)}")
    print(f"compiled_states_per_s={compiled:.0f} interpreted_states_per_s={interpreted:.0f} "
          f"speedup={compiled / interpreted:.2f} distinct={counts[1]} rounds={ns.rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
