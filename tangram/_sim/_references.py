"""References for :class:`~tangram.ElasticPolicy`, each a separate, simple implementation.

A reference that is a mode of the policy under test shares its bugs: a wrong reservation
or a unit lost in its split would show in both arms and cancel out. These share nothing
with it but the :class:`~tangram._core._policy.Policy` protocol and the ledger, and each
rule fits on a screen, so it can be checked by reading:

- :class:`ShortestFirst` (arm ``ref-srpt``): admit waiting actions shortest expected
  service first (seconds at the minimum grant), each one whose minimum fits, with no
  reservation, no aging and no starvation bound. The reference of the average.
- :class:`FcfsAdmission` (arm ``ref-fcfs``): admit in arrival order, and nothing passes an
  earlier waiting action that needs a kind it needs (strict first-come first-served per
  resource kind). Not one queue for all kinds: then a search call waiting for its rate
  budget would hold up every build behind it, which no deployment would do (the static
  baseline keeps API calls in a queue of their own for the same reason). No backfill,
  unlike ``tangram-fcfs`` (``ElasticPolicy(order="arrival")``, EASY-style backfill).
- Both split each elastic kind by water-fill: the units not held by others go to the
  running resizable actions of the kind and the newcomers, equal shares capped at each
  one's maximum and never below its minimum (max-min fair), recomputed at every pass.
- :func:`~tangram._sim._gpu_reference.simulate_gpu_fcfs` (arm ``ref-gpu-fcfs``, traces of
  GPU actions only): one first-come-first-served line for every device, restores paid
  and least-recently-used replicas evicted, in a pool model of its own
  (:mod:`._gpu_reference`): what a plain deployment reaches where ``pooled`` cannot.
- :func:`simulate_best_fixed_dop` (arm ``best-fixed-dop``): :class:`~tangram.FcfsPolicy`
  with each degree of parallelism of a small grid, the best average ACT kept: the fixed-DoP
  ablation at its best K, known only in hindsight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from .._core._fcfs import FcfsPolicy
from .._core._policy import Entry, Plan, Policy, State
from ..errors import InvalidSettingError
from ._gpu_reference import ARM as GPU_FCFS
from ._gpu_reference import simulate_gpu_fcfs
from ._simulate import SimulationResult, simulate
from ._trace import Trace

__all__ = [
    "DOP_GRID",
    "REFERENCES",
    "FcfsAdmission",
    "ShortestFirst",
    "dop_grid",
    "replay",
    "run_reference",
    "simulate_best_fixed_dop",
    "water_fill",
]

REFERENCES = ("ref-srpt", "ref-fcfs", GPU_FCFS, "best-fixed-dop")
"""Simulator arms that are references, not product policies (not in the policy registry)."""

# Degrees of parallelism the best-fixed-DoP arm tries, below the trace's largest maximum;
# "max" (every action at its own maximum) is always tried.
DOP_GRID = (1, 2, 4, 8, 16)

_EPS = 1e-9


@attrs.frozen
class ShortestFirst:
    """Shortest expected service first, anything that fits; water-fill per elastic kind."""

    def priority(self, entry: Entry, state: State) -> tuple[float, float]:
        """The ledger's order: expected seconds at the minimum grant, never due (no aging)."""
        return entry.t1 / entry.speed(entry.emin), math.inf

    def due(self, arrival: float, seconds: float) -> float:
        """GPU seat lines: never due, so they are shortest first too."""
        return math.inf

    def plan(self, state: State) -> Plan:
        return _plan(state, state.waiting(), strict=False)


@attrs.frozen
class FcfsAdmission:
    """Arrival order, no passing within a kind; water-fill per elastic kind."""

    def due(self, arrival: float, seconds: float) -> float:
        """GPU seat lines: due on arrival, so they are first come, first served too."""
        return arrival

    def plan(self, state: State) -> Plan:
        # No ``priority``: the ledger yields waiting actions in arrival order.
        return _plan(state, state.waiting(), strict=True)


def _plan(state: State, queue: Iterable[Entry], *, strict: bool) -> Plan:
    """Admit from ``queue`` in its order each action whose minimum fits, then split.

    Units resizable running actions hold above their minimum count as room (the split
    takes them back), as do a rate budget's tokens. ``strict``: an action that does not
    fit blocks every later one needing any of its kinds.
    """
    room = {kind: free + state.surplus.get(kind, 0.0) for kind, free in state.free.items()}
    tokens = dict(state.tokens)
    rigid = dict.fromkeys(room, 0.0)  # units of held kinds newcomers take outside the split
    blocked: set[str] = set()
    admitted: list[Entry] = []
    plan = Plan()
    for entry in queue:
        # Without budgets nothing later can start once every kind is full. With them every
        # action is looked at, to book a wake-up for when its budget refills.
        if not tokens and all(left <= _EPS for left in room.values()):
            break
        demand = entry.action.demand
        need = [(tokens if k in tokens else room, k, amount) for k, amount in demand.minimum]
        if strict and any(kind in blocked for _, kind, _ in need):
            continue
        if any(amount > pool[kind] + _EPS for pool, kind, amount in need):
            wake = _refill(state, tokens, demand.minimum)
            if wake is not None and (plan.wake_at is None or wake < plan.wake_at):
                plan.wake_at = wake
            if strict:
                blocked.update(kind for _, kind, _ in need)
            continue
        for pool, kind, amount in need:
            pool[kind] -= amount
        for kind, amount in demand.rigid:
            if kind in rigid:
                rigid[kind] += amount
        admitted.append(entry)
    _split(state, admitted, rigid, plan)
    return plan


