"""The job's scheduler actor with host agents (``tangram/_shared/_cluster.py``), driven
directly in this process: agents are handles the tests answer, kill or silence."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from tangram.errors import InvalidDemandError

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_workers_home_counts_as_a_placement_not_on_an_actions_path() -> None:
    """``ray_ceiling`` reads messages less heartbeats and placements as those on an
    action's path: a worker's ``home``, once per worker, is where its sandboxes live."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 2}, None, heartbeat=0.05, timeout=5.0, token="t")
    try:
        first = await actor.counters()
        await actor.home("a", "node-a")
        after = await actor.counters()
        assert after["messages"] - first["messages"] == 1
        assert after["placements"] - first["placements"] == 1
    finally:
        await actor.close()


def _answered(*args: Any) -> asyncio.Future[None]:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def _unanswered(*args: Any) -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


class _QuietAgent:
    """An agent handle whose ``report`` answers that it has nothing to tell."""

    class report:
        remote = staticmethod(_answered)

    class ended:  # it serves for as long as the test
        remote = staticmethod(_unanswered)

    class forget:  # a dropped proxy's own sandboxes here: it has none
        remote = staticmethod(_answered)


def _node_report(seq: int, held: float) -> dict[str, Any]:
    return {
        "seq": seq,
        "records": [("sandbox", "completed", 0.0, 0.0, 0.1)],
        "resources": {"cpu@n": (2.0, held, held / 2, 3.0, 2.0)},
        "waiting": 0,
        "running": int(held),
        "decisions": seq,
        "decision_seconds": 0.0,
        "resizes": 0,
        "evictions": 0,
    }


