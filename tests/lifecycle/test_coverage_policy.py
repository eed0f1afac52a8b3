"""The pure core's 100% statement and branch coverage is enforced, not printed: the test command
fails under 100 (`scripts/test.sh`: --cov-fail-under=100 on versioned_lora/lifecycle with
--cov-branch), and nothing is excluded from the measurement (no `pragma: no cover` / `no branch`
in lifecycle/, no exclude or omit in the coverage configuration). The tests in this folder alone
reach 100% (so does any run that includes them, e.g. `make test-fast`)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIFECYCLE = ROOT / "versioned_lora" / "lifecycle"
PRAGMA = re.compile(r"#.*pragma:\s*no\s*(cover|branch)", re.IGNORECASE)


def test_no_coverage_pragma_in_lifecycle() -> None:
    sources = sorted(LIFECYCLE.rglob("*.py"))
    assert sources, f"no sources under {LIFECYCLE}"
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sources
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if PRAGMA.search(line)]
    assert found == []


def test_coverage_configuration_excludes_nothing() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8")).get("tool", {}).get("coverage", {})
    excluding = {"exclude_lines", "exclude_also", "omit", "partial_branches", "partial_also"}
    assert {section: sorted(excluding & set(values)) for section, values in config.items()
            if excluding & set(values)} == {}
    assert not any((ROOT / name).exists() for name in (".coveragerc", "setup.cfg", "tox.ini"))


def test_test_command_fails_under_full_branch_coverage_of_lifecycle() -> None:
    words = shlex.split((ROOT / "scripts" / "test.sh").read_text(encoding="utf-8"), comments=True)
    assert {"--cov=versioned_lora/lifecycle", "--cov-branch", "--cov-fail-under=100"} <= set(words)
