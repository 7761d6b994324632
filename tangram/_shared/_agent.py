"""Per-host agents: a Ray actor pinned to a node that owns that node's sandboxes and GPUs.

An action's cores must come from the machine its sandbox lives on, so each host is its
own capacity kind, ``cpu@<agent>``, registered with the shared scheduler when its agent
starts. The agent is an ordinary client of the scheduler: its :class:`tangram.SandboxPool`
acquires through a proxy, so the central policy decides how many cores each action gets
while the agent turns the count into core ids and runs the command locally.

The scheduler places a trajectory on the least loaded host when its sandbox opens and
keeps it there (:mod:`._placement`): every action of the trajectory runs next to its
files. Commands reach the agent as one Ray call each from a worker's handle
(:mod:`._hosts`); files and output travel by value.

GPUs follow the same split. An agent given model services runs a
:class:`tangram.gpu.GpuPool` over its node's devices and registers them as
``gpu@<agent>``, counted in devices. Device memory stays a node-local ledger (the pool's
own ``gpu_mem:<device>`` kinds, in a runtime inside the agent), because device names
repeat on every node and eviction is a decision about one node's memory. Each replica's
grant is also taken as the share of devices its memory takes of ``gpu@<agent>``, from the
node's runtime beside its cores, so the node's policy orders GPU work with the rest and
the job's view counts it (:mod:`._reports`). Which node serves a service block is the
job's decision (its placement). Torch is imported only by an agent that loads a torch
service.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import attrs

from .._runtime._run import Runtime
from .._runtime._scheduler import Scheduler
from .._sandbox._backend import (
    Host,
    RunResult,
    SandboxBackend,
    SandboxHandle,
    default_backend,
)
from .._sandbox._pool import Sandbox, SandboxPool
from ..errors import (
    GpuError,
    InvalidSettingError,
    SandboxClosedError,
    SettingTypeError,
    UnknownResourceError,
)
from ._node_rates import NodeRates, lent_kinds
from ._protocol import IDLE, SCHEDULER_CALLS, Heard, logger, lost, stalled, task_failed
from ._proxy import RemoteRuntime, attach
from ._reports import FULL, Outbox, snapshot

if TYPE_CHECKING:
    from .._gpu._devices import Device
    from .._gpu._pool import GpuPool
    from .._gpu._service import ModelService
    from .._runtime._lease import Lease

__all__ = ["HostAgent", "start_agent"]

BackendSpec = SandboxBackend | Callable[[], SandboxBackend] | None
# A replica's share of a device, in the shared scheduler, is rounded down to a multiple
# of this: binary fractions add up exactly, so the shares on a full device sum to at most
# one device and never trip the shared capacity over the memory the node's ledger allows.
_SHARE_STEP = 2.0**-20


class _HostBackend(SandboxBackend):
    """The agent's backend with its host's cores counted as ``cpu@<agent>``."""

    def __init__(self, inner: SandboxBackend, agent: str) -> None:
        self._inner = inner
        self._agent = agent
        self._hosts: dict[str, Host] = {}
        self.python = inner.python

    async def start(self) -> Sequence[Host]:
        hosts = list(await self._inner.start())
        if len(hosts) != 1:
            raise InvalidSettingError(
                f"`backend` must place a host agent's sandboxes on exactly one host "
                f"(got {len(hosts)} hosts): start one agent per host"
            )
        self._hosts = {host.name: host for host in hosts}
        return [attrs.evolve(hosts[0], resource=f"cpu@{self._agent}")]

    async def create(self, host: Host) -> SandboxHandle:
        return await self._inner.create(self._hosts[host.name])

    async def aclose(self) -> None:
        await self._inner.aclose()


class _NodeGpuLedger(Runtime):
    """The agent GpuPool's runtime: node memory, each grant mirrored as a share of devices.

    A replica's grant is taken first from this node's own books (``gpu_mem:<device>``
    bytes, which decide eviction and fit) and then, for as long as it is held, as its
    share of devices of ``gpu@<agent>`` from ``shared``: the node's runtime when the
    agent decides its node (on Ray), else the job's scheduler. Node memory comes first:
    the shared kind is this agent's alone, so its grant never waits on memory, and the
    books show only replicas that really hold a device. A Runtime itself, because a
    GpuPool takes nothing else for its runtime.
    """

    def __init__(self, shared: Scheduler | None, resource: str, sizes: Mapping[str, int]) -> None:
        super().__init__(dict(sizes))
        self._shared = shared
        self._resource = resource
        self._sizes = dict(sizes)

    def share(self, demand: Mapping[str, object]) -> float:
        """Devices a demand of ``{gpu_mem:<device>: bytes}`` takes, rounded down."""
        total = 0.0
        for kind, amount in demand.items():
            fraction = float(cast(float, amount)) / self._sizes[kind]
            total += math.floor(fraction / _SHARE_STEP) * _SHARE_STEP
        return max(total, _SHARE_STEP)

    # The pool's one call; a narrower signature than Runtime.acquire on purpose.
    def acquire(  # type: ignore[override]
        self, demand: Mapping[str, object], *, kind: str, estimate: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[Lease]:
        return self._acquire(dict(demand), kind, estimate)

    @contextlib.asynccontextmanager
    async def _acquire(
        self, demand: dict[str, object], kind: str, estimate: float | None
    ) -> AsyncIterator[Lease]:
        assert self._shared is not None
        share = {self._resource: self.share(demand)}
        async with (
            super().acquire(demand, kind=kind, estimate=estimate) as lease,
            self._shared.acquire(share, kind=kind, estimate=estimate),
        ):
            yield lease


# Dropped workers an agent remembers, so a sandbox one of them was still opening when
# it was dropped is closed, not kept; ids are never reused, so the oldest can go.
_FORGOTTEN_KEPT = 1024


class HostAgentActor:
    """The body of a host agent's Ray actor; its methods are the wire protocol.

    Its node's cores are decided here, by a runtime of the agent's own under the job's
    policy: a sandbox action's grant and release never leave the node, and the job's
    actor hears of them in batches (:mod:`._reports`). Only what spans nodes (the job's
    placement of trajectories, GPU shares, quotas) goes through the job's scheduler.
    """

    # Whether the node's cores are decided here. The scheduler process of a node outside
    # Ray hosts its agent in its own process, where the job's books are as near as these.
    decides_cores = True

    def __init__(
        self,
        name: str,
        scheduler: Any,
        backend: BackendSpec,
        warm: int,
        services: Sequence[Any] = (),
        devices: Sequence[Device] | None = None,
        timeout: float | None = None,
        exit_alone: bool = False,
    ) -> None:
        self._name = name
        self._scheduler = scheduler
        self._backend = backend
        self._warm = warm
        self._timeout = timeout
        self._exit_alone = exit_alone
        self._calls: dict[str, set[asyncio.Task[Any]]] = {}
        self._services = list(services)
        self._devices = None if devices is None else list(devices)
        self._gpu: GpuPool | None = None
        self._resident: frozenset[str] = frozenset()
        self._resident_seq = 0
        self._pool: SandboxPool | None = None
        self._sandboxes: dict[str, tuple[contextlib.AsyncExitStack, Sandbox]] = {}
        # Who opened each sandbox placed here by its worker, not by the job's actor: the
        # proxy whose death must close it (see ``forget``).
        self._owners: dict[str, str] = {}
        self._units = 0  # the node's cores, once started
        self._opening = 0  # ``open_here`` calls between the check and the sandbox
        self._forgotten: dict[str, None] = {}  # dropped workers, newest last
        self._heard: Heard | None = None  # when a worker of this node last beat here
        self._reserved: set[str] = set()  # trajectories whose sandbox is being opened
        self._started: asyncio.Future[dict[str, Any]] | None = None
        self._stop: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self._cores: Runtime | None = None  # the node's own runtime, when it decides
        self._rates: NodeRates | None = None  # its shares of the job's API rates, then
        self._cid: str | None = None  # its proxy's id: the job's actor files reports by it
        self._remote: RemoteRuntime | None = None  # its proxy on the job's actor
        self._outbox = Outbox()

    async def start(self) -> dict[str, Any]:
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_future()
            self._stop = asyncio.Event()
            self._main = loop.create_task(self._serve())
        return await asyncio.shield(self._started)

    async def _serve(self) -> None:
        assert self._started is not None and self._stop is not None
        try:
            spec = self._backend
            if spec is None:
                inner = await default_backend()
            elif isinstance(spec, SandboxBackend):
                inner = spec
            else:
                inner = spec()
            backend = _HostBackend(inner, self._name)
            async with attach(self._scheduler) as remote, contextlib.AsyncExitStack() as stack:
                self._cid = remote._id
                self._remote = remote
                extra: dict[str, Any] = {} if self._timeout is None else {"timeout": self._timeout}
                lender: Scheduler = remote
                if self.decides_cores:
                    policy = await self._scheduler.policy.remote()
                    cores = Runtime({f"cpu@{self._name}": 0}, policy=policy)
                    await stack.enter_async_context(cores)
                    cores.add_instrument(self._outbox)
                    self._cores = lender = cores
                pool = SandboxPool(backend, runtime=lender, warm=self._warm, **extra)
                await stack.enter_async_context(pool)
                self._pool = pool
                host = pool.hosts[0]
                self._units = len(host.cores)
                if self._cores is not None:
                    self._cores.set_capacity({host.resource: len(host.cores)})
                gpu: dict[str, Any] | None = None
                if self._services:
                    gpu = await self._open_gpu(remote, stack)
                await self._scheduler.add_host.remote(
                    self._name,
                    host.resource,
                    len(host.cores),
                    self._me(),
                    remote._id,
                    gpu,
                    self.decides_cores,
                    self._node_id(),
                )
                await remote._refresh()
                kinds = lent_kinds(remote.capacity)
                if self._cores is not None and kinds:
                    self._rates = NodeRates(
                        self._cores,
                        remote,
                        self._name,
                        kinds,
                        period=remote._heartbeat,
                        timeout=remote._lease_timeout,
                    )
                    asker = asyncio.ensure_future(self._rates.run())
                    stack.callback(asker.cancel)
                self._started.set_result(
                    {
                        "name": self._name,
                        "resource": host.resource,
                        "units": len(host.cores),
                        "cores": host.cores,
                        "node_id": self._node_id(),
                        "pid": os.getpid(),
                        "backend": repr(inner),
                        "gpu": gpu,
                    }
                )
                try:
                    if self._exit_alone:
                        await self._outlive(remote)
                    else:
                        await self._stop.wait()
                finally:
                    for sandbox_stack, _ in list(self._sandboxes.values()):
                        await sandbox_stack.aclose()
                    self._sandboxes.clear()
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            raise

    async def _outlive(self, remote: RemoteRuntime) -> None:
        """Serve until stopped, or end this actor once its scheduler is gone.

        A detached agent (one per node for a job's shared scheduler) has no owner to
        take it down: the scheduler stops it when the job's workers are gone, and if the
        scheduler itself dies first (killed, or its node lost), its proxy here fails and
        the agent ends on its own, its sandboxes and services first: at once if no
        worker of its node beats here, else once none has for ``IDLE`` lease timeouts.
        """
        await self._serve_while(lambda: remote._error is None)
        assert self._stop is not None
        # Its node's cores are its own to lend: while the node's workers still beat here,
        # their sandbox actions go on; only what the job's actor lent fails.
        idle = IDLE * remote._lease_timeout
        if not self._stop.is_set() and self._serving(idle):
            logger.warning(
                "host agent %r: its scheduler is gone; it serves its node's workers until "
                "none has beaten here for %g s",
                self._name,
                idle,
            )
            await self._serve_while(lambda: self._serving(idle))
        if not self._stop.is_set():
            logger.warning("host agent %r: its scheduler is gone; it ends", self._name)
            self._end()

    async def _serve_while(self, condition: Callable[[], bool], period: float = 1.0) -> None:
        """Until stopped or ``condition`` fails, checked each ``period``; its own stall is
        not its workers' silence (see :class:`Heard`)."""
        assert self._stop is not None
        while not self._stop.is_set() and condition():
            since = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), period)
            if self._heard is not None:
                self._heard.stalled(stalled(since, period), time.monotonic())

    def _serving(self, idle: float) -> bool:
        """Whether a worker of this node has beaten here within ``idle`` seconds."""
        heard = self._heard
        return heard is not None and heard.silence(time.monotonic(), idle) <= idle

    def _beat_heard(self) -> None:
        """A worker of this node beat here: the agent serves its node a while longer."""
        now = time.monotonic()
        if self._heard is None:
            self._heard = Heard(now)
        else:
            self._heard.hear(now)

    # What the transport decides: the node's scheduler process (:mod:`._node`) hosts its
    # agent itself and replaces these three.

    def _me(self) -> Any:
        """The handle the scheduler and workers reach this agent by."""
        import ray

        return ray.get_runtime_context().current_actor

    def _node_id(self) -> str:
        import ray

        node: str = ray.get_runtime_context().get_node_id()
        return node

    def _end(self) -> None:
        """End the agent's process once it has let go of what it holds."""
        import ray

        me = ray.get_runtime_context().current_actor
        asyncio.get_running_loop().call_later(1.0, ray.kill, me)

    async def _open_gpu(
        self, remote: RemoteRuntime, stack: contextlib.AsyncExitStack
    ) -> dict[str, Any]:
        """Build the services here, on the node, and serve them from a GpuPool."""
        from .._gpu._devices import discover_devices
        from .._gpu._pool import GpuPool
        from .._gpu._service import ModelService

        services: list[ModelService] = []
        for spec in self._services:
            service = spec if isinstance(spec, ModelService) else spec()
            if not isinstance(service, ModelService):
                raise SettingTypeError(
                    f"a service factory must return a tangram.gpu.ModelService (got {service!r})"
                )
            services.append(service)
        devices = self._devices
        if devices is None:
            devices = await anyio.to_thread.run_sync(discover_devices)
            if not devices:
                raise GpuError(
                    f"no CUDA device is visible on the node of host agent {self._name!r}; "
                    "pass devices=[tangram.gpu.Device('cpu:0', memory=...)] to serve on "
                    "the host"
                )
        resource = f"gpu@{self._name}"
        lender: Scheduler = remote
        if self._cores is not None:  # decided on the node, as its cores are
            self._cores.set_capacity({resource: len(devices)})
            lender = self._cores
        ledger = await stack.enter_async_context(
            _NodeGpuLedger(lender, resource, {d.kind: d.memory for d in devices})
        )
        pool = GpuPool(services, devices=devices, runtime=ledger)
        self._gpu = await stack.enter_async_context(pool)
        return {
            "resource": resource,
            "units": len(devices),
            "devices": [d.name for d in devices],
            "services": [s.name for s in services],
            "resident": sorted(self._residency()[1]),
        }

    def _residency(self) -> tuple[int, list[str]]:
        """The services resident here, numbered so the scheduler keeps the newest report."""
        assert self._gpu is not None
        resident = frozenset(name for name, where in self._gpu.residency().items() if where)
        if resident != self._resident:
            self._resident = resident
            self._resident_seq += 1
        return self._resident_seq, sorted(resident)

    async def call_service(self, name: str, batch: Any) -> tuple[Any, int, list[str]]:
        """One action on service ``name`` of this node's pool, and the residency after it."""
        await self.start()
        if self._gpu is None:
            raise UnknownResourceError(
                f"host agent {self._name!r} serves no GPU model services (asked for {name!r})"
            )
        try:
            async with self._gpu.use(name) as svc:
                result = await svc(batch)
        finally:
            if len(self._outbox.records) >= FULL:
                self._push()
        return (result, *self._residency())

    async def service_stats(self) -> dict[str, dict[str, float | int | None]]:
        await self.start()
        return {} if self._gpu is None else self._gpu.service_stats()

    async def stop(self) -> None:
        await self.start()
        assert self._stop is not None and self._main is not None
        self._stop.set()
        with contextlib.suppress(Exception):
            await self._main

    async def ended(self) -> None:
        """Return once this agent stops; never, while it serves.

        The job's actor keeps one of these calls waiting on each agent that decides its
        node's cores: when the agent's process dies, the call fails at once, and the
        actor drops the agent then rather than a lease timeout later (see
        ``ClusterSchedulerActor._watch``).
        """
        await self.start()
        assert self._stop is not None
        await self._stop.wait()

    async def open(self, trajectory: str) -> str:
        """Open ``trajectory``'s sandbox here; returns the interpreter ``code=`` runs in it."""
        await self.start()
        if trajectory in self._sandboxes or trajectory in self._reserved:
            raise InvalidSettingError(
                f"trajectory {trajectory!r} already has an open sandbox on host agent "
                f"{self._name!r}: one `remote.sandbox(...)` block per trajectory at a time"
            )
        assert self._pool is not None
        # Held from the check to the record: a second open of the same trajectory while
        # this one awaits its sandbox is refused, not left to overwrite it.
        self._reserved.add(trajectory)
        try:
            stack = contextlib.AsyncExitStack()
            sandbox = await stack.enter_async_context(self._pool.sandbox(trajectory))
            self._sandboxes[trajectory] = (stack, sandbox)
        finally:
            self._reserved.discard(trajectory)
        return self._pool.backend.python

    async def open_here(self, trajectory: str, cid: str) -> tuple[str | None, int]:
        """Open a sandbox for a worker on this node, if the node has a core for it.

        Returns the interpreter, or ``None`` when this node already has a sandbox per
        core, and the sandboxes open here either way. Below one per core, a sandbox's
        action finds a core here as soon as it would anywhere, and the placement costs
        no message to the job's actor (at 1,000 nodes that actor, placing every sandbox,
        was the bottleneck of the whole job; ``benchmarks/scale_model.py``). At one per
        core and beyond, the job's actor places it on the least loaded host.
        """
        await self.start()
        assert self._stop is not None
        # Counted from the ask, not once open: opening awaits, and asks arriving
        # meanwhile would each see the same free core. A stopping agent takes none: the
        # job's actor places it elsewhere.
        if self._stop.is_set() or len(self._sandboxes) + self._opening >= self._units:
            return None, self._own()
        self._opening += 1
        try:
            python = await self.open(trajectory)
        finally:
            self._opening -= 1
        if cid in self._forgotten:  # its worker was dropped while this one opened
            await self.close(trajectory)
            raise SandboxClosedError(f"the worker that opened {trajectory!r} is gone")
        self._owners[trajectory] = cid
        return python, self._own()

    def _own(self) -> int:
        """Sandboxes open or opening here that workers placed themselves, not the job's book.

        The book counts its own placements; it adds these (``HostBook.note``).
        """
        return len(self._owners) + self._opening

    async def beat(self, cid: str) -> bool:
        """A worker on this node is alive and has nothing at the job's actor: say so there.

        Passed on in this agent's next poll of the job's actor (see
        ``RemoteRuntime._poller``), one message for the node's workers. Returns whether
        it will be: not once this agent's proxy has lost the job's actor, when the
        worker must try the job's actor itself. Either way the beat keeps this agent
        serving its node (see ``_outlive``).
        """
        self._beat_heard()
        remote = self._remote
        if remote is None or remote._error is not None or not remote._open:
            return False
        self._forgotten.pop(cid, None)  # dropped while alive, it is back
        remote._relayed.add(cid)
        return True

    async def take(
        self,
        cid: str,
        request: int,
        demand: dict[str, float],
        kind: str,
        trajectory: str | None,
        estimate: float | None,
        wait_timeout: float | None,
    ) -> dict[str, float] | None:
        """A worker's call on API rates alone, granted from this node's shares of them
        (:mod:`._node_rates`); ``None`` when they are not lent here."""
        if self._rates is None:
            return None
        return await self._rates.take(
            cid, request, demand, kind, trajectory, estimate, wait_timeout
        )

    async def give(self, cid: str, request: int, outcome: int) -> None:
        """A worker's call on this node's API shares ended, or its wait was given up."""
        if self._rates is not None:
            self._rates.give(cid, request, outcome)

    async def forget(self, cid: str) -> None:
        """Proxy ``cid`` is gone: close the sandboxes it opened here without the job's actor."""
        if self._rates is not None:
            self._rates.forget(cid)
        self._forgotten[cid] = None
        if len(self._forgotten) > _FORGOTTEN_KEPT:
            self._forgotten.pop(next(iter(self._forgotten)))
        for trajectory in [t for t, owner in self._owners.items() if owner == cid]:
            await self.close(trajectory)

    async def close(self, trajectory: str) -> None:
        """Close the sandbox, cancelling its calls still running (their caller is gone)."""
        self._owners.pop(trajectory, None)
        calls = self._calls.pop(trajectory, set())
        for task in calls:
            task.cancel()
        for task in calls:
            with contextlib.suppress(BaseException):
                await task
        entry = self._sandboxes.pop(trajectory, None)
        if entry is not None:
            await entry[0].aclose()

    async def _tracked(self, trajectory: str, call: Any) -> Any:
        """Run one call of ``trajectory`` as a task ``close`` can cancel."""
        task = asyncio.ensure_future(call)
        calls = self._calls.setdefault(trajectory, set())
        calls.add(task)
        try:
            return await task
        finally:
            calls.discard(task)

    def _sandbox(self, trajectory: str) -> Sandbox:
        entry = self._sandboxes.get(trajectory)
        if entry is None:
            raise SandboxClosedError(f"trajectory {trajectory!r} has no open sandbox here")
        return entry[1]

    async def run(self, trajectory: str, kwargs: dict[str, Any]) -> RunResult:
        try:
            result: RunResult = await self._tracked(
                trajectory, self._sandbox(trajectory).run(**kwargs)
            )
        finally:
            if len(self._outbox.records) >= FULL:
                self._push()
        return result

    async def report(self) -> dict[str, Any] | None:
        """What this node decided since the last report, for the job's stats."""
        await self.start()
        return None if self._cores is None else self._snapshot()

    def _push(self) -> None:
        """Send a full outbox to the job's scheduler unasked (fire and forget)."""
        gone = self._remote is not None and self._remote._error is not None
        if self._cores is not None and self._cid is not None and not gone:
            self._scheduler.report.remote(self._cid, self._snapshot())

    def _snapshot(self) -> dict[str, Any]:
        """The node's report, with the sandboxes its workers placed here (the job's book
        places by it)."""
        assert self._cores is not None
        return {**snapshot(self._cores, self._outbox), "sandboxes": self._own()}

    async def put(self, trajectory: str, path: str, data: bytes | str) -> None:
        await self._tracked(trajectory, self._sandbox(trajectory).put(path, data))

    async def get(self, trajectory: str, path: str) -> bytes:
        data: bytes = await self._tracked(trajectory, self._sandbox(trajectory).get(path))
        return data


