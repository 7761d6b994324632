"""The shared scheduler on a real local Ray cluster: separate worker processes, one actor.

Workers are Ray actors, so each is its own process with its own proxy; they meet only
through the scheduler actor. One small cluster (4 CPUs, no dashboard) serves the whole
module. With ``CI`` set these never skip; without it they skip where Ray is not installed.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from ray_support import held, wait_for, work_dir_holding

import tangram
from tangram.errors import (
    AcquireReusedError,
    AsyncioRequiredError,
    CapacityExceededError,
    DemandTypeError,
    GpuError,
    GpuServiceError,
    InvalidCapacityError,
    InvalidDemandError,
    InvalidSettingError,
    UnknownResourceError,
    WaitTimeoutError,
)

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

import tangram.ray as tray  # noqa: E402
from tangram.gpu import ModelService  # noqa: E402

# Worker actors are defined here, in a module Ray's workers cannot import: ship them by value.
importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.anyio
HEARTBEAT = 0.4
LEASE_TIMEOUT = 2.0


@pytest.fixture
def anyio_backend() -> str:
    # A Ray call is awaited on an asyncio loop only.
    return "asyncio"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",  # a cluster of its own, never one left running
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"tangram-test-{uuid.uuid4().hex[:8]}",
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def workers(cluster: None) -> list[Any]:
    """Four workers, plus a fifth the kill test ends (processes start in parallel here)."""
    pool = [Worker.remote() for _ in range(5)]  # type: ignore[attr-defined]
    ray.get([w.pid.remote() for w in pool])
    return pool


def _name() -> str:
    return f"sched-{uuid.uuid4().hex[:8]}"


def _connect(name: str, *, lease_timeout: float = LEASE_TIMEOUT, **kwargs: Any) -> Any:
    return tray.connect(name=name, heartbeat=HEARTBEAT, lease_timeout=lease_timeout, **kwargs)


@ray.remote(num_cpus=0)
class Worker:
    """A rollout process: its own event loop, its own proxy, actions through tangram.acquire."""

    async def pid(self) -> int:
        return os.getpid()

    async def act(
        self, name: str, actions: int, seconds: float, tasks: int, cpu: int
    ) -> list[tuple[float, float, float]]:
        intervals: list[tuple[float, float, float]] = []

        async def one() -> None:
            for _ in range(actions):
                async with tangram.acquire(cpu=cpu, kind="work") as lease:
                    started = time.time()
                    await anyio.sleep(seconds)
                    intervals.append((started, time.time(), lease.grant["cpu"]))

        async with (
            tray.connect(name=name, create=False, heartbeat=HEARTBEAT),
            anyio.create_task_group() as tg,
        ):
            for _ in range(tasks):
                tg.start_soon(one)
        return intervals

    async def hang(self, name: str, cpu: int) -> None:
        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT) as remote:
            await remote.run({"cpu": cpu}, anyio.sleep_forever, kind="hang")

    async def stall(self, name: str, cpu: int, seconds: float) -> dict[str, Any]:
        outcome: dict[str, Any] = {}

        async def waiter(remote: tray.RemoteRuntime) -> None:
            try:
                async with remote.acquire(cpu=1, kind="waiter"):
                    outcome["waiter"] = "granted"
            except tray.SchedulerUnavailableError:
                outcome["waiter"] = "dropped"

        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT) as remote:
            async with (
                remote.acquire(cpu=cpu, kind="stall") as lease,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(waiter, remote)
                # Its request waits at the actor before the stall: one sent after it would
                # be a new request from a live process, and wait for cores like any other.
                with anyio.fail_after(30):
                    while (await remote.stats()).waiting < 1:  # noqa: ASYNC110 - remote state
                        await anyio.sleep(0.05)
                time.sleep(seconds)  # noqa: ASYNC251 - a stalled process: no heartbeats
                await anyio.sleep(HEARTBEAT * 2)  # the poll that reports what was lost
            outcome["reclaimed"] = lease.reclaimed
        return outcome

    async def bad_inputs(self, name: str) -> list[str]:
        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT):
            return _bad_input_errors()


def _bad_input_errors() -> list[str]:
    """The error type each bad call raises at the call, in the runtime this task sees."""
    calls = [
        lambda: tangram.acquire(cpu="four"),
        lambda: tangram.acquire(cpu=True),
        lambda: tangram.acquire(gpu=1),
        lambda: tangram.acquire(cpu=100),
        lambda: tangram.acquire(cpu=-1),
        lambda: tangram.acquire({"cpu": 1}, cpu=1),
        lambda: tangram.acquire(cpu=1, kind=3),
        lambda: tangram.acquire(cpu=1, wait_timeout=-1),
        lambda: tangram.acquire(cpu=1, estimate=float("inf")),
        lambda: tangram.acquire(cpu=1, trajectory=7),
        lambda: tangram.acquire(cpu=tangram.Elastic(8, 16)),
    ]
    names = []
    for call in calls:
        try:
            call()
        except Exception as exc:
            names.append(type(exc).__qualname__)
        else:
            names.append("no error")
    return names


def _max_overlap(intervals: list[tuple[float, float, float]]) -> float:
    """The most units held at once, from (start, end, units) intervals."""
    points = sorted(
        [(start, units) for start, _, units in intervals]
        + [(end, -units) for _, end, units in intervals],
        key=lambda p: (p[0], p[1]),  # at equal times a release counts before a grant
    )
    level = peak = 0.0
    for _, change in points:
        level += change
        peak = max(peak, level)
    return peak


def test_importing_tangram_does_not_import_ray() -> None:
    code = "import sys, tangram; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_tangram_ray_does_not_import_torch() -> None:
    # GPU agents are optional: torch loads only in an agent that loads a torch service.
    code = "import sys, tangram.ray; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_replicas_share_of_devices_never_exceeds_what_its_memory_allows() -> None:
    from tangram._shared._agent import _NodeGpuLedger

    ledger = _NodeGpuLedger(None, "gpu@h", {"gpu_mem:a": 3, "gpu_mem:b": 4})
    thirds = [ledger.share({"gpu_mem:a": 1}) for _ in range(3)]
    assert 0 < thirds[0] < 1 / 3 and sum(thirds) <= 1  # a full device is at most one
    assert ledger.share({"gpu_mem:a": 3, "gpu_mem:b": 4}) == 2  # a replica on two devices
    assert ledger.share({"gpu_mem:b": 2}) == 0.5


def test_trio_is_refused_with_a_clear_error() -> None:
    import trio

    async def main() -> None:
        async with tray.connect():
            pass

    with pytest.raises(AsyncioRequiredError, match="asyncio"):
        trio.run(main)
    assert issubclass(AsyncioRequiredError, RuntimeError)


def test_the_host_book_keeps_a_trajectory_on_the_least_loaded_host() -> None:
    from tangram._shared._placement import HostBook

    book = HostBook()
    with pytest.raises(tray.SchedulerUnavailableError, match="no host agent"):
        book.place("t0")
    gpu = {"resource": "gpu@b", "units": 1, "services": ["judge"], "resident": []}
    assert book.add("a", "cpu@a", 4, "agent-a", "cid-a", None) == {"cpu@a": 4}
    assert book.add("b", "cpu@b", 2, "agent-b", "cid-b", gpu) == {"cpu@b": 2, "gpu@b": 1}
    assert book.place("t1") == ("a", "agent-a")  # both empty: the first by name
    assert book.place("t2") == ("b", "agent-b")  # a has a sandbox per 4 cores, b none
    with pytest.raises(InvalidSettingError, match="already has an open sandbox"):
        book.place("t1")  # one block per trajectory: its first keeps its host and count
    assert book.describe()["a"]["placed"] == 1
    with pytest.raises(UnknownResourceError, match="no host agent serves 'other'") as caught:
        book.place_service("cid-w", "other")
    assert isinstance(caught.value, LookupError)  # as GpuPool.use for a name it lacks
    ticket, host, _ = book.place_service("cid-w", "judge")
    assert host == "b" and book.describe()["b"]["calls"] == 1
    # The worker's proxy is dropped: its service block ends; host b's agent is dropped
    # next, and its cores and devices leave the capacity.
    assert book.drop("cid-w") == {}
    assert book.describe()["b"]["calls"] == 0
    assert book.drop("cid-b") == {"cpu@b": 0, "gpu@b": 0}
    assert sorted(book.describe()) == ["a"]
    book.unplace_service(ticket, 1, ["judge"])  # a late end of the block changes nothing
    book.unplace("t1")
    assert book.describe()["a"]["placed"] == 0


def test_the_host_book_counts_the_sandboxes_an_agent_placed_itself() -> None:
    """Workers place sandboxes on their own node without the book; a host whose agent
    says it holds more per core is no longer the least loaded."""
    from tangram._shared._placement import HostBook

    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.add("b", "cpu@b", 2, "agent-b", "cid-b", None)
    book.note("a", 3)  # three opened on a by its own workers
    assert book.place("t1") == ("b", "agent-b")
    assert book.place("t2") == ("b", "agent-b")  # b at 1 per core, a at 1.5
    assert book.describe()["a"]["sandboxes"] == 3
    book.note("a", 0)  # they closed
    assert book.place("t3") == ("a", "agent-a")
    assert book.describe()["a"]["sandboxes"] == 1  # the book's own
    book.note("gone", 5)  # a host that left: nothing to count


def test_the_host_book_counts_open_blocks_on_a_host_that_comes_back() -> None:
    """A host dropped and added again (a replacement agent under its name) counts the
    sandboxes placed there that have not ended: each one's ``unplace`` will, so its
    load never goes below what the book placed."""
    from tangram._shared._placement import HostBook

    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.place("t1", "cid-w")
    book.place("t2", "cid-w")
    assert book.drop("cid-a") == {"cpu@a": 0}
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    assert book.describe()["a"]["placed"] == 2
    book.unplace("t1")
    book.unplace("t2")
    assert book.describe()["a"]["placed"] == 0
    # So too the service blocks open there: the old agent's lapsed, or gone, or alive.
    book = HostBook()
    gpu = {"resource": "gpu@a", "units": 2, "services": ["s"], "resident": []}
    for leave in (book.lapse, book.drop, lambda cid: None):
        book.add("a", "cpu@a", 2, "agent-a", "cid-a", gpu)
        ticket, _, _ = book.place_service("cid-w", "s")
        leave("cid-a")
        book.add("a", "cpu@a", 2, "agent-a2", "cid-a2", gpu)
        assert book.describe()["a"]["calls"] == 1
        book.unplace_service(ticket, 0, [])
        assert book.describe()["a"]["calls"] == 0


def test_the_host_book_hands_back_the_sandboxes_of_a_dropped_proxy() -> None:
    from tangram._shared._placement import HostBook

    book = HostBook()
    book.add("a", "cpu@a", 2, "agent-a", "cid-a", None)
    book.place("t1", "cid-w")
    book.place("t2", "cid-w")
    book.place("t3", "cid-v")
    assert book.agents() == {"cid-a": "agent-a"}
    # The worker's proxy went silent: its two sandboxes are to be closed on their agent,
    # and they no longer count on the host; the other worker's stays.
    assert sorted(book.orphans("cid-w")) == [("t1", "agent-a"), ("t2", "agent-a")]
    assert book.describe()["a"]["placed"] == 1
    assert book.orphans("cid-w") == []
    book.unplace("t3")  # closed by its owner: nothing left to hand back
    assert book.orphans("cid-v") == []


async def test_a_grant_made_as_a_silent_process_is_dropped_fails_its_request() -> None:
    """The scheduler actor's books, driven directly: no cluster needed for the race.

    A silent process's lease is reclaimed first (its last heartbeat is older than its last
    call), the units go to its own waiting request, and the process is dropped a moment
    later with that new lease. It never saw the grant, so the request must be failed when
    it comes back, or its ``acquire`` would wait forever (found as a hang of the test
    above on a loaded machine).
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


