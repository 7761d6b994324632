"""The GPU pool: model services sharing devices, restored per action, evicted when idle.

The paper's GPU manager deploys every model service up front with its state backed up in
host memory. A service is *resident* (on a device) or *evicted* (host memory only); an
action on an evicted service first restores it, evicting least-recently-used idle services
when memory is short. Restoring from host memory takes a fraction of a cold load.

How it maps onto the runtime: every device is one resource kind, ``gpu_mem:<device>``
(bytes), and :meth:`GpuPool.capacity` hands those to ``Runtime(capacity=...)``. A
*replica* (a service on a device, or on an NVLink chunk of devices for a multi-GPU
service) holds ``runtime.acquire({"gpu_mem:<device>": memory})`` while actions use it, so
the runtime only ever grants memory that running replicas can hold. Idle resident replicas
hold no lease: they are a cache the pool evicts (LRU) to make room for a granted one, which
is why a granted replica always fits once the idle ones are gone, and why a replica with a
running action is never evicted.

This module is the pool's lifecycle and its one action, :meth:`GpuPool.use`. The books and
the decisions are in ``_placing.py`` (the rules themselves, shared with the simulator, in
``tangram/_core/_placement.py``), a replica's holder task, restores and evictions in
``_holding.py``, the records in ``_replica.py``; devices in ``_devices.py``, the service
protocol in ``_service.py``, the torch service in ``_torch.py``. None of them imports torch
or initialises NVML when imported (``_optional.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import attrs

from .._core._placement import nvlink_groups, starvation_bound
from .._runtime._run import Runtime, current_local_runtime
from ..errors import (
    GpuError,
    GpuPoolClosedError,
    GpuServiceError,
    InvalidSettingError,
    SettingTypeError,
    UnknownResourceError,
)
from ._checks import check_bool
from ._devices import Device, device_memory_used, discover_devices, nvml_nvlink_pairs
from ._holding import Holder
from ._placing import Placer
from ._replica import Call, PoolReplica, Residency, ServiceState, Waiter
from ._service import ModelService

# Device, ModelService, TorchService and discover_devices are listed for the modules that
# import them from here (the Ray agent, the in-memory testing pool, the framework session,
# the bench) until they import them from ``_devices``, ``_service`` and ``_torch``.
__all__ = ["GpuPool", "ServiceHandle"]

logger = logging.getLogger("tangram.gpu")


@attrs.define(eq=False)
class _Block:
    """An open ``pool.use`` block: the replica it holds a seat on, while ``open``."""

    replica: PoolReplica
    open: bool = True


# The blocks around this code, in any pool: a block inside one that is still open (in
# the same task, or in a task started inside it) never waits in a line, where it could
# wait for a seat its own action holds. A context variable, since a task started inside
# a block inherits it, and one started elsewhere does not; ``open`` goes false when the
# block ends, so a task that outlives its block waits in line as any action does.
_held: contextvars.ContextVar[tuple[_Block, ...]] = contextvars.ContextVar(
    "tangram_gpu_held", default=()
)


class _PoolState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class GpuPool:
    """Model services sharing devices, restored per action and evicted when idle (EOE).

    ``async with GpuPool([judge, teacher], devices=...) as pool:`` loads every service
    cold into host memory; ``Runtime(capacity=pool.capacity())`` schedules the devices'
    memory; ``async with pool.use("judge") as svc: scores = await svc(batch)`` runs an
    action on a replica of the service, restoring it first when it is not resident.

    Placement: an action takes a seat on a live replica of its service that has one (one
    action when the service runs one call at a time; ``max_batch`` when it batches, and
    as many again forming the next run), or starts one where the service is still
    resident, else on the device (or NVLink chunk) with the most free memory; a
    multi-GPU replica waits for room inside one NVLink group rather than straddle two.
    When every live replica is full, another one starts only if ``max_replicas`` allows
    it, a device has room without waiting, and, when it would need a restore, the
    service is below its share of the devices by queued work; else the action waits in
    its service's line, first come first served, for the first seat that frees on any
    of its replicas. A batching service with no ``max_batch`` merges every call that
    waits, so its actions join the least loaded replica instead. The replica's memory
    grant is passed to the runtime with the restore time (0 when resident) plus the
    service's learnt run time as its estimate, so the policy sees what the action will
    really cost.

    While replicas wait for their grant, the least loaded running replicas of services
    above their share that have held their grant for at least two restore times (then
    the longest held) stop taking newcomers, as many as the waiters need beyond the free
    memory, and give their grant back once their seated actions end; every other replica
    keeps serving. Without this a busy service would hold its devices for as long as it
    stays busy; the tenure keeps a restore to at most a third of a replica's time on its
    devices. A waiting replica none of whose devices will give way asks for one that
    will instead.

    :param services: the model services (names unique).
    :param devices: devices and the memory each may fill (default: every visible GPU).
    :param runtime: the runtime grants come from (default: the current one at each use).
    :param links: NVLink peer pairs of device indices (default: as NVML reports them).
    :param warm: when the pool is entered, restore idle replicas onto the devices with
        room (one of each service in order, then a second of each, and so on), so the
        first actions pay no restore. They hold no grant and are evicted like any idle
        replica. ``False`` leaves the devices empty until an action needs them (a GPU
        shared with processes the pool does not know about).
    :raises SettingTypeError: an argument of the wrong type (also a ``TypeError``).
    :raises InvalidSettingError: no services, or two services or two devices share a name.
    """

    def __init__(
        self,
        services: Sequence[ModelService],
        *,
        devices: Sequence[Device] | None = None,
        runtime: Runtime | None = None,
        links: Iterable[tuple[int, int]] | None = None,
        warm: bool = True,
    ) -> None:
        check_bool("warm", warm)
        if isinstance(services, (str, ModelService)) or not isinstance(services, Iterable):
            raise SettingTypeError(
                f"`services` must be a list of model services (got {services!r})"
            )
        states: dict[str, ServiceState] = {}
        for service in services:
            if not isinstance(service, ModelService):
                raise SettingTypeError(
                    f"`services` must hold tangram.gpu.ModelService objects (got {service!r})"
                )
            if service.name in states:
                raise InvalidSettingError(
                    f"service names must be unique (got {service.name!r} twice)"
                )
            states[service.name] = ServiceState(service)
        if not states:
            raise InvalidSettingError(
                f"`services` must hold at least one model service (got {services!r}): "
                "a pool with none can serve nothing"
            )
        if devices is not None:
            given = devices
            devices = list(devices) if isinstance(devices, Iterable) else []
            if not devices or not all(isinstance(d, Device) for d in devices):
                raise SettingTypeError(
                    f"`devices` must be a non-empty list of tangram.gpu.Device (got {given!r})"
                )
            names = [d.name for d in devices]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise InvalidSettingError(f"device names must be unique (got {twice} twice)")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise SettingTypeError(f"`runtime` must be a tangram.Runtime or None (got {runtime!r})")
        if links is not None:
            pairs = []
            for pair in links:
                if (
                    not isinstance(pair, (tuple, list))
                    or len(pair) != 2
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in pair)
                ):
                    raise SettingTypeError(
                        f"`links` must be pairs of device indices like (0, 1) (got {pair!r})"
                    )
                pairs.append((pair[0], pair[1]))
            links = pairs
        self._services = states
        self._devices: list[Device] = devices or []
        self._runtime = runtime
        self._links = links
        self._warm = warm
        self._placer = Placer(states)
        self._holder = Holder(self._placer)
        self._state = _PoolState.NEW

    def __repr__(self) -> str:
        names = ", ".join(self._services)
        return f"<tangram.gpu.GpuPool {self._state.value} services=[{names}]>"

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(self._devices)

    def capacity(self) -> dict[str, int]:
        """Runtime capacity of the devices: ``{"gpu_mem:<device>": bytes}``."""
        if not self._devices:
            raise GpuPoolClosedError("devices are discovered when the pool is entered")
        return {d.kind: d.memory for d in self._devices}

    async def __aenter__(self) -> GpuPool:
        if self._state is not _PoolState.NEW:
            raise GpuPoolClosedError(
                f"a GpuPool can be entered once (this one is {self._state.value})"
            )
        if not self._devices:
            self._devices = await anyio.to_thread.run_sync(discover_devices)
            if not self._devices:
                raise GpuError(
                    "no CUDA device is visible; pass devices=[Device('cpu:0', memory=...)] "
                    "to run on the host"
                )
        for i, device in enumerate(self._devices):
            if device.index is None:
                self._devices[i] = attrs.evolve(device, index=i)
        links = self._links
        if links is None:
            links = await anyio.to_thread.run_sync(nvml_nvlink_pairs)
        groups = nvlink_groups((d.index for d in self._devices if d.index is not None), links)
        self._placer.open(self._devices, groups)
        self._holder.add_devices(self._devices)
        # Cold loads run together (a TorchService runs its factory alone, for seeded
        # weights, and packs its host buffer in parallel with the others); the first
        # error is raised as itself, not inside an ExceptionGroup, so ``except GpuError``
        # catches it.
        errors: list[Exception] = []
        async with anyio.create_task_group() as loading:
            for state in self._services.values():
                loading.start_soon(self._load, state, errors)
        if errors:
            self._state = _PoolState.CLOSED
            with anyio.CancelScope(shield=True):
                for state in self._services.values():
                    with contextlib.suppress(Exception):
                        await state.service.aclose()
            raise errors[0]
        try:
            for state in self._services.values():
                self._placer.check_fits(state)
            if self._warm:
                # Nothing runs yet: the devices start full of idle replicas, planned on
                # the books first, then restored together.
                await self._holder.warm(self._placer.warm_plan())
        except BaseException:
            self._state = _PoolState.CLOSED
            with anyio.CancelScope(shield=True):
                for state in self._services.values():
                    await self._holder.evict_replicas(state)
                    with contextlib.suppress(Exception):
                        await state.service.aclose()
            raise
        self._holder.stopped = self._stopped
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._holder.task_group = task_group
        self._holder.open = True
        self._state = _PoolState.OPEN
        return self

    async def _load(self, state: ServiceState, errors: list[Exception]) -> None:
        service = state.service
        try:
            await service.load()
        except GpuError as exc:
            errors.append(exc)
        except Exception as exc:
            error = GpuServiceError(f"could not load {service.name!r}: {exc}")
            error.__cause__ = exc
            errors.append(error)
        else:
            if service.memory is None:
                errors.append(GpuServiceError(f"{service.name!r} gave no `memory` after loading"))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every replica, evict what is resident, close the services; safe twice."""
        if self._state is _PoolState.CLOSED:
            return
        self._state = _PoolState.CLOSED
        self._holder.open = False
        for state in self._services.values():
            while state.line:
                state.line.popleft().seated.set()  # with no seat: the pool closed
        task_group, self._holder.task_group = self._holder.task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            for state in self._services.values():
                await self._holder.evict_replicas(state)
                try:
                    await state.service.aclose()
                except Exception:
                    logger.exception("could not close %r", state.service)

    def _check_open(self) -> None:
        if self._state is not _PoolState.OPEN:
            raise GpuPoolClosedError(
                f"the GPU pool is {self._state.value}: use it inside `async with pool:`"
            )

    # -- actions ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ServiceHandle]:
        """One action on service ``name``: wait for a seat on a resident replica, call it,
        let go.

        The block holds its seat until it ends, so keep the calls inside it and other work
        outside: the next action in line takes the seat when it ends. The replica's
        memory stays granted while any action uses it, so it cannot be evicted under a
        running action; when the last action leaves it stays resident, idle and
        evictable, for the next action to find. A block inside another open block of the
        pool (in the same task, or in a task started inside it) joins a serving replica
        of its service beyond its seats rather than wait in line behind its own action.

        :raises UnknownResourceError: the pool has no service named ``name`` (a
            ``LookupError``).
        :raises GpuOutOfMemoryError: the restore found no room (nothing is left held).
        :raises GpuServiceError: the service failed to restore or to run.
        :raises GpuPoolClosedError: the pool closed while the action waited in line.
        """
        self._check_open()
        state = self._services.get(name)
        if state is None:
            raise UnknownResourceError(f"no service named {name!r} (have {sorted(self._services)})")
        runtime = self._runtime if self._runtime is not None else current_local_runtime("a GpuPool")
        starved = starvation_bound(runtime.policy)
        held = _held.get()
        replica = self._inside(state, held) or await self._seat(state, runtime, starved)
        block = _Block(replica)
        handle: ServiceHandle | None = None
        try:
            await replica.ready.wait()
            if replica.error is not None:
                raise replica.error
            handle = ServiceHandle(self, replica)
            _held.set((*held, block))
            yield handle
        finally:
            block.open = False
            _held.set(held)
            if handle is not None:
                handle._ended = True
            self._leave(replica, starved)

    def _inside(self, state: ServiceState, held: tuple[_Block, ...]) -> PoolReplica | None:
        """A seat for a block inside an open block of this pool, beyond the replica's
        room: the replica the blocks around it hold of its service, else its least
        loaded replica that serves now. Waiting in line there could wait for its own
        action: for the seat it holds, or, with two services nested in opposite orders
        by two actions, for each other's. ``None``: not inside an open block of this
        pool, or no replica of the service serves now (it asks for one as any action
        does)."""
        around = [
            b.replica
            for b in held
            if b.open and self._services.get(b.replica.state.service.name) is b.replica.state
        ]
        if not around:
            return None
        live = [r for r in around if r.state is state and r.alive] or [
            r
            for r in state.replicas
            if r.alive and r.leased and r.ready.is_set() and r.error is None and not r.draining
        ]
        if not live:
            return None
        replica = min(live, key=lambda r: r.users)
        self._placer.seat(replica, anyio.current_time())
        return replica

    async def _seat(self, state: ServiceState, runtime: Runtime, starved: float) -> PoolReplica:
        """Wait in the service's line for a seat on a replica; the replica."""
        now = anyio.current_time()
        waiter = Waiter(now, runtime)
        line = state.line
        line.append(waiter)  # weighed with its line, from the end of it
        # As at a departure: a replica waiting for its grant may be due a drain now, and
        # is weighed before the newcomer's place is.
        self._placer.drain(now, starved)
        attached = self._placer.attach(state, now, starved)
        if attached is not None:
            replica, new = attached
            line.pop()
            if new:
                self._holder.start(replica, runtime)
            self._placer.hand(replica, waiter)
            self._placer.fill(state)
        try:
            await waiter.seated.wait()
        except BaseException:
            if waiter.replica is not None:
                self._leave(waiter.replica, starved)
            elif waiter in state.line:
                state.line.remove(waiter)
            raise
        if waiter.replica is None:
            raise GpuPoolClosedError("the GPU pool closed while the action waited for a seat")
        return waiter.replica

    def _leave(self, replica: PoolReplica, starved: float) -> None:
        """An action leaves its seat: to the next in line if the replica takes newcomers,
        then the lines are weighed (a waiting replica may be due a drain now that its
        line has aged into its share, though no newcomer comes to look)."""
        replica.users -= 1
        replica.last_used = self._placer.tick()
        self._placer.hand_off(replica)
        self._placer.drain(anyio.current_time(), starved)
        if replica.users == 0:
            if not replica.leased and replica.scope is not None:
                replica.scope.cancel()  # nobody waits for it any more: withdraw
            replica.wake.set()

    def _stopped(self, runtime: Runtime) -> None:
        """A replica stopped and its devices are free, unless the pool closed: a waiting
        replica may wait better on them, free seats go to the lines, and a line that no
        replica takes from starts one now (its own draining replicas, or
        ``max_replicas``, held it back), as in the simulator."""
        if self._state is not _PoolState.OPEN:
            return  # ``aclose`` woke every line
        now = anyio.current_time()
        starved = starvation_bound(runtime.policy)
        self._placer.drain(now, starved)
        for state in self._services.values():
            self._placer.fill(state)
            if state.line and not any(
                r.alive and r.error is None and not r.draining for r in state.replicas
            ):
                self._placer.seat_line(state, now, self._holder.start, starved)

    # -- introspection ---------------------------------------------------------------------

    def residency(self) -> dict[str, list[tuple[str, ...]]]:
        """Where each service is resident now: ``{name: [device names per replica]}``."""
        return {
            name: [
                tuple(d.name for d in r.devices)
                for r in state.replicas
                if r.residency is Residency.RESIDENT
            ]
            for name, state in self._services.items()
        }

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Per device: capacity, resident and granted bytes, the peak, the driver's count."""
        placer = self._placer
        return {
            d.name: {
                "capacity": d.memory,
                "resident": placer.resident.get(d.name, 0),
                "granted": placer.leased.get(d.name, 0),
                "peak": placer.peak.get(d.name, 0),
                "driver_used": device_memory_used(d),
            }
            for d in self._devices
        }

    def service_stats(self) -> dict[str, dict[str, float | int | None]]:
        """Per service: restores actions waited for, restores made when the pool was
        entered (``warmed``), evictions, resident hits, runs, actions run, timings."""
        return {
            name: {
                "restores": s.restores,
                "warmed": s.warmed,
                "evictions": s.evictions,
                "hits": s.hits,
                "runs": s.runs,
                "batched": s.batched,
                "restore_seconds": s.restore_seconds,
                "run_seconds": s.run_seconds,
                "replicas_live": sum(r.alive for r in s.replicas),
            }
            for name, s in self._services.items()
        }


