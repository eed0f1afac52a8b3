"""The suite's own layout: pytest imports test modules by their basename (rootdir-relative "prepend" import mode,
no packages under tests/), so two test files of one name in two folders stop the whole run at collection ("import
file mismatch"), as a clean-clone run did on 2026-12-07 with tests/adapters/ and tests/e2e/test_served_digest.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique_across_the_folders() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
