"""A GPU reference that pays restores: first come, first served on one pool of devices.

``pooled``, the yardstick of issue #28's GPU targets, serves every request on any device
with no restore. No cluster whose services cannot all be resident at once reaches it: a
request for a model that is on no free device waits for a restore whatever the order.
This reference shows what a plain deployment reaches there, with the same restores:

- one line of GPU requests in arrival order, and nothing passes its head: a request takes
  a seat on a replica of its service that is loaded (or loading) and has one free
  (``max_batch`` requests at once, each in its own time), else a replica starts for it on
  devices no replica holds, else it waits, and so does everything behind it;
- a replica holds its devices while it has requests and lets them go with its last one,
  staying loaded; one that starts where its service is loaded and idle pays no restore,
  otherwise it pays the service's ``restore_seconds`` and evicts the least recently used
  idle replicas on its devices until its memory fits;
- before the step the devices are filled with idle replicas, one of each service in name
  order while one fits, then a second of each, and so on.

It shares no code with the pool under test (the simulator's ``_Pool`` and the rules of
``tangram/_core/_placement.py``) and fits on a screen, so its figures can be checked by
reading. It replays traces whose actions are all on GPUs; a GPU action that names no
service holds its devices for its run with no restore and no batching.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping
from typing import cast

import attrs

from ..errors import InvalidSettingError
from ._simulate import ActionRecord, SimulationResult
from ._trace import Trace, TraceAction

__all__ = ["ARM", "simulate_gpu_fcfs"]

ARM = "ref-gpu-fcfs"
"""The simulator arm's name."""

_EPS = 1e-9


@attrs.frozen
class _Spec:
    gpus: int
    per_device: float  # GiB on each of its devices while loaded
    restore: float
    seats: int
    keep: bool  # stays loaded when idle (a service); a plain GPU action does not


@attrs.define(eq=False)
class _Request:
    action: TraceAction
    arrival: float
    service: str
    taken: bool = False


@attrs.define(eq=False)
class _Replica:
    service: str
    devices: tuple[int, ...]
    ready: float
    used_at: float
    users: int = 0
    waiting: list[tuple[TraceAction, float, float]] = attrs.Factory(list)  # seated, not ready


def simulate_gpu_fcfs(
    trace: Trace, overrides: Mapping[str, float] | None = None
) -> SimulationResult:
    """``trace`` on one first-come-first-served pool of its GPUs, restores paid (see above).

    :raises InvalidSettingError: an action not on ``gpu``, no GPUs, or a service that no
        device (or not enough devices) could hold.
    """
    return _Pool(trace, overrides).run()