@attrs.frozen
class HostAgent:
    """A started host agent: where it runs and what it registered.

    ``resource``/``units`` are its cores (``cpu@<name>``); ``gpu_resource``/``gpus`` its
    devices (``gpu@<name>``; ``None``/0 without services) and ``services`` the model
    services it serves. ``await agent.aclose()`` stops it: its sandboxes are destroyed,
    its services evicted and closed, and its capacity leaves the scheduler.
    """

    name: str
    resource: str
    units: int
    node_id: str
    pid: int
    gpu_resource: str | None
    gpus: int
    services: tuple[str, ...]
    actor: Any = attrs.field(repr=False)

    async def service_stats(self) -> dict[str, dict[str, float | int | None]]:
        """Its GPU pool's :meth:`tangram.gpu.GpuPool.service_stats` (restores, runs, ...)."""
        stats: dict[str, dict[str, float | int | None]] = await self.actor.service_stats.remote()
        return stats

    async def aclose(self) -> None:
        import ray

        with contextlib.suppress(*lost()):
            await self.actor.stop.remote()
        ray.kill(self.actor)


async def start_agent(
    remote: RemoteRuntime,
    *,
    name: str,
    node_id: str | None = None,
    backend: BackendSpec = None,
    warm: int = 0,
    services: Sequence[ModelService | Callable[[], ModelService]] = (),
    devices: Sequence[Device] | None = None,
) -> HostAgent:
    """Start a host agent on ``node_id`` (default: this node) and register its capacity.

    With ``services`` the agent also serves GPU model services from a
    :class:`tangram.gpu.GpuPool` over the node's devices, and registers them as
    ``gpu@<name>``; workers reach them with ``remote.service(name)``. Each service is
    built and cold-loaded on the agent's node before this returns.

    :param remote: a proxy on the scheduler the agent serves.
    :param name: the host's name; its cores become the capacity kind ``cpu@<name>``.
    :param backend: a :class:`tangram.abc.SandboxBackend`, or a callable building one on the
        agent's node (better for anything that probes the machine), or ``None`` for
        Docker when usable there, else the embedded local backend.
    :param warm: parked sandboxes the agent keeps ready.
    :param services: the model services, each a :class:`tangram.gpu.ModelService` not
        loaded yet (a ``TorchService`` carries only its factory until it loads) or a
        picklable callable that builds one on the node. They travel to the agent's
        process by pickle: never a live module.
    :param devices: the node's devices as :class:`tangram.gpu.Device`; default: every
        CUDA device visible on the agent's node. ``Device("cpu:0", memory=...)`` serves
        on the host (CPU-only nodes, tests).
    :raises InvalidSettingError: a name that is empty, has an ``@`` or is in use, a backend
        that spans several hosts, or devices without services (a ``ValueError``).
    :raises SettingTypeError: a name, services or devices of the wrong type (a
        ``TypeError``, and a ``ValueError`` as the name check raised before).
    :raises tangram.errors.GpuError: no device on the node, or a service that failed to
        load or fits no device (from the agent).
    """
    if not isinstance(name, str):
        raise SettingTypeError(f"`name` must be a non-empty string without '@' (got {name!r})")
    if not name or "@" in name:
        raise InvalidSettingError(f"`name` must be a non-empty string without '@' (got {name!r})")
    services, devices = _check_gpu_arguments(services, devices)
    hosts = await remote.actor.hosts.remote()
    if name in hosts:
        raise InvalidSettingError(
            f"`name`: a host agent named {name!r} is already registered (have {sorted(hosts)})"
        )
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id if node_id is not None else ray.get_runtime_context().get_node_id()
    actor_class: Any = ray.remote(HostAgentActor)
    actor = actor_class.options(
        num_cpus=0,
        max_concurrency=SCHEDULER_CALLS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(name, remote.actor, backend, warm, services, devices)
    try:
        info = await actor.start.remote()
    except task_failed() as exc:
        ray.kill(actor)
        raise exc.cause from exc
    await remote._refresh()
    gpu = info["gpu"]
    return HostAgent(
        name=info["name"],
        resource=info["resource"],
        units=info["units"],
        node_id=info["node_id"],
        pid=info["pid"],
        gpu_resource=None if gpu is None else gpu["resource"],
        gpus=0 if gpu is None else gpu["units"],
        services=() if gpu is None else tuple(gpu["services"]),
        actor=actor,
    )


def _check_gpu_arguments(
    services: object, devices: object
) -> tuple[list[Any], list[Device] | None]:
    """Refuse bad GPU arguments in the caller, before a process starts on another node."""
    if not services and devices is None:
        return [], None
    # Only the classes: neither module imports torch or NVML.
    from .._gpu._devices import Device
    from .._gpu._service import ModelService

    if isinstance(services, (str, bytes)) or not isinstance(services, Sequence):
        raise SettingTypeError(f"`services` must be a list of model services (got {services!r})")
    checked: list[Any] = []
    for spec in services:
        if not isinstance(spec, ModelService) and not callable(spec):
            raise SettingTypeError(
                "each service must be a tangram.gpu.ModelService or a callable building one "
                f"on the agent's node (got {spec!r})"
            )
        checked.append(spec)
    if devices is None:
        return checked, None
    if not checked:
        raise InvalidSettingError(
            f"`devices` without `services` (got devices={devices!r}): an agent's devices "
            "serve its services"
        )
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise SettingTypeError(f"`devices` must be a list of tangram.gpu.Device (got {devices!r})")
    listed = list(devices)
    if not listed or not all(isinstance(d, Device) for d in listed):
        raise SettingTypeError(
            f"`devices` must be a non-empty list of tangram.gpu.Device (got {devices!r})"
        )
    return checked, listed
