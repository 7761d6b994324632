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
from types import SimpleNamespace
from typing import Any

import pytest

import tangram
from tangram._core._resources import parse_capacity
from tangram._runtime._run import Runtime
from tangram._shared._node_rates import RAMP, NodeRates, lent_kinds
from tangram._shared._protocol import CANCELLED, COMPLETED
from tangram._shared._proxy import attach
from tangram._shared._rates import GIVE_BACK_AFTER, LEASE_AT, POOL
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


async def _prime(rates: NodeRates, amount: float = 1.0) -> None:
    """Calls sent on to the job's actor, one fewer than LEASE_AT: the node's next call
    within the heartbeat makes it lease (see ._rates.leases)."""
    for _ in range(LEASE_AT - 1):
        request = next(_requests)
        await rates.take("w", request, {"api": amount}, "search", None, None, None)
        rates.give("w", request, COMPLETED)
    assert not rates._leasing


def _waiting_at(actor: SchedulerActor) -> int:
    return sum(len(client.waiting) for client in actor._clients.values())


async def test_a_call_is_granted_on_its_node_and_given_back() -> None:
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            await _prime(rates)
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


async def test_an_ask_says_the_calls_waiting_on_average_since_the_last_ask() -> None:
    """The book splits a saturated rate by each node's mean queue (one line's weights):
    a call that waited and was given up still counts for the time it waited. The job's
    actor never answers here, so no ask resets the count meanwhile."""

    async def never(*_: Any) -> None:
        await asyncio.sleep(10.0)

    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a", {"lend_rates": never}) as (rates, _):
            loop = asyncio.get_running_loop()
            await _prime(rates)
            await asyncio.sleep(0.05)  # idle: its mean must not count this
            first = asyncio.ensure_future(
                rates.take("w", next(_requests), {"api": 1}, "search", None, None, None)
            )
            await asyncio.sleep(0.15)
            second_id = next(_requests)
            second = asyncio.ensure_future(
                rates.take("w", second_id, {"api": 2}, "search", None, None, None)
            )
            await asyncio.sleep(0.15)
            used, queued, largest, _ = rates._wants(loop.time())["api"]
            assert (used, largest) == (0.0, 2.0)
            assert queued == pytest.approx((1 * 0.3 + 2 * 0.15) / 0.3, rel=0.15)  # 2
            rates.give("w", second_id, CANCELLED)
            with pytest.raises(asyncio.CancelledError):
                await second
            await asyncio.sleep(0.15)
            _, queued, _, _ = rates._wants(loop.time())["api"]
            assert queued == pytest.approx((1 * 0.45 + 2 * 0.15) / 0.45, rel=0.15)  # 1.67
            first.cancel()
    finally:
        await actor.close()


async def test_the_actors_own_use_is_measured_while_no_node_asks() -> None:
    """The job's actor keeps for its own callers what they used lately. Measured only
    when a node asked, the use of a busy spell with every node idle was counted at the
    next ask as if it went on, and that node's share waited behind a stale reserve."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, _):
            await _prime(rates)
            request = next(_requests)
            await rates.take("w", request, {"api": 1}, "search", None, None, None)
            assert rates._leasing
            rates.give("w", request, COMPLETED)
            await asyncio.sleep(0.5)  # its share is cut to nothing: the node stops asking
            assert rates._idle()
            pool = actor._rates["api"]._members[POOL]
            loop = asyncio.get_running_loop()
            end = loop.time() + 0.4
            while loop.time() < end:  # the actor's own callers: about 50 a second
                await _spend(actor, 1.0)
                await asyncio.sleep(0.02)
            assert pool.used > 20.0
            await asyncio.sleep(0.3)  # three heartbeats with no call and no ask
            assert pool.used == 0.0
            assert rates._idle()
    finally:
        await actor.close()


class _Scripted:
    """A job's actor that answers each ask with the next share of a script."""

    def __init__(self, shares: list[float]) -> None:
        self.shares = shares

    async def lend_rates(self, cid: str, asks: dict[str, Any]) -> dict[str, Any]:
        rate = self.shares.pop(0)
        return {"api": (rate, rate / 10, 100.0, 10.0)}


