"""The scheduler actor: one :class:`tangram.Runtime` for many processes, and their books.

A scheduler per rollout process only limits per process: eight processes each allowed
eight cores use sixty-four. Here the one runtime lives in an async Ray actor and every
process talks to it through a proxy (:mod:`._proxy`). The actor keeps, per proxy, the
requests it waits on and the leases it holds; a lease whose heartbeat is older than the
timeout (a dead process, a lost node) is reclaimed, and a release of a reclaimed lease,
arriving late, finds nothing and changes nothing (the wire is :mod:`._protocol`).

Hosts are not known here: the actor ``connect`` creates adds them (:mod:`._cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from .._core._policy import Policy
from .._core._resources import Capacity, Shape
from .._runtime._group import Gate
from .._runtime._run import Runtime
from ..errors import LeaseReleasedError
from ._protocol import CANCELLED, FAILED, Heard, logger, stalled
from ._rates import RateBook, Share

__all__ = ["SchedulerActor"]

# Passes of the actor's loop a send waits before answering, so grants decided at once
# (the deferred pass of a burst included) travel back on its answer instead of a poll.
_SEND_SETTLE_PASSES = 4
# Proxies dropped for silence whose requests are remembered, oldest forgotten first.
_EXPIRED_KEPT = 1024


class _Client:
    """What the actor knows of one proxy: its queue of events, waits and held leases."""

    def __init__(self, now: float) -> None:
        self.heard = Heard(now)
        self.events: list[tuple[Any, ...]] = []
        self.wake = asyncio.Event()
        self.waiting: dict[int, asyncio.Task[None]] = {}
        self.granted: dict[int, int] = {}  # request id -> lease id
        self.leases: set[int] = set()
        self.settling = 0
        self.polling = 0  # its polls held here: it waits on this actor, not silent

    def post(self, event: tuple[Any, ...]) -> None:
        self.events.append(event)
        # While a send settles its events go back on its answer: waking the poll too
        # would cost a second call for the same grant.
        if not self.settling:
            self.wake.set()

    def take(self) -> list[tuple[Any, ...]]:
        events, self.events = self.events, []
        self.wake.clear()
        return events


class _Held:
    __slots__ = ("cid", "client", "follower", "heard", "lease", "request")

    def __init__(self, lease: Any, cid: str, client: _Client, request: int, now: float) -> None:
        self.lease = lease
        self.cid = cid
        self.client = client
        self.request = request
        self.heard = Heard(now)  # its last heartbeat
        self.follower: asyncio.Task[None] | None = None


class _Member:
    """One sample of a group in the job's gate, for a proxy that cannot hold the gate's
    ``async with`` open across calls: a task holds it, the proxy's calls steer it."""

    __slots__ = ("arrived", "cid", "decided", "entered", "released", "task")

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.task: asyncio.Task[None] | None = None  # kept: the loop holds tasks weakly
        self.arrived = False
        self.entered = asyncio.Event()
        self.decided = asyncio.Event()  # set when it arrives, or leaves without
        self.released = asyncio.Event()