class _Forgetful(_QuietAgent):
    """An agent handle that notes which dropped workers it is asked to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        outer = self

        class forget:
            @staticmethod
            def remote(cid: str) -> asyncio.Future[None]:
                outer.forgotten.append(cid)
                return _answered()

        self.forget = forget  # type: ignore[misc,assignment]


async def test_relayed_beats_keep_workers_alive_and_only_their_home_forgets_them() -> None:
    """The scheduler actor's side of beats passed on by a node's agent, driven directly.

    A relayed beat keeps a worker alive; one for a worker dropped while alive (its
    beats late) brings it back with its ``expired`` event, as its own poll would, and
    with the relaying agent as its home again; one
    for a proxy never seen or gone by ``disconnect`` makes up nothing. A dropped worker's
    own-node sandboxes are forgotten by its home agent only, not by every agent.
    """
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=5.0, token="t")
    home, other = _Forgetful(), _Forgetful()
    try:
        await actor.poll("agent-a", [], 0.0)
        await actor.poll("agent-b", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, home, "agent-a", None, True)
        await actor.add_host("b", "cpu@b", 2, other, "agent-b", None, True)
        await actor.poll("w", [], 0.0)
        await actor.home("w", "a")
        actor._clients["w"].heard.at -= 4.0  # silent for 4 of its 5 s
        await actor.poll("agent-a", [], 0.0, ["w", "never-seen"])
        assert actor._clients["w"].heard.at > time.monotonic() - 1.0
        assert "never-seen" not in actor._clients
        assert actor._drop_client("w", expired=True)
        assert home.forgotten == ["w"] and other.forgotten == []
        await actor.poll("agent-a", [], 0.0, ["w"])  # alive after all: back, and told
        assert actor._clients["w"].events[0][0] == "expired"
        # Back through agent a, a is its home again: dropped a second time, a forgets it.
        assert actor._drop_client("w", expired=True)
        assert home.forgotten == ["w", "w"] and other.forgotten == []
        await actor.poll("agent-a", [], 0.0, ["w"])
        await actor.disconnect("w", [])
        await actor.poll("agent-a", [], 0.0, ["w"])
        assert "w" not in actor._clients
    finally:
        await actor.close()


class _Mortal(_Forgetful):
    """An agent handle the test kills, cuts off for a while or stops: its ``ended``
    call then fails as Ray's would, or returns."""

    def __init__(self) -> None:
        super().__init__()
        self.death: asyncio.Future[None] | None = None
        self.asked = 0
        outer = self

        class ended:
            @staticmethod
            def remote() -> asyncio.Future[None]:
                outer.asked += 1
                outer.death = asyncio.get_running_loop().create_future()
                return outer.death

        self.ended = ended  # type: ignore[misc,assignment]

    def kill(self) -> None:
        assert self.death is not None
        self.death.set_exception(ray.exceptions.ActorDiedError())

    def cut_off(self) -> None:
        assert self.death is not None
        self.death.set_exception(ray.exceptions.ActorUnavailableError("a network break", None))

    def stop(self) -> None:
        assert self.death is not None
        self.death.set_result(None)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_dead_agent_is_dropped_at_once_and_its_nodes_workers_follow_its_successor() -> None:
    """Issue 30, driven directly. An agent that dies is dropped the moment its watched
    call fails, not a lease timeout later: a worker connecting on its node is no longer
    told to home there, its cores leave the capacity and its name is free. A worker
    that polls from a node is told of the agent that starts deciding there after it
    connected, on its poll's answer (no message of its own); the agent's own proxy and
    a worker already at home are not; a replacement of the same name is the new home."""
    from tangram._shared._cluster import ClusterSchedulerActor

    # A lease timeout far longer than the test: only the watch can drop the agent.
    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]  # asking Ray starts one
    first, second = _Mortal(), _Mortal()
    try:
        await actor.poll("early", [], 0.0, (), "node-1")  # connected before any agent
        await actor.poll("elsewhere", [], 0.0, (), "node-2")
        await actor.poll("agent-1", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, first, "agent-1", None, True, "node-1")
        assert actor._clients["early"].take() == [("home", "a", first)]
        assert actor._clients["elsewhere"].take() == []
        assert actor._clients["agent-1"].take() == []
        # Its first poll finds the agent, and answers with its home.
        assert await actor.poll("late", [], 0.0, (), "node-1") == [("home", "a", first)]
        assert await actor.poll("late", [], 0.0, (), "node-1") == []  # told once
        assert (await actor.info("node-1"))["home"] == ("a", first)
        assert (await actor.info())["capacity"]["cpu@a"].total == 2

        first.kill()
        await _settle()
        assert (await actor.info("node-1"))["home"] is None
        assert "a" not in await actor.hosts()
        assert (await actor.info())["capacity"]["cpu@a"].total == 0
        assert "agent-1" not in actor._clients

        await actor.poll("agent-2", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, second, "agent-2", None, True, "node-1")
        assert actor._clients["early"].take() == [("home", "a", second)]
        assert actor._clients["late"].take() == [("home", "a", second)]
        assert actor._clients["elsewhere"].take() == []
        assert (await actor.info("node-1"))["home"] == ("a", second)
    finally:
        await actor.close()


