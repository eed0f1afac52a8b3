"""What the command line falls back to when it is given no model: the fixtures. This module and the rest of
`demo/` are the only places outside `fixtures.py` that import the fixtures module (issue 46, item 5;
tests/runtime/test_fixture_independence.py walks the imports); the CLI imports this module lazily, only on a path
that needs a fixture."""

from __future__ import annotations

from versioned_lora.fixtures import FIXTURE_NAMES, TINY, TINY_PROBE_PROMPT, Fixtures, build_fixtures, cache_root

__all__ = ["FIXTURE_NAMES", "TINY", "TINY_PROBE_PROMPT", "Fixtures", "build_fixtures", "cache_root"]
