"""A worker's handle on the shared scheduler: ``acquire`` and ``run`` as on a Runtime.

Every process talks to the scheduler actor through a :class:`RemoteRuntime`, which has
the runtime's ``acquire``/``run`` and becomes what ``tangram.acquire`` reaches. It keeps
at most one *send* in flight: acquires, releases and withdrawals made while it travels go
in the next one, so a burst of a loop iteration is one call. Grants come back on the
send's answer when the scheduler decided at once, otherwise on the *poll* it keeps
waiting at the actor, which is also the heartbeat of the leases it holds (the wire is
:mod:`._protocol`).

Only asyncio: awaiting a Ray call needs an asyncio loop (trio code would pay a thread per
call).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from .._core._action import Action
from .._core._beats import idle_wait, relay_wait
from .._core._estimator import Estimator
from .._core._resources import Capacity, Shape, parse_capacity
from .._runtime._actions import Actions, duration
from .._runtime._lease import LeaseBase
from .._runtime._run import RunMixin
from ..errors import (
    AcquireReusedError,
    InvalidCapacityError,
    RuntimeClosedError,
    SchedulerUnavailableError,
    SettingTypeError,
)
from ._hosts import RemoteSandbox, RemoteService, open_sandbox, open_service
from ._protocol import (
    CANCELLED,
    COMPLETED,
    DEFAULT_TIMEOUT,
    FAILED,
    logger,
    lost,
    task_failed,
)

__all__ = ["RemoteAcquireContext", "RemoteLease", "RemoteRuntime", "attach", "check_capacity"]


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
    """The async context manager ``RemoteRuntime.acquire`` returns; enter it once.

    A second entry raises :class:`~tangram.errors.AcquireReusedError`, as a local
    context does: one context is one action.
    """

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
            raise AcquireReusedError("an acquire context can be entered only once")
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
            outcome = COMPLETED
        elif issubclass(exc_type, Exception) and not issubclass(exc_type, asyncio.CancelledError):
            outcome = FAILED
        else:
            outcome = CANCELLED
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
        # Demands are checked here, at the call, against the capacity last seen.
        self._actions = Actions(parse_capacity(capacity), Estimator())
        self._id = uuid.uuid4().hex
        # This node's host agent, as (host, handle), when this proxy started it: its
        # sandboxes open there first (see ``sandbox``), and while nothing waits or is
        # held at the job's actor, this proxy beats there (see ``_poller``).
        self._local: tuple[str, Any] | None = None
        # The Ray node this proxy runs on (a worker's, set by ``connect`` and
        # ``open_shared``): said in each poll, so that the job's actor can name its node's
        # agent as its home when one starts there after this proxy connected, or takes
        # over from one that died or stops.
        self._node: str | None = None
        self._busy = anyio.Event()  # set when a request goes to the job's actor
        # Proxies that beat to this one's agent, passed on in its next poll (an agent's
        # proxy only).
        self._relayed: set[str] = set()
        self._relays = False
        self._lease_timeout = DEFAULT_TIMEOUT  # the scheduler's, once attached
        # Calls on API rates alone go to this node's agent, which grants them from its
        # share (:mod:`._node_rates`): the agent each such lease is given back to, and
        # the sets of kinds an agent said it is not lent (all of them, together).
        self._taken: dict[int, Any] = {}
        self._unlent: set[frozenset[str]] = set()
        self._gives: dict[int, tuple[Any, int]] = {}  # given back, not yet sent
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
    def client_id(self) -> str:
        """This proxy's id at the scheduler: what names its leases and its requests."""
        return self._id

    @property
    def capacity(self) -> Capacity:
        """The capacity as of the last refresh (connect, or ``set_capacity`` from here)."""
        return self._actions.capacity

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
        with anyio.CancelScope(shield=True):
            # What the stop cut short: the node's agent would hold these calls' grants
            # until the job's actor dropped this worker.
            for request_id in list(self._gives):
                await self._give(request_id)
        error = RuntimeClosedError("the remote runtime closed while this action was waiting")
        for pending in self._pending.values():
            pending.error = error
            pending.done.set()
        self._pending.clear()
        if self._error is None:
            releases, self._releases = self._releases, []
            with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
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
        action = self._actions.build(demand, amounts, kind, trajectory, estimate)
        if wait_timeout is not None:
            duration("wait_timeout", wait_timeout, finite=False)
        sent = dict(demand) if demand is not None else dict(amounts)
        return RemoteAcquireContext(self, action, (sent, kind, trajectory, estimate, wait_timeout))

    async def _enter(self, action: Action, request: tuple[Any, ...]) -> RemoteLease:
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._error is not None:
            raise SchedulerUnavailableError(
                f"the scheduler actor is unreachable: {self._error}"
            ) from self._error
        if not self._open:
            raise RuntimeClosedError("the remote runtime is not open")
        if self._local is not None and self._lent(action):
            lease = await self._enter_local(self._local[1], action, request)
            if lease is not None:
                return lease
        request_id = next(self._requests)
        pending = _Pending(action, anyio.current_time())
        self._pending[request_id] = pending
        self._submits[request_id] = (request_id, *request)
        self._dirty.set()
        self._busy.set()
        try:
            await pending.done.wait()
        except BaseException:
            self._pending.pop(request_id, None)
            if pending.lease is not None:
                self._release(pending.lease, CANCELLED)
            elif self._submits.pop(request_id, None) is None:
                self._withdraws.append(request_id)
                self._dirty.set()
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.lease is not None
        return pending.lease

    def _lent(self, action: Action) -> bool:
        """Whether ``action`` needs only API rates that this node's agent may be lent."""
        demand = action.demand
        if demand.elastic is not None or not demand.rigid:
            return False
        capacity = self._actions.capacity
        kinds = frozenset(kind for kind, _ in demand.rigid)
        return kinds not in self._unlent and all(
            capacity[kind].shape is Shape.RATE for kind in kinds
        )

    async def _enter_local(
        self, agent: Any, action: Action, request: tuple[Any, ...]
    ) -> RemoteLease | None:
        """Take ``action``'s API units from this node's share; ``None``: ask the job's actor."""
        _, kind, trajectory, estimate, wait_timeout = request
        demand = dict(action.demand.rigid)
        request_id = next(self._requests)
        queued_at = anyio.current_time()
        try:
            grant = await agent.take.remote(
                self._id, request_id, demand, kind, trajectory, estimate, wait_timeout
            )
        except task_failed() as exc:
            raise exc.cause from exc
        except lost():
            return None  # the agent is gone: the job's actor serves the call
        except BaseException:
            self._give_back(agent, request_id, CANCELLED)  # withdrawn, or granted meanwhile
            raise
        if grant is None:
            self._unlent.add(frozenset(demand))
            return None
        self._taken[request_id] = agent
        return RemoteLease(action, -request_id, grant, None, queued_at, anyio.current_time())

    def _give_back(self, agent: Any, request_id: int, outcome: int) -> None:
        self._gives[request_id] = (agent, outcome)
        if self._task_group is not None:
            self._task_group.start_soon(self._give, request_id)

    async def _give(self, request_id: int) -> None:
        given = self._gives.get(request_id)
        if given is None:
            return
        agent, outcome = given
        with contextlib.suppress(*lost()):  # a gone agent took its node's grants with it
            await agent.give.remote(self._id, request_id, outcome)
        self._gives.pop(request_id, None)

    def _release(self, lease: RemoteLease, outcome: int) -> None:
        if not math.isnan(lease.finished_at):
            return
        lease.finished_at = anyio.current_time()
        agent = self._taken.pop(-lease.lease_id, None)
        if agent is not None:
            self._give_back(agent, -lease.lease_id, outcome)
            return
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
            except lost() as exc:
                self._sending = None
                self._fail(exc)
                return
            self._sending = None
            self._dispatch(events)

    async def _poller(self) -> None:
        """Wait for grants at the actor; every call is also the heartbeat of our leases.

        While this proxy has nothing waiting or held at the job's actor and its node's
        agent is known, it beats to that agent instead, which passes the beat on in its
        own poll: at 1,000 nodes of 8 workers every worker's poll to the job's actor was
        2.7 cores' worth of its time (``benchmarks/scale_model.py``). A request wakes it
        back to the job's actor at once, where its grant will come.
        """
        while True:
            local = None if self._pending or self._leases else self._local
            if local is not None and await self._beat_locally(local):
                continue
            relayed, self._relayed = self._relayed, set()
            # An agent that passes beats on, and a proxy with nothing waiting or held
            # here, poll at the pace that keeps them (and the workers whose beats they
            # pass on) inside the lease timeout, with its margin (``relay_wait``): only
            # leases need the heartbeat's pace. An idle driver's or worker's poll a second
            # was most of what the job's actor heard from a node whose agent decides its
            # cores (``benchmarks/ray_ceiling.py``). A request is sent at once whatever
            # the wait, and its grant ends the poll.
            self._relays = self._relays or bool(relayed)
            if self._relays:
                wait = relay_wait(self._heartbeat, self._lease_timeout)
            elif not (self._pending or self._leases):
                wait = idle_wait(self._heartbeat, self._lease_timeout)
            else:
                wait = self._heartbeat
            self.calls += 1
            try:
                events = await self._actor.poll.remote(
                    self._id, list(self._leases), wait, list(relayed), self._node
                )
            except lost() as exc:
                self._fail(exc)
                break
            self._dispatch(events)
        # The job's actor is gone: what it lent fails loudly from now on, but this node's
        # agent lends its cores itself, and serves this worker's sandboxes while it hears
        # that the worker lives.
        while self._local is not None:
            await self._beat_locally(self._local)

    async def _beat_locally(self, local: tuple[str, Any]) -> bool:
        """One heartbeat through this node's agent, then idle until due or busy.

        False when the agent did not take it in time or could not pass it on (this
        round's beat goes to the job's actor), or is gone (every beat does from now on).
        """
        self._busy = anyio.Event()
        try:
            with anyio.move_on_after(self._heartbeat) as scope:
                relayed = await local[1].beat.remote(self._id)
        except (*lost(), *task_failed()):
            logger.warning("this node's host agent is gone; heartbeats go to the scheduler")
            self._local = None
            return False
        if scope.cancelled_caught or not (relayed or self._error is not None):
            return False
        with anyio.move_on_after(self._heartbeat):
            await self._busy.wait()
        return True

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
            elif tag == "home":  # this node's agent, started (or replaced) after we came
                self._local = (event[1], event[2])
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

    def sandbox(self, trajectory_id: str) -> contextlib.AbstractAsyncContextManager[RemoteSandbox]:
        """A sandbox for ``trajectory_id``: on this worker's node, or where the scheduler says.

        ``async with remote.sandbox("traj-7") as sbx: await sbx.run("pytest -q", cpu=2)``:
        the sandbox lives on one host agent (see :func:`tangram.ray.start_agent`) for the
        block's whole life, so every action of the trajectory runs where its files are.
        With this node's agent started by this proxy (``agent=True``) it opens there while
        the node has a core per open sandbox, with no message to the job's scheduler;
        beyond that, the scheduler places it on the least loaded host.

        :raises SettingTypeError: ``trajectory_id`` is not a string (at the call; also a
            ``TypeError``).
        :raises InvalidSettingError: ``trajectory_id`` already has an open sandbox
            (entering the block; also a ``ValueError``).
        """
        if not isinstance(trajectory_id, str):
            raise SettingTypeError(f"`trajectory_id` must be a string (got {trajectory_id!r})")
        return open_sandbox(self._actor, trajectory_id, self._id, self._local)

    def service(self, name: str) -> contextlib.AbstractAsyncContextManager[RemoteService]:
        """A GPU model service on the host the scheduler picks, like ``GpuPool.use``.

        ``async with remote.service("judge") as svc: scores = await svc(batch)``: the
        block runs on one host agent that serves ``name`` (see
        :func:`tangram.ray.start_agent`), preferably one where it is resident; each call
        is one action on that agent's :class:`tangram.gpu.GpuPool`.

        :raises SettingTypeError: ``name`` is not a non-empty string (at the call; also a
            ``TypeError``).
        :raises UnknownResourceError: no live host agent serves ``name`` (entering the
            block; also a ``LookupError``), as ``GpuPool.use`` for a name it lacks.
        """
        if not isinstance(name, str) or not name:
            raise SettingTypeError(f"`name` must be a non-empty string (got {name!r})")
        return open_service(self._actor, self._id, name)

    # -- remote introspection ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def group(self, key: str, wait: float) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """One sample of group ``key`` in the job's gate (see :mod:`tangram._runtime._group`):
        the samples of one key that any worker of the job holds at once wait for each
        other, none longer than ``wait`` seconds. The block calls the yielded ``arrive()``
        right before it asks for its grant.

        :raises SchedulerUnavailableError: the scheduler actor failed.
        """
        try:
            member = await self._actor.group_enter.remote(self._id, key, wait)
        except lost() as exc:
            raise SchedulerUnavailableError(f"the scheduler actor failed: {exc}") from exc
        arrived = False

        async def arrive() -> None:
            nonlocal arrived
            if arrived:
                return
            arrived = True
            try:
                await self._actor.group_arrive.remote(self._id, member)
            except lost() as exc:
                raise SchedulerUnavailableError(f"the scheduler actor failed: {exc}") from exc

        try:
            yield arrive
        finally:
            if not arrived:
                with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
                    await self._actor.group_leave.remote(self._id, member)

    async def _home(self, host: str, agent: Any) -> None:
        """Open sandboxes on, and beat through, ``agent`` (host ``host``): this node's.

        The job's actor hears of it first, so that it can have that agent close them if
        this proxy is dropped.
        """
        await self._actor.home.remote(self._id, host, agent)
        self._local = (host, agent)

    async def _refresh(self) -> None:
        """Fetch the actor's capacity again (a host agent added its cores)."""
        info = await self._actor.info.remote()
        self._actions.capacity = parse_capacity(info["capacity"])

    async def stats(self) -> Any:
        """The shared runtime's :class:`tangram.Stats`."""
        return await self._actor.stats.remote()

    async def stats_step(self) -> tuple[Any, Any]:
        """The shared runtime's stats now and at the job's previous such call (``None``
        at the first): the adapters' per-sample figures, one baseline for the job."""
        return await self._actor.stats_step.remote()  # type: ignore[no-any-return]

    async def set_capacity(
        self, capacity: Mapping[str, object] | None = None, /, **amounts: object
    ) -> None:
        """Change the shared capacity (see :meth:`tangram.Runtime.set_capacity`)."""
        if capacity is not None and not isinstance(capacity, Mapping):
            raise InvalidCapacityError(
                f"capacity must be a mapping of name to amount (got {capacity!r})"
            )
        updates = dict(capacity or {}, **amounts)
        self.capacity.with_updates(updates)  # the same errors, raised here
        new = await self._actor.set_capacity.remote(updates)
        self._actions.capacity = parse_capacity(new)


