"""The RFC §7.2 run, in the order the RFC fixes: pre-registration, clean baselines, the §3.4 scenario on both
engines, negative controls, two-way KV isolation. Engines come in as URLs; verdicts go out as a report."""

from __future__ import annotations

import asyncio
import time
import traceback
import uuid
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import attrs

from gpu_validation import checks as C
from gpu_validation.checks import Baseline, Check
from gpu_validation.config import DEFAULT_SESSIONS, PreRegistered, SessionPlan, build_preregistered
from gpu_validation.engines import DEFAULT_BUCKET_BYTES, Engine, LaunchSpec, Observation, start_engine, stop_engine
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir
from versioned_lora.capabilities import parse_key
from versioned_lora.spec.identities import VersionKey, lora_name


@attrs.define
class Options:
    engine_urls: list[str]
    out_dir: Path
    model_dir: Path
    adapter_dirs: dict[str, Path]
    launch: LaunchSpec  # how fresh baseline processes are started (and E0/E1 with --launch)
    token: str | None
    repo: Path
    transport: str = "link"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


@attrs.define
class Run:
    """Mutable state of one run: checks so far, every observation, phase timings."""

    options: Options
    pre: PreRegistered
    snapshots: dict[str, Snapshot]
    run_id: str
    epoch: int
    checks: list[Check] = attrs.field(factory=list)
    observations: list[Observation] = attrs.field(factory=list)
    timings: dict[str, float] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    baselines: dict[str, dict[str, Baseline]] = attrs.field(factory=dict)

    @property
    def epsilon(self) -> float:
        return float(self.pre.body["epsilon"])

    @property
    def new_tokens(self) -> int:
        return int(self.pre.body["sampling"]["max_new_tokens"])

    @property
    def probe(self) -> list[int]:
        return list(self.pre.body["probe_input_ids"])

    def name(self, version: str, label: str) -> str:
        """A managed name never used before (run id in the version id): a fresh lora_id, a cold namespace."""
        return lora_name(VersionKey(self.epoch, f"gv{label}-{self.run_id}"), self.snapshots[version].digest)

    def engine(self, label: str, url: str) -> Engine:
        device = "cuda" if self.options.launch.gpu else "cpu"  # the link's backend must match the engines'
        return Engine(label, url, self.options.token, self.options.transport, self.options.bucket_bytes, device,
                      capability_key=parse_key(self.options.launch.key_file.read_text()))

    async def score(self, engine: Engine, name: str, prefix_id: str, phase: str) -> Observation:
        observation = await engine.score(name, prefix_id, self.pre.prefix(prefix_id).token_ids, self.new_tokens, phase)
        self.observations.append(observation)
        return observation

    async def timed(self, phase: str, work: Awaitable[Any]) -> Any:
        started = time.monotonic()
        try:
            return await work
        finally:
            self.timings[phase] = round(time.monotonic() - started, 2)


def preregister(options: Options) -> tuple[PreRegistered, dict[str, Snapshot]]:
    """Step 0, before any engine request: fix every number that decides a verdict and write it down."""
    from versioned_lora.adapters.reference_forward import ReferenceModel

    snapshots = {v: snapshot_from_adapter_dir(d) for v, d in options.adapter_dirs.items()}
    pre = build_preregistered(
        model_dir=options.model_dir, snapshots=snapshots, adapter_dirs=options.adapter_dirs, repo=options.repo,
        reference=ReferenceModel(options.model_dir), engines=options.engine_urls, transport=options.transport,
    )  # fmt: skip
    pre.write(options.out_dir / "preregistered.json")
    return pre, snapshots


# ---- step 1: clean single-version baselines ----------------------------------------------------------------------


async def baseline(run: Run, version: str) -> None:
    """A fresh engine process that only ever holds `version`: score every pre-registered prefix twice (the
    second time confirms the baseline is stable), then stop the process."""
    label = f"baseline-{version}"
    process = await start_engine(run.options.launch, label)
    engine = run.engine(label, process.url)
    try:
        held = await engine.managed_names() + await engine.stock_adapters()
        if held:
            raise RuntimeError(f"{label} is not clean: it already holds {held}")
        name = run.name(version, f"base{version}")
        await engine.publish(run.snapshots[version], name, run.options.adapter_dirs[version], run.probe)
        firsts, repeats = [], []
        for prefix in run.pre.prefixes():
            first = await run.score(engine, name, prefix.prefix_id, f"baseline {version}")
            firsts.append(first)
            repeats.append((first, await run.score(engine, name, prefix.prefix_id, f"baseline {version} repeat")))
        run.baselines[version] = {o.prefix_id: Baseline.from_observation(version, o) for o in firsts}
        run.checks.append(C.cold_start_check(f"baseline_{version}_fresh_process_cold_start", firsts[0]))
        run.checks.append(C.stability_check(f"baseline_{version}_stable", repeats, run.epsilon))
    finally:
        await engine.close()
        await stop_engine(process)