async def test_an_ask_too_soon_to_show_a_use_does_not_end_a_ramp() -> None:
    """A node ramps (asks RAMP times a heartbeat) while its share grows RAMPING-fold an
    ask. An ask right after the one before (a call came while the share was nothing)
    grows it less, having had no time to use it: that must not end the ramp, or the
    node waits a whole heartbeat at a tenth of its part while another node ramps on."""
    period = 0.4
    remote = SimpleNamespace(actor=_Handle(_Scripted([10.0, 14.0, 19.0, 26.0]), {}), client_id="c")
    runtime = Runtime({"cpu@a": 0})
    async with runtime:
        rates = NodeRates(
            runtime,
            remote,
            "a",
            lent_kinds(parse_capacity({"api": tangram.Rate(100.0, burst=10.0)})),
            period,
            5.0,
        )
        await asyncio.sleep(period)
        await rates._ask()  # from nothing to 10: a ramp
        assert rates._grew
        await rates._ask()  # at once: 10 -> 14, less than RAMPING-fold
        assert rates._grew
        await asyncio.sleep(period / RAMP)
        await rates._ask()  # a paced ask: 14 -> 19 is no ramp
        assert not rates._grew
        await rates._ask()  # quick again, but after no ramp: still none
        assert not rates._grew


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


async def test_a_call_given_back_before_its_wait_began_takes_nothing() -> None:
    """The give can land after the take began but before its wait did (the task that
    waits runs a loop turn later): that wait must not start, or a call nobody waits for
    would spend a unit of the node's share."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            request = next(_requests)
            waiting = asyncio.ensure_future(
                rates.take("w", request, {"api": 1}, "search", None, None, None)
            )
            await asyncio.sleep(0)  # the take is in; the task that waits has not run
            rates.give("w", request, CANCELLED)
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0.5)  # the node's asks lend it a share meanwhile
            spent, wanted, waited = runtime._rate_use("api@a")
            assert (spent, wanted, waited) == (0.0, 0.0, 0.0)
            assert not rates._takes and not rates._tasks
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
    """A call waiting on its node, sent on (cut below its amount, or its node's calls
    thinned out and it gave its share back), keeps the time it already waited:
    ``wait_timeout`` ends when it would have at the job's actor."""
    actor = _actor(1.0, 10.0)
    try:
        async with _node(actor, "a") as (a, _), _node(actor, "b") as (b, _):
            await _prime(a, 0.001)
            await _prime(b, 0.001)
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


async def _calls(rates: NodeRates, count: int, gap: float) -> None:
    """``count`` calls of one unit, ``gap`` seconds apart, each held a moment."""
    for _ in range(count):
        request = next(_requests)
        await asyncio.wait_for(
            rates.take("w", request, {"api": 1}, "search", None, None, None), 2.0
        )
        await asyncio.sleep(0.001)
        rates.give("w", request, COMPLETED)
        await asyncio.sleep(gap)


async def test_a_node_whose_calls_are_sparse_sends_them_on_and_never_asks() -> None:
    """Calls half a heartbeat apart: asks every heartbeat would cost the job's actor
    more than the calls sent to it. Every call is granted there, about two messages
    each, and the node never asks for a share."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            loop = asyncio.get_running_loop()
            before, began = actor.messages, loop.time()
            await _calls(rates, 12, 0.05)  # two a heartbeat of 0.1 s, LEASE_AT is 4
            assert not rates._leasing and actor.lends == 0
            polls = (loop.time() - began) / 0.1 + 1  # the agent's proxy's, one a heartbeat
            assert actor.messages - before <= 2 * 12 + polls
            assert len(runtime._ledger.running) == 0 and not rates._takes
    finally:
        await actor.close()


async def test_a_node_leases_while_its_calls_come_close_and_gives_its_share_back() -> None:
    """A busy spell (calls back to back) makes the node lease and ask each heartbeat;
    when its calls thin out, it gives its share back (the book lends it nothing) and
    stops asking, while its calls go on being granted at the job's actor."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, _):
            await _calls(rates, 20, 0.0)
            assert rates._leasing and actor.lends > 0
            member = actor._rates["api"]._members[actor_client(actor, rates)]
            assert member.granted[0] > 0
            await _calls(rates, 8, 0.3)  # three heartbeats apart: 2.4 s
            assert not rates._leasing
            await asyncio.sleep(0.3)  # the cut to nothing is said to be applied
            assert member.granted == (0.0, 0.0) and member.applied == (0.0, 0.0)
            assert rates._idle()
            lends = actor.lends
            await _calls(rates, 3, 0.3)
            assert actor.lends == lends  # sparse calls: no more asks
    finally:
        await actor.close()


