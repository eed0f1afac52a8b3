"""Session-wide fixtures: the fixture checkpoints, two real SGLang CPU engines, the skip allow-list.

Engines start once per test session, in parallel, and only if some selected test asks for them.
An engine that fails to start is an error for every test that needs it, never a skip.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from engine_helpers import TEST_ENGINE_ARGS, TEST_PATCHES, engine_env
from engine_pool import COUNTERS, PooledEngine, StandbyPool

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block
from versioned_lora.fixtures import Fixtures, build_fixtures
from versioned_lora.spec.wire import SOURCE_ROOT_ENV

ALLOWLIST_PATH = Path(__file__).with_name("skip_allowlist.txt")

def _load_allowlist() -> dict[str, str]:
    entries: dict[str, str] = {}
    for line in ALLOWLIST_PATH.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, _, reason = line.partition("|")
        if not reason.strip():
            raise ValueError(f"{ALLOWLIST_PATH}: entry without a reason: {line!r}")
        entries[nodeid.strip()] = reason.strip()
    return entries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A skip or xfail that is not on the committed allow-list fails the test. A failed test that used the
    session's engines carries the end of each engine's log: CI keeps only its own output, not the files."""
    outcome = yield
    report = outcome.get_result()
    skipped_or_xfailed = report.skipped or hasattr(report, "wasxfail")
    if skipped_or_xfailed and item.nodeid not in _load_allowlist():
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} was skipped or xfailed but is not on tests/skip_allowlist.txt; "
            f"add it there with its reason or make it run."
        )
    if report.failed and isinstance(getattr(item, "funcargs", {}).get("engines"), EnginePair):
        for name, engine in zip(("E0", "E1"), item.funcargs["engines"], strict=True):
            report.sections.append((f"engine log {name}: last {LOG_TAIL_LINES} lines but 2xx access lines",
                                     _log_tail(engine)))


LOG_TAIL_LINES = 40


def _log_tail(engine: EngineProcess) -> str:
    path = engine.config.log_path
    if path is None or not path.exists():
        return "(no log file)"
    with path.open("rb") as log:
        log.seek(max(0, path.stat().st_size - 1024 * 1024))
        lines = log.read().decode(errors="replace").splitlines()
    # Answered requests (uvicorn's access lines with a 2xx status) say little and crowd out what does.
    kept = [line for line in lines if not _ANSWERED.search(line)][-LOG_TAIL_LINES:]
    return "\n".join(line[:400] for line in kept)  # SGLang's server_args line alone is ~30 kB


_ANSWERED = re.compile(r'HTTP/1\.1" 2\d\d ')


# ---------------------------------------------------------------- per-suite wall time
# The run ends by printing each suite's wall time: a suite is a top-level folder of tests/, its time the
# sum of its tests' setup, call and teardown (tests of one folder run one after another, so this is the
# suite's wall time but collection). A session fixture's start (the two engines, Ray) counts toward the
# suite whose test first needs it, its teardown toward the last suite that ran.
_SUITE_SECONDS: dict[str, float] = {}
_SUITE_TESTS: dict[str, set[str]] = {}
_SESSION_STARTED = time.monotonic()


def _suite(nodeid: str) -> str:
    """tests/<folder>/ for a test in a folder of tests/, else the test's own directory."""
    parts = nodeid.split("::")[0].split("/")
    return "/".join(parts[:2] if len(parts) > 2 and parts[0] == "tests" else parts[:-1]) + "/"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    suite = _suite(report.nodeid)
    _SUITE_SECONDS[suite] = _SUITE_SECONDS.get(suite, 0.0) + report.duration
    _SUITE_TESTS.setdefault(suite, set()).add(report.nodeid)


# ---------------------------------------------------------------- engine tests and cold starts
# A test talks to a real engine if it asks (directly or through another fixture) for one of the fixtures that
# start engines, or if an engine was started while it ran. Cold starts are counted where every engine start
# goes through: EngineProcess.start (a standby's activation is not one; tests/engine_pool.py counts those).
ENGINE_FIXTURES = frozenset({"engines", "standby_pool", "metrics_engine", "keyed", "four_engines", "scale_engines",
                             "stock_engine"})
_ENGINE_TESTS: set[str] = set()
_cold_start = EngineProcess.start


def _counted_start(self: EngineProcess, timeout_s: float = 300.0) -> None:
    COUNTERS.cold_starts += 1
    _cold_start(self, timeout_s)


