"""`python -m versioned_lora.spec.docs [--check] [--out DIR]`: write (or check) the generated docs.

The one module under spec/ that touches files: the renderers in `render.py` are pure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from versioned_lora.spec.render import documents

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="directory to write into (default: docs/)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, content in documents().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != content:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        print("stale generated docs (run `python -m versioned_lora.spec.docs`): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
