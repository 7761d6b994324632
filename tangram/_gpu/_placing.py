"""The live pool's books, and its decisions made from them by the pure placement rules.

The books: each device's resident, granted and peak bytes, the NVLink groups, every
service's replicas and line. The decisions (which replica an action joins or whether it
waits in line, where a new one goes, which running ones drain for a waiter and where a
waiting one waits, which idle one is evicted, what is warmed) are the
rules of ``tangram/_core/_placement.py``, which the simulator calls too; this module only
turns the books into their arguments and their answers back into replicas. Synchronous
and without a clock: the time comes in as an argument, as it does to the rules.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence

from .._core import _placement as rules
from .._core._units import format_size
from .._runtime._run import Runtime
from ..errors import GpuOutOfMemoryError, InvalidSettingError
from ._devices import Device
from ._replica import PoolReplica, Residency, ServiceState, Waiter

__all__ = ["Placer"]


class Placer:
    """Where a GPU pool's replicas are and go: its books and its placement decisions."""

    def __init__(self, services: Mapping[str, ServiceState]) -> None:
        self.services = services
        self.devices: list[Device] = []
        self.groups: list[tuple[int, ...]] = []
        self.resident: dict[str, int] = {}
        self.leased: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._clock = 0
        # When each action seated on a replica came, oldest first (trimmed to its users).
        self._joined: dict[PoolReplica, list[float]] = {}
        self._unserved: rules.Unserved[str] = rules.Unserved()

    def open(self, devices: Sequence[Device], groups: Sequence[tuple[int, ...]]) -> None:
        """Start the books on ``devices`` (each with an index) linked as ``groups``."""
        self.devices = list(devices)
        self.groups = list(groups)
        for device in self.devices:
            self.resident[device.name] = self.leased[device.name] = self.peak[device.name] = 0

    def tick(self) -> float:
        """The next use stamp: LRU order needs only which use came last, not a clock."""
        self._clock += 1
        return float(self._clock)

    def check_fits(self, state: ServiceState) -> None:
        """Refuse a service bound to unknown devices, or larger than the devices.

        :raises InvalidSettingError: a slot names a device the pool does not have.
        :raises GpuOutOfMemoryError: too few devices can hold one replica's memory.
        """
        service = state.service
        assert service.memory is not None
        slots = service.slots()
        if slots is not None:
            names = {d.name for d in self.devices}
            for slot in slots:
                unknown = [n for n in slot if n not in names]
                if unknown:
                    raise InvalidSettingError(
                        f"{service.name!r} is bound to unknown devices {unknown} "
                        f"(the pool has {sorted(names)})"
                    )
        big_enough = [d for d in self.devices if d.memory >= service.memory]
        if len(big_enough) < service.gpus:
            raise GpuOutOfMemoryError(
                f"{service.name!r} needs {format_size(service.memory)} on each of "
                f"{service.gpus} device(s); the largest device has "
                f"{format_size(max(d.memory for d in self.devices))}"
            )

    # -- actions ---------------------------------------------------------------------------

    def attach(
        self, state: ServiceState, now: float, starved: float = math.inf
    ) -> tuple[PoolReplica, bool] | None:
        """The replica an action in the service's line runs on, and whether it must be
        started for it; ``None``: it stays in line, for a seat a replica frees.

        A newcomer is weighed from the end of the line, as the simulator weighs it: a
        replica started for it serves it after a restore, and those before it take the
        seats that free meanwhile. ``starved``: the runtime's policy's starvation bound,
        past which a line that no replica serves gets one by its wait alone
        (:func:`~tangram._core._placement.targets`).
        """
        service = state.service
        alive = [r for r in state.replicas if r.alive]
        live = [r for r in alive if r.error is None and not r.draining]
        seats = rules.seats(service.max_batch, service.batching)
        may_grow = len(alive) < service.max_replicas
        # A batching service with no ``max_batch`` merges every call that waits: its
        # replicas are never full, so an action joins the least loaded rather than wait
        # (it waits in line only for a first replica).
        merges = service.batching and service.max_batch is None
        index = rules.seat(
            [r.users for r in live], seats=rules.room(seats), may_grow=may_grow or not merges
        )
        if index is not None:
            return live[index], False
        least = min(live, key=lambda r: r.users) if live and merges else None
        if not may_grow:
            return None if least is None else (least, False)
        if live:
            devices = self.choose(state, room_now=True)
            if state.run_seconds is None:
                # Before any run was measured the line's length is unknown: another copy
                # where a device has room now.
                if devices is None:
                    return None if least is None else (least, False)
            else:
                # Another copy when the service is below its share of the devices by
                # queued work (it may wait for a drain), else a seat a replica frees.
                _, wanted = self.targets(now, starved)
                if wanted[service.name] <= len(live):
                    return None if least is None else (least, False)
                if devices is None:
                    devices = self.choose(state, room_now=False)
                if devices is None:
                    return None if least is None else (least, False)
        else:
            devices = self.choose(state, room_now=False)
            if devices is None:
                return None
        return self.replica_on(state, devices), True

    def hand_off(self, replica: PoolReplica) -> Waiter | None:
        """The next in line, given the seat an action on ``replica`` left, if the replica
        takes newcomers; ``None`` when it does not or nobody waits."""
        state = replica.state
        line = state.line
        if (
            not line
            or not replica.alive
            or replica.draining
            or replica.error is not None
            or replica.users
            >= rules.room(rules.seats(state.service.max_batch, state.service.batching))
        ):
            return None
        waiter = line.popleft()
        self.hand(replica, waiter)
        return waiter

    def fill(self, state: ServiceState) -> None:
        """Hand the free seats of the service's replicas that take newcomers to its line
        (a batching replica started for a newcomer has more than that one)."""
        for replica in list(state.replicas):
            while state.line and self.hand_off(replica) is not None:
                pass

    def seat(self, replica: PoolReplica, arrival: float) -> None:
        """A seat on ``replica`` for an action that came at ``arrival`` (its age is read
        from when it came)."""
        replica.users += 1
        bisect.insort(self._joined.setdefault(replica, []), arrival)

    def hand(self, replica: PoolReplica, waiter: Waiter) -> None:
        """Seat ``waiter`` on ``replica``, and wake it."""
        self.seat(replica, waiter.arrival)
        waiter.replica = replica
        waiter.seated.set()

    def seat_line(
        self,
        state: ServiceState,
        now: float,
        start: Callable[[PoolReplica, Runtime], None],
        starved: float = math.inf,
    ) -> None:
        """Seat the line's head while :meth:`attach` finds it a place (a service none of
        whose replicas takes newcomers), calling ``start`` at once for a replica started
        for it (with the runtime it came through), so the next head's look sees it."""
        line = state.line
        while line:
            attached = self.attach(state, now, starved)
            if attached is None:
                return
            replica, new = attached
            waiter = line.popleft()
            if new:
                start(replica, waiter.runtime)
            self.hand(replica, waiter)

    def targets(
        self, now: float, starved: float = math.inf
    ) -> tuple[list[rules.Backlog[str]], dict[str, int]]:
        """Each service's line, and the replicas
        :func:`tangram._core._placement.targets` gives each, sharing the devices' memory.

        A service's line is its actions no seat has taken, with those seated on a replica
        still waiting for its grant (and, for a service that merges every call, those
        beyond a granted replica's seat, the latest to join). What each is expected to run
        is the service's learnt run time.
        """
        lines = []
        for name, state in self.services.items():
            service = state.service
            assert service.memory is not None
            seats = rules.seats(service.max_batch, service.batching)
            line = state.line
            taking = behind = 0
            joined: list[float] = []
            for replica in state.replicas:
                times = self._joined.get(replica, [])
                del times[: max(0, len(times) - replica.users)]  # the earliest have left
                if not replica.alive:
                    continue
                if replica.leased and replica.error is None and not replica.draining:
                    taking += 1
                behind += max(0, replica.users - seats)
                waiting = replica.users - (min(replica.users, seats) if replica.leased else 0)
                joined.extend(times[len(times) - waiting :] if waiting > 0 else [])
            if line:
                behind += len(line)
                joined.append(line[0].arrival)
            count = len(joined) + (len(line) - 1 if line else 0)
            oldest = min(joined, default=now)
            idle = any(r.residency is Residency.RESIDENT and not r.alive for r in state.replicas)
            lines.append(
                rules.Backlog(
                    name,
                    (state.run_seconds or 0.0) * behind,
                    now - oldest,
                    count,
                    taking,
                    seats,
                    float(service.memory * service.gpus),
                    0.0 if idle else state.restore_estimate(),
                    self._unserved.seconds(name, taking > 0, now),
                )
            )
        capacity = float(sum(d.memory for d in self.devices))
        return lines, rules.targets(lines, capacity, starved)

    def drain(self, now: float, starved: float = math.inf) -> None:
        """Mark running replicas draining until the waiting ones' memory is on the way
        (the rule and its reasons: :func:`tangram._core._placement.drains`), after moving
        a waiting replica to devices where it can come (:meth:`_move`)."""
        replicas = [r for state in self.services.values() for r in state.replicas]
        if not any(r.alive and not r.leased and r.users > 0 for r in replicas):
            return
        lines, targets = self.targets(now, starved)
        surplus = {line.key: line.replicas - targets[line.key] for line in lines}
        running = [
            rules.Holding(
                r,
                dict.fromkeys((d.name for d in r.devices), r.memory),
                users=r.users,
                granted_at=r.granted_at,
                restore_seconds=r.state.restore_estimate(),
                draining=r.draining,
                restored=r.ready.is_set(),  # a first restore's time is known by now
                service=r.state.service.name,
            )
            for r in replicas
            if r.alive and r.leased
        ]
        wanted = dict.fromkeys(self.leased, 0)
        for r in replicas:
            if r.alive and not r.leased and r.users > 0:
                self._move(r, running, surplus)
                for d in r.devices:
                    wanted[d.name] += r.memory
        free = {d.name: d.memory - self.leased[d.name] for d in self.devices}
        for replica in rules.drains(running, wanted=wanted, free=free, now=now, surplus=surplus):
            replica.draining = True

    def _move(
        self,
        replica: PoolReplica,
        running: Sequence[rules.Holding[PoolReplica]],
        surplus: Mapping[str, int],
    ) -> None:
        """Move a replica waiting for its grant to devices where the grant can come (the
        rule: :func:`tangram._core._placement.wait_on`), cancelling its ask: its holder
        asks again for the new devices, behind the grants asked for since.

        Only a one-device replica with no resident copy to lose, whose service is bound
        to no slots, moves, and only to a device where its service has no other copy
        than a stopped, evicted record, which takes the devices it leaves.
        """
        state = replica.state
        service = state.service
        if service.gpus != 1 or service.slots() is not None:
            return
        if replica.residency is not Residency.EVICTED or replica.scope is None:
            return
        taken = {
            d.name
            for r in state.replicas
            if r is not replica and (r.alive or r.users or r.residency is not Residency.EVICTED)
            for d in r.devices
        }
        # Room each device has for it: neither granted nor asked for by another waiter.
        free = {d.name: float(self.free_now(d)) for d in self.devices}
        for d in replica.devices:
            free[d.name] += replica.memory
        options = sorted(
            (d for d in self.devices if d.name not in taken and d.memory >= replica.memory),
            key=lambda d: -free[d.name],
        )
        devices = rules.wait_on(
            [d.name for d in replica.devices],
            [(d.name,) for d in options],
            running,
            need=replica.memory,
            free=free,
            surplus=surplus,
        )
        if devices is None:
            return
        by_name = {d.name: d for d in self.devices}
        here, replica.devices = replica.devices, tuple(by_name[n] for n in devices)
        # A stopped, evicted record of the service there takes the devices left, so no
        # two records share devices and moves add none.
        for other in state.replicas:
            if other is not replica and other.devices == replica.devices:
                other.devices = here
        replica.scope.cancel()

    def replica_on(self, state: ServiceState, devices: tuple[Device, ...]) -> PoolReplica:
        """The service's stopped replica on ``devices`` (it may still be resident) that no
        action is seated on, or a new one numbered with the lowest free index."""
        # One whose actions have not yet seen it stop (an error, say) is theirs, and the
        # new one started beside it shares its devices: the resident record first.
        stopped = [
            r for r in state.replicas if r.devices == devices and not r.alive and r.users == 0
        ]
        if stopped:
            return min(stopped, key=lambda r: r.residency is not Residency.RESIDENT)
        used = {r.index for r in state.replicas}
        index = next(i for i in itertools.count() if i not in used)
        replica = PoolReplica(state, index, devices)
        state.replicas.append(replica)
        return replica

    def free_now(self, device: Device) -> int:
        """Memory not granted and not asked for by a replica waiting for its grant."""
        asked = 0
        for state in self.services.values():
            for r in state.replicas:
                if r.alive and not r.leased and device in r.devices:
                    asked += r.memory
        return device.memory - self.leased[device.name] - asked

    def choose(self, state: ServiceState, *, room_now: bool) -> tuple[Device, ...] | None:
        """Devices for a new replica of ``state``'s service (the rule:
        :func:`tangram._core._placement.replica_devices`)."""
        service = state.service
        assert service.memory is not None
        busy = {d.name for r in state.replicas if r.alive for d in r.devices}
        by_name = {d.name: d for d in self.devices}
        by_index = {d.index: d for d in self.devices if d.index is not None}
        slots = service.slots()
        open_devices: Collection[int] | None = None
        if slots is not None:
            places = [tuple(by_name[n] for n in slot) for slot in slots]
            places = [o for o in places if not any(d.name in busy for d in o)]
        else:
            places = [
                r.devices
                for r in state.replicas
                if not r.alive
                and r.residency is Residency.RESIDENT
                and not any(d.name in busy for d in r.devices)
            ]
            if not places or room_now:
                open_devices = [
                    d.index
                    for d in self.devices
                    if d.index is not None and d.name not in busy and d.memory >= service.memory
                ]
        pick = rules.replica_devices(
            [_indices(o) for o in places],
            groups=self.groups,
            count=service.gpus,
            need=service.memory,
            free={i: float(self.free_now(d)) for i, d in by_index.items()},
            open_devices=open_devices,
            resident={
                _indices(r.devices) for r in state.replicas if r.residency is Residency.RESIDENT
            },
            room_now=room_now,
        )
        return None if pick is None else tuple(by_index[i] for i in pick)

    def victim(self, device: Device, keep: PoolReplica) -> PoolReplica | None:
        """The replica on ``device`` to evict for ``keep``: one another restore is evicting
        already, else the least recently used resident one that holds no grant."""
        idle = [
            rules.Idle(r, r.memory, r.last_used, going=r.residency is Residency.EVICTING)
            for state in self.services.values()
            for r in state.replicas
            if r is not keep
            and device in r.devices
            and r.residency in (Residency.RESIDENT, Residency.EVICTING)
            and not r.leased
        ]
        free = device.memory - self.resident[device.name]
        chosen = rules.evictions(idle, free=free, need=keep.memory)
        return chosen[0] if chosen else None

    # -- warming ---------------------------------------------------------------------------

    def warm_plan(self) -> list[PoolReplica]:
        """The idle replicas to restore when the pool is entered (the rule:
        :func:`tangram._core._placement.fill`), made on the books before any restore."""
        wanted = []
        for state in self.services.values():
            assert state.service.memory is not None
            wanted.append(
                rules.Wanted(state.service.name, state.service.memory, state.service.max_replicas)
            )
        free = {d.name: float(d.memory - self.resident[d.name]) for d in self.devices}
        plan = rules.fill(wanted, free, self._warm_devices)
        by_name = {d.name: d for d in self.devices}
        return [
            self.replica_on(self.services[name], tuple(by_name[n] for n in names))
            for name, names in plan
        ]

    def _warm_devices(
        self, wanted: rules.Wanted, free: Mapping[str, float], taken: Collection[str]
    ) -> tuple[str, ...] | None:
        """Devices with room for one more idle replica of a service, or ``None``."""
        service = self.services[wanted.name].service
        need = wanted.need
        slots = service.slots()
        if slots is not None:
            for slot in slots:
                if not any(n in taken for n in slot) and all(
                    rules.fits(free[n], need) for n in slot
                ):
                    return tuple(slot)
            return None
        capable = {
            d.index: free[d.name]
            for d in self.devices
            if d.index is not None and d.name not in taken and d.memory >= need
        }
        roomy = {i: f for i, f in capable.items() if rules.fits(f, need)}
        pick = rules.place(self.groups, roomy, service.gpus)
        if pick is None:
            return None
        if not rules.linked(self.groups, pick):
            # As for an action: a replica stays where it was restored, so it is not put
            # across NVLink groups while one group could hold it once memory frees up.
            wider = rules.place(self.groups, capable, service.gpus)
            if wider is not None and rules.linked(self.groups, wider):
                return None
        by_index = {d.index: d.name for d in self.devices}
        return tuple(by_index[i] for i in pick)


def _indices(devices: Sequence[Device]) -> tuple[int, ...]:
    return tuple(d.index for d in devices if d.index is not None)
