"""What tangram is measured against, each replaying the same trace on the same capacity.

- ``tangram``: :func:`tangram.simulate` with :class:`~tangram.ElasticPolicy`.
- ``tangram-fcfs``: the same with first-come-first-served admission
  (``ElasticPolicy(order="arrival")``), tangram before size-aware admission: the
  reference of its tail.
- ``srpt``: shortest-first admission plus the same elastic split, no aging and no
  starvation bound (``ElasticPolicy(aging=inf, starvation_bound=inf)``): the reference of
  its average, which nothing stops from starving a long action.
- ``fixed-dop-K``: :func:`tangram.simulate` with ``FcfsPolicy(dop=K)``, the paper's
  fixed-DoP ablation: action-level, but no elasticity.
- ``elastic``, ``fcfs``, any name of the policy registry
  (:data:`tangram.abc.POLICIES`): that policy with its defaults. The arms above that are
  tangram policies are built through the same registry, as a config file's are.
- ``static``: what verl and OpenRLHF do. Each trajectory takes a slot at its first action
  and holds it until its last action ends, LLM generation gaps included. Slots are granted
  first come, first served by the same :class:`~tangram._core._ledger.Ledger` and
  :class:`~tangram.FcfsPolicy` the product uses (one rigid "slot" action per trajectory),
  so the accounting (unit-seconds, peaks) is the product's; only the action model differs.
  API (rate) actions are shared FCFS through a second ledger, because they are not per
  trajectory in those frameworks either; sharing one queue with slot requests would make a
  search call wait behind a trajectory that cannot get a sandbox. Each GPU service gets a
  fixed, even share of the GPUs, always resident, FCFS per service.
- ``k8s``: per-trajectory pods, as ``static`` slots, that grow to an elastic action's
  maximum and shrink back, each resize taking effect a configurable lag (default 60 s)
  after it is asked, as in-place pod resizes or a vertical autoscaler do.
- ``pooled``: a yardstick for GPU services, not a reachable policy. Every request on a
  GPU service is served first come, first served by any device of one pool of all of
  them, with no restore and no residency (each request takes ``1 / max_batch`` of its
  service's devices); other actions as under ``static``. What tangram's placement
  would reach if moving a model cost nothing.
- ``bound``: every action at its maximum units with no queueing. Nothing beats it per
  action, so it is the floor each ACT is compared with.
- ``ref-srpt``, ``ref-fcfs``, ``best-fixed-dop``: references that share no code with the
  policy under test (:mod:`tangram._sim._references`): shortest first and strict FCFS
  admission, each with a water-fill split, and the fixed-DoP ablation at its best K.

Every result is a :class:`tangram.SimulationResult` with per-action records, so ACT
statistics compare like for like.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import cast

import attrs

from .._core._action import Action
from .._core._demand import build_demand
from .._core._efficiency import Estimate, Linear
from .._core._estimator import Estimator
from .._core._fcfs import FcfsPolicy
from .._core._ledger import Ledger
from .._core._policies import DEFAULT_POLICY, policy_class
from .._core._policies import POLICIES as _REGISTRY
from .._core._policy import RUNNING, Entry, Policy
from .._core._resources import Capacity, parse_capacity
from .._core._validate import number
from ..errors import InvalidSettingError
from ._references import REFERENCES, replay, run_reference
from ._simulate import ActionRecord, SimulationResult
from ._trace import Trace, TraceAction

__all__ = [
    "BASELINES",
    "POLICIES",
    "PRESETS",
    "build_policy",
    "parse_policy",
    "run_policy",
    "simulate_bound",
    "simulate_k8s",
    "simulate_pooled",
    "simulate_static",
]

PRESETS: Mapping[str, tuple[str, Mapping[str, float]]] = {
    "tangram": (DEFAULT_POLICY, {}),
    "tangram-fcfs": ("elastic", {"order": "arrival"}),  # type: ignore[dict-item]
    "srpt": ("elastic", {"aging": math.inf, "starvation_bound": math.inf}),
}
"""Arms that are a registered policy with settings: the registry's name and the options.
A registry name (``elastic``, ``fcfs``) is an arm too, with its defaults."""

BASELINES = ("static", "k8s", "pooled", "bound")
"""Arms that are not a tangram policy: a reservation, an autoscaler, a bound."""

POLICIES = (*PRESETS, *_REGISTRY, *BASELINES, *REFERENCES, "fixed-dop-K")

StaticUnits = int | Mapping[str, int] | None


def parse_policy(name: str) -> str:
    """Check an arm's name; ``fixed-dop-K`` (``fcfs`` with ``dop=K``) needs a whole K >= 1.

    :raises InvalidSettingError: an unknown name or a bad K.
    """
    if name in PRESETS or name in _REGISTRY or name in BASELINES or name in REFERENCES:
        return name
    if name.startswith("fixed-dop-"):
        text = name.removeprefix("fixed-dop-")
        if text.isdigit() and int(text) >= 1:
            return name
        raise InvalidSettingError(f"`fixed-dop-K` needs a whole K >= 1 (got {name!r})")
    raise InvalidSettingError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


def build_policy(name: str) -> Policy:
    """The policy object of an arm that is a tangram policy, built through the registry.

    :raises InvalidSettingError: ``name`` is a baseline (``static``...) or unknown.
    """
    parse_policy(name)
    if name in BASELINES or name in REFERENCES:
        raise InvalidSettingError(f"{name!r} is a baseline, not a tangram policy")
    if name.startswith("fixed-dop-"):
        return policy_class("fcfs")(dop=int(name.removeprefix("fixed-dop-")))  # type: ignore[call-arg]
    registered, options = PRESETS.get(name, (name, {}))
    return policy_class(registered)(**options)


def run_policy(
    name: str,
    trace: Trace,
    overrides: Mapping[str, float] | None = None,
    *,
    static_units: StaticUnits = None,
    k8s_lag: float = 60.0,
) -> SimulationResult:
    """Replay ``trace`` under the policy called ``name`` (see :data:`POLICIES`)."""
    parse_policy(name)
    if name == "static":
        return simulate_static(trace, overrides, static_units=static_units)
    if name == "k8s":
        return simulate_k8s(trace, overrides, static_units=static_units, lag=k8s_lag)
    if name == "pooled":
        return simulate_pooled(trace, overrides, static_units=static_units)
    if name == "bound":
        return simulate_bound(trace)
    if name in REFERENCES:
        return run_reference(name, trace, overrides)
    return replay(trace, build_policy(name), overrides)


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
    Actions on a GPU service take no slot: they run on the service's share of the GPUs
    (see :func:`service_shares`).
    """
    capacity = {**trace.capacity, **(overrides or {})}
    batch = max(1, len(trace.trajectories))
    slots: dict[str, dict[str, int]] = {}
    for name, actions in trace.trajectories.items():
        slot: dict[str, int] = {}
        held = [a for a in actions if not trace.is_rate(a.resource) and a.service is None]
        for kind in sorted({a.resource for a in held}):
            if isinstance(static_units, Mapping) and kind in static_units:
                base = int(static_units[kind])
            elif isinstance(static_units, int):
                base = static_units
            else:
                base = int(capacity[kind] // batch)
            ofkind = [a for a in held if a.resource == kind]
            most = math.ceil(max(a.max for a in ofkind))
            least = math.ceil(max(a.min for a in ofkind))
            slot[kind] = max(least, min(max(1, base), most))
        slots[name] = slot
    return slots


def service_shares(trace: Trace, overrides: Mapping[str, float] | None = None) -> dict[str, int]:
    """Replicas each GPU service gets for the whole step under ``static``.

    The GPUs are split evenly over the declared services and each share rounded down to
    whole replicas, but never below one: every service must be served somewhere, so a
    cluster with fewer GPUs than services gets more than its capacity (as a static
    deployment would need). GPUs left over by the rounding go one replica at a time to
    the services in name order, while one fits, so the static cluster uses what it has.
    """
    if not trace.services:
        return {}
    services = trace.gpu_services()
    gpus = int({**trace.capacity, **(overrides or {})}.get("gpu", 0.0))
    share = gpus / len(services)
    replicas = {name: max(1, int(share // s.gpus)) for name, s in services.items()}
    left = gpus - sum(replicas[name] * s.gpus for name, s in services.items())
    while True:
        fits = [name for name, s in services.items() if s.gpus <= left]
        if not fits:
            return replicas
        for name in fits:
            if services[name].gpus <= left:
                replicas[name] += 1
                left -= services[name].gpus


_ARRIVE, _FINISH, _WAKE = 0, 1, 2
_PLACEHOLDER = "_none"
# An ended action: trajectory, index, arrival, admission, mean units.
_Done = tuple[str, int, float, float, float]
_SLOTS = 0


class _Static:
    """The event loop of :func:`simulate_static`.

    Ledger 0 grants trajectory slots; ledger 1 is the shared API queue; ledgers 2 and on
    are one FCFS queue per GPU service over its fixed replicas (``max_batch`` actions
    each, always resident).
    """

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
        self.ledgers = [
            Ledger(self.slot_cap, FcfsPolicy(), Estimator()),
            Ledger(self.api_cap, FcfsPolicy(), Estimator()),
        ]
        self.service_ledger: dict[str, int] = {}
        self.service_gpus = 0
        # Seats a request on each service takes in its ledger.
        self.seats: dict[str, int] = {}
        self.gpu_ledgers(trace, overrides)
        self.slots = slot_sizes(trace, overrides, static_units)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.ids = 0
        self.records: list[ActionRecord] = []
        self.slot_entry: dict[str, Entry] = {}
        self.slot_of: dict[Entry, str] = {}
        self.queued: dict[Entry, tuple[str, int, float]] = {}
        self.wake: dict[int, float | None] = dict.fromkeys(range(len(self.ledgers)))

    def gpu_ledgers(self, trace: Trace, overrides: Mapping[str, float] | None) -> None:
        """One FCFS ledger per GPU service over its fixed replicas, ``max_batch`` seats each."""
        specs = trace.gpu_services()
        for name, replicas in service_shares(trace, overrides).items():
            self.service_ledger[name] = len(self.ledgers)
            self.seats[name] = 1
            slots = parse_capacity({_PLACEHOLDER: replicas * specs[name].max_batch})
            self.ledgers.append(Ledger(slots, FcfsPolicy(), Estimator()))
            self.service_gpus += replicas * specs[name].gpus

    def push(self, at: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def action(
        self, kind: str, trajectory: str, demand: dict[str, object], cap: Capacity
    ) -> Action:
        self.ids += 1
        built = build_demand(demand, cap)
        return Action(self.ids, kind, trajectory, built, Estimate(1.0, Linear()))

    def start(self, name: str, index: int, arrival: float, now: float) -> int | None:
        """Begin action ``index`` of ``name`` (its slot is held); the queue it joined, if any."""
        action = self.trace.trajectories[name][index]
        if action.service is not None:
            which = self.service_ledger[action.service]
            demand: dict[str, object] = {_PLACEHOLDER: self.seats[action.service]}
        elif self.trace.is_rate(action.resource):
            which = 1
            demand = {action.resource: action.max}
            slots = f"{action.resource}_concurrency"
            if slots in self.api_cap:
                demand[slots] = 1
        else:
            units = float(min(self.slots[name][action.resource], action.max))
            finished = now + _exec_seconds(action, units)
            self.push(finished, _FINISH, (name, index, arrival, now, units, None))
            return None
        ledger = self.ledgers[which]
        entry = ledger.submit(self.action(action.kind, name, demand, ledger.capacity), arrival)
        self.queued[entry] = (name, index, arrival)
        return which

    def run(self) -> SimulationResult:
        for name, actions in self.trace.trajectories.items():
            if actions:
                self.push(actions[0].gap, _ARRIVE, (name, 0))
        last = 0.0
        slots = self.ledgers[_SLOTS]
        while self.events:
            now = self.events[0][0]
            changed: set[int] = set()
            while self.events and self.events[0][0] == now:
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == _ARRIVE:
                    name, index = cast("tuple[str, int]", payload)
                    if index == 0 and self.slots[name]:
                        entry = slots.submit(
                            self.action("slot", name, dict(self.slots[name]), self.slot_cap), now
                        )
                        self.slot_entry[name] = entry
                        self.slot_of[entry] = name
                        changed.add(_SLOTS)
                    else:
                        self._started(self.start(name, index, now, now), changed)
                elif kind == _FINISH:
                    name, index, arrival, admitted, units, held = cast(
                        "tuple[str, int, float, float, float, tuple[int, Entry] | None]", payload
                    )
                    if held is not None:
                        self.ledgers[held[0]].finish(held[1], now)
                        changed.add(held[0])
                    self.finish((name, index, arrival, admitted, units), now, changed)
                elif kind == _WAKE:
                    which = cast(int, payload)
                    if self.wake[which] == now:
                        self.wake[which] = None
                        changed.add(which)
                else:
                    self.event(kind, payload, now, changed)
            if _SLOTS in changed:
                plan = slots.step(now)
                for entry, _ in plan.admits:
                    self.granted(entry, now, changed)
                self._wake(_SLOTS, plan.wake_at, now)
            for which in sorted(changed - {_SLOTS}):
                plan = self.ledgers[which].step(now)
                for entry, _ in plan.admits:
                    name, index, arrival = self.queued.pop(entry)
                    action = self.trace.trajectories[name][index]
                    # The FINISH carries the entry: its slot is returned then.
                    self.push(
                        now + action.seconds_at_1,
                        _FINISH,
                        (name, index, arrival, now, float(action.max), (which, entry)),
                    )
                self._wake(which, plan.wake_at, now)
            last = now
        return self._result(last)

    def finish(self, done: _Done, now: float, changed: set[int]) -> None:
        """Record an ended action; issue the next one, or end the trajectory's slot."""
        name, index, arrival, admitted, units = done
        actions = self.trace.trajectories[name]
        self.records.append(
            ActionRecord(name, index, actions[index].kind, arrival, admitted, now, units)
        )
        if index + 1 < len(actions):
            self.push(now + actions[index + 1].gap, _ARRIVE, (name, index + 1))
        elif name in self.slot_entry:
            self.ledgers[_SLOTS].finish(self.slot_entry.pop(name), now)
            changed.add(_SLOTS)

    def granted(self, entry: Entry, now: float, changed: set[int]) -> None:
        """The slot ledger admitted ``entry``: a trajectory's slot, its first action starts."""
        name = self.slot_of.pop(entry)
        # The slot wait counts as queueing of the trajectory's first action.
        self._started(self.start(name, 0, entry.arrival, now), changed)

    def event(self, kind: int, payload: object, now: float, changed: set[int]) -> None:
        """Events of a subclass's own (none here)."""
        raise AssertionError(f"unknown event {kind}")

    def _started(self, which: int | None, changed: set[int]) -> None:
        if which is not None:
            changed.add(which)

    def _result(self, last: float) -> SimulationResult:
        unit_seconds: dict[str, float] = {}
        peak: dict[str, float] = {}
        for ledger in self.ledgers[: _SLOTS + 2]:
            ledger._account(last)
            unit_seconds.update(ledger.unit_seconds)
            peak.update(ledger.peak)
        unit_seconds.pop(_PLACEHOLDER, None)
        peak.pop(_PLACEHOLDER, None)
        self.records.sort(key=lambda r: (r.arrival, r.trajectory, r.index))
        step = max((r.finished for r in self.records), default=0.0)
        if self.service_gpus:
            # Dedicated GPUs are the bill for the whole step, busy or not.
            unit_seconds["gpu"] = unit_seconds.get("gpu", 0.0) + self.service_gpus * step
            peak["gpu"] = peak.get("gpu", 0.0) + self.service_gpus
        return SimulationResult(
            records=tuple(self.records),
            step_seconds=step,
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


_RESIZE, _DONE, _SHRINK = 3, 4, 5

#: Seconds a pod resize takes to take effect under ``k8s`` unless told otherwise.
K8S_LAG = 60.0


class _Pod:
    """A trajectory's pod: its extra units beyond the slot, and what is in flight."""

    __slots__ = ("extra", "grow", "kind", "token")

    def __init__(self) -> None:
        self.extra = 0
        self.kind = ""
        self.grow: Entry | None = None
        # Bumped when an elastic action starts or ends: a resize or shrink booked before
        # is stale once it changes.
        self.token = 0


@attrs.define
class _PodRun:
    """The elastic action a pod is running: true work left and the units it runs at."""

    index: int
    arrival: float
    admitted: float
    work: float
    last: float = attrs.field(default=attrs.Factory(lambda self: self.admitted, takes_self=True))
    units: int = 0
    unit_time: float = 0.0
    version: int = 0


class _K8s(_Static):
    """The event loop of :func:`simulate_k8s`: static slots, resized late."""

    def __init__(
        self,
        trace: Trace,
        overrides: Mapping[str, float] | None,
        static_units: StaticUnits,
        lag: float,
    ) -> None:
        super().__init__(trace, overrides, static_units)
        self.lag = lag
        self.pods: dict[str, _Pod] = {}
        self.runs: dict[str, _PodRun] = {}
        self.grow_of: dict[Entry, str] = {}

    def start(self, name: str, index: int, arrival: float, now: float) -> int | None:
        action = self.trace.trajectories[name][index]
        if action.service is not None or self.trace.is_rate(action.resource):
            return super().start(name, index, arrival, now)
        if action.max <= action.min:
            return super().start(name, index, arrival, now)
        pod = self.pods.setdefault(name, _Pod())
        pod.token += 1
        self.runs[name] = _PodRun(index, arrival, now, action.seconds_at_1)
        want = int(action.max) - self.slots[name][action.resource]
        if pod.grow is None and want > 0:
            self.push(now + self.lag, _RESIZE, (name, pod.token, want))
        self._run_at(name, now)
        return None

    def _run_at(self, name: str, now: float) -> None:
        """Account progress at the old units; book the end at the pod's units now."""
        run = self.runs[name]
        action = self.trace.trajectories[name][run.index]
        pod = self.pods[name]
        extra = pod.extra if pod.kind == action.resource else 0
        units = int(min(action.max, self.slots[name][action.resource] + extra))
        if run.units:
            run.work = max(0.0, run.work - (now - run.last) * action.efficiency.speedup(run.units))
            run.unit_time += run.units * (now - run.last)
        run.last = now
        run.units = units
        run.version += 1
        done = now + run.work / action.efficiency.speedup(units)
        self.push(done, _DONE, (name, run.version))

    def granted(self, entry: Entry, now: float, changed: set[int]) -> None:
        name = self.grow_of.pop(entry, None)
        if name is None:
            super().granted(entry, now, changed)
            return
        pod = self.pods[name]
        ((pod.kind, extra),) = entry.action.demand.rigid
        pod.extra = int(extra)
        if name in self.runs:
            self._run_at(name, now)

    def event(self, kind: int, payload: object, now: float, changed: set[int]) -> None:
        if kind == _RESIZE:
            name, token, want = cast("tuple[str, int, int]", payload)
            pod = self.pods.get(name)
            if pod is None or pod.token != token or pod.grow is not None:
                return
            run = self.runs[name]
            resource = self.trace.trajectories[name][run.index].resource
            ledger = self.ledgers[_SLOTS]
            pod.grow = ledger.submit(
                self.action("resize", name, {resource: want}, ledger.capacity), now
            )
            self.grow_of[pod.grow] = name
            changed.add(_SLOTS)
        elif kind == _DONE:
            name, version = cast("tuple[str, int]", payload)
            ended = self.runs.get(name)
            if ended is None or ended.version != version:
                return
            del self.runs[name]
            pod = self.pods[name]
            pod.token += 1
            ran = now - ended.admitted
            held = ended.unit_time + ended.units * (now - ended.last)
            units = held / ran if ran > 0 else ended.units
            if pod.grow is not None:
                if pod.grow.state == RUNNING:
                    self.push(now + self.lag, _SHRINK, (name, pod.token))
                else:  # asked for, never granted: the request is dropped at once
                    self._drop_grow(pod, now)
            self.finish((name, ended.index, ended.arrival, ended.admitted, units), now, changed)
        else:
            name, token = cast("tuple[str, int]", payload)
            pod = self.pods.get(name)
            if pod is not None and pod.token == token and pod.grow is not None:
                self._drop_grow(pod, now)
                changed.add(_SLOTS)

    def finish(self, done: _Done, now: float, changed: set[int]) -> None:
        name, index = done[0], done[1]
        last = index + 1 == len(self.trace.trajectories[name])
        pod = self.pods.pop(name, None) if last else None
        if pod is not None and pod.grow is not None:
            # The pod is deleted with the trajectory: its extra units go back now.
            self._drop_grow(pod, now)
            changed.add(_SLOTS)
        super().finish(done, now, changed)

    def _drop_grow(self, pod: _Pod, now: float) -> None:
        assert pod.grow is not None
        ledger = self.ledgers[_SLOTS]
        if pod.grow.state == RUNNING:
            ledger.finish(pod.grow, now)
        else:
            ledger.withdraw(pod.grow)
            self.grow_of.pop(pod.grow, None)
        pod.grow = None
        pod.extra = 0


def simulate_k8s(
    trace: Trace,
    overrides: Mapping[str, float] | None = None,
    *,
    static_units: StaticUnits = None,
    lag: float = K8S_LAG,
) -> SimulationResult:
    """Per-trajectory pods, as static slots, whose resizes take effect ``lag`` seconds late.

    An elastic action starts at its pod's size. The pod asks to grow to the action's
    ``max`` when the action starts; the resize takes effect ``lag`` seconds later, and
    then only once the cluster has the units (FCFS with new pods). When the action ends the
    pod asks to shrink back, again ``lag`` seconds later, and holds (and is billed for)
    the extra units until then; an elastic action starting before that keeps them. A
    trajectory's last action ending deletes the pod at once. API and GPU-service actions
    are served as under ``static``.

    :raises InvalidSettingError: a negative or non-finite lag (a ``SettingTypeError`` for
        one that is not a number).
    """
    lag = number("lag", lag)
    return _K8s(trace, overrides, static_units, lag).run()


class _Pooled(_Static):
    """The event loop of :func:`simulate_pooled`: one FCFS ledger for every GPU request."""

    def gpu_ledgers(self, trace: Trace, overrides: Mapping[str, float] | None) -> None:
        specs = trace.gpu_services()
        if not specs:
            return
        gpus = int({**trace.capacity, **(overrides or {})}.get("gpu", 0.0))
        # A device is ``seats`` seats; a request takes its share of its service's devices.
        seats = math.lcm(*(s.max_batch for s in specs.values()))
        pool = len(self.ledgers)
        self.ledgers.append(
            Ledger(parse_capacity({_PLACEHOLDER: gpus * seats}), FcfsPolicy(), Estimator())
        )
        for name, spec in specs.items():
            self.service_ledger[name] = pool
            self.seats[name] = spec.gpus * seats // spec.max_batch
        self.service_gpus = gpus


def simulate_pooled(
    trace: Trace, overrides: Mapping[str, float] | None = None, *, static_units: StaticUnits = None
) -> SimulationResult:
    """GPU requests first come, first served on one pool of every device, no restore.

    A yardstick, not a policy one could run: a device serves any service at once, as if
    every model were resident everywhere. Each request holds ``gpus / max_batch`` of its
    service's devices for its run; the pool is billed for every device the whole step.
    Actions on no service run as under :func:`simulate_static`. tangram's ACT over this
    one is what moving models between devices costs it.
    """
    return _Pooled(trace, overrides, static_units).run()


def simulate_static(
    trace: Trace, overrides: Mapping[str, float] | None = None, *, static_units: StaticUnits = None
) -> SimulationResult:
    """Per-trajectory slots held from the first action's start to the last action's end.

    ``static_units``: units of each held kind per slot, one number for all kinds or a
    mapping per kind; default the capacity over the batch (see :func:`slot_sizes`).
    A trajectory waiting for its slot counts that wait as queueing of its first action.
    """
    return _Static(trace, overrides, static_units).run()