class _Pool:
    def __init__(self, trace: Trace, overrides: Mapping[str, float] | None) -> None:
        self.trace = trace
        self.gpus = int({**trace.capacity, **(overrides or {})}.get("gpu", 0))
        self.memory = trace.gpu_mem_gib_per_device
        self.specs: dict[str, _Spec] = {
            name: _Spec(s.gpus, s.per_device, s.restore_seconds, s.max_batch, True)
            for name, s in trace.gpu_services().items()
        }
        for actions in trace.trajectories.values():
            for action in actions:
                self._check(action)
        self.resident: list[list[_Replica]] = [[] for _ in range(self.gpus)]
        self.holder: list[_Replica | None] = [None] * self.gpus
        self.line: deque[_Request] = deque()
        self.waiting: dict[str, deque[_Request]] = {name: deque() for name in self.specs}
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.records: list[ActionRecord] = []
        self.restores = self.unloads = 0
        self.held = self.peak = 0
        self.held_seconds = 0.0
        self.billed_at = 0.0

    def _check(self, action: TraceAction) -> None:
        if action.resource != "gpu":
            raise InvalidSettingError(
                f"{ARM} replays GPU actions only; {action.trajectory}'s action "
                f"{action.index} needs {action.resource!r}"
            )
        if action.service is None:
            spec = _Spec(math.ceil(action.max), 0.0, 0.0, 1, False)
            self.specs[_plain(action)] = spec
        else:
            spec = self.specs[action.service]
        if spec.gpus > self.gpus or spec.per_device > self.memory + _EPS:
            raise InvalidSettingError(
                f"{ARM}: {action.service or 'a plain GPU action'} needs {spec.gpus} GPUs of "
                f"{spec.per_device:g} GiB; the trace has {self.gpus} of {self.memory:g} GiB"
            )

    def push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def run(self) -> SimulationResult:
        self._warm()
        for name, actions in self.trace.trajectories.items():
            if actions:
                self.push(actions[0].gap, _ARRIVE, (name, 0))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == _ARRIVE:
                name, index = cast(tuple[str, int], payload)
                action = self.trace.trajectories[name][index]
                request = _Request(action, now, action.service or _plain(action))
                self.line.append(request)
                self.waiting[request.service].append(request)
            elif kind == _READY:
                self._ready(cast(_Replica, payload), now)
            else:
                self._finish(*cast(tuple[_Replica, ActionRecord], payload), now)
            self._dispatch(now)
        self.records.sort(key=lambda r: (r.arrival, r.trajectory, r.index))
        step = max((r.finished for r in self.records), default=0.0)
        return SimulationResult(
            records=tuple(self.records),
            step_seconds=step,
            unit_seconds={"gpu": self.held_seconds},
            peak_units={"gpu": float(self.peak)},
            resizes=0,
            evictions=0,
            decisions=0,
            restores=self.restores,
            unloads=self.unloads,
        )

    def _warm(self) -> None:
        placed = True
        while placed:
            placed = False
            for name in sorted(n for n, s in self.specs.items() if s.keep):
                spec = self.specs[name]
                room = [
                    d
                    for d in range(self.gpus)
                    if self._free_memory(d) + _EPS >= spec.per_device
                    and all(r.service != name for r in self.resident[d])
                ]
                if len(room) >= spec.gpus:
                    self._load(name, tuple(room[: spec.gpus]), ready=0.0, used_at=-1.0)
                    placed = True

    def _free_memory(self, device: int) -> float:
        used = sum(self.specs[r.service].per_device for r in self.resident[device])
        return self.memory - used

    def _load(
        self, service: str, devices: tuple[int, ...], ready: float, used_at: float
    ) -> _Replica:
        replica = _Replica(service, devices, ready, used_at)
        for device in devices:
            self.resident[device].append(replica)
        return replica

    def _dispatch(self, now: float) -> None:
        while self.line:
            request = self.line[0]
            if request.taken:
                self.line.popleft()
                continue
            replica = self._seat(request.service, now) or self._start(request.service, now)
            if replica is None:
                return  # the head waits for devices, and so does everything behind it
            self._take(replica, request, now)
            if replica.users == 1:  # it just started: its service's line comes along
                mates = self.waiting[request.service]
                while mates and replica.users < self.specs[request.service].seats:
                    mate = mates.popleft()
                    if not mate.taken:
                        self._take(replica, mate, now)

    def _take(self, replica: _Replica, request: _Request, now: float) -> None:
        request.taken = True
        replica.users += 1
        if replica.ready <= now:
            self._begin(replica, request.action, request.arrival, now, now)
        else:
            replica.waiting.append((request.action, request.arrival, now))

    def _seat(self, service: str, now: float) -> _Replica | None:
        """A loaded replica of ``service`` with a free seat, one that serves now before
        one still restoring."""
        seats = self.specs[service].seats
        free = {
            id(r): r
            for r in self.holder
            if r is not None and r.service == service and r.users < seats
        }
        return min(free.values(), key=lambda r: (r.ready > now, r.devices), default=None)

    def _start(self, service: str, now: float) -> _Replica | None:
        spec = self.specs[service]
        free = [d for d in range(self.gpus) if self.holder[d] is None]
        if len(free) < spec.gpus:
            return None
        loaded = [
            r
            for d in free
            for r in self.resident[d]
            if r.service == service and all(self.holder[x] is None for x in r.devices)
        ]
        if loaded:
            replica = min(loaded, key=lambda r: r.devices)
        else:
            # The free devices that need the least evicted, then the lowest numbered.
            free.sort(key=lambda d: (max(0.0, spec.per_device - self._free_memory(d)), d))
            devices = tuple(sorted(free[: spec.gpus]))
            for device in devices:
                self._evict(device, spec.per_device)
            self.restores += spec.restore > 0
            replica = self._load(service, devices, now + spec.restore, now)
            if spec.restore > 0:
                self.push(replica.ready, _READY, replica)
        self._bill(now)
        for device in replica.devices:
            self.holder[device] = replica
        self.held += len(replica.devices)
        self.peak = max(self.peak, self.held)
        return replica

    def _evict(self, device: int, needed: float) -> None:
        idle = sorted((r for r in self.resident[device] if r.users == 0), key=lambda r: r.used_at)
        while self._free_memory(device) + _EPS < needed:
            gone = idle.pop(0)
            for other in gone.devices:
                self.resident[other].remove(gone)
            self.unloads += 1

    def _ready(self, replica: _Replica, now: float) -> None:
        waiting, replica.waiting = replica.waiting, []
        for action, arrival, admitted in waiting:
            self._begin(replica, action, arrival, admitted, now)

    def _begin(
        self, replica: _Replica, action: TraceAction, arrival: float, admitted: float, now: float
    ) -> None:
        record = ActionRecord(
            trajectory=action.trajectory,
            index=action.index,
            kind=action.kind,
            arrival=arrival,
            admitted=admitted,
            finished=now + action.seconds_at_1,
            units=float(len(replica.devices)),
            overhead=now - admitted,
        )
        self.push(record.finished, _FINISH, (replica, record))

    def _finish(self, replica: _Replica, record: ActionRecord, now: float) -> None:
        self.records.append(record)
        actions = self.trace.trajectories[record.trajectory]
        if record.index + 1 < len(actions):
            self.push(
                now + actions[record.index + 1].gap, _ARRIVE, (record.trajectory, record.index + 1)
            )
        replica.users -= 1
        replica.used_at = now
        if replica.users > 0:
            return
        self._bill(now)
        for device in replica.devices:
            self.holder[device] = None
        self.held -= len(replica.devices)
        if not self.specs[replica.service].keep:
            for device in replica.devices:
                self.resident[device].remove(replica)

    def _bill(self, now: float) -> None:
        self.held_seconds += self.held * (now - self.billed_at)
        self.billed_at = now


_ARRIVE, _READY, _FINISH = 0, 1, 2


def _plain(action: TraceAction) -> str:
    """A GPU action on no service is its own unbatched, never-loaded 'service', on whole
    devices (a fraction of one holds it)."""
    return f"<{math.ceil(action.max)} gpus>"