@contextlib.asynccontextmanager
async def attach(
    actor: Any,
    *,
    heartbeat: float | None = None,
    info: Mapping[str, Any] | None = None,
    node: str | None = None,
) -> AsyncIterator[RemoteRuntime]:
    """A proxy on a scheduler actor handle (a host agent's), not made current; ``node``,
    the Ray node it runs on, makes its node's deciding agent its home when one starts."""
    if info is None:
        try:
            info = await actor.info.remote()
        except lost() as exc:
            raise SchedulerUnavailableError(f"the scheduler actor failed: {exc}") from exc
    beat = info["heartbeat"] if heartbeat is None else min(heartbeat, info["heartbeat"])
    remote = RemoteRuntime(actor, heartbeat=beat, capacity=info["capacity"])
    remote._lease_timeout = float(info.get("timeout", DEFAULT_TIMEOUT))
    remote._node = node
    await remote._start()
    try:
        yield remote
    finally:
        await remote._stop()


def check_capacity(found: Capacity, wanted: Capacity) -> None:
    """Refuse a worker whose config states another capacity than the job's scheduler has.

    :raises InvalidCapacityError: a kind ``wanted`` names has another total in ``found``.
    """
    got = {k: r.total for k, r in found.items() if k in wanted}
    stated = {k: r.total for k, r in wanted.items()}
    if got != stated:
        raise InvalidCapacityError(
            f"this job's scheduler has capacity {got!r}, this worker's config states "
            f"{stated!r}: every worker must read the same config"
        )