async def test_bad_settings_fail_before_anything_starts() -> None:
    with pytest.raises(InvalidCapacityError, match="twice"):
        async with tray.connect(heartbeat=1.0, lease_timeout=1.5):
            pass
    with pytest.raises(InvalidCapacityError):
        async with tray.connect(heartbeat=-1.0):
            pass
    with pytest.raises(InvalidCapacityError):
        async with tray.connect(capacity={"cpu": -4}):
            pass


async def test_workers_never_exceed_the_global_capacity(workers: list[Any]) -> None:
    name = _name()
    # A long lease timeout: on a loaded 2-core machine seven processes can stall one
    # worker's heartbeats past the short one, and a reclaim is not what this test is about.
    async with _connect(name, capacity={"cpu": 3}, lease_timeout=60.0) as remote:
        runs = [
            w.act.remote(name, 6, 0.02, 2, 1 + i % 2)  # two tasks each; 1 or 2 cores per action
            for i, w in enumerate(workers[:4])
        ]
        results = await _gather(runs)
        intervals = [i for result in results for i in result]
        assert len(intervals) == 4 * 2 * 6
        # Each worker alone may hold 4 cores (two tasks x 2); together they stay at 3.
        assert _max_overlap(intervals) <= 3
        stats = await remote.stats()
        assert stats.resources["cpu"].peak <= 3
        assert stats.resources["cpu"].peak >= 2  # they did run side by side
        assert stats.kinds["work"].completed == 48
        assert stats.resources["cpu"].held == 0
        assert stats.waiting == 0 and stats.running == 0
        counters = await remote.actor.counters.remote()
        assert counters["leases"] == 0 and counters["reclaimed"] == 0


