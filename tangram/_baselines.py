"""What tangram is measured against, each replaying the same trace on the same capacity.

- ``tangram``: :func:`tangram.simulate` with :class:`~tangram.ElasticPolicy`.
- ``fixed-dop-K``: :func:`tangram.simulate` with ``FcfsPolicy(dop=K)``, the paper's
  fixed-DoP ablation: action-level, but no elasticity.
- ``static``: what verl and OpenRLHF do. Each trajectory takes a slot at its first action
  and holds it until its last action ends, LLM generation gaps included. Slots are granted
  first come, first served by the same :class:`~tangram._ledger.Ledger` and
  :class:`~tangram.FcfsPolicy` the product uses (one rigid "slot" action per trajectory),
  so the accounting (unit-seconds, peaks) is the product's; only the action model differs.
  API (rate) actions are shared FCFS through a second ledger, because they are not per
  trajectory in those frameworks either; sharing one queue with slot requests would make a
  search call wait behind a trajectory that cannot get a sandbox.
- ``bound``: every action at its maximum units with no queueing. Nothing beats it per
  action, so it is the floor each ACT is compared with.

Every result is a :class:`tangram.SimulationResult` with per-action records, so ACT
statistics compare like for like.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import cast

from ._action import Action
from ._demand import build_demand
from ._efficiency import Estimate, Linear
from ._estimator import Estimator
from ._ledger import Ledger
from ._policy import ElasticPolicy, Entry, FcfsPolicy
from ._resources import Capacity, parse_capacity
from ._simulate import ActionRecord, SimulationResult, simulate
from ._trace import Trace, TraceAction

__all__ = ["POLICIES", "parse_policy", "run_policy", "simulate_bound", "simulate_static"]

POLICIES = ("tangram", "static", "bound", "fixed-dop-K")

StaticUnits = int | Mapping[str, int] | None


def parse_policy(name: str) -> str:
    """Check a policy name; ``fixed-dop-K`` needs a whole K >= 1.

    :raises ValueError: an unknown name or a bad K.
    """
    if name in ("tangram", "static", "bound"):
        return name
    if name.startswith("fixed-dop-"):
        text = name.removeprefix("fixed-dop-")
        if text.isdigit() and int(text) >= 1:
            return name
        raise ValueError(f"`fixed-dop-K` needs a whole K >= 1 (got {name!r})")
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


def run_policy(
    name: str,
    trace: Trace,
    overrides: Mapping[str, float] | None = None,
    *,
    static_units: StaticUnits = None,
) -> SimulationResult:
    """Replay ``trace`` under the policy called ``name`` (see :data:`POLICIES`)."""
    parse_policy(name)
    if name == "static":
        return simulate_static(trace, overrides, static_units=static_units)
    if name == "bound":
        return simulate_bound(trace)
    capacity = trace.runtime_capacity(overrides)
    if name == "tangram":
        return simulate(trace.workload(), capacity, policy=ElasticPolicy())
    dop = int(name.removeprefix("fixed-dop-"))
    return simulate(trace.workload(), capacity, policy=FcfsPolicy(dop=dop))


def _exec_seconds(action: TraceAction, units: float) -> float:
    if action.max > action.min:
        return action.seconds_at_1 / action.efficiency.speedup(units)
    return action.seconds_at_1


def simulate_bound(trace: Trace) -> SimulationResult:
    """Every action alone on the cluster at its maximum units: ACT = T1 / speedup(max).

    Capacity is ignored on purpose: the bound is what the actions could do, so it may use
    more units at once than exist (``peak_units`` says how many).
    """
    records: list[ActionRecord] = []
    usage: dict[str, float] = {}
    edges: list[tuple[float, int, str, float]] = []
    for name, actions in trace.trajectories.items():
        now = 0.0
        for action in actions:
            arrival = now + action.gap
            seconds = _exec_seconds(action, action.max)
            finished = arrival + seconds
            records.append(
                ActionRecord(
                    name, action.index, action.kind, arrival, arrival, finished, action.max
                )
            )
            if not trace.is_rate(action.resource):
                usage[action.resource] = usage.get(action.resource, 0.0) + action.max * seconds
                # Ends sort before starts at the same instant, so back-to-back holds do
                # not count twice in the peak.
                edges.append((arrival, 1, action.resource, action.max))
                edges.append((finished, 0, action.resource, -action.max))
            now = finished
    peak: dict[str, float] = {}
    held: dict[str, float] = {}
    for _, _, kind, delta in sorted(edges):
        held[kind] = held.get(kind, 0.0) + delta
        peak[kind] = max(peak.get(kind, 0.0), held[kind])
    records.sort(key=lambda r: (r.arrival, r.trajectory, r.index))
    return SimulationResult(
        records=tuple(records),
        step_seconds=max((r.finished for r in records), default=0.0),
        unit_seconds=usage,
        peak_units=peak,
        resizes=0,
        evictions=0,
        decisions=0,
    )


def slot_sizes(
    trace: Trace, overrides: Mapping[str, float] | None = None, static_units: StaticUnits = None
) -> dict[str, dict[str, int]]:
    """Each trajectory's slot: units of every held kind it uses.

    The default is the capacity split evenly over the batch (at least 1), capped at the
    most any of its actions can use and raised to the least its rigid actions need, so a
    slot never idles units no action could take and never starves an action of its minimum.
    """
    capacity = {**trace.capacity, **(overrides or {})}
    batch = max(1, len(trace.trajectories))
    slots: dict[str, dict[str, int]] = {}
    for name, actions in trace.trajectories.items():
        slot: dict[str, int] = {}
        for kind in sorted({a.resource for a in actions if not trace.is_rate(a.resource)}):
            if isinstance(static_units, Mapping) and kind in static_units:
                base = int(static_units[kind])
            elif isinstance(static_units, int):
                base = static_units
            else:
                base = int(capacity[kind] // batch)
            ofkind = [a for a in actions if a.resource == kind]
            most = math.ceil(max(a.max for a in ofkind))
            least = math.ceil(max(a.min for a in ofkind))
            slot[kind] = max(least, min(max(1, base), most))
        slots[name] = slot
    return slots


_ARRIVE, _FINISH, _WAKE = 0, 1, 2
_PLACEHOLDER = "_none"


class _Static:
    """The event loop of :func:`simulate_static`."""

    def __init__(
        self, trace: Trace, overrides: Mapping[str, float] | None, static_units: StaticUnits
    ) -> None:
        self.trace = trace
        capacity = trace.runtime_capacity(overrides)
        held = {k: v for k, v in capacity.items() if not trace.is_rate(k)}
        # Concurrency slots of an API belong to the shared API queue, not to sandboxes.
        shared = {k for k in held if k.endswith("_concurrency")}
        # A ledger needs some capacity; a placeholder kind stands in where a trace has no
        # held (or no API) kinds, and is dropped from the results.
        slot_kinds = {k: v for k, v in held.items() if k not in shared}
        self.slot_cap = parse_capacity(slot_kinds or {_PLACEHOLDER: 1})
        api = {k: v for k, v in capacity.items() if trace.is_rate(k) or k in shared}
        self.api_cap = parse_capacity(api or {_PLACEHOLDER: 1})
        self.slots_ledger = Ledger(self.slot_cap, FcfsPolicy(), Estimator())
        self.api_ledger = Ledger(self.api_cap, FcfsPolicy(), Estimator())
        self.slots = slot_sizes(trace, overrides, static_units)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.ids = 0
        self.records: list[ActionRecord] = []
        self.slot_entry: dict[str, Entry] = {}
        self.slot_of: dict[Entry, str] = {}
        self.api_of: dict[Entry, tuple[str, int, float]] = {}
        self.wake: dict[int, float | None] = {0: None, 1: None}

    def push(self, at: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def action(
        self, kind: str, trajectory: str, demand: dict[str, object], cap: Capacity
    ) -> Action:
        self.ids += 1
        built = build_demand(demand, cap)
        return Action(self.ids, kind, trajectory, built, Estimate(1.0, Linear()))

    def start(self, name: str, index: int, arrival: float, now: float) -> bool:
        """Begin action ``index`` of ``name`` (its slot is held); True if the API queue grew."""
        action = self.trace.trajectories[name][index]
        if self.trace.is_rate(action.resource):
            demand: dict[str, object] = {action.resource: action.max}
            slots = f"{action.resource}_concurrency"
            if slots in self.api_cap:
                demand[slots] = 1
            entry = self.api_ledger.submit(
                self.action(action.kind, name, demand, self.api_cap), arrival
            )
            self.api_of[entry] = (name, index, arrival)
            return True
        units = float(min(self.slots[name][action.resource], action.max))
        finished = now + _exec_seconds(action, units)
        self.push(finished, _FINISH, (name, index, arrival, now, units, None))
        return False

    def run(self) -> SimulationResult:
        for name, actions in self.trace.trajectories.items():
            if actions:
                self.push(actions[0].gap, _ARRIVE, (name, 0))
        last = 0.0
        while self.events:
            now = self.events[0][0]
            slots_changed = api_changed = False
            while self.events and self.events[0][0] == now:
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == _ARRIVE:
                    name, index = cast("tuple[str, int]", payload)
                    if index == 0 and self.slots[name]:
                        entry = self.slots_ledger.submit(
                            self.action("slot", name, dict(self.slots[name]), self.slot_cap), now
                        )
                        self.slot_entry[name] = entry
                        self.slot_of[entry] = name
                        slots_changed = True
                    else:
                        api_changed = self.start(name, index, now, now) or api_changed
                elif kind == _FINISH:
                    name, index, arrival, admitted, units, held = cast(
                        "tuple[str, int, float, float, float, Entry | None]", payload
                    )
                    if held is not None:
                        self.api_ledger.finish(held, now)
                        api_changed = True
                    action = self.trace.trajectories[name][index]
                    self.records.append(
                        ActionRecord(name, index, action.kind, arrival, admitted, now, units)
                    )
                    actions = self.trace.trajectories[name]
                    if index + 1 < len(actions):
                        self.push(now + actions[index + 1].gap, _ARRIVE, (name, index + 1))
                    elif name in self.slot_entry:
                        self.slots_ledger.finish(self.slot_entry.pop(name), now)
                        slots_changed = True
                else:
                    which = cast(int, payload)
                    if self.wake[which] == now:
                        self.wake[which] = None
                        api_changed = api_changed or which == 1
                        slots_changed = slots_changed or which == 0
            if slots_changed:
                plan = self.slots_ledger.step(now)
                for entry, _ in plan.admits:
                    name = self.slot_of.pop(entry)
                    # The slot wait counts as queueing of the trajectory's first action.
                    api_changed = self.start(name, 0, entry.arrival, now) or api_changed
                self._wake(0, plan.wake_at, now)
            if api_changed:
                plan = self.api_ledger.step(now)
                for entry, _ in plan.admits:
                    name, index, arrival = self.api_of.pop(entry)
                    action = self.trace.trajectories[name][index]
                    # The FINISH carries the entry: its concurrency slot is returned then.
                    self.push(
                        now + action.seconds_at_1,
                        _FINISH,
                        (name, index, arrival, now, float(action.max), entry),
                    )
                self._wake(1, plan.wake_at, now)
            last = now
        self.slots_ledger._account(last)
        self.api_ledger._account(last)
        self.records.sort(key=lambda r: (r.arrival, r.trajectory, r.index))
        unit_seconds = {**self.api_ledger.unit_seconds, **self.slots_ledger.unit_seconds}
        peak = {**self.api_ledger.peak, **self.slots_ledger.peak}
        unit_seconds.pop(_PLACEHOLDER, None)
        peak.pop(_PLACEHOLDER, None)
        return SimulationResult(
            records=tuple(self.records),
            step_seconds=max((r.finished for r in self.records), default=0.0),
            unit_seconds=unit_seconds,
            peak_units=peak,
            resizes=0,
            evictions=0,
            decisions=0,
        )

    def _wake(self, which: int, at: float | None, now: float) -> None:
        if at is not None and at > now and at != self.wake[which]:
            self.wake[which] = at
            self.push(at, _WAKE, which)


def simulate_static(
    trace: Trace, overrides: Mapping[str, float] | None = None, *, static_units: StaticUnits = None
) -> SimulationResult:
    """Per-trajectory slots held from the first action's start to the last action's end.

    ``static_units``: units of each held kind per slot, one number for all kinds or a
    mapping per kind; default the capacity over the batch (see :func:`slot_sizes`).
    A trajectory waiting for its slot counts that wait as queueing of its first action.
    """
    return _Static(trace, overrides, static_units).run()