class ServiceHandle:
    """A resident replica lent to one action: ``await svc(batch)`` runs a batch on it.

    Calls from every action on the replica queue together; when the service batches, the
    next run takes all of them at once.
    """

    __slots__ = ("_ended", "_pool", "_replica")

    def __init__(self, pool: GpuPool, replica: PoolReplica) -> None:
        self._pool = pool
        self._replica = replica
        # Set when the action's block ends: the replica may still serve other actions,
        # but this one no longer holds a seat on it, nor its share of the memory grant.
        self._ended = False

    def __repr__(self) -> str:
        names = ",".join(d.name for d in self._replica.devices)
        return f"<tangram.gpu.ServiceHandle {self.name!r} on {names}>"

    @property
    def name(self) -> str:
        return self._replica.state.service.name

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._replica.devices

    @property
    def replica(self) -> int:
        return self._replica.index

    async def __call__(self, batch: Any) -> Any:
        """Run ``batch`` on the replica, merged with other actions' calls where it batches.

        :raises GpuPoolClosedError: the action's ``async with pool.use(...)`` block ended.
        :raises GpuServiceError: the service failed on this batch (other actions' batches
            merged with it are run again without it).
        """
        replica = self._replica
        if self._ended or not replica.alive:
            raise GpuPoolClosedError("the action ended: use the handle inside its `async with`")
        call = Call(batch)
        replica.pending.append(call)
        replica.wake.set()
        try:
            await call.done.wait()
        except BaseException:
            with contextlib.suppress(ValueError):
                replica.pending.remove(call)
            raise
        if call.error is not None:
            raise call.error
        return call.result