def _refill(
    state: State, tokens: Mapping[str, float], need: Iterable[tuple[str, float]]
) -> float | None:
    """When the rate budgets alone would let ``need`` start, if one of them is short."""
    wake: float | None = None
    for kind, amount in need:
        level = tokens.get(kind)
        if level is not None and amount > level + _EPS:
            # A microsecond late, so rounding cannot leave the budget a hair short then.
            at = state.now + (amount - level) / state.rates[kind] + 1e-6
            wake = at if wake is None else max(wake, at)
    return wake


def _split(state: State, admitted: list[Entry], rigid: Mapping[str, float], plan: Plan) -> None:
    """Grant the admitted actions and resize the running resizable ones, per elastic kind.

    A kind's pool is its free units, less what this pass's rigid admissions take, plus
    what its running resizable actions hold: everything not held for good by others.
    """
    fresh: dict[str, list[Entry]] = {}
    for entry in admitted:
        kind = entry.action.demand.elastic_kind
        if kind is None:
            plan.admits.append((entry, 0))
        else:
            fresh.setdefault(kind, []).append(entry)
    for kind, free in state.free.items():
        members = list(state.split(kind).members)
        new = fresh.get(kind, [])
        if not members and not new:
            continue
        pool = free - rigid[kind] + sum(e.units for e in members)
        shares = water_fill([*members, *new], math.floor(pool + _EPS))
        plan.admits.extend((e, shares[e]) for e in new)
        plan.resizes.extend((e, shares[e]) for e in members if shares[e] != e.units)
    # Shrinks first, so whoever applies the plan in order never holds more than there is.
    plan.resizes.sort(key=lambda item: item[1] - item[0].units)


def water_fill(entries: Sequence[Entry], units: int) -> dict[Entry, int]:
    """Max-min fair shares of ``units``: one level for all, clamped to each [min, max].

    The level is the highest whole number whose clamped shares fit; the units left below
    the next level go one each to the earliest arrivals still at the level and below their
    maximum (fewer are left than there are such actions). When the minimums alone exceed
    ``units`` (a capacity cut), everyone gets its minimum.
    """
    low, high = 0, max(e.emax for e in entries)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(max(mid, e.emin), e.emax) for e in entries) <= units:
            low = mid
        else:
            high = mid - 1
    shares = {e: min(max(low, e.emin), e.emax) for e in entries}
    left = units - sum(shares.values())
    for e in sorted(entries, key=lambda e: e.seq):
        if left <= 0:
            break
        if shares[e] == low < e.emax:
            shares[e] += 1
            left -= 1
    return shares


def replay(
    trace: Trace, policy: Policy, overrides: Mapping[str, float] | None = None
) -> SimulationResult:
    """``trace`` under ``policy``, its GPU services modelled: how every policy arm replays."""
    capacity = trace.runtime_capacity(overrides)
    if not trace.services:
        return simulate(trace.workload(), capacity, policy=policy)
    return simulate(
        trace.workload(),
        capacity,
        policy=policy,
        services=trace.gpu_services(),
        gpu_mem_gib_per_device=trace.gpu_mem_gib_per_device,
    )


def dop_grid(trace: Trace) -> list[int | Literal["max"]]:
    """The degrees of parallelism worth trying: the grid below the largest maximum, and max.

    A K at or above every elastic action's maximum grants what ``"max"`` does.
    """
    largest = max(
        (
            a.max
            for actions in trace.trajectories.values()
            for a in actions
            if a.max > a.min and not trace.is_rate(a.resource) and a.service is None
        ),
        default=1.0,
    )
    return [*(k for k in DOP_GRID if k < largest), "max"]


def simulate_best_fixed_dop(
    trace: Trace, overrides: Mapping[str, float] | None = None
) -> tuple[SimulationResult, str]:
    """``FcfsPolicy(dop=K)`` at the K of :func:`dop_grid` with the lowest average ACT, and K.

    Ties keep the smaller K. Chosen in hindsight, on the trace itself, which no real
    deployment could do: that makes it the strongest fixed-DoP arm, not a reachable one.
    """
    best: tuple[SimulationResult, str] | None = None
    for dop in dop_grid(trace):
        result = replay(trace, FcfsPolicy(dop=dop), overrides)
        if best is None or result.avg_act < best[0].avg_act:
            best = (result, str(dop))
    assert best is not None  # the grid always holds "max"
    return best


def run_reference(
    name: str, trace: Trace, overrides: Mapping[str, float] | None = None
) -> SimulationResult:
    """Replay ``trace`` under the reference arm ``name`` (one of :data:`REFERENCES`).

    :raises InvalidSettingError: ``name`` is not a reference arm.
    """
    if name not in REFERENCES:
        raise InvalidSettingError(f"unknown reference {name!r} (known: {', '.join(REFERENCES)})")
    if name == "best-fixed-dop":
        return simulate_best_fixed_dop(trace, overrides)[0]
    if name == GPU_FCFS:
        return simulate_gpu_fcfs(trace, overrides)
    policy: Policy = ShortestFirst() if name == "ref-srpt" else FcfsAdmission()
    return replay(trace, policy, overrides)
