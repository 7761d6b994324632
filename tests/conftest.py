"""Shared fixtures: event-loop backends, a virtual clock, and checks that nothing leaked.

Runtime tests run on anyio's pytest plugin under asyncio, asyncio in debug mode and trio
(the ``anyio_backend`` fixture below, as in anyio's own conftest). Tests that assert exact
times override ``anyio_backend`` with :func:`virtual_backend`: trio with a
``MockClock(autojump_threshold=0)``, which jumps straight to the next deadline whenever
every task is blocked, so a test of minutes of schedule runs in milliseconds and every
time it reads is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import trio.testing

import tangram
from tangram._core._ledger import held_matches_grants

Backend = tuple[str, dict[str, Any]]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"debug": True}), id="asyncio+debug"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Backend:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """A fresh virtual clock per test (a clock keeps its time between runs)."""
    return trio.testing.MockClock(autojump_threshold=0)


def virtual_backend(clock: trio.testing.MockClock) -> Backend:
    """The backend option that runs a test on trio under ``clock``."""
    return ("trio", {"clock": clock})


async def wait_until(predicate: Callable[[], bool], *, checkpoints: int = 10_000) -> None:
    """Yield to other tasks until ``predicate()`` holds; fail rather than hang.

    Checkpoints do not let a virtual clock advance, so waiting this way never moves time.
    """
    for _ in range(checkpoints):
        if predicate():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError(f"condition never held after {checkpoints} checkpoints")


def after_grant(runtime: tangram.Runtime, running: int, callback: Callable[[], object]) -> None:
    """Call ``callback`` once, inside the scheduling pass that leaves ``running`` actions.

    A pass grants units and wakes the waiter, which runs only at its next turn: a callback
    here acts in the window between a grant and the granted task resuming, which no
    task of the test can reach by itself (the pass may run in the runtime's own task).
    """

    class AfterGrant(tangram.Instrument):
        def after_plan(self, plan: tangram.abc.Plan, now: float) -> None:
            if runtime.stats().running == running:
                runtime.remove_instrument(self)
                callback()

    runtime.add_instrument(AfterGrant())


def assert_idle(runtime: tangram.Runtime) -> None:
    """Nothing held, nothing waiting, nothing running, and the ledger is consistent."""
    stats = runtime.stats()
    for name, res in stats.resources.items():
        if name not in runtime._ledger.rates:
            assert res.held == 0, f"{name}: {res.held} units still held"
    assert stats.waiting == 0
    assert stats.running == 0
    assert runtime._leases == {}
    assert held_matches_grants(runtime._ledger)


def assert_consistent(runtime: tangram.Runtime) -> None:
    """Units held equal the sum of live grants and none is negative."""
    ledger = runtime._ledger
    assert held_matches_grants(ledger)
    for name, held in ledger.held.items():
        assert held >= -1e-9, f"{name}: negative hold {held}"


def held(runtime: tangram.Runtime, kind: str = "cpu") -> float:
    return runtime.stats().resources[kind].held


async def hold(runtime: tangram.Runtime, tg: anyio.abc.TaskGroup, **demand: object) -> anyio.Event:
    """Start a task holding ``demand`` until the returned event is set."""
    release = anyio.Event()
    granted = anyio.Event()

    async def holder() -> None:
        async with runtime.acquire(kind="holder", estimate=100.0, **demand):
            granted.set()
            await release.wait()

    tg.start_soon(holder)
    await granted.wait()
    return release