async def _gather(refs: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(refs)

    async def one(index: int) -> None:
        results[index] = await refs[index]

    async with anyio.create_task_group() as tg:
        for index in range(len(refs)):
            tg.start_soon(one, index)
    return results


async def test_a_killed_worker_returns_its_units_and_others_keep_going(
    workers: list[Any],
) -> None:
    name = _name()
    victim = workers[4]
    async with _connect(name, capacity={"cpu": 3}) as remote:
        victim.hang.remote(name, 2)
        await wait_for(lambda: _equals(held(remote), 2.0), 30)
        # One core is left: a worker using one core at a time keeps going meanwhile.
        steady = workers[0].act.remote(name, 20, 0.05, 1, 1)
        blocked = workers[1].act.remote(name, 1, 0.01, 1, 2)  # needs the victim's cores
        await anyio.sleep(0.3)
        killed_at = time.monotonic()
        ray.kill(victim)
        with anyio.fail_after(LEASE_TIMEOUT + 10):
            await blocked
        returned_after = time.monotonic() - killed_at
        assert returned_after <= LEASE_TIMEOUT + 3 * HEARTBEAT + 2.0
        assert len(await steady) == 20
        counters = await remote.actor.counters.remote()
        assert counters["reclaimed"] == 1
        assert await held(remote) == 0
        stats = await remote.stats()
        assert stats.resources["cpu"].peak <= 3


async def _equals(value: Any, expected: float) -> bool:
    return bool(await value == expected)


async def _waiting_or_reclaimed(remote: Any) -> bool:
    if (await remote.stats()).waiting >= 1:
        return True
    return bool((await remote.actor.counters.remote())["reclaimed"] >= 1)


async def test_a_late_release_of_a_reclaimed_lease_is_harmless(workers: list[Any]) -> None:
    name = _name()
    async with _connect(name, capacity={"cpu": 2}) as remote:
        # Twice the timeout: the actor drops the silent process (and so its waiting
        # request) only once its last call is a timeout old, and on a loaded machine that
        # call may reach the actor well after it was sent.
        stalled = workers[2].stall.remote(name, 2, 2 * LEASE_TIMEOUT + HEARTBEAT)
        await wait_for(lambda: _equals(held(remote), 2.0), 30)
        # Asked only once the worker's own request waits (or was already dropped with the
        # silent worker): the worker counts waiting requests to know that its request has
        # reached the actor, so this one must not be among them.
        await wait_for(lambda: _waiting_or_reclaimed(remote), 30)
        # The stalled worker sends no heartbeat; its lease is reclaimed and granted here.
        # The bound only keeps a bug from hanging the suite: the stall alone is ~5 s, and
        # a loaded 2-core machine takes seconds more to start and stop the worker's client.
        with anyio.fail_after(LEASE_TIMEOUT + 30):
            async with remote.acquire(cpu=2, kind="next") as lease:
                assert lease.grant["cpu"] == 2
                report = await stalled  # its block ends now: the late release arrives
                assert report == {"reclaimed": True, "waiter": "dropped"}
                await anyio.sleep(HEARTBEAT)
                # No double credit: this lease still holds both cores, nothing else fits.
                assert await held(remote) == 2
                with pytest.raises(WaitTimeoutError):
                    async with remote.acquire(cpu=1, wait_timeout=0.3):
                        pass
                counters = await remote.actor.counters.remote()
                assert counters["ignored_releases"] == 1  # it did arrive, and was ignored
        await wait_for(lambda: _equals(held(remote), 0.0), 5)
        counters = await remote.actor.counters.remote()
        assert counters["reclaimed"] == 1 and counters["leases"] == 0
        stats = await remote.stats()
        assert stats.resources["cpu"].peak == 2


async def test_bad_input_raises_the_local_runtimes_errors_at_the_call(
    workers: list[Any],
) -> None:
    capacity = {"cpu": 4, "mem": "8GiB"}
    async with tangram.Runtime(capacity=capacity):
        local = _bad_input_errors()
    assert "no error" not in local
    name = _name()
    async with _connect(name, capacity=capacity) as remote:
        assert await workers[3].bad_inputs.remote(name) == local
        assert _bad_input_errors() == local  # the driver's proxy too
        with pytest.raises(DemandTypeError):
            remote.acquire(cpu="four")
        with pytest.raises(UnknownResourceError):
            remote.acquire(gpu=1)
        with pytest.raises(CapacityExceededError):
            remote.acquire(cpu=5)
        with pytest.raises(InvalidDemandError):
            remote.acquire(mem="-1GiB")
        with pytest.raises(TypeError):
            await remote.run({"cpu": 1}, "not callable")  # type: ignore[arg-type]
        assert await held(remote) == 0


async def test_a_resizable_grant_follows_the_shared_scheduler(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 4}) as remote:
        elastic = tangram.Elastic(1, 4, resizable=True)
        async with tangram.acquire(cpu=elastic, estimate=10.0, kind="grow") as lease:
            assert isinstance(lease, tray.RemoteLease)
            assert lease.units == 4 and lease.grant == {"cpu": 4.0}
            got: list[float] = []

            async def other() -> None:
                async with remote.acquire(cpu=2, estimate=0.1, kind="small") as small:
                    got.append(small.grant["cpu"])

            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
                with anyio.fail_after(10):
                    assert await lease.wait_resized() == 2
                assert lease.grant == {"cpu": 2.0} and lease.resizes == 1
            assert got == [2.0]
        # Releases travel in the background, on the proxy's next send.
        await wait_for(lambda: _equals(held(remote), 0.0), 5)
        stats = await remote.stats()
        assert stats.resources["cpu"].peak == 4 and stats.resizes >= 1


