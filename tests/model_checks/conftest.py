"""The model checks run without the coverage tracer (pytest-cov's `no_cover` marker on every test here), and the
checker's suite (model_checks/suite.py) is run once per session for every test that reads its verdicts (test_suite.py,
test_drivers.py, test_crowd.py): SMOKE_BOUNDS in `make test` (`checked`), every entry in `make check-deep`
(`checked_in_full`).

`make test` measures the pure core's coverage (scripts/test.sh: 100% statement and branch of
versioned_lora/lifecycle), and tests/lifecycle alone reaches it. The checkers call the core's step
functions millions of times; under the tracer, which records every line and branch of them, the drivers'
and the crowd's bounds ran about 2.4x slower (222 s against 91 s for
test_every_bound_holds_and_fires_every_row_but_the_defensive_ones) and added nothing to the figure.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from model_checks import suite
from model_checks.drivers import Checked

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.no_cover)


@pytest.fixture(scope="session")
def checked() -> dict[suite.Entry, Checked]:
    """Each entry of SMOKE_BOUNDS (`make test`'s: every entry of CHECKER_BOUNDS but DEEP_ONLY), checked on a worker a
    core: entry -> its verdict and the rows it fired."""
    return dict(zip(suite.SMOKE_BOUNDS, suite.run(suite.SMOKE_BOUNDS), strict=True))


@pytest.fixture(scope="session")
def checked_in_full() -> dict[suite.Entry, Checked]:
    """Each entry of CHECKER_BOUNDS (`make check-deep`'s), checked on a worker a core."""
    return dict(zip(suite.CHECKER_BOUNDS, suite.run(), strict=True))


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    path = HERE.parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def script() -> Callable[[str], ModuleType]:
    """The loader of scripts/<name>.py, for the tests that run a script's own functions."""
    return load_script
