"""The generated docs in docs/ are exactly what the table renders today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from versioned_lora.spec import ROWS, Machine
from versioned_lora.spec.docs import DOCS_DIR, main
from versioned_lora.spec.render import documents, render_state_machines, render_transition_table

REPO = Path(__file__).resolve().parents[2]


def test_committed_docs_equal_a_fresh_generation_byte_for_byte() -> None:
    assert DOCS_DIR == REPO / "docs"
    for name, content in documents().items():
        assert (DOCS_DIR / name).read_bytes() == content.encode("utf-8"), (
            f"run python -m versioned_lora.spec.docs ({name})"
        )


def test_docs_cover_every_row_and_machine() -> None:
    table = render_transition_table()
    diagrams = render_state_machines()
    assert all(f"`{row.id}`" in table for row in ROWS)
    assert diagrams.count("stateDiagram-v2") == len(Machine)
    assert "LOADING --> PUBLISHED: Commit" in diagrams and "PUBLISHED --> RETIRED: Commit (commit.swap)" in diagrams


def test_docs_command_writes_and_checks(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--check"]) == 1  # nothing there yet
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "state-machines.md").write_text("stale")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    done = subprocess.run(
        [sys.executable, "-m", "versioned_lora.spec.docs", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