async def test_homes_follow_the_agents_that_serve_a_node_and_only_death_drops_one() -> None:
    """The review's cases, driven directly. A ``home`` naming an agent dropped since the
    worker heard of it records nothing, so the worker follows the replacement. With two
    deciding agents on one node the newest is the home; when it goes, the other takes its
    workers, and a worker is forgotten by the agent it was homed to, never by another of
    the same name. An agent cut off for a while (not dead) is asked again, not dropped;
    one that stops is nobody's new home but stays until its proxy leaves."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    old, new, third = _Mortal(), _Mortal(), _Mortal()
    try:
        for cid in ("agent-old", "agent-new"):
            await actor.poll(cid, [], 0.0)
        await actor.add_host("a", "cpu@a", 1, old, "agent-old", None, True, "node-1")
        await actor.poll("w", [], 0.0, (), "node-1")  # homed to the only agent there
        # A second agent of the same name on the same node: the newest is the home.
        await actor.add_host("a", "cpu@a", 1, new, "agent-new", None, True, "node-1")
        assert (await actor.info("node-1"))["home"] == ("a", new)
        await actor.poll("v", [], 0.0, (), "node-1")
        assert actor._homes == {"w": "agent-old", "v": "agent-new"}

        await _settle()  # the watches are waiting
        new.cut_off()  # unreachable, not dead: asked again a heartbeat later
        await asyncio.sleep(0.2)
        assert new.asked == 2 and "agent-new" in actor._clients

        new.kill()  # the newest dies: its worker moves to the one left, w stays
        await _settle()
        assert (await actor.info("node-1"))["home"] == ("a", old)
        assert actor._clients["v"].take() == [("home", "a", old)]
        assert actor._homes == {"w": "agent-old", "v": "agent-old"}
        assert "agent-old" in actor._clients
        await actor.disconnect("w", [])
        assert old.forgotten == ["w"] and new.forgotten == []

        old.kill()  # nobody left on node-1: a late `home` for "a" records nothing
        await _settle()
        await actor.poll("late", [], 0.0)
        await actor.home("late", "a")
        assert "late" not in actor._homes and (await actor.info("node-1"))["home"] is None
        await actor.poll("late", [], 0.0, (), "node-1")
        await actor.poll("agent-third", [], 0.0)
        await actor.add_host("a", "cpu@a", 1, third, "agent-third", None, True, "node-1")
        assert actor._clients["late"].take() == [("home", "a", third)]

        await _settle()
        third.stop()  # stopping: no longer named, not dropped before its proxy leaves
        await _settle()
        assert (await actor.info("node-1"))["home"] is None
        assert "agent-third" in actor._clients and actor._homes["late"] == "agent-third"
    finally:
        await actor.close()


async def test_the_job_keeps_a_nodes_newest_books_and_never_lends_its_kinds() -> None:
    """The scheduler actor's side of node-decided cores, driven directly.

    Every report's actions count, but an older report arriving late does not replace a
    newer one's books; a node's kinds stay refused while any agent decides them, even
    after another agent of the same name was dropped (its node's agent replaced).
    """
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=5.0, token="t")
    try:
        await actor.poll("c1", [], 0.0)  # the agent's proxy: a client of the actor
        await actor.add_host("n", "cpu@n", 2, _QuietAgent(), "c1", None, True)
        await actor.report("c1", _node_report(2, held=1.0))
        await actor.report("c1", _node_report(1, held=2.0))  # sent first, arrived late
        stats = await actor.stats()
        assert stats.kinds["sandbox"].completed == 2
        assert stats.resources["cpu@n"].held == 1.0
        assert stats.running == 1
        await actor.poll("c2", [], 0.0)
        await actor.add_host("n", "cpu@n", 2, _QuietAgent(), "c2", None, True)
        assert actor._drop_client("c1")
        events = await actor.send("w", [(1, {"cpu@n": 1}, "x", None, None, None)], [], [])
        assert [e[0] for e in events] == ["error"]
        assert isinstance(events[0][2], InvalidDemandError)
        assert "lent by its host agent" in str(events[0][2])
        assert (await actor.counters())["leases"] == 0
    finally:
        await actor.close()


class _Lapsing(_Mortal):
    """A deciding agent's handle that also notes the sandboxes it is asked to close and
    whether it was told to stop."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []
        self.stopped = 0
        outer = self

        class close:
            @staticmethod
            def remote(trajectory: str) -> asyncio.Future[None]:
                outer.closed.append(trajectory)
                return _answered()

        class stop:
            @staticmethod
            def remote() -> asyncio.Future[None]:
                outer.stopped += 1
                return _answered()

        self.close = close  # type: ignore[misc,assignment]
        self.stop = stop  # type: ignore[method-assign,assignment]  # the handle's call

    def finish(self) -> None:
        """Its ``ended`` returns: it is stopping (``_Mortal.stop``, under another name)."""
        _Mortal.stop(self)


async def _two_agents(actor: Any) -> tuple[_Lapsing, _Lapsing]:
    a, b = _Lapsing(), _Lapsing()
    for cid in ("agent-a", "agent-b"):
        await actor.poll(cid, [], 0.0)
    await actor.add_host("a", "cpu@a", 2, a, "agent-a", None, True, "node-1")
    await actor.add_host("b", "cpu@b", 2, b, "agent-b", None, True, "node-2")
    await _settle()  # the watches are waiting
    return a, b


async def _capacity(actor: Any, kind: str) -> float:
    total: float = (await actor.info())["capacity"][kind].total
    return total


async def test_an_agent_dropped_for_its_own_stall_lapses_and_its_node_comes_back() -> None:
    """F5 (issue 30). An agent whose own loop stalls past the lease timeout is alive: it
    lapses, not leaves. While lapsed its node's capacity is 0, the book places nothing
    there and no worker connecting on its node is sent to it, but its name stays taken
    and it stays the home of the workers it had, so a worker dropped meanwhile is still
    forgotten there and what the book placed there still closes. Heard again (even with
    its ``expired`` record evicted), its capacity is back, and a worker that connected
    on its node meanwhile is told it is home."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    try:
        a, _ = await _two_agents(actor)
        assert await actor.poll("w", [], 0.0, (), "node-1") == [("home", "a", a)]
        await actor.poll("x", [], 0.0)
        assert (await actor.place("t1", "x"))[0] == "a"

        assert actor._drop_client("agent-a", expired=True)  # what the watchdog does
        assert await _capacity(actor, "cpu@a") == 0
        hosts = await actor.hosts()
        assert hosts["a"]["lapsed"] and not hosts["b"]["lapsed"]
        assert [(await actor.place(t, "x"))[0] for t in ("t2", "t3", "t4")] == ["b"] * 3
        assert (await actor.info("node-1"))["home"] is None
        assert await actor.poll("v", [], 0.0, (), "node-1") == []  # not sent to a stalled agent
        assert actor._homes["w"] == "agent-a"
        await actor.home("u", "a")  # it opened one there before it heard: still forgotten
        assert actor._homes["u"] == "agent-a"
        await actor.disconnect("w", [])
        assert a.forgotten == ["w"]
        await actor.disconnect("x", [])
        assert a.closed == ["t1"]

        actor._expired.clear()  # 1,024 are kept: an agent's may be evicted
        events = await actor.poll("agent-a", [], 0.0)
        assert await _capacity(actor, "cpu@a") == 2
        assert not (await actor.hosts())["a"]["lapsed"]
        assert (await actor.place("t5", "y"))[0] == "a"
        assert events == []  # it held nothing here: its own runtime decides its cores
        assert (await actor.info("node-1"))["home"] == ("a", a)
        assert actor._clients["v"].take() == [("home", "a", a)]
    finally:
        await actor.close()


async def test_a_lapsed_agent_that_dies_or_stops_leaves_for_good() -> None:
    """A lapsed agent whose process dies is dropped at once, as a serving one is: its
    name is free for a replacement, and nothing of it comes back. One that was stopping
    when it went silent is not kept either; one that starts stopping while lapsed is not
    brought back when heard, and leaves with its proxy."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    try:
        a, b = await _two_agents(actor)
        assert actor._drop_client("agent-a", expired=True)
        a.kill()
        await _settle()
        assert "a" not in await actor.hosts()
        assert (await actor.info("node-1"))["home"] is None
        await actor.poll("agent-a", [], 0.0)  # a last call in flight when it died
        assert "a" not in await actor.hosts() and await _capacity(actor, "cpu@a") == 0
        replacement = _Lapsing()
        await actor.poll("agent-a2", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, replacement, "agent-a2", None, True, "node-1")
        assert (await actor.info("node-1"))["home"] == ("a", replacement)

        b.finish()  # ``ended`` returned: b is stopping
        await _settle()
        assert actor._drop_client("agent-b", expired=True)
        assert "b" not in await actor.hosts()
        await actor.poll("agent-b", [], 0.0)
        assert "b" not in await actor.hosts() and await _capacity(actor, "cpu@b") == 0

        assert actor._drop_client("agent-a2", expired=True)
        replacement.finish()  # it may die unheard now: no call of ours would fail then
        await _settle()
        assert "a" not in await actor.hosts() and await _capacity(actor, "cpu@a") == 0
        await actor.poll("agent-a2", [], 0.0)
        assert "a" not in await actor.hosts() and await _capacity(actor, "cpu@a") == 0
    finally:
        await actor.close()


async def test_a_job_left_with_only_lapsed_agents_retires_and_stops_them() -> None:
    """A lapsed agent keeps no job alive (it serves the scheduler, not a user), and the
    scheduler's retirement stops it with the others."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor(
        {"cpu": 1}, None, heartbeat=0.05, timeout=0.2, token="t", idle=0.3
    )
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    killed: list[Any] = []
    actor._kill = killed.append  # type: ignore[method-assign]
    actor._end = lambda: None  # type: ignore[method-assign]
    try:
        a, b = await _two_agents(actor)
        assert actor._drop_client("agent-a", expired=True)
        for _ in range(60):
            if killed:
                break
            await actor.poll("agent-b", [], 0.0)
            await asyncio.sleep(0.05)
        assert a.stopped == 1 and b.stopped == 1
        assert a in killed and b in killed
    finally:
        await actor.close()


class _Stalled(_Lapsing):
    """A lapsed agent's handle: its loop is stalled, so its report never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.reports = 0
        outer = self

        class report:
            @staticmethod
            def remote() -> asyncio.Future[None]:
                outer.reports += 1
                return _unanswered()

        self.report = report  # type: ignore[misc,assignment]


async def test_the_jobs_stats_do_not_wait_on_a_lapsed_agent() -> None:
    """``stats()`` asks each deciding agent for its books and waits up to a lease timeout
    for an answer; a lapsed agent's loop is stalled, so each call waited the whole
    timeout and left one more call on it. Its last books stand for it instead."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=2.0, token="t")
    stalled = _Stalled()
    try:
        await actor.poll("agent-a", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, stalled, "agent-a", None, True)
        await actor.report("agent-a", _node_report(1, held=1.0))
        assert actor._drop_client("agent-a", expired=True)
        started = time.monotonic()
        for _ in range(3):
            stats = await actor.stats()
        assert time.monotonic() - started < 1.0
        assert stalled.reports == 0
        assert stats.kinds["sandbox"].completed == 1
    finally:
        await actor.close()


class _FailedStart(_Lapsing):
    """An agent whose start failed after it registered: its ``ended`` raises the start's
    error, and whoever started it kills it, so it never calls again."""

    def __init__(self) -> None:
        super().__init__()

        class ended:
            @staticmethod
            def remote() -> asyncio.Future[None]:
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(
                    ray.exceptions.RayTaskError("ended", "", RuntimeError("start failed"))
                )
                return failed

        self.ended = ended  # type: ignore[misc,assignment]


async def test_only_an_agent_whose_death_is_watched_lapses() -> None:
    """A lapse ends when the agent is heard or its watched call fails. An agent whose
    watch has ended (its start failed, so it was killed) has neither: its silence drops
    it for good, or its name and node would be held at 0 for the rest of the job."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    try:
        await actor.poll("agent-a", [], 0.0)
        await actor.add_host("a", "cpu@a", 2, _FailedStart(), "agent-a", None, True, "node-1")
        await _settle()
        assert actor._drop_client("agent-a", expired=True)
        assert "a" not in await actor.hosts() and not actor._lapsed
    finally:
        await actor.close()


async def test_two_agents_under_one_name_each_keep_to_their_own() -> None:
    """Two agents under one name (the scheduler actor takes a second while the first
    serves; ``start_agent`` refuses it, but two can race past its check): the older is
    out of the book. Its reports, and a spill by a worker at home there, do not write
    the newer's count of open sandboxes; a worker records as its home the agent it was
    told of, not the newest of that name; both are the scheduler's own clients, not
    users that keep the job alive, and both are stopped when the job retires. A name
    held by a lapsed agent is refused: that agent may come back to it."""
    from tangram._shared._cluster import ClusterSchedulerActor
    from tangram.errors import InvalidSettingError

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    actor._kill = lambda agent: None  # type: ignore[method-assign]
    actor._end = lambda: None  # type: ignore[method-assign]
    old, new, third = _Lapsing(), _Lapsing(), _Lapsing()
    try:
        for cid in ("agent-old", "agent-new", "agent-third", "w", "v", "u", "x"):
            await actor.poll(cid, [], 0.0)
        await actor.add_host("a", "cpu@a", 2, old, "agent-old", None, True, "node-1")
        await actor.home("w", "a", old)
        await actor.add_host("a", "cpu@a", 2, new, "agent-new", None, True, "node-1")
        report = _node_report(1, held=0.0)
        report["sandboxes"] = 7
        await actor.report("agent-old", report)
        await actor.place("t1", "w", ("a", 9))
        assert (await actor.hosts())["a"]["sandboxes"] == 1  # t1 alone
        # Nor a spill by a worker with no recorded home (dropped, back by its own poll).
        await actor.home("x", "a", old)
        assert actor._drop_client("x", expired=True)
        await actor.poll("x", [], 0.0)
        await actor.place("t2", "x", ("a", 9))
        assert (await actor.hosts())["a"]["sandboxes"] == 2  # t1 and t2
        await _settle()
        assert actor._drop_client("agent-new", expired=True)  # the newer lapses
        assert (await actor.info("node-1"))["home"] == ("a", old)
        await actor.home("v", "a", old)
        assert actor._homes == {"w": "agent-old", "v": "agent-old"}
        await actor.home("u", "a")  # a caller that names no handle: the serving one
        assert actor._homes == {"w": "agent-old", "v": "agent-old", "u": "agent-old"}
        with pytest.raises(InvalidSettingError, match="lapsed"):
            await actor.add_host("a", "cpu@a", 2, third, "agent-third", None, True, "node-1")
        assert (await actor.hosts())["a"]["lapsed"]
        # The older, out of the book, stalls too: it lapses as well, and stays the
        # scheduler's own when it is heard again, never a user keeping the job alive.
        assert actor._drop_client("agent-old", expired=True)
        assert "agent-old" in actor._lapsed
        await actor.poll("agent-old", [], 0.0)
        assert "agent-old" not in actor._lapsed
        assert actor._own_clients() >= {"agent-old", "agent-new"}
        assert await actor._retire()
        assert old.stopped == 1 and new.stopped == 1
    finally:
        await actor.close()


async def test_an_agent_gone_by_its_departure_does_not_lapse_if_heard_after() -> None:
    """An agent's proxy that left (``disconnect``) is dropped for good, while the call
    its watch waits on may not have returned yet: a late call of that proxy, silent in
    turn, is an ordinary client's, not a lapse of an agent no longer deciding."""
    from tangram._shared._cluster import ClusterSchedulerActor

    actor = ClusterSchedulerActor({"cpu": 1}, None, heartbeat=0.05, timeout=60.0, token="t")
    actor._node_id = lambda: "head"  # type: ignore[method-assign]
    try:
        await _two_agents(actor)
        await actor.disconnect("agent-a", [])
        assert "a" not in await actor.hosts() and "agent-a" in actor._watches
        await actor.poll("agent-a", [], 0.0)
        assert actor._drop_client("agent-a", expired=True)
        assert "agent-a" not in actor._lapsed and "a" not in await actor.hosts()
    finally:
        await actor.close()
