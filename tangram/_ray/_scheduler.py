"""One scheduler for many processes: a Runtime inside a named Ray actor, and its proxy.

A scheduler per rollout process only limits per process: eight processes each allowed
eight cores use sixty-four. Here the one :class:`tangram.Runtime` lives in an async Ray
actor and every process talks to it through a :class:`RemoteRuntime`, which has the
runtime's ``acquire``/``run`` and becomes what ``tangram.acquire`` reaches.

Messages are batched both ways, because one actor call costs a millisecond or more while
a decision costs microseconds. A proxy keeps at most one *send* in flight: acquires,
releases and withdrawals made while it travels go in the next one, so a burst of a loop
iteration is one call. Grants come back on the send's answer when the scheduler decided
at once, otherwise on a *poll* that the proxy keeps waiting at the actor; a poll answers
with every grant made since the last.

The poll doubles as the heartbeat: it names the leases the proxy holds, and the actor
reclaims a lease whose heartbeat is older than the timeout (a dead process, a lost node).
A release of a reclaimed lease, arriving late, finds nothing and changes nothing.

Only asyncio: awaiting a Ray call needs an asyncio loop (trio code would pay a thread per
call).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._core._action import Action
from .._core._policy import Policy
from .._core._resources import Capacity
from .._runtime._lease import LeaseBase
from .._runtime._run import RunMixin, Runtime, _enter_current, _exit_current
from ..errors import InvalidCapacityError, RuntimeClosedError, SchedulerUnavailableError

__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TIMEOUT",
    "RemoteAcquireContext",
    "RemoteLease",
    "RemoteRuntime",
    "SchedulerUnavailableError",
    "attach",
    "connect",
]

logger = logging.getLogger("tangram.ray")
T = TypeVar("T")

DEFAULT_HEARTBEAT = 1.0
"""Seconds between a proxy's heartbeats (its polls return at least this often)."""
DEFAULT_TIMEOUT = 10.0
"""Seconds without a heartbeat after which the actor reclaims a lease."""
LOOKUP_SECONDS = 30.0
"""How long ``connect`` without a capacity waits for the actor to be created."""

_COMPLETED, _FAILED, _CANCELLED = 0, 1, 2
# Passes of the actor's loop a send waits before answering, so grants decided at once
# (the deferred pass of a burst included) travel back on its answer instead of a poll.
_SEND_SETTLE_PASSES = 4
# Proxies dropped for silence whose requests are remembered, oldest forgotten first.
_EXPIRED_KEPT = 1024


# -- the actor ------------------------------------------------------------------------


class _Client:
    """What the actor knows of one proxy: its queue of events, waits and held leases."""

    def __init__(self, now: float) -> None:
        self.seen = now
        self.events: list[tuple[Any, ...]] = []
        self.wake = asyncio.Event()
        self.waiting: dict[int, asyncio.Task[None]] = {}
        self.granted: dict[int, int] = {}  # request id -> lease id
        self.leases: set[int] = set()
        self.settling = 0

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
    __slots__ = ("beat", "cid", "client", "follower", "lease", "request")

    def __init__(self, lease: Any, cid: str, client: _Client, request: int, now: float) -> None:
        self.lease = lease
        self.cid = cid
        self.client = client
        self.request = request
        self.beat = now
        self.follower: asyncio.Task[None] | None = None


class _Host:
    __slots__ = (
        "agent",
        "calls",
        "cid",
        "gpu_resource",
        "gpus",
        "name",
        "placed",
        "resident",
        "resource",
        "seen_seq",
        "services",
        "units",
    )

    def __init__(
        self,
        name: str,
        resource: str,
        units: int,
        agent: Any,
        cid: str,
        gpu: Mapping[str, Any] | None,
    ) -> None:
        self.name = name
        self.resource = resource
        self.units = units
        self.agent = agent
        self.cid = cid
        self.placed = 0
        self.gpu_resource: str | None = None if gpu is None else gpu["resource"]
        self.gpus: int = 0 if gpu is None else gpu["units"]
        self.services: frozenset[str] = frozenset(() if gpu is None else gpu["services"])
        self.resident: frozenset[str] = frozenset(() if gpu is None else gpu["resident"])
        self.seen_seq = 0  # the agent's residency report this copy is from
        self.calls = 0  # open ``remote.service`` blocks placed here


