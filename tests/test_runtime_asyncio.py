"""Interplay with asyncio's own cancellation: ``asyncio.timeout``, ``wait_for``, ``gather``.

These cancel with a native ``Task.cancel()``, which anyio's shielded scopes do not keep
out, so they reach code paths anyio cancellation never does. Run under pytest-asyncio.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import after_grant, assert_idle, wait_until

import tangram

pytestmark = pytest.mark.asyncio


def held(runtime: tangram.Runtime) -> float:
    return runtime.stats().resources["cpu"].held


async def test_asyncio_timeout_while_waiting_releases() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        # Held by another task: one holding it itself would be refused at once.
        holding, release = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with runtime.acquire(cpu=1):
                holding.set()
                await release.wait()

        task = asyncio.create_task(holder())
        await holding.wait()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02), runtime.acquire(cpu=1, kind="late"):
                pytest.fail("granted while held")  # pragma: no cover
        assert runtime.stats().waiting == 0
        assert held(runtime) == 1
        release.set()
        await task
        assert runtime.stats().kinds["late"].cancelled == 1
        assert_idle(runtime)


async def test_asyncio_timeout_firing_as_the_grant_is_made_releases() -> None:
    """A native cancel delivered on the checkpoint after an immediate grant.

    ``asyncio.timeout(0)`` cancels the task at its first suspension, which is the
    checkpoint ``acquire`` makes after granting free units at once.
    """
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0), runtime.acquire(cpu=1, kind="instant"):
                await asyncio.sleep(1)  # pragma: no cover
        assert held(runtime) == 0
        assert runtime.stats().kinds["instant"].cancelled == 1
        assert_idle(runtime)


async def test_task_cancel_while_waiting_and_after_grant() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        release = asyncio.Event()
        ran: list[str] = []
        tasks: dict[str, asyncio.Task[None]] = {}
        running_at_cancel: list[int] = []

        async def holder() -> None:
            async with runtime.acquire(cpu=1, kind="holder"):
                await release.wait()

        def cancel() -> None:
            # Inside the pass that granted the unit to "raced", which has not resumed.
            running_at_cancel.append(runtime.stats().running)
            tasks["raced"].cancel()

        async def waiter(name: str) -> None:
            async with runtime.acquire(cpu=1, kind=name):
                ran.append(name)
                await asyncio.sleep(3600)

        holding = asyncio.create_task(holder())
        await wait_until(lambda: held(runtime) == 1)
        tasks["queued"] = asyncio.create_task(waiter("queued"))
        tasks["raced"] = asyncio.create_task(waiter("raced"))
        await wait_until(lambda: runtime.stats().waiting == 2)
        tasks["queued"].cancel()  # cancelled while waiting in the queue
        await wait_until(lambda: runtime.stats().waiting == 1)
        after_grant(runtime, 1, cancel)
        release.set()
        await holding
        assert running_at_cancel == [1]
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert ran == []
        stats = runtime.stats()
        assert stats.kinds["queued"].cancelled == 1
        assert stats.kinds["raced"].cancelled == 1
        assert_idle(runtime)


async def test_gather_of_run_respects_capacity_and_returns_in_order() -> None:
    async with tangram.Runtime(capacity={"cpu": 3}) as runtime:
        peak = 0

        async def work(i: int) -> int:
            nonlocal peak
            peak = max(peak, int(held(runtime)))
            await asyncio.sleep(0)
            return i * i

        results = await asyncio.gather(*(runtime.run({"cpu": 1}, work, i) for i in range(20)))
        assert results == [i * i for i in range(20)]
        assert peak == 3
        assert runtime.stats().kinds["action"].completed == 20
        assert_idle(runtime)


async def test_wait_for_around_run_releases() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with runtime.acquire(cpu=1):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(runtime.run({"cpu": 1}, asyncio.sleep, 0), 0.02)
            assert runtime.stats().waiting == 0
        assert_idle(runtime)
