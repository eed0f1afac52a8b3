"""The compiled checker (model_checks/native.py): it is the one in use, it explores exactly what the
interpreted source explores, and a build older than its sources refuses to run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_checks import native
from model_checks.report import summary_fields

ROOT = Path(__file__).resolve().parents[2]
# The CI bound of test_checker.py and the one bound with a crash and a retired version at once.
BOUNDS = (
    "--engines 2 --versions 3 --sessions 1 --drops 1 --dups 0 --crashes 0 --failures 0 --bootstrapped",
    "--engines 1 --versions 2 --sessions 1 --drops 0 --dups 0 --crashes 1 --failures 0 --bootstrapped --max-depth 28",
)


def _package_copy(tmp_path: Path, compiled: bool) -> Path:
    return native.package_copy(tmp_path / ("compiled" if compiled else "interpreted"), compiled=compiled)


def _python(where: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, *args], cwd=where, env=env, capture_output=True, text=True, timeout=300,
                          check=check)


def _check(where: Path, args: str) -> str:
    out = _python(where, "-m", "model_checks", *args.split(), "--no-progress").stdout
    # everything but the timing fields, plus the rows never fired
    kept = " ".join(f"{k}={v}" for k, v in summary_fields(out).items() if k not in ("sec", "states_per_s"))
    return f"{kept}\n{out.strip().splitlines()[-1]}"


def test_the_checker_in_use_is_the_compiled_one() -> None:
    assert native.extension_files(), "no compiled checker: scripts/setup.sh runs scripts/build_checker.py"
    assert native.is_compiled()


@pytest.mark.parametrize("args", BOUNDS, ids=["ci-bound", "reclaim-while-rehydrating"])
def test_compiled_and_interpreted_explore_the_same_states(tmp_path: Path, args: str) -> None:
    copies = {flag: _package_copy(tmp_path, compiled=flag) for flag in (True, False)}
    probe = "import model_checks as m; from model_checks import native; print(m.__file__, native.is_compiled())"
    for flag, where in copies.items():  # each copy runs what it holds (not the repo's own package)
        assert _python(where, "-c", probe).stdout.split() == [str(where / "model_checks" / "__init__.py"), str(flag)]
    compiled, interpreted = _check(copies[True], args), _check(copies[False], args)
    assert compiled == interpreted
    print(compiled)


def test_a_build_older_than_its_sources_refuses_to_run(tmp_path: Path) -> None:
    where = _package_copy(tmp_path, compiled=True)
    system_py = where / "model_checks" / "system.py"
    system_py.write_text(system_py.read_text() + "\n# edited after the build\n")
    run = _python(where, "-c", "import model_checks", check=False)
    assert run.returncode != 0
    assert "StaleNativeBuild" in run.stderr and "scripts/build_checker.py" in run.stderr