async def test_a_call_waiting_when_its_node_gives_its_share_back_is_sent_on() -> None:
    """The node's asks go unanswered, so its share stays nothing and its call waits
    there; once its calls span GIVE_BACK_AFTER heartbeats with none since, the node
    stops leasing and the call is sent on and granted at the job's actor, not left
    waiting on a share that will never come."""

    async def never(*_: Any) -> None:
        await asyncio.sleep(10.0)

    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a", {"lend_rates": never}) as (rates, runtime):
            await _prime(rates)
            loop = asyncio.get_running_loop()
            began = loop.time()
            request = next(_requests)
            call = asyncio.ensure_future(
                rates.take("w", request, {"api": 1}, "search", None, None, None)
            )
            await asyncio.sleep(0.05)
            assert rates._leasing and not call.done()
            assert await asyncio.wait_for(call, 3.0) == {"api": 1.0}
            waited = loop.time() - began
            # Checked at each ask, which waits up to the lease timeout (0.6 s) unanswered.
            assert 0.1 * GIVE_BACK_AFTER <= waited <= 0.1 * (GIVE_BACK_AFTER + 2) + 0.6, waited
            assert not rates._leasing and len(runtime._ledger.running) == 0
            rates.give("w", request, COMPLETED)
    finally:
        await actor.close()


def actor_client(actor: SchedulerActor, rates: NodeRates) -> str:
    """The id the job's actor knows a node's agent by, in its books."""
    return str(rates._remote.client_id)


async def test_a_node_whose_share_was_cut_to_nothing_sends_its_next_call_on() -> None:
    """A busy node that goes quiet is cut to nothing. Its next call, still within
    GIVE_BACK_AFTER heartbeats of the busy spell, must not wait for a share to grow
    from nothing (an ask, then a first token at the new share's pace): it goes on to
    the job's actor, granted at once."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, runtime):
            await _calls(rates, 20, 0.0)
            assert rates._leasing
            await asyncio.sleep(0.4)  # a quiet spell: cut to nothing, said applied
            assert rates._idle() and not rates._leasing
            lends = actor.lends
            loop = asyncio.get_running_loop()
            began = loop.time()
            await _calls(rates, 1, 0.0)
            assert loop.time() - began < 0.05
            assert actor.lends == lends and len(runtime._ledger.running) == 0
    finally:
        await actor.close()


async def test_a_leasing_node_with_no_call_for_a_heartbeat_stops_leasing() -> None:
    """A busy spell makes the node lease; then a call every 1.5 heartbeats. With no
    call for a heartbeat, the book would cut its share to nothing for want of use, and
    each later call would wait on an empty share while the node asks and grows it
    again (a review measured 33 asks for 12 such calls, 26 ms each, when a share was
    given back only once calls spanned GIVE_BACK_AFTER heartbeats). The node stops
    leasing at its next ask instead; its later calls go on at once."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, _):
            loop = asyncio.get_running_loop()
            await _calls(rates, 20, 0.0)
            assert rates._leasing
            await asyncio.sleep(0.15)
            lends = actor.lends
            waits = []
            for _ in range(12):
                began = loop.time()
                await _calls(rates, 1, 0.0)
                waits.append(loop.time() - began)
                await asyncio.sleep(0.15)
            assert not rates._leasing
            assert actor.lends - lends <= 3  # the ask that stops, the one saying it applied
            assert sum(waits) / len(waits) < 0.01, waits
    finally:
        await actor.close()


async def test_the_first_ask_after_a_node_starts_leasing_says_the_call_waiting() -> None:
    """Calls sent on and still held when the node starts leasing: its queue is measured
    from the switch, so its first ask says the call that waits (a review found it
    averaged over the time since the first call sent on: about 0.01 units, a share of
    almost nothing, and a ramp ask more)."""
    actor = _actor(100.0, 10.0)
    try:
        async with _node(actor, "a") as (rates, _):
            asked: list[float] = []
            wants = rates._wants

            def spy(now: float) -> Any:
                out = wants(now)
                asked.append(out["api"][1])
                return out

            rates._wants = spy  # type: ignore[method-assign]
            held = []
            for _ in range(LEASE_AT - 1):  # sent on, and still held
                request = next(_requests)
                await rates.take("w", request, {"api": 1}, "search", None, None, None)
                held.append(request)
                await asyncio.sleep(0.01)
            request = next(_requests)
            await asyncio.wait_for(
                rates.take("w", request, {"api": 1}, "search", None, None, None), 2.0
            )
            for done in [*held, request]:
                rates.give("w", done, COMPLETED)
            assert asked and asked[0] >= 0.5, asked
    finally:
        await actor.close()