async def test_an_acquire_context_is_entered_once(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 2}) as remote:
        context = remote.acquire(cpu=1)
        async with context as lease:
            with pytest.raises(AcquireReusedError, match="only once"):
                await context.__aenter__()
            assert lease.active and await held(remote) == 1
        await wait_for(lambda: _equals(held(remote), 0.0), 5)


async def test_an_existing_scheduler_with_other_limits_is_refused(cluster: None) -> None:
    name = _name()
    async with _connect(name, capacity={"cpu": 2}):
        with pytest.raises(InvalidCapacityError, match="already exists"):
            async with _connect(name, capacity={"cpu": 8}):
                pass
        async with _connect(name, capacity={"cpu": 2}) as same:
            async with same.acquire(cpu=1) as lease:
                assert lease.grant == {"cpu": 1.0}
            with pytest.raises(tray.SchedulerUnavailableError, match="no host agent"):
                async with same.sandbox("traj-0"):
                    pass
            with pytest.raises(InvalidCapacityError):
                await same.set_capacity(cpu="lots")
            await same.set_capacity(cpu=3)
            assert same.capacity["cpu"].total == 3
            async with same.acquire(cpu=3) as lease:  # checked against the new capacity
                assert lease.grant == {"cpu": 3.0}
    with pytest.raises(tray.SchedulerUnavailableError):
        async with tray.connect(name=name, create=False, lookup_timeout=0.5):
            pass


