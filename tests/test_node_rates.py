"""A node agent's side of the job's API rates (tangram/_shared/_node_rates.py), in process.

The job's real ``SchedulerActor``, the agent's real proxy on it (``attach``) and a real
``NodeRates`` on a real node ``Runtime`` run on one event loop; only Ray's transport is
a stand-in (``_Handle`` runs each ``.remote()`` call as a task on this loop), so the
orders the live path allows can be forced: a give before its take, a call given up
while its forward asks the job's capacity. tests/test_ray_rates.py runs the same code
over a real multi-node Ray cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import tangram
from tangram._runtime._run import Runtime
from tangram._shared._node_rates import NodeRates, lent_kinds
from tangram._shared._protocol import CANCELLED, COMPLETED
from tangram._shared._proxy import attach
from tangram._shared._scheduler import SchedulerActor
from tangram.errors import WaitTimeoutError

pytestmark = pytest.mark.anyio
_requests = itertools.count(1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Handle:
    """A Ray-like handle on an object here: ``handle.method.remote(*args)`` is a task;
    ``hooks[method]`` runs first (to delay a call)."""

    def __init__(self, target: Any, hooks: dict[str, Callable[..., Awaitable[None]]]) -> None:
        self._target = target
        self._hooks = hooks

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._target, method)
        hook = self._hooks.get(method)

        class _Method:
            def remote(self, *args: Any) -> asyncio.Future[Any]:
                async def run() -> Any:
                    if hook is not None:
                        await hook(*args)
                    return await call(*args)

                return asyncio.ensure_future(run())

        return _Method()


def _actor(rate: float, burst: float) -> SchedulerActor:
    actor = SchedulerActor(
        {"api": tangram.Rate(rate, burst=burst)}, None, heartbeat=0.1, timeout=0.6, token="t"
    )
    actor._node_id = lambda: "node"  # type: ignore[method-assign]
    return actor


@contextlib.asynccontextmanager
async def _node(
    actor: SchedulerActor, name: str, hooks: dict[str, Any] | None = None
) -> AsyncIterator[tuple[NodeRates, Runtime]]:
    async with attach(_Handle(actor, hooks or {})) as remote:
        runtime = Runtime({f"cpu@{name}": 0})
        async with runtime:
            await remote._refresh()
            rates = NodeRates(
                runtime,
                remote,
                name,
                lent_kinds(remote.capacity),
                period=remote._heartbeat,
                timeout=remote._lease_timeout,
            )
            asker = asyncio.ensure_future(rates.run())
            try:
                yield rates, runtime
            finally:
                asker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asker


async def _spend(actor: SchedulerActor, amount: float) -> None:
    """A worker with no agent takes ``amount`` at the job's actor."""
    async with attach(_Handle(actor, {})) as driver, driver.acquire({"api": amount}):
        pass


def _waiting_at(actor: SchedulerActor) -> int:
    return sum(len(client.waiting) for client in actor._clients.values())


async def test_a_call_is_granted_on_its_node_and_given_back() -> None:
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            request = next(_requests)
            grant = await asyncio.wait_for(
                rates.take("w", request, {"api": 1}, "search", None, None, None), 2.0
            )
            assert grant == {"api": 1.0}
            assert len(runtime._ledger.running) == 1
            rates.give("w", request, COMPLETED)
            await asyncio.sleep(0.05)
            assert len(runtime._ledger.running) == 0 and not rates._takes
    finally:
        await actor.close()


async def test_a_give_that_passes_its_take_keeps_the_take_from_being_served() -> None:
    """An async actor runs one caller's calls in no set order: a worker that gave up
    its wait sends a give that can land first. Its take must not be granted and held."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            request = next(_requests)
            rates.give("w", request, CANCELLED)
            assert await rates.take("w", request, {"api": 1}, "search", None, None, None) is None
            await asyncio.sleep(0.2)
            assert not rates._takes and runtime._ledger.waiting_count == 0
            assert len(runtime._ledger.running) == 0
    finally:
        await actor.close()


async def test_a_forwarded_call_given_up_while_its_capacity_is_asked_waits_nowhere() -> None:
    """A call over the job's burst as the node heard it is sent on after the node asks
    the job's capacity; given up meanwhile, it must not wait, and be granted, there."""
    actor = _actor(1.0, 10.0)
    slow = asyncio.Event()

    async def slow_info(*_: Any) -> None:
        if slow.is_set():
            await asyncio.sleep(0.5)

    try:
        async with _node(actor, "a", {"info": slow_info}) as (rates, _):
            await _spend(actor, 10.0)  # the job's bucket is empty
            await actor.set_capacity({"api": tangram.Rate(1.0, burst=12.0)})
            slow.set()
            request = next(_requests)
            waiting = asyncio.ensure_future(
                rates.take("w", request, {"api": 12}, "search", None, None, None)
            )
            await asyncio.sleep(0.2)  # its forward is asking the capacity
            rates.give("w", request, CANCELLED)
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(1.0)
            assert _waiting_at(actor) == 0
            assert not rates._takes and not rates._tasks
    finally:
        await actor.close()


async def test_a_forwarded_calls_wait_timeout_counts_from_its_first_wait() -> None:
    """A call waiting on its node, cut below its amount and sent on, keeps the time it
    already waited: ``wait_timeout`` ends when it would have at the job's actor."""
    actor = _actor(1.0, 10.0)
    try:
        async with _node(actor, "a") as (a, _), _node(actor, "b") as (b, _):
            loop = asyncio.get_running_loop()
            began = loop.time()
            first = asyncio.ensure_future(
                a.take("wa", next(_requests), {"api": 6}, "search", None, None, 2.0)
            )
            await asyncio.sleep(1.0)
            second = asyncio.ensure_future(
                b.take("wb", next(_requests), {"api": 6}, "search", None, None, 2.0)
            )
            with pytest.raises(WaitTimeoutError):
                await first
            assert loop.time() - began < 2.6
            with contextlib.suppress(WaitTimeoutError):
                await second
    finally:
        await actor.close()