# ---- step 2: RFC §3.4 on both engines ------------------------------------------------------------------------------


def session_prefix_ids(session: SessionPlan) -> list[str]:
    return [f"{session.name}/turn{t + 1}" for t in range(len(session.tool_outputs) + 1)]


async def scenario(run: Run, engines: Sequence[Engine]) -> dict[str, str]:
    """Default A on both engines; S_old binds A and keeps generating while B is staged; B READY on E0 only, S_mid
    still binds A; B READY on E1, the default moves to B; S_new binds B; then every session's tool turn, retry
    and resume (full prefixes) run concurrently on both engines. Every generation is scored against the clean
    baseline of its session's version for the same full prefix."""
    names = {"A": run.name("A", "A"), "B": run.name("B", "B")}
    dirs = run.options.adapter_dirs
    await asyncio.gather(*(e.publish(run.snapshots["A"], names["A"], dirs["A"], run.probe) for e in engines))
    bound: dict[str, str] = {}  # session -> version, fixed at its first generation (bind_first)
    default = "A"

    async def first_turn(session: str, phase: str) -> None:
        bound[session] = default
        for engine in engines:
            await run.score(engine, names[bound[session]], f"{session}/turn1", phase)

    await first_turn("S_old", "S_old turn1 before publication")
    stop = asyncio.Event()

    async def old_requests_keep_running() -> None:
        while True:
            for engine in engines:
                await run.score(engine, names["A"], "S_old/turn1", "S_old turn1 during publication of B")
            if stop.is_set():
                return

    background = asyncio.create_task(old_requests_keep_running())
    try:
        staged = await asyncio.gather(*(e.begin(run.snapshots["B"], names["B"], dirs["B"]) for e in engines))
        await engines[0].end(staged[0][0], names["B"], staged[0][1], run.probe)
        run.notes.append(f"B READY on {engines[0].label} only")
        await first_turn("S_mid", "S_mid turn1 after READY(B) on E0 only")  # E1 not ready: default is still A
        for engine, (handle, attempt) in zip(engines[1:], staged[1:], strict=True):
            await engine.end(handle, names["B"], attempt, run.probe)
    finally:
        stop.set()
        await background
    during = sum(1 for o in run.observations if o.phase.endswith("during publication of B"))
    run.notes.append(f"{during} S_old generations ran while B was staged and ended")
    default = "B"  # commit: READY from every engine; the harness's own default switch (no registry here)
    run.notes.append("B READY on every engine: default -> B (the harness's own switch; no registry here)")
    await first_turn("S_new", "S_new turn1 after commit")

    async def later_turns(engine: Engine, session: SessionPlan) -> None:
        tool, resume = session_prefix_ids(session)[1:3]
        name = names[bound[session.name]]
        await run.score(engine, name, tool, f"{session.name} tool turn")
        await run.score(engine, name, tool, f"{session.name} retry of tool turn")
        await run.score(engine, name, resume, f"{session.name} resume")

    await asyncio.gather(*(later_turns(e, s) for e in engines for s in DEFAULT_SESSIONS))
    for session in DEFAULT_SESSIONS:
        if bound[session.name] != session.version:
            raise RuntimeError(f"{session.name} bound {bound[session.name]}, pre-registered {session.version}")
        pairs = [(o, run.baselines[session.version][o.prefix_id]) for o in run.observations
                 if o.prefix_id.startswith(f"{session.name}/") and not o.phase.startswith("baseline")]  # fmt: skip
        run.checks.append(C.numerics_check(f"scenario_{session.name}_matches_{session.version}_baseline", "positive",
                                           pairs, run.epsilon))  # fmt: skip
    return names


# ---- step 3: negative control (a) and two-way KV isolation ---------------------------------------------------------


