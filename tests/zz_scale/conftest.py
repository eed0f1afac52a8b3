"""The 0.6B-shape scope: its own two engines, started after the session's tiny engines are stopped.

This directory sorts last (`zz_`), so its module runs after every test that uses the tiny engines. Two
0.6B-shape engines beside the two tiny ones, Ray and a 0.6B reference model come close to the host's
24 GiB, so the module's first fixture stops the tiny engines (through their fixture's own teardown; a
later test that asks for them would start them again) before its engines start. A sampler records the
peak memory of the whole process tree (pytest, Ray, engines) and of the host while the module runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psutil
import pytest
from engine_helpers import TEST_ENGINE_ARGS, engine_env

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, Fixtures, build_fixtures

GIB = 2**30


class MemorySampler:
    """Every `period_s`: the RSS of this process and all its descendants (Ray's processes and the engines
    are children of the pytest process), of each engine's own tree, and the host's used memory; keeps the
    peaks. RSS sums count shared pages once per process, so the tree figure is an upper bound."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.engines: dict[str, EngineProcess] = {}
        self.peak_tree = 0
        self.peak_host_used = 0
        self.peak_engine: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> None:
        me = psutil.Process()
        tree = _rss([me.pid, *(child.pid for child in me.children(recursive=True))])
        vm = psutil.virtual_memory()
        self.peak_tree = max(self.peak_tree, tree)
        self.peak_host_used = max(self.peak_host_used, vm.total - vm.available)
        for name, engine in list(self.engines.items()):
            rss = _rss(engine.process_ids())
            self.peak_engine[name] = max(self.peak_engine.get(name, 0), rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except psutil.Error:  # a process that exited while its children were listed: the next sample
                pass
            self._stop.wait(self.period_s)


def _rss(pids: list[int]) -> int:
    """The summed RSS of `pids`; a process gone since it was listed counts 0."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


@attrs.define
class ScaleFigures:
    """What the module measured; printed at its end and written to $VERSIONED_LORA_SCALE_FIGURES if set."""

    values: dict[str, Any] = attrs.field(factory=dict)

    def write(self, terminal: Any) -> None:
        text = json.dumps(self.values, indent=1, sort_keys=True)
        if terminal is not None:
            terminal.write_line(f"\nqwen3-0.6b-shape figures: {text}")
        target = os.environ.get("VERSIONED_LORA_SCALE_FIGURES")
        if target:
            Path(target).write_text(text + "\n")


@pytest.fixture(scope="module")
def scale_figures(request: pytest.FixtureRequest) -> Iterator[ScaleFigures]:
    figures = ScaleFigures()
    started = time.monotonic()
    yield figures
    figures.values["module_wall_s"] = round(time.monotonic() - started, 1)
    figures.write(request.config.pluginmanager.get_plugin("terminalreporter"))


@pytest.fixture(scope="module")
def memory(scale_figures: ScaleFigures) -> Iterator[MemorySampler]:
    sampler = MemorySampler()
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()
        scale_figures.values["peak_tree_rss_gib"] = round(sampler.peak_tree / GIB, 2)
        scale_figures.values["peak_host_used_gib"] = round(sampler.peak_host_used / GIB, 2)
        scale_figures.values["peak_engine_rss_gib"] = {k: round(v / GIB, 2) for k, v in sampler.peak_engine.items()}


@pytest.fixture(scope="module")
def scale_fixtures() -> Fixtures:
    return build_fixtures(fixture=QWEN3_0_6B_SHAPE)


@pytest.fixture(scope="module")
def scale_reference(scale_fixtures: Fixtures) -> ReferenceModel:
    return ReferenceModel(scale_fixtures.model_dir)


@pytest.fixture(scope="module")
def tiny_engines_stopped(request: pytest.FixtureRequest) -> bool:
    """Stop the session's tiny engines if some earlier test started them; True if it did. Their fixture's
    own teardown runs (FixtureDef.finish), so nothing is left running and the session's end stops nothing
    twice."""
    stopped = False
    for fixturedef in request._fixturemanager.getfixturedefs("engines", request.node) or ():
        if fixturedef.cached_result is not None:
            fixturedef.finish(request)  # type: ignore[arg-type]
            stopped = True
    return stopped


@attrs.frozen
class ScaleEngines:
    e0: EngineProcess
    e1: EngineProcess

    def __iter__(self) -> Iterator[EngineProcess]:
        return iter((self.e0, self.e1))


@pytest.fixture(scope="module")
def scale_engines(
    scale_fixtures: Fixtures, tiny_engines_stopped: bool, memory: MemorySampler, scale_figures: ScaleFigures,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ScaleEngines]:
    """Two engines serving the 0.6B-shape model with r=64 on every linear module, started together and
    timed each (two starts on 2 cores share them: each time is an upper bound of a lone start)."""
    log_dir = Path(os.environ.get("VERSIONED_LORA_ENGINE_LOGS", tmp_path_factory.mktemp("scale-engine-logs")))
    engines = []
    for index in range(2):
        engines.append(EngineProcess(EngineConfig(
            model_dir=scale_fixtures.model_dir, port=free_port_block(), log_path=log_dir / f"scale-E{index}.log",
            max_lora_rank=scale_fixtures.lora_rank, lora_target_modules=scale_fixtures.target_modules,
            extra_args=TEST_ENGINE_ARGS, env=engine_env(),
        )))
    for index, engine in enumerate(engines):
        memory.engines[f"E{index}"] = engine
    seconds: dict[str, float] = {}
    errors: list[BaseException] = []

    def start(name: str, engine: EngineProcess) -> None:
        began = time.monotonic()
        try:
            engine.start()
        except BaseException as exc:  # re-raised below, after both starts finished
            errors.append(exc)
        seconds[name] = round(time.monotonic() - began, 1)

    threads = [threading.Thread(target=start, args=(f"E{i}", e)) for i, e in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        memory.sample()
        scale_figures.values["tiny_engines_stopped_first"] = tiny_engines_stopped
        scale_figures.values["engine_start_s_parallel"] = seconds
        scale_figures.values["engine_rss_after_start_gib"] = {
            name: round(_rss(engine.process_ids()) / GIB, 2)
            for name, engine in zip(("E0", "E1"), engines, strict=True)}
        yield ScaleEngines(engines[0], engines[1])
    finally:
        memory.sample()
        for engine in engines:
            engine.stop()
