"""The shared scheduler's actor (``tangram/_shared/_scheduler.py``) and its agents' watch,
driven directly in this process: grants to silent processes, the watchers' own stalls,
a busy loop's lateness, and the polls a proxy sends. No cluster is started, and the
tests that attach a proxy check that Ray stayed uninitialised.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any

import anyio
import pytest
from ray_support import wait_for

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    # The agents' and proxies' code runs on asyncio only, as under Ray.
    return "asyncio"


async def test_a_grant_made_as_a_silent_process_is_dropped_fails_its_request() -> None:
    """The scheduler actor's books, driven directly: no cluster needed for the race.

    A silent process's lease is reclaimed first (its last heartbeat is older than its last
    call), the units go to its own waiting request, and the process is dropped a moment
    later with that new lease. It never saw the grant, so the request must be failed when
    it comes back, or its ``acquire`` would wait forever (found as a hang of
    ``tests/test_ray.py``'s late-release test on a loaded machine).
    """
    from tangram._shared._scheduler import SchedulerActor

    actor = SchedulerActor({"cpu": 2}, None, heartbeat=0.05, timeout=0.3, token="t")
    try:
        events = await actor.send("a", [(1, {"cpu": 2}, "held", None, None, None)], [], [])
        assert [e[0] for e in events] == ["grant"]
        lease = events[0][2]
        await actor.poll("a", [lease], 0.0)  # the last heartbeat
        await anyio.sleep(0.15)
        # A later call, but no heartbeat: the process then stalls.
        assert await actor.send("a", [(2, {"cpu": 1}, "waiter", None, None, None)], [], []) == []

        async def dropped() -> bool:
            return (await actor.counters())["clients"] == 0

        await wait_for(dropped, 5)
        assert (await actor.counters())["reclaimed"] == 1
        # Back from the stall: request 2 is reported failed, whatever happened to it.
        events = await actor.poll("a", [lease], 0.0)
        expired = [e for e in events if e[0] == "expired"]
        assert len(expired) == 1 and 2 in expired[0][1]
        assert (await actor.stats()).resources["cpu"].held == 0
    finally:
        await actor.close()


@pytest.mark.parametrize("state", ["holding", "waiting", "idle"])
async def test_the_schedulers_own_stall_drops_no_proxy_and_reclaims_no_lease(state: str) -> None:
    """A scheduler whose loop stalls (a long collection, a blocking call, a starved core)
    heard nothing while it stalled, so its proxies' silence then is its own: none is
    dropped and no lease reclaimed for it. In a node's scheduler process the node's agent
    is one of those proxies, and a dropped agent took its host's cores with it. Swept
    over what the proxy has at the actor: a lease, a waiting request, nothing."""
    from tangram._shared._protocol import COMPLETED
    from tangram._shared._scheduler import SchedulerActor

    actor = SchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=0.3, token="t")
    try:
        events = await actor.send("a", [(1, {"cpu": 1}, "held", None, None, None)], [], [])
        lease = events[0][2]
        leases = [lease]
        if state == "waiting":
            await actor.send("a", [(2, {"cpu": 1}, "waiter", None, None, None)], [], [])
        elif state == "idle":
            await actor.send("a", [], [(lease, COMPLETED)], [])
            leases = []
        await actor.poll("a", leases, 0.0)
        await anyio.sleep(0.1)  # the watchdog runs
        time.sleep(3 * 0.3)  # noqa: ASYNC251 - the stall under test
        await anyio.sleep(0.1)  # the watchdog's next ticks, inside the timeout
        counters = await actor.counters()
        assert counters["clients"] == 1
        assert counters["reclaimed"] == 0
        assert counters["leases"] == len(leases)
        # A proxy that stays silent once the scheduler runs again is still dropped.
        await wait_for(lambda: _no_clients(actor), 5)
    finally:
        await actor.close()


@pytest.mark.parametrize("stalls", [[], [3.0], [0.5] * 12, [0.2, 3.0, 0.2], [3.0, 3.0]])
@pytest.mark.parametrize("heard", ["before", "at the first wake"])
def test_a_silence_is_forgiven_the_watchers_own_lateness_after_the_last_word_bounded(
    stalls: list[float], heard: str
) -> None:
    """The rule every silence judgement in shared mode uses (``Heard``), swept over
    patterns of late wakes: one long stall (forgiven whole), a busy loop's many (their
    sum, up to one timeout), a last word heard at a wake (queued during the stall, it
    ran first: none of that stall is forgiven)."""
    from tangram._shared._protocol import Heard

    tick, cap = 0.05, 1.0
    wakes = list(itertools.accumulate(tick + late for late in stalls))
    heard_at = wakes[0] - 0.001 if heard != "before" and wakes else 0.0
    last = Heard(heard_at)
    for late, wake in zip(stalls, wakes, strict=True):
        last.stalled(late, wake)
    now = (wakes[-1] if wakes else 0.0) + tick
    theirs = [
        min(late, max(0.0, wake - heard_at)) for late, wake in zip(stalls, wakes, strict=True)
    ]
    forgiven = max(max(theirs, default=0.0), min(sum(theirs), cap))
    assert last.silence(now, cap) == pytest.approx(now - heard_at - forgiven)
    assert last.silence(now, cap) >= now - heard_at - max([*stalls, cap])
    last.hear(now)  # a word resets what was forgiven
    assert last.silence(now + 1.0, cap) == pytest.approx(1.0)


async def test_a_proxy_heard_during_the_schedulers_stall_is_judged_from_then() -> None:
    """A call queued while the scheduler stalled runs when it wakes: the proxy was heard
    then, so if it dies after that call its lease is reclaimed and it is dropped one
    ``lease_timeout`` later, not a stall's length later too."""
    from tangram._shared._scheduler import SchedulerActor

    timeout = 0.3
    actor = SchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=timeout, token="t")
    try:
        events = await actor.send("a", [(1, {"cpu": 1}, "held", None, None, None)], [], [])
        lease = events[0][2]
        await anyio.sleep(0.1)  # the watchdog runs
        # Out of the timers' batch, so the watchdog wakes after the queued call, as a
        # call delivered during a stall runs first.
        await asyncio.sleep(0)
        last = asyncio.ensure_future(actor.poll("a", [lease], 0.0))  # runs at the wake
        time.sleep(10 * timeout)  # noqa: ASYNC251 - the stall under test
        woke = time.monotonic()
        await last
        await wait_for(lambda: _no_clients(actor), 10)
        # A stall's length (3 s) later with the credit moving the last call past the wake.
        assert time.monotonic() - woke < 5 * timeout
        assert (await actor.counters())["reclaimed"] == 1
    finally:
        await actor.close()