EngineProcess.start = _counted_start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    starts = COUNTERS.cold_starts + COUNTERS.standby_takes
    yield
    started_one = COUNTERS.cold_starts + COUNTERS.standby_takes > starts
    if started_one or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
        _ENGINE_TESTS.add(item.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run's figures for scripts/test.sh's last line, where it asks for them ($VERSIONED_LORA_TEST_STATS)."""
    target = os.environ.get("VERSIONED_LORA_TEST_STATS")
    if not target:
        return
    stats = {"tests": sum(len(ids) for ids in _SUITE_TESTS.values()), "engine_tests": len(_ENGINE_TESTS),
             **attrs.asdict(COUNTERS),
             "suites": {suite: {"seconds": round(seconds, 1), "tests": len(_SUITE_TESTS[suite])}
                        for suite, seconds in _SUITE_SECONDS.items()}}
    Path(target).write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")


@pytest.hookimpl(trylast=True)  # after the coverage table: the run ends with the suite times
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SUITE_SECONDS:
        return
    terminalreporter.section("suite wall times")
    for suite, seconds in sorted(_SUITE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{suite:<24} {seconds:8.1f} s  ({len(_SUITE_TESTS[suite])} tests)")
    terminalreporter.write_line(f"{'sum':<24} {sum(_SUITE_SECONDS.values()):8.1f} s; "
                                f"session {time.monotonic() - _SESSION_STARTED:.1f} s (with collection)")
    terminalreporter.write_line(f"{COUNTERS.line()} engine_tests={len(_ENGINE_TESTS)}")


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    return build_fixtures()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A small local Ray cluster (2 CPUs, ~200 MB object store), started once per test session."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
                 log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@attrs.frozen
class EnginePair:
    e0: EngineProcess
    e1: EngineProcess

    def __iter__(self) -> Iterator[EngineProcess]:
        return iter((self.e0, self.e1))


# The largest registry capacity K any test needs (tests/e2e/test_window.py: K = 3): the session's engines start
# with K + 1 loaded-adapter slots, and each test's registry capacity (2 unless it says) gates what is held.
SHARED_ENGINE_CAPACITY = 3


@pytest.fixture(scope="session")
def engines(fixtures: Fixtures, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePair]:
    """E0 and E1, with a warm standby (tests/engine_pool.py) that serves every restart of either."""
    log_dir = Path(os.environ.get("VERSIONED_LORA_ENGINE_LOGS", tmp_path_factory.mktemp("engine-logs")))
    template = EngineConfig(
        model_dir=fixtures.model_dir,
        port=0,  # each engine's own, below
        extra_args=TEST_ENGINE_ARGS,
        capacity=SHARED_ENGINE_CAPACITY,
        # Hold points and injected faults inside the engine's calls (the test-only patch set "test_faults",
        # managed/hold_points.py), for the kill and fault tests: loaded by the test flag TEST_PATCHES only.
        patches=TEST_PATCHES,
        # Disk-sourced begins read the fixture cache and the tests' own temporary directories.
        # (SGLANG_REQUEST_STATE_WAIT_TIMEOUT=1, tried so that a client disconnect is noticed sooner, made the
        # engine abort requests whose clients were still connected, "disconnected (type 1)": left at 4 s.)
        env=engine_env(**{SOURCE_ROOT_ENV: os.pathsep.join([str(fixtures.root),
                                                            str(tmp_path_factory.getbasetemp())])}),
    )
    pool = StandbyPool(template, log_dir)
    pair = EnginePair(*(PooledEngine(attrs.evolve(template, port=free_port_block(), log_path=log_dir / f"E{i}.log",
                                                  env=dict(template.env)), pool)
                        for i in range(2)))
    try:
        start_in_parallel(list(pair))
        pool.refill()  # the first standby starts now, at low priority, while the tests use E0 and E1
        yield pair
    finally:
        pool.close()
        for engine in pair:
            engine.stop()


def start_in_parallel(engines: list[EngineProcess]) -> None:
    """Start engines together (each start is mostly waiting); if one fails, stop all and raise."""
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as starting:
        futures = [starting.submit(engine.start) for engine in engines]
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:
        for engine in engines:
            engine.stop()
        raise errors[0]  # type: ignore[misc]


@pytest.fixture(scope="session")
def standby_pool(engines: EnginePair) -> StandbyPool:
    """The session engines' standby, for a test that needs one more engine of their configuration."""
    assert isinstance(engines.e0, PooledEngine)
    return engines.e0.pool
