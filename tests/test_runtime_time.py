"""Exact times on a virtual clock: lease timings, rate refills, FCFS, resizes.

Every test here runs on trio with ``MockClock(autojump_threshold=0)``: when all tasks are
blocked the clock jumps to the next deadline, so sleeps cost nothing and the times a test
reads are exactly those the schedule implies.
"""

from __future__ import annotations

import anyio
import anyio.abc
import pytest
import trio.testing
from conftest import Backend, assert_consistent, assert_idle, virtual_backend, wait_until

import tangram
from tangram.errors import WaitTimeoutError

pytestmark = pytest.mark.anyio

# Rate wake-ups are set a microsecond past the exact refill time (see _policy._rate_wait).
REFILL_SLACK = 1e-5


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return virtual_backend(autojump_clock)


async def test_the_clock_is_virtual() -> None:
    start = anyio.current_time()
    await anyio.sleep(3600)
    assert anyio.current_time() - start == 3600


async def test_lease_timings_are_exact() -> None:
    leases: dict[str, tangram.Lease] = {}
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:

        async def action(name: str, arrive: float, seconds: float) -> None:
            await anyio.sleep(arrive)
            async with runtime.acquire(cpu=1, kind=name) as lease:
                leases[name] = lease
                await anyio.sleep(seconds)

        async with anyio.create_task_group() as tg:
            tg.start_soon(action, "a", 0.0, 2.0)
            tg.start_soon(action, "b", 0.5, 1.0)
        a, b = leases["a"], leases["b"]
        assert (a.queued_at, a.admitted_at, a.started_at, a.finished_at) == (0, 0, 0, 2)
        assert (b.queued_at, b.admitted_at, b.started_at, b.finished_at) == (0.5, 2, 2, 3)
        assert (b.queue_seconds, b.overhead_seconds, b.exec_seconds) == (1.5, 0, 1)
        assert (a.queue_seconds, a.exec_seconds) == (0, 2)
        assert_idle(runtime)


async def test_fcfs_admission_order_equals_arrival_order() -> None:
    admitted: list[int] = []
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:

        async def action(i: int) -> None:
            await anyio.sleep(0.01 * i)
            async with runtime.acquire(cpu=1, estimate=1.0):
                admitted.append(i)
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as tg:
            for i in reversed(range(12)):  # start order must not matter, only arrival
                tg.start_soon(action, i)
        assert admitted == list(range(12))
        assert anyio.current_time() == pytest.approx(6.01)
        assert_idle(runtime)