async def test_a_dead_scheduler_fails_waiting_and_new_acquires(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 1}) as remote:
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await remote.run({"cpu": 1}, anyio.sleep, 0)
            except tray.SchedulerUnavailableError as exc:
                errors.append(exc)

        async with remote.acquire(cpu=1) as running:
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.2)  # queued behind the held core
                ray.kill(remote.actor)
            assert len(errors) == 1
            assert isinstance(errors[0].__cause__, ray.exceptions.RayError)
            assert running.grant == {"cpu": 1.0}  # a running block finishes
        with pytest.raises(tray.SchedulerUnavailableError):
            async with remote.acquire(cpu=1):
                pass


async def test_actions_placed_on_host_agents_run_in_their_sandboxes(cluster: None) -> None:
    roots = [tempfile.mkdtemp(prefix="tangram-agent-") for _ in range(2)]
    for root in roots:
        os.chmod(root, 0o755)  # the sandbox user (nobody, as root) walks through it
    agents: list[tray.HostAgent] = []
    try:
        async with _connect(_name(), capacity={"cpu": 1}) as remote:
            for index, root in enumerate(roots):
                backend = functools.partial(tangram.LocalBackend, cores=[index % 2], root=root)
                agents.append(await tray.start_agent(remote, name=f"host{index}", backend=backend))
            assert remote.capacity["cpu@host0"].total == 1
            # The driver that created the scheduler is not homed to an agent it starts on
            # its own node: the scheduler places its sandboxes, least loaded first.
            await anyio.sleep(3 * HEARTBEAT)
            assert remote._local is None
            root_of = {agent.name: root for agent, root in zip(agents, roots, strict=True)}

            async def trajectory(index: int) -> tuple[str, str]:
                async with remote.sandbox(f"traj-{index}") as sbx:
                    first = await sbx.run(f"echo traj-{index} > mine.txt")
                    second = await sbx.run(["cat", "mine.txt"])
                    assert first.ok and second.ok, (first, second)
                    # Run by that agent's backend, in a work dir under that agent's root.
                    cwd = work_dir_holding(root_of[sbx.host], f"traj-{index}")
                    # The second action ran where the first left its file.
                    assert second.stdout.decode().strip() == f"traj-{index}"
                    assert first.units == 1
                    # Bad input is refused by the agent with the local sandbox's error.
                    with pytest.raises(TypeError, match="command"):
                        await sbx.run(42)  # type: ignore[arg-type]
                    return sbx.host, cwd

            results: list[tuple[str, str]] = [("", "")] * 4

            async def record(index: int) -> None:
                results[index] = await trajectory(index)

            async with anyio.create_task_group() as tg:
                for index in range(4):
                    tg.start_soon(record, index)
            hosts = [host for host, _ in results]
            assert sorted(hosts) == ["host0", "host0", "host1", "host1"]
            stats = await remote.stats()
            for agent in agents:
                assert stats.resources[agent.resource].peak == 1
                assert stats.resources[agent.resource].held == 0
            assert stats.kinds["sandbox"].completed == 8
            for _, cwd in results:
                assert not await anyio.Path(cwd).exists()  # each sandbox went with its block
    finally:
        for agent in agents:
            await agent.aclose()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


