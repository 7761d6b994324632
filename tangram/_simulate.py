"""A virtual-clock driver: the live scheduler's ledger and policy, run on simulated time.

Nothing here decides anything: arrivals and completions are replayed from a workload and
every decision comes from the same :class:`~tangram._ledger.Ledger` and policy the live
:class:`~tangram.Runtime` uses. Actions run their *true* work (``seconds_at_1`` and
``efficiency`` of each step) while the policy sees only estimates, exact or learned.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import attrs

from ._action import Action
from ._demand import build_demand
from ._efficiency import Efficiency, Estimate, Linear
from ._estimator import Estimator
from ._ledger import Ledger
from ._policy import RUNNING, ElasticPolicy, Entry, Policy
from ._resources import Capacity, parse_capacity
from ._stats import nearest_rank

__all__ = ["ActionRecord", "SimulationResult", "Step", "simulate"]

_ARRIVE, _FINISH, _WAKE = 0, 1, 2


def _seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    # A negative or NaN time would move the virtual clock backwards or stall it.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{attribute.name}` must be a number of seconds (got {value!r})")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`{attribute.name}` must be >= 0 and finite (got {value!r})")


def _step_efficiency(
    instance: object, attribute: attrs.Attribute[Efficiency], value: object
) -> None:
    if not isinstance(value, Efficiency):
        raise TypeError(f"`efficiency` must have a speedup(units) method (got {value!r})")


@attrs.frozen(kw_only=True)
class Step:
    """One action of a simulated trajectory, issued ``gap`` seconds after the previous ends.

    The demand is checked when :func:`simulate` starts.

    :raises TypeError: a time that is not a number, or an efficiency without ``speedup``.
    :raises ValueError: a time that is not finite and >= 0.
    """

    demand: Mapping[str, object]
    seconds_at_1: float = attrs.field(validator=_seconds)
    efficiency: Efficiency = attrs.field(factory=Linear, validator=_step_efficiency)
    gap: float = attrs.field(default=0.0, validator=_seconds)
    kind: str = "action"


@attrs.frozen
class ActionRecord:
    """When one simulated action arrived, started and ended, and its mean elastic units."""

    trajectory: str
    index: int
    kind: str
    arrival: float
    admitted: float
    finished: float
    units: float

    @property
    def queue(self) -> float:
        return self.admitted - self.arrival

    @property
    def exec(self) -> float:
        return self.finished - self.admitted

    @property
    def act(self) -> float:
        return self.finished - self.arrival


@attrs.frozen
class SimulationResult:
    """Every action's record plus the resource bill of one simulated step."""

    records: tuple[ActionRecord, ...]
    step_seconds: float
    unit_seconds: Mapping[str, float]
    peak_units: Mapping[str, float]
    resizes: int
    evictions: int
    decisions: int

    @property
    def avg_act(self) -> float:
        return sum(r.act for r in self.records) / len(self.records) if self.records else math.nan

    def act_quantile(self, q: float) -> float:
        return nearest_rank(sorted(r.act for r in self.records), q)


class _Run:
    __slots__ = ("index", "last", "step", "trajectory", "units", "version", "work")

    def __init__(self, trajectory: str, index: int, step: Step) -> None:
        self.trajectory = trajectory
        self.index = index
        self.step = step
        self.work = step.seconds_at_1
        self.last = 0.0
        self.version = 0
        self.units: int | None = None


def simulate(
    trajectories: Mapping[str, Sequence[Step]],
    capacity: Mapping[str, object] | Capacity,
    *,
    policy: Policy | None = None,
    estimates: Literal["exact", "learned"] = "exact",
    estimator: Estimator | None = None,
) -> SimulationResult:
    """Replay ``trajectories`` on ``capacity`` under ``policy`` in virtual time.

    :param estimates: ``"exact"`` gives the policy each step's true duration model;
        ``"learned"`` makes it rely on the online estimator, as a live runtime does.
    """
    cap = parse_capacity(capacity)
    learner = estimator if estimator is not None else Estimator()
    ledger = Ledger(cap, policy if policy is not None else ElasticPolicy(), learner)
    demands = {
        (name, i): build_demand(step.demand, cap)
        for name, steps in trajectories.items()
        for i, step in enumerate(steps)
    }
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
                action = Action(ids, step.kind, name, demands[(name, index)], guess)
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
                del runs[entry]
                changed = True
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
            elif wake_pending == now:
                wake_pending = None
                changed = True
        if not changed:
            continue
        last = now
        plan = ledger.step(now)
        decisions += 1
        for entry, _ in (*plan.resizes, *plan.admits):
            _progress(runs[entry], entry, now, push)
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
    )


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