class SchedulerActor:
    """The body of the Ray actor: a :class:`tangram.Runtime` and the proxies' books.

    Created through :func:`connect`; its methods are the wire protocol, not an API.
    """

    def __init__(
        self,
        capacity: Mapping[str, object],
        policy: Policy | None,
        heartbeat: float,
        timeout: float,
        token: str,
    ) -> None:
        self._runtime = Runtime(capacity, policy=policy)
        self._heartbeat = heartbeat
        self._timeout = timeout
        self._token = token
        self._clients: dict[str, _Client] = {}
        self._held: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        self._hosts: dict[str, _Host] = {}
        self._placements: dict[str, str] = {}
        self._tickets = itertools.count(1)
        self._service_calls: dict[int, tuple[str, str]] = {}  # ticket -> (host, cid)
        self._expired: dict[str, tuple[list[int], list[int]]] = {}
        self._started: asyncio.Future[None] | None = None
        self._stop: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self.reclaimed = 0
        self.ignored = 0

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
        context = ray.get_runtime_context()
        return {
            "token": self._token,
            "capacity": runtime.capacity,
            "heartbeat": self._heartbeat,
            "timeout": self._timeout,
            "node_id": context.get_node_id(),
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
        client.seen = now
        return client

    async def send(
        self,
        cid: str,
        submits: list[tuple[int, dict[str, object], str, str | None, float | None, float | None]],
        releases: list[tuple[int, int]],
        withdraws: list[int],
    ) -> list[tuple[Any, ...]]:
        """Apply a proxy's batch; answer with the events decided by the time it settles."""
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

    async def poll(self, cid: str, leases: list[int], wait: float) -> list[tuple[Any, ...]]:
        """The heartbeat of ``leases``; answers with new events, or empty after ``wait``."""
        await self._ready()
        client = self._client(cid)
        now = client.seen
        for lease_id in leases:
            held = self._held.get(lease_id)
            if held is not None and held.cid == cid:
                held.beat = now
            else:  # reclaimed while this proxy was silent (and maybe forgotten with it)
                client.post(("reclaimed", lease_id))
        if not client.events:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.wake.wait(), wait)
        return client.take()

    async def disconnect(self, cid: str, releases: list[tuple[int, int]]) -> None:
        """A proxy left: its last releases, then whatever it still holds or waits for."""
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

    async def _follow(self, lease_id: int, held: _Held) -> None:
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
        if outcome == _FAILED:
            exc_type = Exception
        elif outcome == _CANCELLED:
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
            self._release(lease_id, _CANCELLED)

    def _drop_client(self, cid: str, *, expired: bool = False) -> None:
        client = self._clients.pop(cid, None)
        if client is None:
            return
        # Granted requests too: a grant posted while the proxy was silent never reached
        # it, and its acquire would wait forever for a lease released here. One it did
        # receive is no longer pending there, so naming it again changes nothing.
        requests = [*client.waiting, *client.granted]
        for task in client.waiting.values():
            task.cancel()
        client.waiting.clear()
        leases = list(client.leases)
        for lease_id in leases:
            self._release(lease_id, _CANCELLED)
        if expired:
            # Remembered in case the proxy was only stalled: its next call learns which
            # of its requests and leases are gone, instead of waiting forever on them.
            if len(self._expired) >= _EXPIRED_KEPT:
                self._expired.pop(next(iter(self._expired)))
            self._expired[cid] = (requests, leases)
        for ticket, (_, owner) in list(self._service_calls.items()):
            if owner == cid:
                self._end_service_call(ticket)
        for host in [h for h in self._hosts.values() if h.cid == cid]:
            logger.warning("host agent %r stopped answering; its capacity is now 0", host.name)
            del self._hosts[host.name]
            gone: dict[str, object] = {host.resource: 0}
            if host.gpu_resource is not None:
                gone[host.gpu_resource] = 0
            self._runtime.set_capacity(gone)

    async def _watchdog(self) -> None:
        while True:
            await anyio.sleep(self._heartbeat / 2)
            now = time.monotonic()
            for lease_id, held in list(self._held.items()):
                if now - held.beat > self._timeout and self._release(lease_id, _CANCELLED):
                    self.reclaimed += 1
                    held.client.post(("reclaimed", lease_id))
                    logger.warning(
                        "reclaimed lease %d of %s: no heartbeat for %.1f s",
                        lease_id,
                        held.cid,
                        now - held.beat,
                    )
            for cid, client in list(self._clients.items()):
                if now - client.seen > self._timeout:
                    self._drop_client(cid, expired=True)

    # -- introspection and capacity ------------------------------------------------------

    async def stats(self) -> Any:
        return (await self._ready()).stats()

    async def counters(self) -> dict[str, int]:
        await self._ready()
        return {
            "clients": len(self._clients),
            "leases": len(self._held),
            "reclaimed": self.reclaimed,
            "ignored_releases": self.ignored,
        }

    async def set_capacity(self, updates: dict[str, object]) -> Capacity:
        runtime = await self._ready()
        runtime.set_capacity(updates)
        return runtime.capacity

    # -- hosts -----------------------------------------------------------------------

    async def add_host(
        self,
        name: str,
        resource: str,
        units: int,
        agent: Any,
        cid: str,
        gpu: Mapping[str, Any] | None = None,
    ) -> None:
        runtime = await self._ready()
        host = _Host(name, resource, units, agent, cid, gpu)
        self._hosts[name] = host
        updates: dict[str, object] = {resource: units}
        if host.gpu_resource is not None:
            updates[host.gpu_resource] = host.gpus
        runtime.set_capacity(updates)

    async def hosts(self) -> dict[str, dict[str, Any]]:
        await self._ready()
        return {
            h.name: {
                "resource": h.resource,
                "units": h.units,
                "placed": h.placed,
                "gpu_resource": h.gpu_resource,
                "gpus": h.gpus,
                "services": sorted(h.services),
                "resident": sorted(h.resident),
                "calls": h.calls,
            }
            for h in self._hosts.values()
        }

    async def place(self, trajectory: str) -> tuple[str, Any]:
        """The host for ``trajectory``'s sandbox: where it already is, else the least loaded.

        Load is sandboxes placed per core; a trajectory's actions then all run on the
        host that keeps its files.
        """
        await self._ready()
        name = self._placements.get(trajectory)
        host = self._hosts.get(name) if name is not None else None
        if host is None:
            if not self._hosts:
                raise SchedulerUnavailableError("no host agent is registered with the scheduler")
            host = min(self._hosts.values(), key=lambda h: (h.placed / max(h.units, 1), h.name))
            host.placed += 1
            self._placements[trajectory] = host.name
        return host.name, host.agent

    async def unplace(self, trajectory: str) -> None:
        await self._ready()
        name = self._placements.pop(trajectory, None)
        host = self._hosts.get(name) if name is not None else None
        if host is not None:
            host.placed -= 1

    async def place_service(self, cid: str, service: str) -> tuple[int, str, Any]:
        """The host for one ``remote.service(service)`` block, and its ticket.

        Mirrors the pool's own rule one level up: a host where the service is resident
        (no restore) wins while it has fewer open blocks than devices; once every such
        host is that busy, the least busy host that serves it, so calls spread over the
        cluster's devices instead of queueing on one.
        """
        await self._ready()
        serving = [h for h in self._hosts.values() if service in h.services and h.gpus > 0]
        if not serving:
            offered = sorted({s for h in self._hosts.values() for s in h.services})
            raise LookupError(
                f"no host agent serves {service!r} (served: {offered}): start one with "
                "tangram.ray.start_agent(..., services=[...])"
            )

        def key(h: _Host) -> tuple[bool, bool, float, str]:
            load = h.calls / h.gpus
            return (load >= 1, service not in h.resident, load, h.name)

        host = min(serving, key=key)
        host.calls += 1
        ticket = next(self._tickets)
        self._service_calls[ticket] = (host.name, cid)
        return ticket, host.name, host.agent

    async def unplace_service(self, ticket: int, seq: int, resident: list[str]) -> None:
        """A service block ended; ``resident`` is its agent's residency as of report ``seq``."""
        await self._ready()
        name = self._end_service_call(ticket)
        host = self._hosts.get(name) if name is not None else None
        # Reports travel through workers, and calls to an async actor may overtake each
        # other: only a newer report than the one applied replaces it.
        if host is not None and seq > host.seen_seq:
            host.seen_seq = seq
            host.resident = frozenset(resident)

    def _end_service_call(self, ticket: int) -> str | None:
        entry = self._service_calls.pop(ticket, None)
        if entry is None:
            return None
        host = self._hosts.get(entry[0])
        if host is not None:
            host.calls -= 1
        return entry[0]


