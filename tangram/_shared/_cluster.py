"""The named actor ``connect`` creates: the scheduler's books and the host book, together.

The scheduler (:mod:`._scheduler`) knows proxies and their leases, the host book
(:mod:`._placement`) knows hosts and what is placed on them; neither imports the other.
They meet in one actor because a host is also a client: its agent acquires through a
proxy of its own, and when that proxy goes silent and is dropped, the host's cores and
devices leave the shared capacity with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._core._policy import Policy
from ..errors import InvalidDemandError, InvalidSettingError
from ._placement import HostBook
from ._protocol import died, logger, lost, task_failed
from ._reports import merge, record
from ._scheduler import SchedulerActor

if TYPE_CHECKING:
    from ._quotas import QuotaDesk, Wire
    from ._scheduler import _Client

__all__ = ["ClusterSchedulerActor"]


class ClusterSchedulerActor(SchedulerActor):
    """The shared scheduler with host agents: its methods are the wire protocol."""

    def __init__(
        self,
        capacity: Mapping[str, object],
        policy: Policy | None,
        heartbeat: float,
        timeout: float,
        token: str,
        idle: float | None = None,
    ) -> None:
        super().__init__(capacity, policy, heartbeat, timeout, token, idle)
        self._book = HostBook()
        # Agents that decide their node's cores, by their client id: (name, kinds, agent).
        self._deciding: dict[str, tuple[str, list[str], Any]] = {}
        self._decided: set[str] = set()  # their kinds, which this actor never lends
        # Each such agent's newest report (:mod:`._reports`), by client id.
        self._nodes: dict[str, dict[str, Any]] = {}
        # Workers that open sandboxes on their own node's agent: client id -> that
        # agent's client id (not its name: a replacement may take the name of one that
        # is not dropped yet).
        self._homes: dict[str, str] = {}
        # Each deciding agent's Ray node, and those whose ``ended`` returned (stopping).
        self._agent_nodes: dict[str, str] = {}
        self._stopping: set[str] = set()
        # The deciding agent of each Ray node, by node id: (host, agent, its client id),
        # what a worker connecting there is told its home is: the newest still serving.
        self._on_node: dict[str, tuple[str, Any, str]] = {}
        # Each worker's Ray node, as its polls say: a worker there with no home is told
        # of an agent that starts deciding the node's cores (a first, or a replacement).
        self._located: dict[str, str] = {}
        # One per deciding agent, by client id, while it runs: only a watched agent may
        # lapse, as only its watch would tell that a silent one is dead.
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._desk: QuotaDesk | None = None  # the job's API quotas, from a first use
        # Agents dropped for their silence but not known dead, by client id: their hosts
        # stay in the book at no capacity until they are heard again (``_client``).
        self._lapsed: set[str] = set()

    def _client(self, cid: str) -> _Client:
        client = super()._client(cid)
        if cid in self._lapsed and cid not in self._stopping:
            self._lapsed.discard(cid)
            back = self._book.resume(cid)
            if back:
                self._runtime.set_capacity(back)
                logger.warning(
                    "host agent %r is heard again: its capacity is back (%s)",
                    self._deciding[cid][0],  # only a deciding agent lapses
                    ", ".join(sorted(back)),
                )
            self._name_home_of(cid)
        return client

    def _drop_client(self, cid: str, *, expired: bool = False) -> bool:
        """Forget a proxy; an agent's that went silent while alive only lapses.

        An agent's own loop can stall past the lease timeout (a long GC, a blocking
        call) with its node and sandboxes intact; dropping it would take its node's
        cores out of the job for good. So it lapses: its hosts lend nothing and the book
        places nothing there and no new worker is sent to it, but its name, its
        placements and its workers' homes stay, and it is back when heard. Its process's
        death (the watched ``ended`` call), its own departure, or a silence while
        stopping drops it for good.
        """
        if not super()._drop_client(cid, expired=expired) and cid not in self._lapsed:
            return False
        if self._desk is not None:
            self._desk.drop(cid)  # its API requests, waiting or in flight
        for trajectory, agent in self._book.orphans(cid):
            # The agent cancels what still runs there: the cores its commands hold return.
            agent.close.remote(trajectory)
        self._located.pop(cid, None)
        home = self._deciding.get(self._homes.pop(cid, ""))
        if home is not None:
            # The sandboxes it opened on its own node, unknown to the book, close too.
            home[2].forget.remote(cid)
        # Only an agent whose death its watch would tell (one that decides its node's
        # cores, started, not stopping and not gone): else nothing would end its lapse.
        if expired and cid in self._deciding and cid in self._watches and cid not in self._stopping:
            self._lapsed.add(cid)
            lapsed = self._book.lapse(cid)
            if lapsed:
                self._runtime.set_capacity(lapsed)
            logger.warning(
                "host agent %r stopped answering; its capacity is 0 until it is heard",
                self._deciding[cid][0],
            )
            self._name_home_of(cid)
            return True
        self._lapsed.discard(cid)
        gone = self._book.drop(cid)
        if gone:
            self._runtime.set_capacity(gone)
        deciding = self._deciding.pop(cid, None)
        if deciding is not None:
            self._stopping.discard(cid)
            # Its workers have no home until their node has an agent again (they beat to
            # this actor meanwhile), then that one.
            self._homes = {c: agent for c, agent in self._homes.items() if agent != cid}
            where = self._agent_nodes.pop(cid, None)
            if where is not None:
                self._name_home(where)
            # Another agent may decide the same kinds by now (its node's new agent).
            self._decided = {k for _, kinds, _ in self._deciding.values() for k in kinds}
            node = self._nodes.get(cid)
            if node is not None:  # its books went with it: nothing held or queued there
                node.update(waiting=0, running=0)
        return True

    async def close(self) -> None:
        for task in list(self._watches.values()):
            task.cancel()
        if self._desk is not None:
            await self._desk.aclose()
        await super().close()

    def _returned(self, cid: str, relayed_by: str) -> None:
        """A worker dropped while alive came back in ``relayed_by``'s poll: that agent is
        its home again, so that it closes what the worker opens there if it is dropped."""
        if relayed_by in self._deciding:
            self._homes[cid] = relayed_by

    def _agents(self) -> dict[str, Any]:
        """Every agent's handle by its client id: the book's, and deciding agents whose
        name another took meanwhile (their node's, out of the book but still serving)."""
        agents = {cid: agent for cid, (_, _, agent) in self._deciding.items()}
        agents.update(self._book.agents())
        return agents

    def _own_clients(self) -> set[str]:
        return set(self._agents())

    async def _retire(self) -> bool:
        """Stop the agents (their sandboxes and services) before this actor ends."""
        agents = list(self._agents().values())
        with contextlib.suppress(*lost(), asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(agent.stop.remote() for agent in agents)), self._timeout
            )
        for agent in agents:
            with contextlib.suppress(*lost()):
                self._kill(agent)
        return await super()._retire()

    def _kill(self, agent: Any) -> None:
        import ray

        ray.kill(agent, no_restart=True)

    async def add_host(
        self,
        name: str,
        resource: str,
        units: int,
        agent: Any,
        cid: str,
        gpu: Mapping[str, Any] | None = None,
        decides: bool = False,
        node: str | None = None,
    ) -> None:
        runtime = await self._ready()
        if self._book.holder(name) in self._lapsed - {cid}:
            raise InvalidSettingError(
                f"`name`: host agent {name!r} has lapsed (silent past the lease timeout, "
                "not known dead) and keeps its name until it is heard again or dies"
            )
        runtime.set_capacity(self._book.add(name, resource, units, agent, cid, gpu))
        if decides:
            kinds = [resource] if gpu is None else [resource, gpu["resource"]]
            self._deciding[cid] = (name, kinds, agent)
            self._decided.update(kinds)
            if node is not None:
                self._agent_nodes[cid] = node
                self._name_home(node)
            self._watch(cid, name, agent)

    def _watch(self, cid: str, name: str, agent: Any) -> None:
        """Drop the agent as soon as its process is gone, not a lease timeout later.

        Until dropped, a dead agent was still named to workers connecting on its node,
        still held its node's cores in the job's capacity, and a replacement could not
        take its name. The call it waits on (``ended``) fails the moment Ray knows the
        actor died; a node lost without a word is still dropped by the lease timeout.
        """

        async def watch() -> None:
            while True:
                try:
                    await agent.ended.remote()
                except task_failed():
                    return  # it failed to start: its proxy goes, and the agent with it
                except lost() as exc:
                    if not died(exc):  # unreachable for now, not dead: ask again
                        await asyncio.sleep(self._heartbeat)
                        continue
                    if self._drop_client(cid):
                        logger.warning(
                            "host agent %r is gone: its node's cores and devices leave the job",
                            name,
                        )
                    return
                # Stopping: closing its sandboxes and services until its proxy leaves. It
                # is nobody's new home from now on; a lapsed one, which may never be heard
                # again and has no call left here to fail when it dies, leaves now.
                self._stopping.add(cid)
                if cid in self._lapsed:
                    self._drop_client(cid)
                    return
                where = self._agent_nodes.get(cid)
                if where is not None:
                    self._name_home(where)
                return

        task = asyncio.get_running_loop().create_task(watch())
        self._watches[cid] = task
        task.add_done_callback(lambda _: self._watches.pop(cid, None))

    def _locate(self, cid: str, node: str) -> None:
        if self._located.get(cid) != node:
            self._located[cid] = node
            self._rehome(node, [cid])

    def _name_home_of(self, cid: str) -> None:
        """Name again the home of the node of agent ``cid``, if it decides one."""
        where = self._agent_nodes.get(cid)
        if where is not None:
            self._name_home(where)

    def _name_home(self, node: str) -> None:
        """Name ``node``'s newest deciding agent that still serves as the home of the
        workers there, and tell those without one (a first agent, or one that took over
        from an agent gone or stopping)."""
        cid = self._newest_serving(lambda agent: self._agent_nodes.get(agent) == node)
        if cid is None:
            self._on_node.pop(node, None)
            return
        name, _, agent = self._deciding[cid]
        self._on_node[node] = (name, agent, cid)
        self._rehome(node, [c for c, at in self._located.items() if at == node])

    def _newest_serving(self, where: Callable[[str], bool], *, lapsed: bool = False) -> str | None:
        """The client id of the newest deciding agent that still serves, of those
        ``where`` accepts: the home a node's workers are given. A lapsed one (stalled)
        is no new worker's home, unless ``lapsed``: a worker that already chose it."""
        for cid in reversed(self._deciding):
            if cid not in self._stopping and (lapsed or cid not in self._lapsed) and where(cid):
                return cid
        return None

    def _rehome(self, node: str, cids: list[str]) -> None:
        """Tell workers on ``node`` with no home that its deciding agent is their home.

        As ``connect`` does for a worker that finds the agent there: its sandboxes open
        on its own node and, idle, it beats through the agent. Told on its poll's answer,
        so no message of its own; recorded here, so the agent forgets it when it goes.
        """
        on = self._on_node.get(node)
        if on is None:
            return
        host, agent, agent_cid = on
        for cid in cids:
            client = self._clients.get(cid)
            if client is None or cid == agent_cid or cid in self._homes:
                continue
            self._homes[cid] = agent_cid
            client.post(("home", host, agent))

    async def info(self, node: str | None = None) -> dict[str, Any]:
        """The scheduler's facts; with ``node``, also ``home``: (host, agent) of the agent
        that decides that node's cores, or ``None``. A worker connecting there opens its
        sandboxes on it and beats through it, as one that started it does."""
        facts = await super().info()
        if self._desk is not None:
            # A quota's kinds as configured, not as AIMD has cut them: what a worker that
            # states the same quota compares with.
            facts["capacity"] = facts["capacity"].with_updates(self._desk.configured())
        if node is not None:
            on = self._on_node.get(node)
            facts["home"] = None if on is None else on[:2]
        return facts

    async def policy(self) -> Policy:
        """The job's policy, for the agents that decide their node's cores under it."""
        return (await self._ready()).policy

    async def report(self, cid: str, node: dict[str, Any]) -> None:
        """A node's report, pushed by its agent when its outbox filled."""
        self.messages += 1
        await self._ready()
        self._take(cid, node)

    def _take(self, cid: str, node: dict[str, Any] | None) -> None:
        """Count a report's ended actions; keep its books if they are the agent's newest.

        Its actions always count (each report carries its own). Its books do not when an
        older report arrives after a newer one, or after the agent was dropped: a dead
        node holds nothing.
        """
        if node is None:
            return
        record(self._runtime._recorder, node.pop("records"))
        last = self._nodes.get(cid)
        deciding = self._deciding.get(cid)
        if deciding is not None and (last is None or node["seq"] > last["seq"]):
            self._nodes[cid] = node
            if "sandboxes" in node:
                self._book.note(deciding[0], node["sandboxes"], cid)

    def _check(self, demand: dict[str, object]) -> None:
        decided = self._decided
        if decided and any(k in decided for k in demand):
            mine = sorted(k for k in demand if k in decided)
            raise InvalidDemandError(
                f"{', '.join(mine)}: a node's cores and GPUs are lent by its host agent, "
                "not by the job's scheduler; run on them through a sandbox or a service "
                "block placed there (`remote.sandbox(...)`, `remote.service(...)`)"
            )

    async def stats(self) -> Any:
        """The job's stats, with each deciding node's books asked for first."""
        runtime = await self._ready()
        # A lapsed agent's loop is stalled: its last books stand for it, not a call on it
        # that would wait a lease timeout each time.
        deciding = [
            (cid, agent) for cid, (_, _, agent) in self._deciding.items() if cid not in self._lapsed
        ]

        async def ask(cid: str, agent: Any) -> None:
            call = asyncio.ensure_future(agent.report.remote())
            try:
                self._take(cid, await asyncio.wait_for(asyncio.shield(call), self._timeout))
            except asyncio.TimeoutError:
                # The agent took its records when it answered: count them when it does.
                call.add_done_callback(lambda done: self._late(cid, done))
            except lost():
                pass

        if deciding:
            await asyncio.gather(*(ask(cid, agent) for cid, agent in deciding))
        return merge(runtime.stats(), self._nodes)

    def _late(self, cid: str, call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is None:
            self._take(cid, call.result())

    async def hosts(self) -> dict[str, dict[str, Any]]:
        await self._ready()
        return self._book.describe()

    async def home(self, cid: str, host: str, agent: Any = None) -> None:
        """Worker ``cid`` opens sandboxes on ``agent`` (host ``host``) itself, from now on.

        Told once, before its first: when the worker is dropped, that agent (only) is
        asked to close them. Counted as a placement: it says where sandboxes live, once
        per worker, on no action's path. The agent is named by its handle: another of
        the same name (a replacement) may be the newest, or may have lapsed.
        """
        self.messages += 1
        self.placements += 1
        await self._ready()

        def told(other: str) -> bool:
            name, _, handle = self._deciding[other]
            return name == host and (agent is None or handle == agent)

        # Only an agent that still serves: one dropped since the worker heard of it
        # would leave the worker homed to nobody, skipped when a replacement starts. A
        # lapsed one does, where no other fits: the worker opens its sandboxes there
        # once it is heard again.
        agent_cid = self._newest_serving(told) or self._newest_serving(told, lapsed=True)
        if agent_cid is not None:
            self._homes[cid] = agent_cid

    async def place(
        self, trajectory: str, cid: str | None = None, spilled: tuple[str, int] | None = None
    ) -> tuple[str, Any]:
        """A host for a sandbox; ``spilled``: (host, its open sandboxes) it did not fit on."""
        self.messages += 1
        self.placements += 1
        await self._ready()
        # Said by a worker of that host's agent: counted there only if its home is known.
        if spilled is not None and (cid is None or cid in self._homes):
            self._book.note(*spilled, self._homes.get(cid) if cid is not None else None)
        return self._book.place(trajectory, cid)

    async def unplace(self, trajectory: str) -> None:
        self.messages += 1
        self.placements += 1
        await self._ready()
        self._book.unplace(trajectory)

    async def place_service(self, cid: str, service: str) -> tuple[int, str, Any]:
        self.messages += 1
        self.placements += 1
        await self._ready()
        return self._book.place_service(cid, service)

    async def unplace_service(self, ticket: int, seq: int, resident: list[str]) -> None:
        self.messages += 1
        self.placements += 1
        await self._ready()
        self._book.unplace_service(ticket, seq, resident)

    # -- the job's API quotas (:mod:`._quotas`; httpx is imported at a first use) --------

    async def _quotas(self) -> QuotaDesk:
        runtime = await self._ready()
        if self._desk is None:
            from ._quotas import QuotaDesk

            self._desk = QuotaDesk(runtime)
        return self._desk

    async def quota_open(
        self, name: str, keys: list[dict[str, Any]], options: dict[str, Any]
    ) -> None:
        """A worker's ``[quota.NAME]``: built here by the first, checked for the others."""
        self.messages += 1
        (await self._quotas()).open(name, keys, options)

    async def quota_send(self, name: str, call: str, wire: Wire) -> tuple[Any, ...]:
        """Send a worker's request under the job's quota ``name`` (see :mod:`._quotas`)."""
        self.messages += 1
        return await (await self._quotas()).send(name, call, wire)

    async def quota_cancel(self, call: str) -> None:
        """The worker that sent ``call`` stopped waiting for it: its slot comes back now."""
        self.messages += 1
        (await self._quotas()).cancel(call)