async def control_b_under_a_name(run: Run, engine: Engine) -> None:
    """B's weights served where A is expected, scored as S_old against A's baseline: the numerics check must FAIL.
    (Under a name of A's form, with A's digest prefix, an engine refuses B's begin outright: NAME_DIGEST_MISMATCH.)"""
    name = run.name("B", "Actrl")  # a name of B's own form, scored against A's baseline below
    await engine.publish(run.snapshots["B"], name, run.options.adapter_dirs["B"], run.probe)
    pairs = []
    for prefix_id in session_prefix_ids(DEFAULT_SESSIONS[0]):
        observation = await run.score(engine, name, prefix_id, "control: B served where A is expected")
        pairs.append((observation, run.baselines["A"][prefix_id]))
    run.checks.append(C.numerics_check("control_B_served_under_A_name", "negative", pairs, run.epsilon))
    await engine.reclaim(name)


async def kv_direction(run: Run, engine: Engine, warm_version: str, with_blind_key_control: bool) -> None:
    """One direction of the RFC §7.2 KV flowchart from its own initial cache state: two names never loaded
    before (fresh lora_ids, so cold namespaces, no flush), the warm version first, then the other version cold,
    then the other again (must hit its own cache)."""
    other = "B" if warm_version == "A" else "A"
    warm_name, other_name = run.name(warm_version, f"kv{warm_version}"), run.name(other, f"kv{other}")
    dirs = run.options.adapter_dirs
    for version, name in ((warm_version, warm_name), (other, other_name)):
        await engine.publish(run.snapshots[version], name, dirs[version], run.probe)
    phase = f"KV {warm_version} warm -> {other}"
    warm = await run.score(engine, warm_name, "KV/prompt", f"{phase}: warm {warm_version}")
    cross = await run.score(engine, other_name, "KV/prompt", f"{phase}: {other} after {warm_version} warm")
    repeat = await run.score(engine, other_name, "KV/prompt", f"{phase}: {other} repeated")
    baseline = run.baselines[other]["KV/prompt"]
    run.checks.append(C.kv_isolation_check(f"kv_{warm_version}_warm_then_{other}_cold_on_{engine.label}", "positive",
                                           warm, cross, repeat, baseline, run.epsilon))  # fmt: skip
    if with_blind_key_control:
        # Negative control (b): a cache key that ignores the adapter puts the other version's request into the
        # warm version's namespace. Produced for real by sending that request with the warm version's
        # lora_path: the engine reports the warm request's tokens as cached. Judged by the same rules.
        blind = await run.score(engine, warm_name, "KV/prompt", f"control: {other} request under a blind cache key")
        blind_repeat = await run.score(engine, warm_name, "KV/prompt", "control: blind cache key, repeated")
        run.checks.append(C.kv_isolation_check("control_cache_key_ignores_adapter", "negative", warm, blind,
                                               blind_repeat, baseline, run.epsilon))  # fmt: skip
    for name in (warm_name, other_name):
        await engine.reclaim(name)


async def isolation_and_controls(run: Run, engines: Sequence[Engine]) -> None:
    """E0: control (a), then A warm -> B (with control (b)); E1 meanwhile: B warm -> A. Two managed slots per
    engine (max_loaded_loras 3 = two pinned + one free) bound how much runs at once."""
    e0, e1 = engines[0], engines[-1]

    async def on_e0() -> None:
        await control_b_under_a_name(run, e0)
        await kv_direction(run, e0, "A", with_blind_key_control=True)

    await asyncio.gather(on_e0(), kv_direction(run, e1, "B", with_blind_key_control=False))


# ---- the whole run ------------------------------------------------------------------------------------------------


async def run_all(options: Options) -> Run:
    options.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pre, snapshots = preregister(options)
    run = Run(options, pre, snapshots, run_id=uuid.uuid4().hex[:8], epoch=int(time.time()))
    run.timings["preregister"] = round(time.monotonic() - started, 2)
    engines = [run.engine(f"E{i}", url) for i, url in enumerate(options.engine_urls)]
    try:
        for version in ("A", "B"):
            await run.timed(f"baseline_{version}", baseline(run, version))
        run.checks.append(C.discrimination_check(run.baselines, [p.prefix_id for p in pre.prefixes()],
                                                 float(pre.body["min_separation"])))  # fmt: skip
        names = await run.timed("scenario", scenario(run, engines))
        await asyncio.gather(*(e.reclaim(n) for e in engines for n in names.values()))
        await run.timed("isolation_and_controls", isolation_and_controls(run, engines))
    except Exception:  # the run stops, the report says where; never a silent PASS
        run.checks.append(Check("harness_completed", "positive", C.FAIL, traceback.format_exc()[-4000:]))
    else:
        run.checks.append(Check("harness_completed", "positive", C.PASS, "every phase ran"))
    finally:
        for engine in engines:
            await engine.close()
    run.timings["total"] = round(time.monotonic() - started, 2)
    return run