# -- the proxy ------------------------------------------------------------------------


class RemoteLease(LeaseBase):
    """What ``async with remote.acquire(...) as lease:`` gives the body in a worker.

    The same reading surface as :class:`tangram.Lease`: ``grant``, ``units``,
    ``wait_resized()`` and the loop-clock times, taken in this process.
    ``reclaimed`` says the actor took the units back because heartbeats stopped
    arriving (this process stalled longer than the timeout); the block may still finish,
    but its units may already serve someone else.
    """

    __slots__ = ("_action", "_grant", "_units", "lease_id", "reclaimed")

    def __init__(
        self,
        action: Action,
        lease_id: int,
        grant: Mapping[str, float],
        units: int | None,
        queued_at: float,
        now: float,
    ) -> None:
        self._action = action
        self.lease_id = lease_id
        self._grant = dict(grant)
        self._units = units
        self._resized: anyio.Event | None = None
        self._seen = 0
        self.resizes = 0
        self.reclaimed = False
        self.queued_at = queued_at
        self.admitted_at = now
        self.started_at = now
        self.finished_at = math.nan

    def __repr__(self) -> str:
        return (
            f"<tangram.ray.RemoteLease #{self.lease_id} kind={self._action.kind!r} "
            f"grant={self._grant!r}>"
        )

    @property
    def action(self) -> Action:
        return self._action

    @property
    def grant(self) -> Mapping[str, float]:
        return MappingProxyType(self._grant)

    @property
    def units(self) -> int | None:
        return self._units

    @property
    def active(self) -> bool:
        return math.isnan(self.finished_at) and not self.reclaimed

    async def wait_resized(self) -> int:
        """Wait until the scheduler changes this action's elastic units (see Lease)."""
        await self._next_resize()
        return self._units if self._units is not None else 0

    def _resize(self, grant: Mapping[str, float], units: int | None) -> None:
        self._grant = dict(grant)
        self._units = units
        self.resizes += 1
        event, self._resized = self._resized, None
        if event is not None:
            event.set()