@pytest.mark.parametrize("trajectories", [8, 60])
async def test_a_new_trajectorys_first_action_waits_its_turn_among_its_kind(
    trajectories: int,
) -> None:
    """Two trajectories run 30 ms actions back to back on two cores; the others come 50 ms
    in. The newcomers' first actions came while the kind's estimate still leaned on the
    prior, so they were filed many times their size, and every later action of the same
    kind passed them until they fell due: they waited up to 1.48 s at 8 trajectories
    and 4.7 s at 60 (written first, this failed so; at 60 it failed again with each
    later action falling due alone, until the alike ahead fell due with it). As alike as
    anyone knows, they wait in arrival order: one run of each other trajectory's, two
    at a time, goes first."""
    waits: dict[int, float] = {}
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:

        async def trajectory(index: int, start: float, stop: float) -> None:
            await anyio.sleep(start)
            while anyio.current_time() < stop:
                asked = anyio.current_time()
                async with runtime.acquire(cpu=1, kind="run", trajectory=f"t{index}"):
                    waits.setdefault(index, anyio.current_time() - asked)
                    await anyio.sleep(0.03)

        began = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for index in range(trajectories):
                tg.start_soon(trajectory, index, 0.0 if index < 2 else 0.05, began + 2.0)
        assert_idle(runtime)
    assert len(waits) == trajectories
    assert max(waits.values()) <= (trajectories // 2 + 1) * 0.03 + 1e-6, waits


@pytest.mark.parametrize(
    "capacity", [pytest.param(tangram.Rate(5, burst=5), id="Rate"), pytest.param("5/s", id="text")]
)
async def test_rate_admits_at_the_refill_times(capacity: object) -> None:
    times: list[float] = []
    async with tangram.Runtime(capacity={"api": capacity}) as runtime:

        async def call() -> None:
            async with runtime.acquire(api=1):
                times.append(anyio.current_time())

        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(call)
    # A burst of five at once, then one every 1/5 s as the budget refills.
    expected = [0.0] * 5 + [0.2 * k for k in range(1, 8)]
    assert times == pytest.approx(expected, abs=REFILL_SLACK)
    assert all(t >= e for t, e in zip(times, expected, strict=True))


async def test_rate_burst_below_rate_and_fractional_takes() -> None:
    times: list[float] = []
    async with tangram.Runtime(capacity={"tokens": tangram.Rate(2, burst=1)}) as runtime:

        async def call(amount: float) -> None:
            async with runtime.acquire(tokens=amount):
                times.append(anyio.current_time())

        for amount in (1, 1, 0.5, 0.5, 1):
            await call(amount)
    assert times == pytest.approx([0.0, 0.5, 0.75, 1.0, 1.5], abs=REFILL_SLACK)


async def test_rate_and_count_together() -> None:
    """Each action needs a slot and a request: the slower of the two sets the pace."""
    times: list[float] = []
    async with tangram.Runtime(capacity={"conn": 2, "api": tangram.Rate(10, burst=1)}) as runtime:

        async def call() -> None:
            async with runtime.acquire(conn=1, api=1):
                times.append(anyio.current_time())
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(call)
    assert times == pytest.approx([0.0, 0.1, 1.0, 1.1], abs=REFILL_SLACK)


async def test_rate_waiter_behind_an_exhausting_admission_is_woken_by_the_refill() -> None:
    times: dict[str, float] = {}
    cap = {"cpu": 1, "api": tangram.Rate(1, burst=2)}
    async with tangram.Runtime(capacity=cap) as runtime, anyio.create_task_group() as tg:

        async def action(name: str, seconds: float, demand: dict[str, object]) -> None:
            async with runtime.acquire(demand, kind=name):
                times[name] = anyio.current_time()
                await anyio.sleep(seconds)

        await action("drain", 0, {"api": 2})  # the budget is empty at t=0
        tg.start_soon(action, "long", 100, {"cpu": 1, "api": 1})  # granted at t=1, holds cpu
        await wait_until(lambda: runtime.stats().waiting == 1)
        tg.start_soon(action, "call", 0, {"api": 1})  # needs only the budget: t=2
        await wait_until(lambda: runtime.stats().waiting == 2)
    assert times["long"] == pytest.approx(1.0, abs=REFILL_SLACK)
    assert times["call"] == pytest.approx(2.0, abs=REFILL_SLACK)


async def test_wait_timeout_fires_at_its_deadline() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            release, _ = await hold_elastic(runtime, tg, "holder", tangram.Elastic(1, 1), 100.0, [])
            with pytest.raises(WaitTimeoutError):
                async with runtime.acquire(cpu=1, kind="late", wait_timeout=2.5):
                    pytest.fail("granted while held")  # pragma: no cover
            assert anyio.current_time() == 2.5
            release.set()
        stats = runtime.stats().kinds["late"]
        assert stats.cancelled == 1
        assert stats.queue.mean == 2.5
        assert_idle(runtime)


async def test_wait_timeout_not_reached_when_granted_in_time() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime, anyio.create_task_group() as tg:

        async def holder() -> None:
            async with runtime.acquire(cpu=1):
                await anyio.sleep(1.0)

        tg.start_soon(holder)
        await wait_until(lambda: runtime.stats().running == 1)
        async with runtime.acquire(cpu=1, wait_timeout=1.5) as lease:
            assert lease.admitted_at == 1.0
        # Waiting longer in the body does not time anything out.
        await anyio.sleep(5)


async def test_stats_summaries_and_outcomes_are_exact() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:

        async def action(arrive: float, seconds: float, kind: str, fail: bool = False) -> None:
            await anyio.sleep(arrive)
            try:
                async with runtime.acquire(cpu=1, kind=kind):
                    await anyio.sleep(seconds)
                    if fail:
                        raise RuntimeError("tool failed")
            except RuntimeError:
                pass

        async with anyio.create_task_group() as tg:
            # One unit: queue waits are 0, 1 and 2 s; each runs 2 s (the third fails).
            tg.start_soon(action, 0.0, 2.0, "x")
            tg.start_soon(action, 1.0, 2.0, "x")
            tg.start_soon(action, 2.0, 2.0, "x", True)
            await anyio.sleep(3.0)
            with anyio.CancelScope() as scope:  # cancelled after 1 s of waiting
                scope.deadline = anyio.current_time() + 1.0
                async with runtime.acquire(cpu=1, kind="y"):
                    pytest.fail("granted while held")  # pragma: no cover
        x = runtime.stats().kinds["x"]
        assert (x.completed, x.failed, x.cancelled) == (2, 1, 0)
        assert (x.queue.count, x.queue.mean, x.queue.p50, x.queue.p95, x.queue.p99) == (
            3,
            1.0,
            1.0,
            2.0,
            2.0,
        )
        assert (x.exec.mean, x.exec.p50, x.exec.p99) == (2.0, 2.0, 2.0)
        assert (x.overhead.mean, x.overhead.p99) == (0.0, 0.0)
        assert (x.act.mean, x.act.p50, x.act.p95) == (3.0, 3.0, 4.0)
        y = runtime.stats().kinds["y"]
        assert (y.completed, y.failed, y.cancelled) == (0, 0, 1)
        assert y.queue.mean == 1.0
        assert y.exec.count == 0  # never ran: no execution time to summarise


async def test_unit_seconds_and_peak() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime, anyio.create_task_group() as tg:

        async def action(units: int, arrive: float, seconds: float) -> None:
            await anyio.sleep(arrive)
            async with runtime.acquire(cpu=units):
                await anyio.sleep(seconds)

        tg.start_soon(action, 1, 0.0, 2.0)  # 2 unit-seconds
        tg.start_soon(action, 2, 1.0, 1.0)  # 2 unit-seconds
        await anyio.sleep(1.5)
        mid = runtime.stats().resources["cpu"]
        assert (mid.held, mid.utilisation, mid.peak) == (3, 0.75, 3)
        assert mid.unit_seconds == pytest.approx(1.0 + 1.5)
    end = runtime.stats().resources["cpu"]
    assert end.unit_seconds == pytest.approx(4.0)
    assert (end.held, end.peak) == (0, 3)


async def test_rate_stats_show_the_budget_as_of_now() -> None:
    async with tangram.Runtime(capacity={"api": tangram.Rate(2, burst=4)}) as runtime:
        for _ in range(4):
            async with runtime.acquire(api=1):
                pass
        spent = runtime.stats().resources["api"]
        assert (spent.total, spent.held, spent.utilisation) == (2, 4, 1.0)
        await anyio.sleep(1.0)  # refills 2 of 4 with nothing else happening
        half = runtime.stats().resources["api"]
        assert (half.held, half.utilisation) == (pytest.approx(2.0), pytest.approx(0.5))
        await anyio.sleep(60)
        assert runtime.stats().resources["api"].held == 0


async def hold_elastic(
    runtime: tangram.Runtime,
    tg: anyio.abc.TaskGroup,
    name: str,
    demand: tangram.Elastic,
    estimate: float,
    log: list[tuple[str, int]],
) -> tuple[anyio.Event, list[tangram.Lease]]:
    """Start an action that records every resize it hears of, until released."""
    release = anyio.Event()
    box: list[tangram.Lease] = []
    granted = anyio.Event()

    async def body() -> None:
        async with runtime.acquire(cpu=demand, kind=name, estimate=estimate) as lease:
            box.append(lease)
            assert lease.units is not None
            log.append((name, lease.units))
            granted.set()
            async with anyio.create_task_group() as inner:

                async def listen() -> None:
                    while True:
                        units = await lease.wait_resized()
                        assert units == lease.units
                        log.append((name, units))

                if demand.resizable:  # others are never resized: nothing to hear
                    inner.start_soon(listen)
                await release.wait()
                inner.cancel_scope.cancel()

    tg.start_soon(body)
    await granted.wait()
    return release, box


async def test_resizable_action_hears_of_arrivals_and_departures() -> None:
    log: list[tuple[str, int]] = []
    elastic = tangram.Elastic(1, 8, efficiency=tangram.Amdahl(0.5), resizable=True)
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime, anyio.create_task_group() as tg:
        release_a, (a,) = await hold_elastic(runtime, tg, "a", elastic, 100.0, log)
        assert a.units == 8
        await anyio.sleep(1)
        release_b, (b,) = await hold_elastic(runtime, tg, "b", elastic, 10.0, log)
        await wait_until(lambda: len(log) == 3)
        assert a.units is not None and b.units is not None
        assert 1 <= a.units < 8 and 1 <= b.units < 8
        assert a.units + b.units == 8
        # Which of the two runs first in that tick is up to the event loop.
        assert log[0] == ("a", 8)
        assert sorted(log[1:]) == [("a", a.units), ("b", b.units)]
        assert_consistent(runtime)
        await anyio.sleep(1)
        release_b.set()
        await wait_until(lambda: log[-1] == ("a", 8))
        assert a.resizes == 2
        assert b.resizes == 0
        release_a.set()
    assert runtime.stats().resizes == 2
    assert_idle(runtime)


async def test_non_resizable_elastic_action_is_never_resized() -> None:
    log: list[tuple[str, int]] = []
    fixed = tangram.Elastic(1, 8, efficiency=tangram.Amdahl(0.5))
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime, anyio.create_task_group() as tg:
        release_a, (a,) = await hold_elastic(runtime, tg, "a", fixed, 100.0, log)
        assert a.units == 8
        started_b = anyio.Event()

        async def b() -> None:
            async with runtime.acquire(cpu=fixed, kind="b", estimate=1.0) as lease:
                log.append(("b", lease.units or 0))
                started_b.set()

        tg.start_soon(b)
        await anyio.sleep(50)
        assert not started_b.is_set()  # it waits: a's units are not taken back
        runtime.set_capacity(cpu=4)  # not even a capacity cut shrinks it
        await anyio.sleep(50)
        assert log == [("a", 8)]
        assert a.units == 8 and a.resizes == 0
        runtime.set_capacity(cpu=8)
        release_a.set()
        await started_b.wait()
    assert log == [("a", 8), ("b", 8)]
    assert runtime.stats().resizes == 0
