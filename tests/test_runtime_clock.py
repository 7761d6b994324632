"""The clock a runtime reads on asyncio: the loop's own, however the loop tells the time.

On asyncio's own loops the runtime reads ``time.monotonic`` directly, which is what their
``time()`` returns; a loop that keeps a clock of its own (a subclass's, or one set on
the instance, as a virtual clock in a test does) must still be read through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import tangram

SHIFT = 1e6  # seconds: far from ``time.monotonic()``, so a wrong clock cannot pass


class _ShiftedLoop(asyncio.SelectorEventLoop):
    def time(self) -> float:
        return super().time() + SHIFT


def _subclassed() -> asyncio.AbstractEventLoop:
    return _ShiftedLoop()


def _patched() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    base = loop.time
    loop.time = lambda: base() + SHIFT  # type: ignore[method-assign]
    return loop


def _plain() -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop()


async def _times() -> tuple[tangram.Lease, float, float]:
    loop = asyncio.get_running_loop()
    async with tangram.Runtime(capacity={"cpu": 1}):
        before = loop.time()
        async with tangram.acquire(cpu=1) as lease:
            pass
        return lease, before, loop.time()


@pytest.mark.parametrize("make", [_plain, _subclassed, _patched])
def test_lease_times_come_from_the_loops_clock(
    make: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    loop = make()
    try:
        lease, before, after = loop.run_until_complete(_times())
    finally:
        loop.close()
    for at in (lease.queued_at, lease.admitted_at, lease.started_at, lease.finished_at):
        assert before <= at <= after
