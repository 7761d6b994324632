"""A virtual-clock driver: the live scheduler's ledger and policy, run on simulated time.

Nothing here decides anything: arrivals and completions are replayed from a workload and
every decision comes from the same :class:`~tangram._core._ledger.Ledger` and policy the live
:class:`~tangram.Runtime` uses. Actions run their *true* work (``seconds_at_1`` and
``efficiency`` of each step) while the policy sees only estimates, exact or learned.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import attrs

from .._core import _placement as rules
from .._core._action import Action
from .._core._demand import Demand, build_demand
from .._core._efficiency import Efficiency, Estimate, Linear
from .._core._estimator import Estimator
from .._core._ledger import Ledger
from .._core._policy import RUNNING, ElasticPolicy, Entry, Policy
from .._core._resources import Capacity, parse_capacity
from .._core._stats import nearest_rank
from .._core._validate import number
from ..errors import DemandTypeError, InvalidDemandError, InvalidSettingError, SettingTypeError
from ._clock import duration
from ._residency import Placement, Residency, ServiceSpec

__all__ = ["DEFAULT_GPU_MEM_GIB", "ActionRecord", "SimulationResult", "Step", "simulate"]

#: A GPU's memory where nobody says (``simulate``'s default, and a trace header's).
DEFAULT_GPU_MEM_GIB = 80.0

_ARRIVE, _FINISH, _WAKE, _SERVED = 0, 1, 2, 3


def _seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    # A negative or NaN time would move the virtual clock backwards or stall it, and a
    # huge one round every later time away.
    duration(attribute.name, value)


def _step_efficiency(
    instance: object, attribute: attrs.Attribute[Efficiency], value: object
) -> None:
    if not isinstance(value, Efficiency):
        raise DemandTypeError(f"`efficiency` must have a speedup(units) method (got {value!r})")


@attrs.frozen(kw_only=True)
class Step:
    """One action of a simulated trajectory, issued ``gap`` seconds after the previous ends.

    The demand is checked when :func:`simulate` starts. ``service`` names the GPU model
    service a rigid ``gpu`` step runs on (see ``services`` of :func:`simulate`).

    :raises SettingTypeError: a time that is not a number.
    :raises DemandTypeError: an efficiency without ``speedup``.
    :raises InvalidSettingError: a time that is not finite and >= 0.
    """

    demand: Mapping[str, object]
    seconds_at_1: float = attrs.field(validator=_seconds)
    efficiency: Efficiency = attrs.field(factory=Linear, validator=_step_efficiency)
    gap: float = attrs.field(default=0.0, validator=_seconds)
    kind: str = "action"
    service: str | None = None


@attrs.frozen
class ActionRecord:
    """When one simulated action arrived, started and ended, and its mean elastic units.

    ``overhead``: seconds between the grant and the work starting (a GPU service's
    restore), so ACT = queue + overhead + exec, as the paper breaks it down.
    """

    trajectory: str
    index: int
    kind: str
    arrival: float
    admitted: float
    finished: float
    units: float
    overhead: float = 0.0

    @property
    def queue(self) -> float:
        return self.admitted - self.arrival

    @property
    def exec(self) -> float:
        return self.finished - self.admitted - self.overhead

    @property
    def act(self) -> float:
        return self.finished - self.arrival


@attrs.frozen
class SimulationResult:
    """Every action's record plus the resource bill of one simulated step.

    ``evictions`` counts the policy's greedy evictions (actions left queued);
    ``restores`` and ``unloads`` count GPU services restored and evicted from devices.
    """

    records: tuple[ActionRecord, ...]
    step_seconds: float
    unit_seconds: Mapping[str, float]
    peak_units: Mapping[str, float]
    resizes: int
    evictions: int
    decisions: int
    restores: int = 0
    unloads: int = 0

    @property
    def avg_act(self) -> float:
        return sum(r.act for r in self.records) / len(self.records) if self.records else math.nan

    def act_quantile(self, q: float) -> float:
        return nearest_rank(sorted(r.act for r in self.records), q)


class _Run:
    __slots__ = (
        "index",
        "last",
        "placement",
        "step",
        "trajectory",
        "units",
        "version",
        "work",
    )

    def __init__(self, trajectory: str, index: int, step: Step) -> None:
        self.trajectory = trajectory
        self.index = index
        self.step = step
        self.work = step.seconds_at_1
        self.last = 0.0
        self.version = 0
        self.units: int | None = None
        self.placement: Placement | None = None


def simulate(
    trajectories: Mapping[str, Sequence[Step]],
    capacity: Mapping[str, object] | Capacity,
    *,
    policy: Policy | None = None,
    estimates: Literal["exact", "learned"] = "exact",
    estimator: Estimator | None = None,
    services: Mapping[str, ServiceSpec] | None = None,
    gpu_mem_gib_per_device: float = DEFAULT_GPU_MEM_GIB,
) -> SimulationResult:
    """Replay ``trajectories`` on ``capacity`` under ``policy`` in virtual time.

    :param estimates: ``"exact"`` gives the policy each step's true duration model;
        ``"learned"`` makes it rely on the online estimator, as a live runtime does.
    :param services: GPU model services by name. When given, the ``gpu`` capacity is that
        many devices of ``gpu_mem_gib_per_device`` GiB each, and steps naming a service
        run on its replicas as the live GPU pool runs them (see ``_Pool``): a replica's
        grant is asked from the same ledger and policy, with the restore in its estimate;
        :class:`~tangram._sim._residency.Residency` places it (evict-on-execution), and a step on
        a replica that was not resident waits for its restore (its ``overhead``).
    :raises SettingTypeError: ``trajectories`` is not a mapping of names to sequences of
        :class:`Step`, or ``policy`` or ``estimator`` of the wrong type.
    :raises InvalidSettingError: ``estimates`` or ``gpu_mem_gib_per_device`` out of range, a
        step names an unknown service, or services without a ``gpu`` capacity.
    :raises InvalidDemandError: a service step that is elastic or whose GPUs differ from its
        service's.
    """
    _check_arguments(trajectories, policy, estimates, estimator)
    number("gpu_mem_gib_per_device", gpu_mem_gib_per_device, strict=True, unit="GiB")
    cap = parse_capacity(capacity)
    learner = estimator if estimator is not None else Estimator()
    ledger = Ledger(cap, policy if policy is not None else ElasticPolicy(), learner)
    demands = {
        (name, i): build_demand(step.demand, cap)
        for name, steps in trajectories.items()
        for i, step in enumerate(steps)
    }
    pool = _pool(trajectories, demands, cap, services, gpu_mem_gib_per_device, ledger)
    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(at: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, payload))

    for name, steps in trajectories.items():
        if steps:
            push(steps[0].gap, _ARRIVE, (name, 0))
    runs: dict[Entry, _Run] = {}
    records: list[ActionRecord] = []
    ids = 0
    decisions = 0
    now = 0.0
    wake_pending: float | None = None
    last = 0.0
    while events:
        now = events[0][0]
        # Decide only when something happened: a stale completion (superseded by a resize)
        # is not an event for the live runtime either, and an extra pass would re-split
        # units as estimates age, making decisions the live runtime never makes.
        changed = False
        while events and events[0][0] == now:
            _, _, kind, payload = heapq.heappop(events)
            if kind == _ARRIVE:
                name, index = cast("tuple[str, int]", payload)
                step = trajectories[name][index]
                ids += 1
                if estimates == "exact":
                    guess = Estimate(step.seconds_at_1, step.efficiency)
                else:
                    guess = learner.predict(step.kind)
                action = Action(
                    ids, step.kind, name, demands[(name, index)], guess, estimates == "learned"
                )
                if pool is not None and step.service is not None:
                    hold = pool.arrive(action, step, index, now, push)
                    changed = changed or (hold is not None and ledger.may_admit(hold))
                    continue
                entry = ledger.submit(action, now)
                runs[entry] = _Run(name, index, step)
                changed = changed or ledger.may_admit(entry)
            elif kind == _FINISH:
                entry, version = cast("tuple[Entry, int]", payload)
                run = runs.get(entry)
                if run is None or run.version != version or entry.state != RUNNING:
                    continue
                ran = now - entry.admitted_at
                units = entry.unit_time + entry.units * (now - entry.mark)
                ledger.finish(entry, now)
                if pool is not None and run.placement is not None:
                    pool.residency.release(run.placement, now)
                del runs[entry]
                last = now
                # As the live runtime: the units freed matter only to a waiting action or
                # a resizable one that may grow into them.
                changed = changed or ledger.waiting_count > 0 or ledger.resizing
                records.append(
                    ActionRecord(
                        run.trajectory,
                        run.index,
                        run.step.kind,
                        entry.arrival,
                        entry.admitted_at,
                        now,
                        units / ran if ran > 0 and entry.elastic else float(entry.units),
                    )
                )
                steps = trajectories[run.trajectory]
                if run.index + 1 < len(steps):
                    push(now + steps[run.index + 1].gap, _ARRIVE, (run.trajectory, run.index + 1))
            elif kind == _SERVED:
                assert pool is not None
                record, served = cast("tuple[ActionRecord, _Hold]", payload)
                records.append(record)
                last = now
                changed = pool.served(served, now, push) or changed
                steps = trajectories[record.trajectory]
                if record.index + 1 < len(steps):
                    push(
                        now + steps[record.index + 1].gap,
                        _ARRIVE,
                        (record.trajectory, record.index + 1),
                    )
            elif wake_pending == now:
                wake_pending = None
                changed = True
        if not changed:
            continue
        last = now
        plan = ledger.step(now)
        decisions += 1
        for entry, _ in plan.resizes:
            _progress(runs[entry], entry, now, push)
        for entry, _ in plan.admits:
            if pool is not None and pool.granted(entry, now, push):
                continue
            run = runs[entry]
            if pool is not None:
                run.placement = pool.place_plain(entry, now)
            _progress(run, entry, now, push)
        if plan.wake_at is not None and plan.wake_at != wake_pending and plan.wake_at > now:
            wake_pending = plan.wake_at
            push(plan.wake_at, _WAKE, None)
    records.sort(key=lambda r: (r.arrival, r.trajectory, r.index))
    ledger._account(last)
    return SimulationResult(
        records=tuple(records),
        step_seconds=last,
        unit_seconds=dict(ledger.unit_seconds),
        peak_units=dict(ledger.peak),
        resizes=ledger.resizes,
        evictions=ledger.evictions,
        decisions=decisions,
        restores=pool.residency.restores if pool is not None else 0,
        unloads=pool.residency.evictions if pool is not None else 0,
    )


def _check_arguments(
    trajectories: object, policy: object, estimates: object, estimator: object
) -> None:
    """Refuse what would otherwise fail deep in the replay, far from the call that made it."""
    if not isinstance(trajectories, Mapping):
        raise SettingTypeError(
            f"`trajectories` must be a mapping of names to sequences of Step (got {trajectories!r})"
        )
    for name, steps in trajectories.items():
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence):
            raise SettingTypeError(
                f"trajectory {name!r} must be a sequence of Step (got {steps!r})"
            )
        for i, step in enumerate(steps):
            if not isinstance(step, Step):
                raise SettingTypeError(f"step {i} of {name!r} must be a Step (got {step!r})")
    if policy is not None and not callable(getattr(policy, "plan", None)):
        raise SettingTypeError(f"`policy` must have a plan(state) method (got {policy!r})")
    if estimates not in ("exact", "learned"):
        raise InvalidSettingError(f"`estimates` must be 'exact' or 'learned' (got {estimates!r})")
    if estimator is not None and not isinstance(estimator, Estimator):
        raise SettingTypeError(
            f"`estimator` must be a tangram.Estimator or None (got {estimator!r})"
        )


def _pool(
    trajectories: Mapping[str, Sequence[Step]],
    demands: Mapping[tuple[str, int], Demand],
    cap: Capacity,
    services: Mapping[str, ServiceSpec] | None,
    memory: float,
    ledger: Ledger,
) -> _Pool | None:
    """The GPU pool model when services are given; every service step checked against it."""
    if services is None:
        return None
    if "gpu" not in cap:
        raise InvalidSettingError(
            "GPU services need a `gpu` capacity, the number of devices "
            f"(the capacity has {', '.join(map(repr, cap))})"
        )
    for name, steps in trajectories.items():
        for i, step in enumerate(steps):
            demand = demands[(name, i)]
            if demand.elastic_kind == "gpu":
                raise InvalidDemandError(
                    f"step {i} of {name!r}: elastic GPU steps cannot be placed on devices"
                )
            if step.service is None:
                continue
            if step.service not in services:
                raise InvalidSettingError(
                    f"step {i} of {name!r}: unknown service {step.service!r} "
                    f"(known: {', '.join(map(repr, services)) or 'none'})"
                )
            if demand.elastic is not None or any(k != "gpu" for k, _ in demand.rigid):
                raise InvalidDemandError(
                    f"step {i} of {name!r}: a service step holds only `gpu` "
                    f"(got {dict(step.demand)!r})"
                )
            gpus = demand.amount("gpu", 0)
            if gpus != services[step.service].gpus:
                raise InvalidDemandError(
                    f"step {i} of {name!r} holds {gpus:g} GPUs but a replica of "
                    f"{step.service!r} needs {services[step.service].gpus}"
                )
    residency = Residency(int(cap["gpu"].total), memory, services)
    residency.warm()
    return _Pool(residency, ledger)


class _Hold:
    """One replica's grant in the ledger and the actions seated on it (the live holder)."""

    __slots__ = ("active", "entry", "gpus", "pending", "placement", "ready", "service", "users")

    def __init__(self, service: str, entry: Entry, gpus: int) -> None:
        self.service = service
        self.entry = entry
        self.gpus = gpus
        self.users = 0
        self.active = 0
        self.pending: deque[_Waiter] = deque()
        self.ready = math.nan
        self.placement: Placement | None = None


