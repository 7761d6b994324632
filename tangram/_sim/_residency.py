"""GPU residency on a virtual clock: the evict-on-execution rules of the live GPU pool.

The scheduler decides *when* a GPU action runs (the shared ledger and policy grant its
``gpu`` units); this model decides *where*, as :class:`tangram.gpu.GpuPool` does once the
runtime has granted a replica its memory. Every service is deployed in host memory, and
:meth:`Residency.warm` makes the ones that fit resident before the step. An action on a
service takes an idle resident replica when one is on free devices (no restore);
otherwise it goes to free devices, evicting the least recently used idle replicas there
until the service's memory fits, and pays the service's restore time. A replica with a
running action is never evicted: its devices are busy, and only free devices are ever
chosen. Which actions share a replica (batching) is the simulator's pool model, not this.

No clock and no I/O: times are passed in, so the model is a pure function of the calls.
The rules it shares with the live pool (which idle replicas an eviction takes, how the
devices are warmed) are those of ``tangram/_core/_placement.py``; what is its own is the
simulator's device model, a count of GPUs with no topology, each of ``memory_gib``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import attrs

from .._core import _placement as rules
from .._core._validate import non_negative, whole
from ..errors import InvalidSettingError
from ._clock import duration

__all__ = ["ServiceSpec", "Placement", "Residency"]


def _count(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    whole(attribute.name, value, minimum=1)


def _duration(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    duration(attribute.name, value)


@attrs.frozen(kw_only=True)
class ServiceSpec:
    """A model service as a trace header declares it (docs/traces.md, ``services``).

    ``gpu_mem_gib`` is what one replica occupies while resident, spread evenly over its
    ``gpus`` devices. A cold load is never paid: every service is deployed when the step
    starts, so the first use costs a restore. ``max_batch``: actions one replica serves at
    once (an inference server's continuous batching), each in its own time.
    """

    name: str
    gpus: int = attrs.field(default=1, validator=_count)
    gpu_mem_gib: float = attrs.field(default=0.0, validator=non_negative)
    restore_seconds: float = attrs.field(default=0.0, validator=_duration)
    max_batch: int = attrs.field(default=1, validator=_count)

    @property
    def per_device(self) -> float:
        return self.gpu_mem_gib / self.gpus


class _ResidentCopy:
    """One replica of a service in the simulated devices' memory; ``busy`` while an
    action runs on it."""

    __slots__ = ("busy", "devices", "last_used", "service")

    def __init__(self, service: str, devices: tuple[int, ...], now: float) -> None:
        self.service = service
        self.devices = devices
        self.last_used = now
        self.busy = True


@attrs.frozen
class Placement:
    """Where one action runs and what it paid to get there."""

    devices: tuple[int, ...]
    restore_seconds: float
    replica: _ResidentCopy | None = attrs.field(eq=False, repr=False)


class Residency:
    """Which replicas are resident on which of ``devices`` GPUs of ``memory_gib`` each.

    :raises InvalidSettingError: a service larger than one device's memory, or than the
        devices.
    """

    def __init__(
        self, devices: int, memory_gib: float, services: Mapping[str, ServiceSpec]
    ) -> None:
        for service in services.values():
            if service.per_device > memory_gib + 1e-9:
                raise InvalidSettingError(
                    f"service {service.name!r} needs {service.per_device:g} GiB per device, "
                    f"more than a device's {memory_gib:g} GiB"
                )
            if service.gpus > devices:
                raise InvalidSettingError(
                    f"service {service.name!r} needs {service.gpus} GPUs; there are {devices}"
                )
        self.services = dict(services)
        self.memory = memory_gib
        self._busy = [False] * devices
        self._resident: list[list[_ResidentCopy]] = [[] for _ in range(devices)]
        self._used = [0.0] * devices
        self.restores = 0
        self.evictions = 0
        self.hits = 0
        # restore_cost runs for every service at every pool event: cached until a place
        # or a release changes what is resident or busy.
        self._costs: dict[str, float] = {}

    @property
    def devices(self) -> int:
        return len(self._busy)

    def _idle_replica(self, service: str) -> _ResidentCopy | None:
        """The most recently used resident replica of ``service`` whose devices are free."""
        best: _ResidentCopy | None = None
        for device in range(self.devices):
            if self._busy[device]:
                continue
            for replica in self._resident[device]:
                if (
                    replica.service == service
                    and not any(self._busy[d] for d in replica.devices)
                    and (best is None or replica.last_used > best.last_used)
                ):
                    best = replica
        return best

    def warm(self) -> int:
        """Fill the devices with idle replicas before the step; return how many it placed.

        Nothing runs before the first action and an idle resident replica costs nothing
        (it goes the moment another service needs its memory), so the devices start full
        rather than empty: one replica of each service in declared order, then a second of
        each while there is room, and so on, as the static baseline shares its GPUs out.
        Evicts nothing, and never puts two replicas of a service on one device.
        """
        self._costs.clear()
        wanted = [rules.Wanted(name, s.per_device) for name, s in self.services.items()]
        free = {d: self.memory - self._used[d] for d in range(self.devices)}
        plan = rules.fill(wanted, free, self._warm_devices)
        for name, devices in plan:
            replica = _ResidentCopy(name, devices, -math.inf)
            replica.busy = False
            for device in devices:
                self._resident[device].append(replica)
                self._used[device] += self.services[name].per_device
        return len(plan)

    def _warm_devices(
        self, wanted: rules.Wanted, free: Mapping[int, float], taken: Collection[int]
    ) -> tuple[int, ...] | None:
        """The first devices with room for one more replica, in device order."""
        room = [
            d for d in range(self.devices) if d not in taken and rules.fits(free[d], wanted.need)
        ]
        gpus = self.services[wanted.name].gpus
        return tuple(room[:gpus]) if len(room) >= gpus else None

    def restore_cost(self, service: str) -> float:
        """Seconds an action on ``service`` arriving now would spend restoring it.

        What the policy's estimate adds, as the live pool's does: 0 when an idle replica is
        resident, the service's restore time otherwise.
        """
        cost = self._costs.get(service)
        if cost is None:
            idle = self._idle_replica(service) is not None
            cost = self._costs[service] = 0.0 if idle else self.services[service].restore_seconds
        return cost

    def place(self, service: str | None, gpus: int, now: float) -> Placement:
        """Put an admitted action on devices: a resident replica, or a restore onto free ones.

        ``service`` ``None`` is a GPU action with no model behind it: it takes free devices
        and evicts nothing.

        :raises RuntimeError: fewer free devices than the action needs (the scheduler
            granted more GPUs than exist, which the ledger never does).
        """
        self._costs.clear()
        if service is not None:
            replica = self._idle_replica(service)
            if replica is not None:
                self._occupy(replica.devices)
                replica.busy = True
                replica.last_used = now
                self.hits += 1
                return Placement(replica.devices, 0.0, replica)
            gpus = self.services[service].gpus
        need = self.services[service].per_device if service is not None else 0.0
        chosen = self._choose(gpus, need, service)
        self._occupy(chosen)
        if service is None:
            return Placement(chosen, 0.0, None)
        for device in chosen:
            self._make_room(device, need, service)
        replica = _ResidentCopy(service, chosen, now)
        for device in chosen:
            self._resident[device].append(replica)
            self._used[device] += need
        self.restores += 1
        return Placement(chosen, self.services[service].restore_seconds, replica)

    def release(self, placement: Placement, now: float) -> None:
        """The action ended: its devices are free, its replica stays resident and idle."""
        self._costs.clear()
        for device in placement.devices:
            self._busy[device] = False
        if placement.replica is not None:
            placement.replica.busy = False
            placement.replica.last_used = now

    def resident(self) -> dict[str, list[tuple[int, ...]]]:
        """Each service's resident replicas by their devices (for checks and reports)."""
        out: dict[str, list[tuple[int, ...]]] = {}
        seen: set[int] = set()
        for replicas in self._resident:
            for replica in replicas:
                if id(replica) not in seen:
                    seen.add(id(replica))
                    out.setdefault(replica.service, []).append(replica.devices)
        return {name: sorted(found) for name, found in sorted(out.items())}

    def busy(self) -> list[int]:
        return [d for d, busy in enumerate(self._busy) if busy]

    # -- internals ---------------------------------------------------------------------

    def _occupy(self, devices: tuple[int, ...]) -> None:
        for device in devices:
            self._busy[device] = True

    def _choose(self, count: int, need: float, service: str | None) -> tuple[int, ...]:
        """``count`` free devices, those that need no eviction first, then the staler ones.

        A device's cost is the latest use among the idle replicas that would have to go
        for ``need`` to fit (least recently used first), so a restore displaces the
        coldest services, as the live pool's LRU eviction does.
        """
        costs: list[tuple[bool, float, float, int]] = []
        for device in range(self.devices):
            if self._busy[device]:
                continue
            victims = self._victims(device, need, service)
            newest = max((r.last_used for r in victims), default=-math.inf)
            costs.append((bool(victims), newest, self._used[device], device))
        if len(costs) < count:
            raise RuntimeError(
                f"{count} GPUs were granted but only {len(costs)} are free: "
                "the scheduler's GPU count and the devices disagree"
            )
        costs.sort()
        return tuple(sorted(device for *_, device in costs[:count]))

    def _victims(self, device: int, need: float, service: str | None) -> list[_ResidentCopy]:
        """Idle replicas to evict from ``device``, least recently used first, for ``need``."""
        idle = sorted(self._resident[device], key=lambda r: r.last_used)
        # A replica of the same service on these devices is stale (its other devices are
        # busy): it goes, so a service never has two replicas on one device.
        stale = [r for r in idle if r.service == service]
        free = self.memory - self._used[device] + sum(self._share(r) for r in stale)
        others = [rules.Idle(r, self._share(r), r.last_used) for r in idle if r.service != service]
        return stale + rules.evictions(others, free=free, need=need)

    def _share(self, replica: _ResidentCopy) -> float:
        return self.services[replica.service].per_device

    def _make_room(self, device: int, need: float, service: str) -> None:
        for victim in self._victims(device, need, service):
            if victim.busy:  # pragma: no cover - busy replicas sit on busy devices only
                raise RuntimeError(f"would evict {victim.service!r} under a running action")
            for d in victim.devices:
                self._resident[d].remove(victim)
                self._used[d] -= self._share(victim)
            self.evictions += 1
