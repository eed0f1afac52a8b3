"""The README and docs/ stand on their own: the README opens with the two commands, and no text in it or in docs/
points to a path outside the repository, to an issue number, or to a file of the repository that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST_LINES = """# versioned-lora

```bash
make demo    # set up .venv/ and run the main job: two local SGLang CPU engines, the end-to-end demo
make test    # set up .venv/ and run the whole test suite (real SGLang engines, Ray, gloo)
```
"""
OUTSIDE = [
    (re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"#\d{1,4}\b(?![0-9a-f])"), "an issue number"),
    (re.compile(r"(?<!\.)\.\./"), "a path above the repository"),
    (re.compile(r"(?<![\w.])/work/"), "a path of the machine it was written on"),
    (re.compile(r"(?<![\w/.])(?:seed|shared)/"), "a file outside the repository (the design brief, the RFC)"),
    (re.compile(r"\bDESIGN\.md\b"), "the design brief outside the repository (docs/design.md is ours)"),
]
# A path of this repository named in backticks must exist.
REPO_PATH = re.compile(r"`((?:versioned_lora|docs|tests|scripts|benchmarks|model_checks|requirements)/[\w./-]*\w)`")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "docs").rglob("*.txt"))]


def test_the_readme_opens_with_the_two_commands() -> None:
    assert (ROOT / "README.md").read_text().startswith(FIRST_LINES)


def test_no_text_points_outside_the_repository_or_to_an_issue_number() -> None:
    found = []
    for path in documents():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {why}: {line.strip()[:120]}"
                      for pattern, why in OUTSIDE if pattern.search(line)]
    assert not found, "\n".join(found)


def test_every_repository_path_named_exists() -> None:
    missing = []
    for path in documents():
        for named in REPO_PATH.findall(path.read_text()):
            if "*" not in named and "<" not in named and not (ROOT / named).exists():
                missing.append(f"{path.relative_to(ROOT)}: {named}")
    assert not missing, "\n".join(missing)


def test_the_readme_diagram_of_a_version_is_the_tables_own() -> None:
    from versioned_lora.ops.commands import mermaid

    section = (ROOT / "README.md").read_text().split("\n## How a publication goes\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```mermaid\n(.*?)```", section, re.DOTALL)
    assert blocks == [mermaid("version")]