# An action on a service: the action, its step, its index, when it arrived.
_Waiter = tuple[Action, Step, int, float]


class _Pool:
    """The live GPU pool's bookkeeping on the virtual clock.

    As :class:`tangram.gpu.GpuPool` does, an action on a service takes a seat on a live
    replica of it that has one (fewer than the service's ``max_batch`` actions), else it
    waits in its service's line, which every replica of the service serves as seats free.
    How many replicas each service should have comes from the work in the lines against
    the restores; a service below its share starts another replica, whose grant of the
    service's GPUs is one ledger entry, asked with the restore time (0 when resident) plus
    the action's run time as its estimate: the ledger and the policy decide when a
    replica gets GPUs, :class:`~tangram._sim._residency.Residency` which devices and
    whether a restore is paid. The grant goes back when the replica's last action ends;
    the replica stays resident, idle and evictable. The seats, the lines, the shares and
    which replicas drain for a waiter are the live pool's rules, called from
    ``tangram/_core/_placement.py``.
    """

    def __init__(self, residency: Residency, ledger: Ledger) -> None:
        self.residency = residency
        self.ledger = ledger
        self.live: dict[str, list[_Hold]] = {name: [] for name in residency.services}
        # The seat lines follow the policy the cores follow (its ``due``); a policy of the
        # user's own without one keeps the default policy's aging.
        due = getattr(ledger.policy, "due", None)
        self.waiting: dict[str, rules.Waiting[_Waiter]] = {
            name: rules.Waiting(due) for name in residency.services
        }
        # A line no replica serves gets one past the policy's starvation bound, if it has
        # one (:func:`tangram._core._placement.targets`).
        self.starved = rules.starvation_bound(ledger.policy)
        self.unserved: rules.Unserved[str] = rules.Unserved()
        self.holds: dict[Entry, _Hold] = {}
        self.asked = 0  # GPUs asked for by replicas still waiting for their grant
        self.draining: set[_Hold] = set()
        self.gpus = ledger.capacity["gpu"].total
        self.taking = dict.fromkeys(residency.services, 0)  # len(_taking(service))

    def _taking(self, service: str) -> list[_Hold]:
        """The service's live replicas that take newcomers (not draining)."""
        return [h for h in self.live[service] if h not in self.draining]

    def arrive(
        self,
        action: Action,
        step: Step,
        index: int,
        now: float,
        push: Callable[[float, int, object], None],
    ) -> Entry | None:
        """Seat an action, start a replica for it, or line it up; the new replica's
        entry if one was asked for."""
        service = step.service
        assert service is not None
        spec = self.residency.services[service]
        if self.asked > 0:
            self._yield(now, *self._targets(now))
        live = self._taking(service)
        waiter = (action, step, index, now)
        pick = rules.seat([h.users for h in live], seats=spec.max_batch, may_grow=True)
        if pick is not None:
            self._seat(live[pick], waiter, now, push)
            return None
        seconds = action.estimate.seconds_at_1
        lines, wanted = self._targets(now, (service, seconds))
        if live and wanted[service] <= len(live):
            self.waiting[service].push(waiter, now, seconds)
            return None
        # Below its share of the GPUs by queued work, or no replica at all: another one,
        # which may wait for a drain.
        entry = self._start(service, waiter, now)
        self._yield(now, lines, wanted)
        return entry

    def _start(self, service: str, waiter: _Waiter, now: float) -> Entry:
        """Start a replica of ``service`` for ``waiter``; its grant is asked from the
        ledger with the restore (0 when resident) plus the action's run as its estimate."""
        spec = self.residency.services[service]
        action = waiter[0]
        restore = self.residency.restore_cost(service)
        guess = Estimate(action.estimate.seconds_at_1 + restore, action.estimate.efficiency)
        # The restore makes the estimate this grant's own, not its kind's.
        entry = self.ledger.submit(attrs.evolve(action, estimate=guess, learned=False), now)
        hold = _Hold(service, entry, spec.gpus)
        self.live[service].append(hold)
        self.taking[service] += 1
        self.holds[entry] = hold
        self.asked += spec.gpus
        hold.users = 1
        hold.pending.append(waiter)
        return entry

    def _seat(
        self, hold: _Hold, waiter: _Waiter, now: float, push: Callable[[float, int, object], None]
    ) -> None:
        hold.users += 1
        hold.pending.append(waiter)
        if hold.entry.state == RUNNING:
            self._drain(hold, now, push)

    def _targets(
        self, now: float, newcomer: tuple[str, float] | None = None
    ) -> tuple[list[rules.Backlog[str]], dict[str, int]]:
        """Each service's line (with the actions seated on replicas still waiting for
        their grant, and ``newcomer``, service and seconds), and the replicas
        :func:`tangram._core._placement.targets` gives each."""
        lines = []
        for name, spec in self.residency.services.items():
            waiting = self.waiting[name]
            oldest = waiting.oldest()
            queued, count = waiting.seconds, len(waiting)
            for hold in self.live[name]:
                if hold.entry.state != RUNNING:  # seated on a replica not granted yet
                    for seat, (action, _, _, arrival) in enumerate(hold.pending):
                        if seat >= spec.max_batch:  # behind the seats, as in a line
                            queued += action.estimate.seconds_at_1
                        count += 1
                        oldest = arrival if oldest is None else min(oldest, arrival)
            if newcomer is not None and newcomer[0] == name:
                queued, count = queued + newcomer[1], count + 1
                oldest = now if oldest is None else oldest
            replicas = sum(h.entry.state == RUNNING for h in self._taking(name))
            lines.append(
                rules.Backlog(
                    name,
                    queued,
                    0.0 if oldest is None else now - oldest,
                    count,
                    replicas,
                    spec.max_batch,
                    spec.gpus,
                    self.residency.restore_cost(name),
                    self.unserved.seconds(name, replicas > 0, now),
                )
            )
        return lines, rules.targets(lines, self.gpus, self.starved)

    def _yield(self, now: float, lines: list[rules.Backlog[str]], wanted: dict[str, int]) -> None:
        """Mark running replicas draining until the waiting ones' GPUs are on the way
        (the rule and its reasons: :func:`tangram._core._placement.drains`), from the
        services above their share by queued work."""
        services = self.residency.services
        running = [
            rules.Holding(
                hold,
                {"gpu": hold.gpus},
                users=hold.users,
                granted_at=hold.entry.admitted_at,
                restore_seconds=services[hold.service].restore_seconds,
                draining=hold in self.draining,
                service=hold.service,
            )
            for hold in self.holds.values()
            if hold.entry.state == RUNNING
        ]
        surplus = {line.key: line.replicas - wanted[line.key] for line in lines}
        need = {"gpu": float(self.asked)}
        free = {"gpu": self.ledger.free["gpu"]}
        for hold in rules.drains(running, wanted=need, free=free, now=now, surplus=surplus):
            self.draining.add(hold)
            self.taking[hold.service] -= 1

    def granted(self, entry: Entry, now: float, push: Callable[[float, int, object], None]) -> bool:
        """Place a replica whose grant came; start its actions once restored."""
        hold = self.holds.get(entry)
        if hold is None:
            return False
        self.asked -= hold.gpus
        hold.placement = self.residency.place(hold.service, hold.gpus, now)
        hold.ready = now + hold.placement.restore_seconds
        self._drain(hold, now, push)
        return True

    def place_plain(self, entry: Entry, now: float) -> Placement | None:
        """Devices for a GPU action with no service behind it (no restore, no eviction)."""
        gpus = int(entry.action.demand.amount("gpu"))
        return self.residency.place(None, gpus, now) if gpus > 0 else None

    def _drain(self, hold: _Hold, now: float, push: Callable[[float, int, object], None]) -> None:
        """Start seated actions while the replica has batch room; each runs its own time."""
        limit = self.residency.services[hold.service].max_batch
        begin = max(now, hold.ready)
        while hold.pending and hold.active < limit:
            action, step, index, arrival = hold.pending.popleft()
            hold.active += 1
            record = ActionRecord(
                action.trajectory or "",
                index,
                step.kind,
                arrival,
                now,
                begin + step.seconds_at_1,
                float(hold.gpus),
                begin - now,
            )
            push(record.finished, _SERVED, (record, hold))

    def served(self, hold: _Hold, now: float, push: Callable[[float, int, object], None]) -> bool:
        """An action on a replica ended: its seat goes to the next in line unless the
        replica drains; True when the replica's grant went back."""
        hold.users -= 1
        hold.active -= 1
        waiting = self.waiting[hold.service]
        if waiting and hold not in self.draining:
            self._seat(hold, waiting.pop(now), now, push)
        # Weighed with the freed seat taken, as the live pool weighs its lines then.
        if self.asked > 0:
            self._yield(now, *self._targets(now))
        if hold.users > 0:
            self._drain(hold, now, push)
            return False
        self.ledger.finish(hold.entry, now)
        if hold.placement is not None:
            self.residency.release(hold.placement, now)
        self.live[hold.service].remove(hold)
        del self.holds[hold.entry]
        if hold in self.draining:
            self.draining.remove(hold)
        else:
            self.taking[hold.service] -= 1
        if waiting and not self.live[hold.service]:
            # Its last replica drained with actions still in line: as a newcomer with no
            # replica would, the next in line starts one, which asks for its grant (no
            # service has a replica of right, so nothing else would serve the line).
            self._start(hold.service, waiting.pop(now), now)
        return True


def _progress(
    run: _Run, entry: Entry, now: float, push: Callable[[float, int, object], None]
) -> None:
    """Account the true work done since the last change, then book the new completion."""
    if run.units is not None:
        run.work = max(0.0, run.work - (now - run.last) * _speed(run.step, run.units))
    run.last = now
    run.units = entry.units
    run.version += 1
    push(now + run.work / _speed(run.step, entry.units), _FINISH, (entry, run.version))


def _speed(step: Step, units: int) -> float:
    return step.efficiency.speedup(units) if units > 0 else 1.0
