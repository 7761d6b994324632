"""``Runtime.set_capacity`` while actions run: a node joins, a node leaves."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import pytest
from conftest import assert_consistent, assert_idle, held, hold, wait_until

import tangram
from tangram.errors import CapacityExceededError

pytestmark = pytest.mark.anyio


async def test_raising_capacity_admits_waiters_at_once() -> None:
    started: list[int] = []
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=1)
            gate = anyio.Event()

            async def waiter(i: int) -> None:
                async with runtime.acquire(cpu=1):
                    started.append(i)
                    await gate.wait()

            for i in range(3):
                tg.start_soon(waiter, i)
                await wait_until(lambda i=i: runtime.stats().waiting == i + 1)
            runtime.set_capacity(cpu=3)
            # Decided inside set_capacity, without waiting for the loop.
            assert runtime.stats().running == 3
            assert runtime.stats().waiting == 1
            await wait_until(lambda: len(started) == 2)
            assert sorted(started) == [0, 1]  # the first two in line, in either order
            release.set()
            await wait_until(lambda: len(started) == 3)
            gate.set()
        assert runtime.capacity["cpu"].total == 3
        assert_idle(runtime)


async def test_lowering_below_a_waiting_demand_fails_it() -> None:
    outcomes: dict[str, str] = {}
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=4)

            async def waiter(name: str, cpu: int) -> None:
                try:
                    async with runtime.acquire(cpu=cpu, kind=name):
                        outcomes[name] = "ran"
                except CapacityExceededError as exc:
                    outcomes[name] = f"failed: {exc}"

            tg.start_soon(waiter, "big", 3)
            await wait_until(lambda: runtime.stats().waiting == 1)
            tg.start_soon(waiter, "small", 1)
            await wait_until(lambda: runtime.stats().waiting == 2)
            prepared = runtime.acquire(cpu=3)  # built before the cut, entered after it
            runtime.set_capacity(cpu=2)
            await wait_until(lambda: "big" in outcomes)
            assert outcomes["big"].startswith("failed")
            assert runtime.stats().waiting == 1  # the small one still waits
            with pytest.raises(CapacityExceededError):
                async with prepared:
                    pytest.fail("granted more than the capacity")  # pragma: no cover
            with pytest.raises(CapacityExceededError):
                runtime.acquire(cpu=3)  # checked at the call against the new capacity
            release.set()
        assert outcomes == {"big": outcomes["big"], "small": "ran"}
        kinds = runtime.stats().kinds
        assert kinds["big"].cancelled == 1
        assert_idle(runtime)


async def test_lowering_below_held_shrinks_resizable_actions() -> None:
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=tangram.Elastic(2, 8, resizable=True)) as lease:
            assert lease.units == 8
            runtime.set_capacity(cpu=5)
            assert lease.units == 5
            assert held(runtime) == 5
            assert await lease.wait_resized() == 5
            runtime.set_capacity(cpu=1)  # below its minimum: it keeps the minimum
            assert lease.units == 2
            assert held(runtime) == 2
            runtime.set_capacity(cpu=8)
            assert lease.units == 8
            assert lease.resizes == 3
            assert_consistent(runtime)
        assert_idle(runtime)


async def test_lowering_below_held_admits_nothing_until_back_under(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started: list[str] = []
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=6)
            with caplog.at_level(logging.WARNING, logger="tangram"):
                runtime.set_capacity(cpu=4)
            assert "below the 6 units held" in caplog.text
            gate = anyio.Event()

            async def newcomer(name: str, demand: object) -> None:
                async with runtime.acquire(cpu=demand, kind=name):
                    started.append(name)
                    assert held(runtime) <= 4
                    await gate.wait()

            tg.start_soon(newcomer, "rigid", 1)
            tg.start_soon(newcomer, "elastic", tangram.Elastic(1, 8, resizable=True))
            await wait_until(lambda: runtime.stats().waiting == 2)
            # 6 held of 4: nothing new is granted, not even one unit.
            assert started == []
            assert held(runtime) == 6
            release.set()
            await wait_until(lambda: len(started) == 2)
            assert held(runtime) <= 4
            assert_consistent(runtime)
            gate.set()
        assert_idle(runtime)


async def test_adding_a_resource_kind_at_run_time() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        runtime.set_capacity({"gpu": 2}, api="10/s")
        async with runtime.acquire(cpu=1, gpu=2, api=1) as lease:
            assert dict(lease.grant) == {"cpu": 1.0, "gpu": 2.0, "api": 1.0}
        assert_idle(runtime)


async def test_raising_a_rate_burst_admits_at_once() -> None:
    async with tangram.Runtime(capacity={"api": tangram.Rate(0.001, burst=1)}) as runtime:
        async with runtime.acquire(api=1):
            pass
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def call() -> None:
                async with runtime.acquire(api=1):
                    done.set()

            tg.start_soon(call)
            await wait_until(lambda: runtime.stats().waiting == 1)
            # A higher rate alone refills the budget only as time passes; here the budget
            # is what the waiter needs, so it is granted once time moves at all.
            runtime.set_capacity(api=tangram.Rate(1000, burst=1))
            with anyio.fail_after(10):
                await done.wait()
        assert runtime.stats().waiting == 0


async def test_a_cut_takes_from_resizable_actions_before_admitting_anything() -> None:
    elastic = tangram.Elastic(1, 8, efficiency=tangram.Amdahl(0.9), resizable=True)
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with anyio.create_task_group() as tg:
            release_rigid = await hold(runtime, tg, cpu=4)
            async with runtime.acquire(cpu=elastic, estimate=100.0) as lease:
                assert lease.units == 4
                runtime.set_capacity(cpu=4)  # 8 held: the elastic one gives back all it can
                assert lease.units == 1
                assert held(runtime) == 5
                started = anyio.Event()

                async def newcomer() -> None:
                    async with runtime.acquire(cpu=1, kind="new", estimate=1.0):
                        started.set()

                tg.start_soon(newcomer)
                await wait_until(lambda: runtime.stats().waiting == 1)
                assert held(runtime) == 5  # over the capacity: nothing more is granted
                runtime.set_capacity(cpu=6)  # room for one more unit: the newcomer's
                await started.wait()
                assert held(runtime) <= 6
                assert_consistent(runtime)
                release_rigid.set()
                await wait_until(lambda: lease.units is not None and lease.units > 1)
                assert held(runtime) <= 6
        assert_idle(runtime)