class SchedulerActor:
    """The body of the Ray actor: a :class:`tangram.Runtime` and the proxies' books.

    Created through :func:`tangram.ray.connect` (with a host book on top); its methods
    are the wire protocol, not an API.
    """

    def __init__(
        self,
        capacity: Mapping[str, object],
        policy: Policy | None,
        heartbeat: float,
        timeout: float,
        token: str,
        idle: float | None = None,
    ) -> None:
        self._runtime = Runtime(capacity, policy=policy)
        self._heartbeat = heartbeat
        self._timeout = timeout
        self._token = token
        self._idle = idle
        self._user = Heard(time.monotonic())  # when a proxy serving users was last here
        self._clients: dict[str, _Client] = {}
        self._held: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        self._expired: dict[str, tuple[list[int], list[int]]] = {}
        self._started: asyncio.Future[None] | None = None
        self._stop: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self.reclaimed = 0
        self.ignored = 0
        # Calls received from proxies and agents: what scale-out has to keep off the job's
        # one actor (benchmarks/ray_ceiling.py counts them per action).
        self.messages = 0
        self.heartbeats = 0  # of which polls: a proxy's per heartbeat or relay wait, not per action
        self.placements = 0  # where a sandbox or service block goes (one per block), homes
        self.lends = 0  # of which agents' asks for their shares of the job's API rates
        self._gates: dict[float, Gate] = {}
        self._members: dict[int, _Member] = {}
        # The job's API rates lent to its nodes' agents, and what this actor's own
        # callers used of each: (when measured, units taken by then, units a second).
        self._rates: dict[str, RateBook] = {}
        self._pool_use: dict[str, tuple[float, float, float]] = {}
        # The job's stats as the adapters' last per-sample read saw them (stats_step).
        self._stepped: Any = None
        self._stepping: asyncio.Lock | None = None

    async def _ready(self) -> Runtime:
        """Start the runtime on first use: the actor's loop exists only inside a method."""
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_future()
            self._stop = asyncio.Event()
            self._main = loop.create_task(self._serve_forever())
        await asyncio.shield(self._started)
        return self._runtime

    async def _serve_forever(self) -> None:
        assert self._started is not None and self._stop is not None
        try:
            async with self._runtime, anyio.create_task_group() as tg:
                tg.start_soon(self._watchdog)
                self._started.set_result(None)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            raise

    async def info(self) -> dict[str, Any]:
        runtime = await self._ready()
        return {
            "token": self._token,
            "capacity": runtime.capacity,
            "heartbeat": self._heartbeat,
            "timeout": self._timeout,
            "node_id": self._node_id(),
            "pid": os.getpid(),
        }

    async def close(self) -> None:
        """Stop the runtime: waiting actions fail with RuntimeClosedError."""
        await self._ready()
        assert self._stop is not None and self._main is not None
        self._stop.set()
        with contextlib.suppress(Exception):
            await self._main

    # -- the protocol ------------------------------------------------------------------

    def _client(self, cid: str) -> _Client:
        client = self._clients.get(cid)
        now = time.monotonic()
        if client is None:
            client = self._clients[cid] = _Client(now)
            gone = self._expired.pop(cid, None)
            if gone is not None:
                client.post(("expired", *gone))
        client.heard.hear(now)
        return client

    async def send(
        self,
        cid: str,
        submits: list[tuple[int, dict[str, object], str, str | None, float | None, float | None]],
        releases: list[tuple[int, int]],
        withdraws: list[int],
    ) -> list[tuple[Any, ...]]:
        """Apply a proxy's batch; answer with the events decided by the time it settles."""
        self.messages += 1
        await self._ready()
        client = self._client(cid)
        for lease_id, outcome in releases:
            self._release(lease_id, outcome)
        for request in withdraws:
            self._withdraw(client, request)
        loop = asyncio.get_running_loop()
        for request, demand, kind, trajectory, estimate, wait_timeout in submits:
            client.waiting[request] = loop.create_task(
                self._acquire(
                    cid, client, request, demand, kind, trajectory, estimate, wait_timeout
                )
            )
        if submits:
            client.settling += 1
            try:
                for _ in range(_SEND_SETTLE_PASSES):
                    await asyncio.sleep(0)
            finally:
                client.settling -= 1
        return client.take()

    async def poll(
        self,
        cid: str,
        leases: list[int],
        wait: float,
        relayed: Sequence[str] = (),
        node: str | None = None,
    ) -> list[tuple[Any, ...]]:
        """The heartbeat of ``leases``; answers with new events, or empty after ``wait``.

        ``relayed``: proxies a host agent heard from since its last poll, which hold
        nothing here and wait for nothing, so they beat to their node's agent instead
        (one message a node, not one a worker); they are alive as if they had polled. One
        dropped while alive (its beats late) comes back, as with its own next poll; one
        never seen, or gone by ``disconnect``, is not made up. ``node``: the Ray node the
        proxy runs on, where it knows it.
        """
        self.messages += 1
        self.heartbeats += 1
        await self._ready()
        client = self._client(cid)
        now = client.heard.at
        if node is not None:
            self._locate(cid, node)
        for other in relayed:
            known = self._clients.get(other)
            if known is not None:
                known.heard.hear(now)
            elif other in self._expired:
                self._client(other)
                self._returned(other, cid)
        for lease_id in leases:
            held = self._held.get(lease_id)
            if held is not None and held.cid == cid:
                held.heard.hear(now)
            else:  # reclaimed while this proxy was silent (and maybe forgotten with it)
                client.post(("reclaimed", lease_id))
        # While held here, and until it is answered, the proxy waits on this actor: the
        # passes a poll takes to land, wait and answer (a busy loop's, each with a block
        # of work in it; Ray hands each call over from another thread) are not its
        # silence. A dead proxy's last poll holds its units at most one wait longer.
        client.polling += 1
        try:
            if not client.events:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.wake.wait(), wait)
        finally:
            client.polling -= 1
        answered = time.monotonic()
        client.heard.hear(answered)
        for lease_id in leases:
            held = self._held.get(lease_id)
            if held is not None and held.cid == cid:
                held.heard.hear(answered)
        return client.take()

    async def disconnect(self, cid: str, releases: list[tuple[int, int]]) -> None:
        """A proxy left: its last releases, then whatever it still holds or waits for."""
        self.messages += 1
        await self._ready()
        for lease_id, outcome in releases:
            self._release(lease_id, outcome)
        self._drop_client(cid)

    async def _acquire(
        self,
        cid: str,
        client: _Client,
        request: int,
        demand: dict[str, object],
        kind: str,
        trajectory: str | None,
        estimate: float | None,
        wait_timeout: float | None,
    ) -> None:
        try:
            self._check(demand)
            context = self._runtime.acquire(
                demand,
                kind=kind,
                trajectory=trajectory,
                estimate=estimate,
                wait_timeout=wait_timeout,
            )
            lease = await context.__aenter__()
        except Exception as exc:
            client.post(("error", request, exc))
            return
        finally:
            client.waiting.pop(request, None)
        lease_id = next(self._ids)
        held = _Held(lease, cid, client, request, time.monotonic())
        self._held[lease_id] = held
        client.leases.add(lease_id)
        client.granted[request] = lease_id
        client.post(("grant", request, lease_id, dict(lease.grant), lease.units))
        elastic = lease.action.demand.elastic
        if elastic is not None and elastic.resizable:
            held.follower = asyncio.get_running_loop().create_task(self._follow(lease_id, held))

    def _check(self, demand: dict[str, object]) -> None:
        """Refuse, by raising, a demand this actor must not decide (none here)."""

    async def _follow(self, lease_id: int, held: _Held) -> None:
        # Cancelled at the release; a lease ended another way (the runtime closing, a
        # capacity cut) ends the wait with LeaseReleasedError, and the follow with it.
        with contextlib.suppress(LeaseReleasedError):
            while True:
                units = await held.lease.wait_resized()
                held.client.post(("resize", lease_id, dict(held.lease.grant), units))

    def _release(self, lease_id: int, outcome: int) -> bool:
        held = self._held.pop(lease_id, None)
        if held is None:
            self.ignored += 1  # reclaimed before this late release (or released twice)
            return False
        held.client.leases.discard(lease_id)
        held.client.granted.pop(held.request, None)
        if held.follower is not None:
            held.follower.cancel()
        exc_type: type[BaseException] | None = None
        if outcome == FAILED:
            exc_type = Exception
        elif outcome == CANCELLED:
            exc_type = asyncio.CancelledError
        self._runtime._release(held.lease, exc_type)
        return True

    def _withdraw(self, client: _Client, request: int) -> None:
        task = client.waiting.pop(request, None)
        if task is not None:
            task.cancel()
            return
        lease_id = client.granted.get(request)
        if lease_id is not None:
            self._release(lease_id, CANCELLED)

    # -- groups: the group reward's gate, shared by the job ---------------------------

    async def group_enter(self, cid: str, key: str, wait: float) -> int:
        """A sample of group ``key`` enters the job's gate (:mod:`tangram._runtime._group`);
        answers its member id once it counts there."""
        self.messages += 1
        await self._ready()
        self._client(cid)
        gate = self._gates.get(wait)
        if gate is None:
            gate = self._gates[wait] = Gate(wait)
        member_id = next(self._ids)
        member = self._members[member_id] = _Member(cid)
        member.task = asyncio.get_running_loop().create_task(
            self._hold(gate, key, member_id, member)
        )
        await member.entered.wait()
        return member_id

    async def _hold(self, gate: Gate, key: str, member_id: int, member: _Member) -> None:
        try:
            async with gate.sample(key) as arrive:
                member.entered.set()
                await member.decided.wait()
                if member.arrived:
                    await arrive()
        finally:
            member.released.set()
            self._members.pop(member_id, None)

    async def group_arrive(self, cid: str, member_id: int) -> None:
        """The sample is about to ask for its grant: answers when its group goes."""
        self.messages += 1
        self._client(cid)
        member = self._members.get(member_id)
        if member is None:
            return  # its proxy was dropped meanwhile: nothing holds it
        member.arrived = True
        member.decided.set()
        await member.released.wait()

    async def group_leave(self, cid: str, member_id: int) -> None:
        """The sample ended without arriving: its group no longer waits for it."""
        self.messages += 1
        member = self._members.get(member_id)
        if member is not None:
            member.decided.set()

    # -- API rates lent to nodes (see ._rates) ------------------------------------------

    async def lend_rates(
        self, cid: str, asks: dict[str, tuple[float, float, float, Share]]
    ) -> dict[str, tuple[float, float, float, float]]:
        """A node's agent asks for its shares of the job's API rates: ``{kind: (units a
        second used, units waiting, largest waiting call, share it runs on)}``, answered
        with ``{kind: (rate, burst, the job's rate, the job's burst)}``: the share, and
        the capacity it is a share of, which may have changed since the agent started."""
        self.messages += 1
        self.lends += 1
        runtime = await self._ready()
        now = time.monotonic()
        shares: dict[str, tuple[float, float, float, float]] = {}
        for kind, (used, waiting, largest, applied) in asks.items():
            book = self._rate_book(kind, runtime)
            if book is None:  # not a rate of this job (any more): nothing to lend
                shares[kind] = (0.0, 0.0, *applied)
                continue
            rate, burst = book.ask(
                cid,
                float(used),
                float(waiting),
                float(largest),
                (float(applied[0]), float(applied[1])),
                now,
            )
            shares[kind] = (rate, burst, book.rate, book.burst)
            self._lend_pool(kind, book, runtime, now)
        return shares

    def _rate_book(self, kind: str, runtime: Runtime) -> RateBook | None:
        resource = runtime.capacity.get(kind)
        if resource is None or resource.shape is not Shape.RATE:
            return None
        book = self._rates.get(kind)
        if book is None:
            book = self._rates[kind] = RateBook(resource.total, resource.burst, self._heartbeat)
        book.rate, book.burst = resource.total, resource.burst
        return book

    def _lend_pool(self, kind: str, book: RateBook, runtime: Runtime, now: float) -> None:
        """This actor's own share of ``kind``: what no node is lent, applied at once."""
        spent, wanted, _ = runtime._rate_use(kind)
        at, before, used = self._pool_use.get(kind, (now, spent, 0.0))
        if now - at >= self._heartbeat:  # its use, measured over a heartbeat at least
            used = (spent - before) / (now - at)
            at, before = now, spent
        self._pool_use[kind] = (at, before, used)
        rate, burst = book.pool(used, wanted, min(wanted, book.burst))
        runtime._limit_rate(kind, rate, burst)

    def _unlend(self, gone: Callable[[RateBook], list[str]]) -> None:
        """Take back the shares of the nodes ``gone`` names in each book, and measure
        this actor's own use afresh.

        The watchdog calls this every half heartbeat, so the use the actor keeps for its
        own callers is never older than a heartbeat and a half. Measured only at the
        nodes' asks, it spanned all the time since the last one: after a quiet spell, a
        node's first asks met a reserve sized by calls that had long stopped."""
        for kind, book in self._rates.items():
            for name in gone(book):
                book.drop(name)
            self._lend_pool(kind, book, self._runtime, time.monotonic())

    def _drop_client(self, cid: str, *, expired: bool = False) -> bool:
        """Forget a proxy: what it waits for is withdrawn, what it holds released.

        :returns: whether ``cid`` was a known proxy (a second drop finds nothing).
        """
        for member in self._members.values():
            if member.cid == cid:
                member.decided.set()  # a dead worker's samples are waited for no more
        self._unlend(lambda book: [cid] if cid in book else [])
        client = self._clients.pop(cid, None)
        if client is None:
            return False
        # Granted requests too: a grant posted while the proxy was silent never reached
        # it, and its acquire would wait forever for a lease released here. One it did
        # receive is no longer pending there, so naming it again changes nothing.
        requests = [*client.waiting, *client.granted]
        for task in client.waiting.values():
            task.cancel()
        client.waiting.clear()
        leases = list(client.leases)
        for lease_id in leases:
            self._release(lease_id, CANCELLED)
        if expired:
            # Remembered in case the proxy was only stalled: its next call learns which
            # of its requests and leases are gone, instead of waiting forever on them.
            if len(self._expired) >= _EXPIRED_KEPT:
                self._expired.pop(next(iter(self._expired)))
            self._expired[cid] = (requests, leases)
        return True

    async def _watchdog(self) -> None:
        tick = self._heartbeat / 2
        while True:
            since = time.monotonic()
            await anyio.sleep(tick)
            # A proxy's silence while this actor stalled is not the proxy's (a node's
            # agent dropped for it took its node's cores): see Heard for what is forgiven.
            late = stalled(since, tick)
            now = time.monotonic()
            if late > 0:
                self._user.stalled(late, now)
                for client in self._clients.values():
                    client.heard.stalled(late, now)
                for held in self._held.values():
                    held.heard.stalled(late, now)
            for lease_id, held in list(self._held.items()):
                if held.client.polling:  # its poll is held here: see ``poll``
                    continue
                if held.heard.silence(now, self._timeout) > self._timeout and self._release(
                    lease_id, CANCELLED
                ):
                    self.reclaimed += 1
                    held.client.post(("reclaimed", lease_id))
                    logger.warning(
                        "reclaimed lease %d of %s: no heartbeat for %.1f s",
                        lease_id,
                        held.cid,
                        now - held.heard.at,
                    )
            for cid, client in list(self._clients.items()):
                if not client.polling and client.heard.silence(now, self._timeout) > self._timeout:
                    self._drop_client(cid, expired=True)
            self._unlend(functools.partial(RateBook.silent, now=now, timeout=self._timeout))
            if set(self._clients) - self._own_clients():
                self._user.hear(now)
            elif self._idle is not None and self._user.silence(now, self._idle) > self._idle:
                logger.info("no client for %.1f s: the scheduler actor ends", now - self._user.at)
                try:
                    ended = await self._retire()
                except Exception:  # an actor left running after its job is the worse failure
                    logger.exception("the scheduler actor failed to retire; it ends anyway")
                    self._end()
                    return
                if ended:
                    return
                self._user.hear(now)

    def _returned(self, cid: str, relayed_by: str) -> None:
        """Proxy ``cid``, dropped while alive, came back in ``relayed_by``'s poll."""

    def _locate(self, cid: str, node: str) -> None:
        """Proxy ``cid`` runs on Ray node ``node`` (said in each of its polls)."""

    def _own_clients(self) -> set[str]:
        """Proxies that serve the scheduler (host agents'), not users: they keep no one alive."""
        return set()

    async def _retire(self) -> bool:
        """End this actor: what it started goes first (see :mod:`._cluster`).

        :returns: whether it ended; the node's scheduler declines while a worker is
            connecting (:mod:`._node`).
        """
        self._end()
        return True

    def _end(self) -> None:
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _node_id(self) -> str:
        """The node this actor runs on, as Ray names it."""
        import ray

        node: str = ray.get_runtime_context().get_node_id()
        return node

    # -- introspection and capacity ------------------------------------------------------

    async def stats(self) -> Any:
        return (await self._ready()).stats()

    async def stats_step(self) -> tuple[Any, Any]:
        """The job's stats now, and as the previous call (by any worker) saw them.

        The adapters' per-sample figures are the change between the two: read with one
        baseline for the whole job, the samples of every worker add up to what the job
        did, where a baseline per process counted each action once per worker. One call
        at a time, so that the spans the calls report never overlap.
        """
        self._stepping = self._stepping or asyncio.Lock()
        async with self._stepping:
            now = await self.stats()
            last, self._stepped = self._stepped, now
        return last, now

    async def counters(self) -> dict[str, float]:
        await self._ready()
        return {
            "clients": len(self._clients),
            "leases": len(self._held),
            "reclaimed": self.reclaimed,
            "ignored_releases": self.ignored,
            "messages": self.messages,
            "heartbeats": self.heartbeats,
            "placements": self.placements,
            "lends": self.lends,
            # The actor's whole process: its event loop, Ray's threads and serialisation.
            "cpu_seconds": time.process_time(),
        }

    async def set_capacity(self, updates: dict[str, object]) -> Capacity:
        runtime = await self._ready()
        runtime.set_capacity(updates)
        now = time.monotonic()
        for kind in list(self._rates):
            book = self._rate_book(kind, runtime)  # a changed rate: the nodes' next asks
            if book is None:
                del self._rates[kind]
            else:
                self._lend_pool(kind, book, runtime, now)
        return runtime.capacity