class _Unloadable(ModelService):
    """A model service whose cold load fails (its weights are missing)."""

    async def load(self) -> None:
        raise RuntimeError("weights not found")

    async def restore(self, replica: int, devices: Any) -> None:
        raise AssertionError("never loaded")

    async def evict(self, replica: int) -> None:
        raise AssertionError("never loaded")

    async def run(self, replica: int, batches: Any) -> list[Any]:
        raise AssertionError("never loaded")


async def test_an_agent_whose_gpu_services_cannot_start_fails_at_start_agent(
    cluster: None,
) -> None:
    async with _connect(_name(), capacity={"cpu": 1}) as remote:
        with pytest.raises(TypeError, match="services"):
            await tray.start_agent(remote, name="bad", services="judge")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Device"):
            await tray.start_agent(
                remote,
                name="bad",
                services=[_Unloadable("judge")],
                devices=["cpu:0"],  # type: ignore[list-item]
            )
        # A CPU-only node: discovery finds no device there (on a GPU node the service's
        # load fails instead), and the agent's error is raised here, as itself. The
        # service is a callable that builds it on the node.
        backend = functools.partial(tangram.LocalBackend, cores=[0])
        with pytest.raises(GpuError) as caught:
            await tray.start_agent(
                remote,
                name="gpuless",
                backend=backend,
                services=[functools.partial(_Unloadable, "judge")],
            )
        if isinstance(caught.value, GpuServiceError):
            assert "weights not found" in str(caught.value)
        else:
            assert "no CUDA device" in str(caught.value)
        # Nothing was registered.
        assert await remote.actor.hosts.remote() == {}
        assert sorted(remote.capacity) == ["cpu"]