async def test_a_busy_scheduler_still_drops_a_dead_proxy_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler late because it is busy (each tick late by blocks of work) forgives
    a dead proxy's silence the sum of its late wakes only up to one timeout (or its
    longest): it is dropped, and its lease reclaimed, within ``lease_timeout`` plus the
    larger of the two and the late tick that judges it, while a live proxy heard
    between the blocks stays."""
    from tangram._shared import _scheduler

    timeout, block, tick = 0.3, 0.5, 0.025
    lateness = _Lateness(monkeypatch, _scheduler)
    dropped: dict[str, float] = {}

    class Recorded(_scheduler.SchedulerActor):
        def _drop_client(self, cid: str, *, expired: bool = False) -> bool:
            dropped.setdefault(cid, time.monotonic())
            return super()._drop_client(cid, expired=expired)

    actor = Recorded({"cpu": 2}, None, heartbeat=2 * tick, timeout=timeout, token="t")

    async def alive() -> None:
        while True:
            await actor.poll("b", [], 0.0)
            await asyncio.sleep(0.01)

    tasks: list[asyncio.Future[None]] = []
    try:
        events = await actor.send("a", [(1, {"cpu": 1}, "held", None, None, None)], [], [])
        await actor.poll("a", [events[0][2]], 0.0)  # a's last call: it dies now
        await actor.poll("b", [], 0.0)
        died = time.monotonic()
        tasks = [asyncio.ensure_future(alive()), asyncio.ensure_future(_busy(block))]
        await wait_for(lambda: _dropped(dropped, "a"), 60)
        # Crediting every late tick, the dead proxy outlived twelve of them (18 s).
        longest = lateness.longest
        assert dropped["a"] - died <= timeout + max(longest, timeout) + longest + 2 * tick + 0.1
        assert actor.reclaimed == 1
        assert "b" not in dropped
    finally:
        for task in tasks:
            task.cancel()
        await actor.close()


@pytest.mark.parametrize("holding", [True, False])
@pytest.mark.parametrize("block", [0.15, 0.3, 0.6])
async def test_a_busy_scheduler_keeps_a_live_proxy_whose_polls_it_answers_late(
    holding: bool, block: float
) -> None:
    """Ray hands an async actor each call from another thread, so a long poll takes
    several of a busy loop's passes to land and to answer, each with one block of work
    in it. The proxy waited on this actor meanwhile: that is not its silence. A live
    proxy long-polling so (at a heartbeat with a lease, at the idle pace without) is
    neither dropped nor has its lease reclaimed, however many passes its polls take."""
    import concurrent.futures
    import threading

    from tangram._core._beats import idle_wait
    from tangram._shared._scheduler import SchedulerActor

    heartbeat, timeout = 0.1, 1.0
    actor = SchedulerActor({"cpu": 2}, None, heartbeat=heartbeat, timeout=timeout, token="t")
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    events = await actor.send("live", [(1, {"cpu": 1}, "held", None, None, None)], [], [])
    leases = [events[0][2]] if holding else []
    if not holding:
        await actor.send("live", [], [(events[0][2], 0)], [])
    wait = heartbeat if holding else idle_wait(heartbeat, timeout)

    def proxy() -> None:
        while not stop.is_set():
            call = asyncio.run_coroutine_threadsafe(actor.poll("live", leases, wait), loop)
            try:
                call.result(30)
            except concurrent.futures.CancelledError:  # the actor closed under its poll
                if not stop.is_set():
                    raise

    thread = threading.Thread(target=proxy, daemon=True)
    thread.start()
    busy = asyncio.ensure_future(_busy(block))
    try:
        await asyncio.sleep(5 * timeout)
        assert "live" in actor._clients
        assert actor.reclaimed == 0
    finally:
        busy.cancel()
        stop.set()
        await asyncio.sleep(0.2)
        await actor.close()
        thread.join(5)


@pytest.mark.parametrize("heard", ["before", "during"])
async def test_a_busy_agent_left_without_its_scheduler_still_ends(
    heard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orphaned agent's watch has the scheduler's rule: its workers' silence is
    forgiven its late ticks only up to a bound, and not a stall before a beat it heard
    (one queued while it stalled, heard at the wake)."""
    from tangram._shared import _agent

    period, block, idle = 0.05, 0.5, 0.3
    agent = _agent.HostAgentActor.__new__(_agent.HostAgentActor)  # the loop alone
    agent._stop = asyncio.Event()
    agent._heard = None
    agent._beat_heard()
    ended: list[float] = []

    def serving() -> bool:
        if agent._serving(idle):
            return True
        ended.append(time.monotonic())
        return False

    task = asyncio.ensure_future(agent._serve_while(serving, period=period))
    busy: asyncio.Future[None] | None = None
    try:
        await asyncio.sleep(0.1)
        if heard == "during":
            asyncio.get_running_loop().call_soon(agent._beat_heard)  # runs at the wake
            time.sleep(10 * idle)  # noqa: ASYNC251 - the stall under test
        lateness = _Lateness(monkeypatch, _agent)
        start = time.monotonic()
        busy = asyncio.ensure_future(_busy(block))
        await asyncio.wait_for(task, 60)
        longest = lateness.longest
        assert ended[0] - start <= idle + max(longest, idle) + longest + 2 * period + 0.1
    finally:
        task.cancel()
        if busy is not None:
            busy.cancel()


