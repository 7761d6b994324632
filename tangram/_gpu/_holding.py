"""A replica's life on its devices: hold the grant, restore, serve, evict.

One holder task per live replica asks the runtime for the replica's memory on each of its
devices, restores it once granted (evicting the idle replicas the placement rules name
until it fits), runs the batches its actions hand it, and gives the grant back when the
last action leaves. Restores and evictions hold the locks of the devices they touch, so
the books (``_placing.py``) always match what the devices hold.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.abc

from .._runtime._run import Runtime
from ..errors import (
    GpuError,
    GpuOutOfMemoryError,
    GpuPoolClosedError,
    GpuServiceError,
    TangramError,
)
from ._devices import Device
from ._placing import Placer
from ._replica import Call, PoolReplica, Residency, ServiceState, ewma

__all__ = ["Holder"]

logger = logging.getLogger("tangram.gpu")


class Holder:
    """Starts and runs the replicas' holder tasks, and restores and evicts replicas."""

    def __init__(self, placer: Placer) -> None:
        self.placer = placer
        self.locks: dict[str, anyio.Lock] = {}
        self.task_group: anyio.abc.TaskGroup | None = None
        self.open = False
        # Called whenever a replica stops, with the runtime it held its grant from: a
        # line its service's draining replicas held back may start a replica then.
        self.stopped: Callable[[Runtime], None] | None = None

    def add_devices(self, devices: list[Device]) -> None:
        for device in devices:
            self.locks[device.name] = anyio.Lock()

    def start(self, replica: PoolReplica, runtime: Runtime) -> None:
        """Start the task that asks for ``replica``'s grant and serves it."""
        assert self.task_group is not None
        replica.alive = True
        replica.draining = False
        replica.error = None
        replica.ready = anyio.Event()
        replica.wake = anyio.Event()
        replica.scope = anyio.CancelScope()
        self.task_group.start_soon(self._hold, replica, runtime)

    @contextlib.asynccontextmanager
    async def holding(self, replica: PoolReplica) -> AsyncIterator[None]:
        """Hold what a restore or an eviction of ``replica`` must hold.

        Its devices' locks in name order, so two replicas never deadlock, then its own.
        """
        async with contextlib.AsyncExitStack() as stack:
            for device in sorted(replica.devices, key=lambda d: d.name):
                await stack.enter_async_context(self.locks[device.name])
            await stack.enter_async_context(replica.lock)
            yield

    async def warm(self, replicas: list[PoolReplica]) -> None:
        """Restore the planned idle ``replicas`` together, serialised per device by the
        device locks, so separate devices fill in parallel."""
        async with anyio.create_task_group() as restoring:
            for replica in replicas:
                restoring.start_soon(self._warm_one, replica)

    async def _warm_one(self, replica: PoolReplica) -> None:
        state = replica.state
        resident = self.placer.resident
        async with self.holding(replica):
            if any(d.memory - resident[d.name] < replica.memory for d in replica.devices):
                return  # the plan leaves room; evict nothing for a replica nobody asked for
            try:
                await self.restore(replica)
            except Exception:
                # A failed warm-up leaves the replica evicted: the first action on it
                # restores it as it would have without warming.
                logger.warning(
                    "could not warm %r onto %s; it stays evicted until an action needs it",
                    state.service.name,
                    ", ".join(d.name for d in replica.devices),
                    exc_info=True,
                )
                return
            state.warmed += 1

    def _estimate(self, replica: PoolReplica) -> float | None:
        """What the replica's grant costs the runtime: a restore unless resident, plus the
        service's learnt run time, so the policy sees what the action will really cost."""
        state = replica.state
        restore = 0.0
        if replica.residency is not Residency.RESIDENT:
            restore = state.restore_estimate()
        if state.run_seconds is None:
            return restore if restore > 0 else None
        return restore + state.run_seconds

    async def _hold(self, replica: PoolReplica, runtime: Runtime) -> None:
        """Hold the replica's memory grant while actions use it; run their batches."""
        state = replica.state
        try:
            while True:
                assert replica.scope is not None
                with replica.scope:
                    await self._lease_and_serve(replica, runtime)
                # The scope is cancelled when the last waiting action left before the
                # grant came. Another action may have joined since, before this task
                # saw the cancellation: it waits on ``ready``, so ask again for it.
                if replica.users == 0 or not self.open:
                    break
                replica.scope = anyio.CancelScope()
        except Exception as exc:
            if isinstance(exc, TangramError):
                replica.error = exc
            else:
                replica.error = GpuServiceError(f"{state.service.name!r}: {exc}")
                replica.error.__cause__ = exc
        finally:
            if replica.error is None and (replica.users or replica.pending):
                replica.error = GpuPoolClosedError("the replica stopped (the pool closed)")
            replica.alive = False
            replica.draining = False
            replica.scope = None
            replica.last_used = self.placer.tick()
            replica.ready.set()
            for call in replica.pending:
                call.error = replica.error or GpuPoolClosedError("the replica stopped")
                call.done.set()
            replica.pending.clear()
            if self.stopped is not None:
                self.stopped(runtime)

    async def _lease_and_serve(self, replica: PoolReplica, runtime: Runtime) -> None:
        state = replica.state
        memory = replica.memory
        leased = self.placer.leased
        devices = replica.devices
        demand = {d.kind: memory for d in devices}
        context = runtime.acquire(
            demand, kind=f"gpu:{state.service.name}", estimate=self._estimate(replica)
        )
        async with context as lease:
            if replica.devices != devices:
                return  # moved while the grant came: its scope is cancelled, ask again
            replica.leased = True
            replica.granted_at = anyio.current_time()
            for d in devices:
                leased[d.name] += memory
            try:
                await self._make_resident(replica)
                lease.started_at = anyio.current_time()
                replica.ready.set()
                await self._serve(replica)
            finally:
                replica.leased = False
                for d in devices:
                    leased[d.name] -= memory

    async def _serve(self, replica: PoolReplica) -> None:
        state = replica.state
        service = state.service
        while True:
            if not replica.pending:
                if replica.users == 0:
                    return
                await replica.wake.wait()
                replica.wake = anyio.Event()
                continue
            limit = (service.max_batch or len(replica.pending)) if service.batching else 1
            calls, replica.pending = replica.pending[:limit], replica.pending[limit:]
            try:
                await self._run_merged(replica, calls)
            except BaseException:
                # Cancelled mid-run (the pool closed): the calls taken from the queue
                # would otherwise wait for ever.
                for call in calls:
                    if not call.done.is_set():
                        call.error = GpuPoolClosedError("the replica stopped (the pool closed)")
                        call.done.set()
                raise

    async def _run_merged(self, replica: PoolReplica, calls: list[Call]) -> None:
        """Run ``calls`` as one run; if it fails, run each alone and fail only its own.

        One action's malformed batch (a wrong shape, a bad request) fails the run of every
        batch merged with it; run alone, the others succeed and only that action gets the
        error. A service that fails for every batch pays one more run per call.
        """
        error = await self._run(replica, calls)
        if error is None:
            return
        if len(calls) == 1:
            calls[0].error = error
            calls[0].done.set()
            return
        for call in calls:
            call.error = await self._run(replica, [call])
            call.done.set()

    async def _run(self, replica: PoolReplica, calls: list[Call]) -> GpuError | None:
        """Run ``calls`` as one merged run; hand out the results, or return the error.

        The calls are left undone on failure, for the caller to retry or fail them.
        """
        state = replica.state
        service = state.service
        started = anyio.current_time()
        try:
            results = await service.run(replica.index, [c.batch for c in calls])
            if len(results) != len(calls):
                raise GpuServiceError(
                    f"{service.name!r} returned {len(results)} results for {len(calls)} batches"
                )
        except Exception as exc:
            if isinstance(exc, GpuError):
                return exc
            error = GpuServiceError(f"{service.name!r} failed to run: {exc}")
            error.__cause__ = exc
            return error
        seconds = anyio.current_time() - started
        state.run_seconds = ewma(state.run_seconds, seconds)
        state.runs += 1
        state.batched += len(calls)
        for call, result in zip(calls, results, strict=True):
            call.result = result
            call.done.set()
        return None

    async def _make_resident(self, replica: PoolReplica) -> None:
        """Restore ``replica`` once its grant came, evicting LRU idle replicas for room."""
        state = replica.state
        resident = self.placer.resident
        async with self.holding(replica):
            if replica.residency is Residency.RESIDENT:
                state.hits += 1
                return
            for device in replica.devices:
                while device.memory - resident[device.name] < replica.memory:
                    victim = self.placer.victim(device, replica)
                    if victim is None:  # pragma: no cover - the runtime's grant prevents it
                        raise GpuOutOfMemoryError(
                            f"no idle service to evict on {device.name} for {state.service.name!r}"
                        )
                    # A victim on several devices may be evicted for a restore on another
                    # of them meanwhile: wait for that, then look again, never twice.
                    async with victim.lock:
                        if victim.residency is Residency.RESIDENT and not victim.leased:
                            await self.evict(victim)
            await self.restore(replica)
            state.restores += 1

    async def restore(self, replica: PoolReplica) -> None:
        """Restore ``replica`` where its memory is free; on failure nothing stays held.

        The caller holds the replica's device locks and its own lock.
        """
        state = replica.state
        memory = replica.memory
        resident, peak = self.placer.resident, self.placer.peak
        replica.residency = Residency.RESTORING
        for device in replica.devices:
            resident[device.name] += memory
            peak[device.name] = max(peak[device.name], resident[device.name])
        started = anyio.current_time()
        try:
            await state.service.restore(replica.index, replica.devices)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await state.service.evict(replica.index)
            replica.residency = Residency.EVICTED
            for device in replica.devices:
                resident[device.name] -= memory
            if isinstance(exc, MemoryError) and not isinstance(exc, GpuError):
                raise GpuOutOfMemoryError(
                    f"restoring {state.service.name!r}: out of memory ({exc})"
                ) from exc
            raise
        state.restore_seconds = ewma(state.restore_seconds, anyio.current_time() - started)
        replica.residency = Residency.RESIDENT

    async def evict(self, replica: PoolReplica) -> None:
        """Free ``replica``'s devices; on failure its memory is still counted as held."""
        state = replica.state
        replica.residency = Residency.EVICTING
        try:
            with anyio.CancelScope(shield=True):
                await state.service.evict(replica.index)
        except Exception:
            # Its memory may still be held: keep counting it, and say so.
            replica.residency = Residency.RESIDENT
            logger.exception("could not evict %r replica %d", state.service.name, replica.index)
            raise
        replica.residency = Residency.EVICTED
        state.evictions += 1
        for device in replica.devices:
            self.placer.resident[device.name] -= replica.memory

    async def evict_replicas(self, state: ServiceState) -> None:
        """Evict every replica of ``state``'s service not known to be evicted, shielded;
        a failure is logged by :meth:`evict` and does not stop the others."""
        with anyio.CancelScope(shield=True):
            for replica in state.replicas:
                if replica.residency is not Residency.EVICTED:
                    with contextlib.suppress(Exception):
                        await self.evict(replica)
