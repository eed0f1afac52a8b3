"""The open-loop traffic of the online benchmark (issue 22 part 6): one seeded arrival schedule, repeated period
after period, offering every window the same sessions. The driver here is a recorder (no engine): what is under
test is when and what the traffic starts, not what an engine does with it."""

from __future__ import annotations

import asyncio
from typing import Any

from versioned_lora.demo.traffic import ArrivalSchedule, OpenLoopTraffic, TrafficShape
from versioned_lora.runtime.agentic_driver import SessionScript


class RecordingDriver:
    def __init__(self, holds: asyncio.Event | None = None) -> None:
        self.scripts: list[SessionScript] = []
        self.holds = holds

    async def run_session(self, script: SessionScript) -> Any:
        self.scripts.append(script)
        if self.holds is not None:
            await self.holds.wait()
        return script.session_id


def test_the_schedule_is_seeded_and_lies_inside_one_period() -> None:
    one, again, other = (ArrivalSchedule.seeded(3.0, 6.0, seed) for seed in (7, 7, 8))
    assert one == again and one != other
    assert all(0.0 <= t < 3.0 for t in one.offsets) and list(one.offsets) == sorted(one.offsets)
    # The rate's count, not a Poisson draw of it (seed 7 at 1.5/s once drew 12 arrivals where 4.5 are meant).
    assert len(one.offsets) == 18
    assert [len(ArrivalSchedule.seeded(3.0, 1.5, seed).offsets) for seed in range(20)] == [4] * 20  # round(4.5)


def test_every_period_offers_the_same_sessions_and_stop_ends_the_arrivals() -> None:
    schedule = ArrivalSchedule(period_s=60.0, offsets=(0.0, 1.0, 2.0))

    async def body() -> tuple[RecordingDriver, OpenLoopTraffic]:
        clock = [1000.0]
        driver = RecordingDriver()
        traffic = OpenLoopTraffic(driver, TrafficShape(turns=2, max_new_tokens=5), schedule, name="m0-",  # type: ignore[arg-type]
                                  clock=lambda: clock[0])
        # Two whole periods are already due (their arrival times lie in the past): they start at once; the
        # third period's first arrival is a minute away, and stop() ends the wait for it.
        traffic.start(t0=1000.0 - 2 * 60.0 + 0.5)
        for _ in range(50):
            await asyncio.sleep(0)
        traffic.stop()
        await traffic.join()
        return driver, traffic

    driver, traffic = asyncio.run(body())
    ids = [s.session_id for s in driver.scripts]
    assert ids == ["m0-0-0", "m0-0-1", "m0-0-2", "m0-1-0", "m0-1-1", "m0-1-2"]
    assert traffic.sessions_started == 6 and len(traffic.transcripts) == 6
    by_index = [s.prompt for s in driver.scripts]
    assert by_index[:3] == by_index[3:] and len(set(by_index[:3])) == 3  # same offers each period, distinct within
    assert {(s.turns, s.max_new_tokens) for s in driver.scripts} == {(2, 5)}


def test_join_waits_for_every_session_that_arrived() -> None:
    schedule = ArrivalSchedule(period_s=60.0, offsets=(0.0,))

    async def body() -> list[Any]:
        holds = asyncio.Event()
        driver = RecordingDriver(holds)
        traffic = OpenLoopTraffic(driver, TrafficShape(), schedule, clock=lambda: 0.0)  # type: ignore[arg-type]
        traffic.start(t0=0.0)
        for _ in range(20):
            await asyncio.sleep(0)
        traffic.stop()
        joined = asyncio.create_task(traffic.join())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not joined.done() and traffic.transcripts == []  # the arrived session is still running
        holds.set()
        await joined
        return traffic.transcripts

    assert asyncio.run(body()) == ["o0-0"]