class _Lateness:
    """Records the longest late wake of a module's watch (its ``stalled``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.longest = 0.0
        measure = module.stalled

        def stalled(since: float, period: float) -> float:
            late: float = measure(since, period)
            self.longest = max(self.longest, late)
            return late

        monkeypatch.setattr(module, "stalled", stalled)


async def _busy(block: float) -> None:
    """A loop kept busy: blocks of ``block`` seconds of work, others run between them."""
    while True:
        time.sleep(block)  # noqa: ASYNC251 - the busy loop under test
        await asyncio.sleep(0)


async def _dropped(dropped: dict[str, float], cid: str) -> bool:
    return cid in dropped


async def test_an_agent_left_without_its_scheduler_does_not_count_its_own_stall() -> None:
    """An agent whose scheduler is gone serves its node's workers while they beat to it,
    and ends once none has for ``IDLE`` lease timeouts: its own stall is not their
    silence, but their silence after it still ends it."""
    from tangram._shared._agent import HostAgentActor

    agent = HostAgentActor.__new__(HostAgentActor)  # the serving loop alone, no actor
    agent._stop = asyncio.Event()
    agent._heard = None
    agent._beat_heard()
    idle = 1.5
    serving = asyncio.ensure_future(agent._serve_while(lambda: agent._serving(idle)))
    try:
        await asyncio.sleep(0.05)
        time.sleep(2 * idle)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.1)
        assert not serving.done()
        await asyncio.wait_for(serving, 5)
    finally:
        serving.cancel()


async def _no_clients(actor: Any) -> bool:
    return (await actor.counters())["clients"] == 0


class _Recorded:
    """A handle on a local scheduler actor, as Ray's would call it, that notes each poll's
    leases and wait."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.polls: list[tuple[list[int], float]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.actor, name)
        polls = self.polls

        class _Method:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future[Any]:
                if name == "poll":
                    polls.append((list(args[1]), args[2]))
                return asyncio.ensure_future(method(*args))

        return _Method