class _Pending:
    __slots__ = ("action", "done", "error", "lease", "queued_at")

    def __init__(self, action: Action, queued_at: float) -> None:
        self.action = action
        self.queued_at = queued_at
        self.done = anyio.Event()
        self.lease: RemoteLease | None = None
        self.error: BaseException | None = None


class RemoteAcquireContext:
    """The async context manager ``RemoteRuntime.acquire`` returns; enter it once."""

    __slots__ = ("_action", "_lease", "_remote", "_request")

    def __init__(self, remote: RemoteRuntime, action: Action, request: tuple[Any, ...]) -> None:
        self._remote = remote
        self._action = action
        self._request = request
        self._lease: RemoteLease | None = None

    @property
    def action(self) -> Action:
        return self._action

    async def __aenter__(self) -> RemoteLease:
        if self._lease is not None:
            raise RuntimeError("an acquire context can be entered only once")
        self._lease = await self._remote._enter(self._action, self._request)
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._lease is not None
        if exc_type is None:
            outcome = _COMPLETED
        elif issubclass(exc_type, Exception) and not issubclass(exc_type, asyncio.CancelledError):
            outcome = _FAILED
        else:
            outcome = _CANCELLED
        self._remote._release(self._lease, outcome)


class RemoteRuntime(RunMixin):
    """A worker's handle on the shared scheduler: ``acquire`` and ``run`` as on a Runtime.

    Got from ``async with tangram.ray.connect(...) as remote:``, which also makes it what
    ``tangram.acquire`` reaches. Demands are checked here, against the capacity the actor
    reported, so bad input fails at the call with the same typed error as a local
    runtime; the actor checks again (its capacity may have changed since).
    """

    def __init__(self, actor: Any, *, heartbeat: float, capacity: Capacity) -> None:
        self._actor = actor
        self._heartbeat = heartbeat
        self._shadow = Runtime(capacity)
        self._id = uuid.uuid4().hex
        self._requests = itertools.count(1)
        self._submits: dict[int, tuple[Any, ...]] = {}
        self._releases: list[tuple[int, int]] = []
        self._sending: Any = None  # the flusher's call in flight (a Ray ObjectRef)
        self._withdraws: list[int] = []
        self._pending: dict[int, _Pending] = {}
        self._leases: dict[int, RemoteLease] = {}
        self._dirty = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._open = False
        self._error: BaseException | None = None
        self.calls = 0

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"<tangram.ray.RemoteRuntime {state} client={self._id[:8]}>"

    @property
    def actor(self) -> Any:
        """The Ray actor handle of the scheduler."""
        return self._actor

    @property
    def capacity(self) -> Capacity:
        """The capacity as of the last refresh (connect, or ``set_capacity`` from here)."""
        return self._shadow.capacity

    # -- lifecycle ----------------------------------------------------------------------

    async def _start(self) -> None:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._open = True
        task_group.start_soon(self._flusher)
        task_group.start_soon(self._poller)

    async def _stop(self) -> None:
        self._open = False
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        error = RuntimeClosedError("the remote runtime closed while this action was waiting")
        for pending in self._pending.values():
            pending.error = error
            pending.done.set()
        self._pending.clear()
        if self._error is None:
            releases, self._releases = self._releases, []
            with anyio.CancelScope(shield=True), contextlib.suppress(ray.exceptions.RayError):
                if self._sending is not None:
                    # An async actor does not run one caller's calls in order: the last
                    # releases must land before the disconnect, or it would record them
                    # as cancelled and ignore them when they come.
                    await self._sending
                await self._actor.disconnect.remote(self._id, releases)

    # -- acquiring -------------------------------------------------------------------

    def acquire(
        self,
        demand: Mapping[str, object] | None = None,
        /,
        *,
        kind: str = "action",
        trajectory: str | None = None,
        estimate: float | None = None,
        wait_timeout: float | None = None,
        **amounts: object,
    ) -> RemoteAcquireContext:
        """Ask the shared scheduler for ``demand``: see :meth:`tangram.Runtime.acquire`.

        :raises InvalidDemandError: (and its subclasses) at the call, as locally.
        """
        local = self._shadow.acquire(
            demand,
            kind=kind,
            trajectory=trajectory,
            estimate=estimate,
            wait_timeout=wait_timeout,
            **amounts,
        )
        sent = dict(demand) if demand is not None else dict(amounts)
        return RemoteAcquireContext(
            self, local.action, (sent, kind, trajectory, estimate, wait_timeout)
        )

    async def _enter(self, action: Action, request: tuple[Any, ...]) -> RemoteLease:
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._error is not None:
            raise SchedulerUnavailableError(
                f"the scheduler actor is unreachable: {self._error}"
            ) from self._error
        if not self._open:
            raise RuntimeClosedError("the remote runtime is not open")
        request_id = next(self._requests)
        pending = _Pending(action, anyio.current_time())
        self._pending[request_id] = pending
        self._submits[request_id] = (request_id, *request)
        self._dirty.set()
        try:
            await pending.done.wait()
        except BaseException:
            self._pending.pop(request_id, None)
            if pending.lease is not None:
                self._release(pending.lease, _CANCELLED)
            elif self._submits.pop(request_id, None) is None:
                self._withdraws.append(request_id)
                self._dirty.set()
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.lease is not None
        return pending.lease

    def _release(self, lease: RemoteLease, outcome: int) -> None:
        if not math.isnan(lease.finished_at):
            return
        lease.finished_at = anyio.current_time()
        self._leases.pop(lease.lease_id, None)
        # Sent even for a lease the actor reclaimed: it finds nothing and changes nothing.
        if self._error is None:
            self._releases.append((lease.lease_id, outcome))
            self._dirty.set()

    # -- the two loops --------------------------------------------------------------------

    async def _flusher(self) -> None:
        """Send what accumulated, one call at a time: a call in flight batches the next."""
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            # Let every task made ready in this loop iteration add to the batch first.
            await anyio.lowlevel.checkpoint()
            submits = list(self._submits.values())
            releases, withdraws = self._releases, self._withdraws
            self._submits, self._releases, self._withdraws = {}, [], []
            self.calls += 1
            self._sending = self._actor.send.remote(self._id, submits, releases, withdraws)
            try:
                events = await self._sending
            except ray.exceptions.RayError as exc:
                self._sending = None
                self._fail(exc)
                return
            self._sending = None
            self._dispatch(events)

    async def _poller(self) -> None:
        """Wait for grants at the actor; every call is also the heartbeat of our leases."""
        while True:
            self.calls += 1
            try:
                events = await self._actor.poll.remote(
                    self._id, list(self._leases), self._heartbeat
                )
            except ray.exceptions.RayError as exc:
                self._fail(exc)
                return
            self._dispatch(events)

    def _fail(self, exc: BaseException) -> None:
        logger.error("lost the scheduler actor: %s", exc)
        self._error = exc
        for pending in self._pending.values():
            pending.error = SchedulerUnavailableError(f"the scheduler actor is unreachable: {exc}")
            pending.error.__cause__ = exc
            pending.done.set()
        self._pending.clear()

    def _dispatch(self, events: list[tuple[Any, ...]]) -> None:
        now = anyio.current_time()
        for event in events:
            tag = event[0]
            if tag == "grant":
                _, request, lease_id, grant, units = event
                pending = self._pending.pop(request, None)
                if pending is None:
                    continue  # withdrawn: the actor releases it when the withdrawal lands
                lease = RemoteLease(pending.action, lease_id, grant, units, pending.queued_at, now)
                self._leases[lease_id] = lease
                pending.lease = lease
                pending.done.set()
            elif tag == "error":
                _, request, error = event
                pending = self._pending.pop(request, None)
                if pending is not None:
                    pending.error = error
                    pending.done.set()
            elif tag == "resize":
                _, lease_id, grant, units = event
                held = self._leases.get(lease_id)
                if held is not None:
                    held._resize(grant, units)
            elif tag == "reclaimed":
                self._reclaimed(event[1])
            elif tag == "expired":
                _, requests, leases = event
                error = SchedulerUnavailableError(
                    "this process sent no heartbeat for longer than the lease timeout; "
                    "the scheduler dropped its waiting request"
                )
                for request in requests:
                    pending = self._pending.pop(request, None)
                    if pending is not None:
                        pending.error = error
                        pending.done.set()
                for lease_id in leases:
                    self._reclaimed(lease_id)

    def _reclaimed(self, lease_id: int) -> None:
        held = self._leases.pop(lease_id, None)
        if held is not None:
            held.reclaimed = True
            logger.warning("the scheduler reclaimed lease %d (heartbeats late)", lease_id)

    # -- sandboxes on host agents ----------------------------------------------------

    def sandbox(self, trajectory_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """A sandbox for ``trajectory_id`` on the host the scheduler places it on.

        ``async with remote.sandbox("traj-7") as sbx: await sbx.run("pytest -q", cpu=2)``:
        the sandbox lives on one host agent (see :func:`tangram.ray.start_agent`) for the
        block's whole life, so every action of the trajectory runs where its files are.
        """
        from ._agent import open_sandbox

        if not isinstance(trajectory_id, str):
            raise TypeError(f"`trajectory_id` must be a string (got {trajectory_id!r})")
        return open_sandbox(self, trajectory_id)

    def service(self, name: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """A GPU model service on the host the scheduler picks, like ``GpuPool.use``.

        ``async with remote.service("judge") as svc: scores = await svc(batch)``: the
        block runs on one host agent that serves ``name`` (see
        :func:`tangram.ray.start_agent`), preferably one where it is resident; each call
        is one action on that agent's :class:`tangram.gpu.GpuPool`.

        :raises TypeError: ``name`` is not a non-empty string (at the call).
        :raises LookupError: no live host agent serves ``name`` (entering the block).
        """
        from ._agent import open_service

        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty string (got {name!r})")
        return open_service(self, name)

    # -- remote introspection ---------------------------------------------------------

    async def _refresh(self) -> None:
        """Fetch the actor's capacity again (a host agent added its cores)."""
        info = await self._actor.info.remote()
        self._shadow = Runtime(info["capacity"])

    async def stats(self) -> Any:
        """The shared runtime's :class:`tangram.Stats`."""
        return await self._actor.stats.remote()

    async def set_capacity(
        self, capacity: Mapping[str, object] | None = None, /, **amounts: object
    ) -> None:
        """Change the shared capacity (see :meth:`tangram.Runtime.set_capacity`)."""
        if capacity is not None and not isinstance(capacity, Mapping):
            raise InvalidCapacityError(
                f"capacity must be a mapping of name to amount (got {capacity!r})"
            )
        updates = dict(capacity or {}, **amounts)
        self._shadow.capacity.with_updates(updates)  # the same errors, raised here
        new = await self._actor.set_capacity.remote(updates)
        self._shadow = Runtime(new)


# -- connecting -----------------------------------------------------------------------


def _check_interval(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidCapacityError(f"`{name}` must be a number of seconds (got {value!r})")
    if not math.isfinite(value) or value <= 0:
        raise InvalidCapacityError(f"`{name}` must be > 0 and finite seconds (got {value!r})")
    return float(value)


async def _lookup(name: str, namespace: str | None, wait: float) -> Any:
    deadline = time.monotonic() + wait
    while True:
        try:
            return await anyio.to_thread.run_sync(lambda: ray.get_actor(name, namespace=namespace))
        except ValueError as exc:
            if time.monotonic() >= deadline:
                where = f"namespace {namespace!r}" if namespace else "this job's namespace"
                raise SchedulerUnavailableError(
                    f"no tangram scheduler actor named {name!r} in {where} after {wait:g} s: "
                    "create it with tangram.ray.connect(capacity=...) in the driver first"
                ) from exc
            await anyio.sleep(0.2)


@contextlib.asynccontextmanager
async def connect(
    *,
    name: str = "tangram",
    namespace: str | None = None,
    address: str | None = None,
    capacity: Mapping[str, object] | None = None,
    create: bool = True,
    policy: Policy | None = None,
    detached: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease_timeout: float = DEFAULT_TIMEOUT,
    lookup_timeout: float = LOOKUP_SECONDS,
) -> AsyncIterator[RemoteRuntime]:
    """Reach the shared scheduler ``name`` (creating it when given a capacity).

    ``async with tangram.ray.connect(capacity={"cpu": 64}) as remote:`` in the driver
    creates the actor; ``async with tangram.ray.connect() as remote:`` in a worker (a Ray
    task or actor of the same job) finds it by name. Inside the block
    ``tangram.acquire(...)`` reaches the shared scheduler.

    :param name: the actor's name.
    :param namespace: its Ray namespace; ``None`` is the job's own, which no other job
        sees, so a new job never finds a stale scheduler. Name one to share a
        ``detached`` scheduler across jobs, and put the job id in ``name``.
    :param address: the Ray cluster, for ``ray.init`` when Ray is not initialised yet.
    :param capacity: create the actor with this capacity if it does not exist. An
        existing actor with another capacity is refused, never silently reused.
    :param create: ``False`` only looks the actor up (waiting ``lookup_timeout``).
    :param policy: the scheduling policy of a new actor.
    :param detached: a new actor outlives this job (``ray.kill`` it when done).
    :param heartbeat: seconds between this proxy's heartbeats.
    :param lease_timeout: seconds without heartbeats after which a new actor reclaims a lease.
    :raises SchedulerUnavailableError: there is no such actor and none was created.
    :raises RuntimeError: not on asyncio (trio cannot await a Ray call).
    :raises InvalidCapacityError: a bad capacity, or one that differs from the actor's.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "tangram.ray needs an asyncio event loop (Ray calls are awaited there)"
        ) from None
    heartbeat = _check_interval("heartbeat", heartbeat)
    lease_timeout = _check_interval("lease_timeout", lease_timeout)
    if lease_timeout < 2 * heartbeat:
        raise InvalidCapacityError(
            "`lease_timeout` must be at least twice `heartbeat` "
            f"(got {lease_timeout:g} < 2 x {heartbeat:g})"
        )
    if not isinstance(name, str) or not name:
        raise TypeError(f"`name` must be a non-empty string (got {name!r})")
    wanted = Runtime(capacity).capacity if capacity is not None else None
    if not ray.is_initialized():
        await anyio.to_thread.run_sync(
            lambda: ray.init(address=address, namespace=namespace, include_dashboard=False)
        )
    token = uuid.uuid4().hex
    actor: Any
    if capacity is not None and create:
        options: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "get_if_exists": True,
            "max_concurrency": 10_000,
            "num_cpus": 0,
            # Ray spreads zero-CPU actors over the nodes; the scheduler stays with its
            # creator, so losing a worker node never takes the limits with it. Not soft:
            # a soft affinity left it on another node in 3 of 4 tries (Ray 2.60).
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        }
        if detached:
            options["lifetime"] = "detached"
        actor_class: Any = ray.remote(SchedulerActor)
        actor = actor_class.options(**options).remote(
            dict(capacity), policy, heartbeat, lease_timeout, token
        )
    else:
        actor = await _lookup(name, namespace, lookup_timeout)
    try:
        info = await actor.info.remote()
    except ray.exceptions.RayError as exc:
        raise SchedulerUnavailableError(f"the scheduler actor {name!r} failed: {exc}") from exc
    owner = info["token"] == token
    if wanted is not None and not owner and _totals(info["capacity"]) != _totals(wanted):
        raise InvalidCapacityError(
            f"a scheduler named {name!r} already exists with capacity "
            f"{_totals(info['capacity'])!r}, not {_totals(wanted)!r}: use a new name (per "
            "job) or set_capacity"
        )
    async with attach(actor, heartbeat=heartbeat, info=info) as remote:
        token_var = _enter_current(remote)
        try:
            yield remote
        finally:
            _exit_current(token_var)
    if owner and not detached:
        with anyio.CancelScope(shield=True), contextlib.suppress(ray.exceptions.RayError):
            await actor.close.remote()
            ray.kill(actor)


@contextlib.asynccontextmanager
async def attach(
    actor: Any, *, heartbeat: float | None = None, info: Mapping[str, Any] | None = None
) -> AsyncIterator[RemoteRuntime]:
    """A proxy on a scheduler actor handle (a host agent's), not made current."""
    if info is None:
        try:
            info = await actor.info.remote()
        except ray.exceptions.RayError as exc:
            raise SchedulerUnavailableError(f"the scheduler actor failed: {exc}") from exc
    beat = info["heartbeat"] if heartbeat is None else min(heartbeat, info["heartbeat"])
    remote = RemoteRuntime(actor, heartbeat=beat, capacity=info["capacity"])
    await remote._start()
    try:
        yield remote
    finally:
        await remote._stop()


def _totals(capacity: Capacity) -> dict[str, float]:
    return {name: res.total for name, res in capacity.items()}