async def test_a_proxy_holding_nothing_polls_at_the_relay_pace_and_leases_at_the_heartbeat() -> (
    None
):
    """Only leases need a beat a heartbeat: a driver or worker with nothing at the job's
    actor polls it every ``relay_wait``, which keeps it inside the lease timeout, and a
    request is granted at once whatever the poll in flight waits for."""
    from tangram._core._beats import idle_wait, relay_wait
    from tangram._shared._proxy import attach
    from tangram._shared._scheduler import SchedulerActor

    actor = SchedulerActor({"cpu": 2}, None, heartbeat=0.1, timeout=1.0, token="t")
    handle = _Recorded(actor)
    pace = idle_wait(0.1, 1.0)
    assert pace == relay_wait(0.1, 1.0) > 0.1  # at this timeout, the relay's pace
    try:
        # The actor's info, given: asking a local actor for it would start Ray here.
        info = {"heartbeat": 0.1, "timeout": 1.0, "capacity": {"cpu": 2}}
        async with attach(handle, info=info) as remote:
            await anyio.sleep(0.05)
            assert handle.polls == [([], pace)]
            asked = anyio.current_time()
            async with remote.acquire(cpu=1) as lease:
                # Not held back until the idle poll in flight returns.
                assert anyio.current_time() - asked < pace / 2
                await anyio.sleep(3 * pace)
            beats = [wait for leases, wait in handle.polls if lease.lease_id in leases]
            assert beats and set(beats) == {0.1}
            assert (await actor.counters())["reclaimed"] == 0
            await anyio.sleep(3 * pace)
            assert handle.polls[-1] == ([], pace)
    finally:
        await actor.close()
    assert not ray.is_initialized()  # the module's own cluster starts later


async def test_an_idle_proxy_never_polls_more_often_than_a_heartbeat() -> None:
    """Under a lease timeout of less than four heartbeats the relay's pace is faster than
    a heartbeat: an idle proxy keeps the heartbeat's, as before."""
    from tangram._core._beats import relay_wait
    from tangram._shared._proxy import attach
    from tangram._shared._scheduler import SchedulerActor

    assert relay_wait(0.2, 0.4) < 0.2
    actor = SchedulerActor({"cpu": 2}, None, heartbeat=0.2, timeout=0.4, token="t")
    handle = _Recorded(actor)
    info = {"heartbeat": 0.2, "timeout": 0.4, "capacity": {"cpu": 2}}
    try:
        async with attach(handle, info=info) as remote:
            await anyio.sleep(0.5)
            assert remote.calls >= 1
            assert {wait for _, wait in handle.polls} == {0.2}
    finally:
        await actor.close()
    assert not ray.is_initialized()


async def test_the_scheduler_counts_the_messages_it_receives() -> None:
    """Every protocol call reaches the count ``benchmarks/ray_ceiling.py`` divides by the
    actions: a batch, a heartbeat, a departure; the actor's CPU time only grows."""
    from tangram._shared._scheduler import SchedulerActor

    actor = SchedulerActor({"cpu": 2}, None, heartbeat=0.05, timeout=5.0, token="t")
    try:
        first = await actor.counters()
        events = await actor.send("a", [(1, {"cpu": 1}, "one", None, None, None)], [], [])
        lease = events[0][2]
        await actor.poll("a", [lease], 0.0)
        await actor.send("a", [], [(lease, 0)], [])
        await actor.disconnect("a", [])
        after = await actor.counters()
        assert after["messages"] - first["messages"] == 4
        assert after["heartbeats"] - first["heartbeats"] == 1
        assert after["placements"] == first["placements"] == 0
        assert after["cpu_seconds"] >= first["cpu_seconds"]
    finally:
        await actor.close()
