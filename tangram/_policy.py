"""Scheduling decisions as pure functions of the scheduler's state.

No clock, no I/O, no awaits: the live runtime and the virtual-clock driver hand the same
state to the same :meth:`Policy.plan` and apply what it returns, which is how a simulated
step and a live one make the same decisions.

:class:`ElasticPolicy` is the paper's action-level scheduler with the gaps it leaves filled:

1. *Admission* walks the queue in arrival order (FCFS) and admits each action whose minimum
   demand fits, counting units that resizable running actions hold above their minimum as
   available (they can be shrunk). The first action that does not fit is the *head*; later
   ones may pass it (backfill) only when the estimate says they end before the head could
   start anyway, or use units the head will not need. An action that has waited longer
   than ``starvation_bound`` is never passed again.
2. *Distribution*: per elastic kind, the units not needed at minimum go one at a time to
   the action whose estimated completion time drops most (a heap of marginal gains; with
   concave speedups this greedy split minimises the sum of completion times *if every
   grant were held to the end*; it ignores that a finished action's units go to the
   others, which would favour actions with less work left). Resizable running actions
   take part, so they grow when units free up and shrink when that lowers the estimated
   total.
3. *Greedy eviction*: when elastic newcomers split scarce units, try leaving the last
   non-resizable one queued and giving its units to the others; keep that while the
   estimated total ACT, including the evicted action's wait from a completion-time walk,
   improves. The walk holds every grant until its action ends, so eviction is tried only
   while no resizable action of the kind runs, and resizable newcomers are never evicted:
   admitted at their minimum they grow as units free up, which waiting in the queue
   cannot beat, while the walk (the evicted action starts later with every unit freed by
   then, and nothing else arrives) makes waiting look better than it is. Measured on
   random workloads (Pareto work, Amdahl, power and linear speedups, 16 cores): evicting
   resizable actions raised the mean ACT by 5-15%, and up to 45% for ``Elastic(4, 16)``;
   evicting non-resizable ones beside resizable running ones raised it by 6%; evicting
   non-resizable ones among themselves, which would otherwise keep a minimum grant for
   life, lowered it by up to 15%.

Every pass looks at no more than ``window`` queued actions, so its cost does not grow with
the length of the queue.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Literal, Protocol

import attrs

from ._action import Action

__all__ = ["ElasticPolicy", "Entry", "FcfsPolicy", "Plan", "Policy", "State", "View"]

WAITING, RUNNING, DONE = 0, 1, 2
_EPS = 1e-9
# Keeping a unit where it is counts this much more than moving it: without it two
# running actions with nearly equal gains would trade a unit back and forth at every event.
_STICKINESS = 1.1
# Remaining work never drops below this share of the estimate, so an action that runs past
# its estimate still looks like it needs some time.
_REMAINING_FLOOR = 0.05


class Entry:
    """The scheduler's mutable record of one action, shared by the policy and the ledger."""

    __slots__ = (
        "action",
        "admitted_at",
        "arrival",
        "deadline",
        "emax",
        "emin",
        "mark",
        "rem",
        "seq",
        "speedup",
        "state",
        "t1",
        "unit_time",
        "units",
    )

    def __init__(self, action: Action, seq: int, arrival: float) -> None:
        self.action = action
        self.seq = seq
        self.arrival = arrival
        self.state = WAITING
        self.units = 0
        estimate = action.estimate
        elastic = action.demand.elastic
        self.emin, self.emax = (elastic.min, elastic.max) if elastic is not None else (0, 0)
        self.t1 = estimate.seconds_at_1
        efficiency = elastic.efficiency if elastic and elastic.efficiency else estimate.efficiency
        self.speedup: Callable[[float], float] = efficiency.speedup
        self.rem = self.t1
        self.mark = arrival
        self.admitted_at = math.nan
        self.unit_time = 0.0
        self.deadline = math.inf

    def __repr__(self) -> str:
        return f"<Entry #{self.action.id} {self.action.kind} state={self.state} units={self.units}>"

    @property
    def elastic(self) -> bool:
        return self.action.demand.elastic is not None

    def speed(self, units: int) -> float:
        return self.speedup(units) if units > 0 else 1.0

    def remaining(self, now: float) -> float:
        """Estimated work left, in seconds at one unit."""
        if self.state != RUNNING:
            return self.rem
        left = self.rem - (now - self.mark) * self.speed(self.units)
        return max(left, _REMAINING_FLOOR * self.t1)

    def seconds_left(self, now: float) -> float:
        return self.remaining(now) / self.speed(self.units)


class State(Protocol):
    """What a policy reads. The ledger provides it; nothing in it is changed by the policy."""

    @property
    def now(self) -> float: ...

    @property
    def totals(self) -> Mapping[str, float]:
        """Capacity of each held kind (counts and sizes)."""

    @property
    def free(self) -> Mapping[str, float]:
        """Capacity minus units held, per held kind; below zero after a capacity cut."""

    @property
    def tokens(self) -> Mapping[str, float]:
        """Units left now in each rate budget."""

    @property
    def rates(self) -> Mapping[str, float]:
        """Refill per second of each rate budget."""

    @property
    def surplus(self) -> Mapping[str, float]:
        """Units resizable running actions hold above their minimum, per kind."""

    @property
    def headroom(self) -> Mapping[str, float]:
        """Units resizable running actions could still grow by, per kind."""

    def waiting(self) -> Iterable[Entry]: ...

    @property
    def running(self) -> Collection[Entry]: ...

    def resizable(self, kind: str) -> Collection[Entry]: ...


View = State


@attrs.define
class Plan:
    """What to do now: admit these with these elastic units, resize those; wake at ``wake_at``."""

    admits: list[tuple[Entry, int]] = attrs.Factory(list)
    resizes: list[tuple[Entry, int]] = attrs.Factory(list)
    wake_at: float | None = None
    evicted: int = 0


class Policy(Protocol):
    """A scheduling policy: one pure method from state to decisions."""

    def plan(self, state: State) -> Plan: ...


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{attribute.name}` must be > 0 (got {value!r})")


def _count(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{attribute.name}` must be a whole number >= 0 (got {value!r})")


def _window(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    # A window of 0 looks at nothing and so admits nothing, ever.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{attribute.name}` must be a whole number >= 1 (got {value!r})")


class _Scan:
    """Working copy of free units for one pass."""

    __slots__ = ("free", "surplus", "tokens")

    def __init__(self, state: State) -> None:
        self.free = dict(state.free)
        self.surplus = dict(state.surplus)
        self.tokens = dict(state.tokens)

    def fits(self, need: Iterable[tuple[str, float]]) -> bool:
        for kind, amount in need:
            have = self.tokens.get(kind)
            if have is None:
                have = self.free[kind] + self.surplus.get(kind, 0.0)
            if amount > have + _EPS:
                return False
        return True

    def take(self, need: Iterable[tuple[str, float]]) -> None:
        for kind, amount in need:
            if kind in self.tokens:
                self.tokens[kind] -= amount
                continue
            free = self.free[kind]
            if amount <= free:
                self.free[kind] = free - amount
            else:  # the rest comes from shrinking resizable actions (free may be < 0)
                self.free[kind] = 0.0
                self.surplus[kind] -= amount - free

    def exhausted(self) -> bool:
        """Whether no later action can start in this pass, so the scan may stop.

        Never true while there are rate budgets: an action that needs only a budget still
        has to be seen, to book the scheduler's wake-up for when the budget refills.
        """
        if self.tokens:
            return False
        surplus = self.surplus
        for kind, free in self.free.items():  # noqa: SIM110 - all() adds a generator per pass
            if free + surplus.get(kind, 0.0) > _EPS:
                return False
        return True


def may_admit(state: State, entry: Entry) -> bool:
    """False only when ``entry``'s minimum cannot fit even by shrinking resizable actions.

    Then a pass run for its arrival admits nothing and changes no other decision: it joins
    the queue's tail. A demand on a rate budget always gets its pass, which books the
    wake-up for the refill.
    """
    free, surplus = state.free, state.surplus
    fits = True
    for kind, amount in entry.action.demand.minimum:
        have = free.get(kind)
        if have is None:
            return True
        if amount > have + surplus.get(kind, 0.0) + _EPS:
            fits = False
    return fits


def _rate_wait(state: State, scan: _Scan, need: Iterable[tuple[str, float]]) -> float | None:
    """When the rate budgets alone would let ``need`` start, if a rate is what blocks it."""
    wake: float | None = None
    for kind, amount in need:
        level = scan.tokens.get(kind)
        if level is not None and amount > level + _EPS:
            # A microsecond past the exact refill time, so float rounding cannot leave the
            # budget a hair short when the timer fires.
            at = state.now + (amount - level) / state.rates[kind] + 1e-6
            wake = at if wake is None else max(wake, at)
    return wake


@attrs.frozen(kw_only=True)
class ElasticPolicy:
    """Action-level elastic scheduling (see the module docstring for the three steps).

    :param starvation_bound: seconds after which a waiting action is never passed again.
    :param window: queued actions looked at per pass; bounds the cost of a decision.
    :param eviction_depth: newcomers the greedy eviction may leave queued per pass.
    """

    starvation_bound: float = attrs.field(default=30.0, validator=_positive)
    window: int = attrs.field(default=128, validator=_window)
    eviction_depth: int = attrs.field(default=4, validator=_count)

    may_admit = staticmethod(may_admit)

    def plan(self, state: State) -> Plan:
        now = state.now
        scan = _Scan(state)
        plan = Plan()
        newcomers: list[Entry] = []
        head: Entry | None = None
        shadow: tuple[float, dict[str, float]] | None = None
        # islice stops before pulling entry window + 1: the queue is never touched past it.
        for entry in itertools.islice(state.waiting(), self.window):
            need = entry.action.demand.minimum
            fits = scan.fits(need)
            protected = now - entry.arrival > self.starvation_bound
            if head is None:
                if fits:
                    scan.take(need)
                    newcomers.append(entry)
                    if scan.exhausted():
                        break
                    continue
                head = entry
                wake = _rate_wait(state, scan, need)
                if wake is not None:
                    plan.wake_at = wake
                if protected or scan.exhausted():
                    break
                continue
            if not fits:
                if protected:
                    break
                if scan.tokens:
                    # Blocked by a budget alone? Wake when it refills, to backfill then.
                    wake = _rate_wait(state, scan, need)
                    if wake is not None and (plan.wake_at is None or wake < plan.wake_at):
                        plan.wake_at = wake
                continue
            if shadow is None:
                shadow = _shadow(state, scan, head, newcomers)
            start, extra = shadow
            end = now + entry.t1 / entry.speed(int(_min_units(entry)))
            if end <= start:
                scan.take(need)
                newcomers.append(entry)
            elif all(amount <= extra.get(kind, math.inf) + _EPS for kind, amount in need):
                scan.take(need)
                for kind, amount in need:
                    if kind in extra:
                        extra[kind] -= amount
                newcomers.append(entry)
            if scan.exhausted():
                break
        self._distribute(state, scan, newcomers, head, plan)
        # Shrinks first: whoever applies the plan in order (the ledger, executors changing
        # cgroup quotas) never holds more than the capacity on the way.
        if len(plan.resizes) > 1:
            plan.resizes.sort(key=_growth)
        return plan

    def _distribute(
        self,
        state: State,
        scan: _Scan,
        newcomers: list[Entry],
        head: Entry | None,
        plan: Plan,
    ) -> None:
        now = state.now
        by_kind: dict[str, list[Entry]] = {}
        for entry in newcomers:
            kind = entry.action.demand.elastic_kind
            if kind is None:
                plan.admits.append((entry, 0))
            else:
                by_kind.setdefault(kind, []).append(entry)
        for kind in state.surplus:
            if kind in by_kind:
                continue
            spare = scan.free[kind]
            reclaimed = state.surplus[kind] - scan.surplus[kind]
            if reclaimed > _EPS or spare < -_EPS or (spare >= 1.0 and state.headroom[kind] > 0):
                by_kind[kind] = []
        for kind, fresh in by_kind.items():
            running = list(state.resizable(kind))
            held = sum(e.units for e in running)
            # Units the members may share: what they hold, what is free after this pass's
            # other admissions, minus what the blocked head will need of this kind.
            pool = scan.free[kind] + sum(_bounds(e)[0] for e in fresh)
            pool += held - (state.surplus.get(kind, 0.0) - scan.surplus.get(kind, 0.0))
            if head is not None:
                reserve = head.action.demand.amount(kind, 0)
                if head.action.demand.elastic_kind == kind:
                    reserve += _bounds(head)[0]
                floors = sum(_bounds(e)[0] for e in running) + sum(_bounds(e)[0] for e in fresh)
                pool -= min(reserve, max(0.0, pool - floors))
            units = math.floor(pool + _EPS)
            members = running + fresh
            alloc = _allocate(members, units, now)
            dropped: list[Entry] = []
            # The eviction walk holds every member's grant until it ends, which is only
            # true when no resizable action of this kind runs (see the module docstring).
            if self.eviction_depth > 0 and fresh and len(members) > 1 and not running:
                best = _total_act(members, alloc, [], units, now)
                candidates = [
                    e
                    for e in fresh
                    if now - e.arrival <= self.starvation_bound and not _resizable(e)
                ]
                for _ in range(self.eviction_depth):
                    if not candidates:
                        break
                    victim = candidates.pop()
                    trial_members = [e for e in members if e is not victim]
                    trial_alloc = _allocate(trial_members, units, now)
                    trial_dropped = [victim, *dropped]
                    trial = _total_act(trial_members, trial_alloc, trial_dropped, units, now)
                    if trial >= best * (1.0 - 1e-6):
                        break
                    best, members, alloc, dropped = trial, trial_members, trial_alloc, trial_dropped
                plan.evicted += len(dropped)
            for entry, target in zip(members, alloc, strict=True):
                if entry.state == RUNNING:
                    if target != entry.units:
                        plan.resizes.append((entry, target))
                else:
                    plan.admits.append((entry, target))


def _growth(item: tuple[Entry, int]) -> int:
    return item[1] - item[0].units


def _bounds(entry: Entry) -> tuple[int, int]:
    elastic = entry.action.demand.elastic
    assert elastic is not None
    return elastic.min, elastic.max


def _resizable(entry: Entry) -> bool:
    elastic = entry.action.demand.elastic
    return elastic is not None and elastic.resizable


def _min_units(entry: Entry) -> float:
    elastic = entry.action.demand.elastic
    return float(elastic.min) if elastic is not None else 0.0


def _allocate(members: list[Entry], units: int, now: float) -> list[int]:
    """Split ``units`` among ``members``, each within its [min, max], by marginal gain.

    Starts from what each member holds now (a newcomer from its minimum), adds or takes
    back the difference one unit at a time where it gains most or costs least, then moves
    single units from the member that loses least to the one that gains most while the gain
    beats the loss by ``_STICKINESS``. With concave speedups no single move improving is
    what optimality means, so this lands where a split from scratch would (up to the
    hysteresis), but a pass costs O(n + changes x log n) instead of O(units x log n): on
    thousands of cores the split from scratch handed out every unit again at each event.
    """
    n = len(members)
    lows = [e.emin for e in members]
    highs = [e.emax for e in members]
    alloc = [min(max(e.units, e.emin), e.emax) if e.state == RUNNING else e.emin for e in members]
    if n == 0:
        return alloc
    rems = _remainings(members, now)
    speedups = [e.speedup for e in members]

    def gain(i: int, m: int) -> float:  # completion time saved by unit m + 1
        s = speedups[i]
        return rems[i] * (1.0 / s(m) - 1.0 / s(m + 1))

    spare = units - sum(alloc)
    if spare < 0:
        shrink = [(gain(i, alloc[i] - 1), i) for i in range(n) if alloc[i] > lows[i]]
        heapq.heapify(shrink)
        while spare < 0 and shrink:
            _, i = heapq.heappop(shrink)
            alloc[i] -= 1
            spare += 1
            if alloc[i] > lows[i]:
                heapq.heappush(shrink, (gain(i, alloc[i] - 1), i))
        if spare < 0:  # over capacity even at every minimum: nothing to rebalance
            return alloc
    # Heap entries carry the allocation they were computed at; an entry whose member has
    # moved since is stale and skipped, so one heap serves handing out and rebalancing.
    # The two heaps are built from 1/speedup at each member's allocation, computed once:
    # the same arithmetic as gain(), without a call and a repeated speedup per member.
    # A pass at scale is mostly this setup (thousands of members, few moves).
    inverse = [1.0 / speedups[i](alloc[i]) for i in range(n)]
    give = [
        (-(rems[i] * (inverse[i] - 1.0 / speedups[i](alloc[i] + 1))), i, alloc[i])
        for i in range(n)
        if alloc[i] < highs[i]
    ]
    given = alloc.copy()
    heapq.heapify(give)
    while spare > 0 and give:
        best, i, at = heapq.heappop(give)
        if at != alloc[i]:
            continue
        if -best <= _EPS:
            return alloc
        alloc[i] += 1
        spare -= 1
        if alloc[i] < highs[i]:
            heapq.heappush(give, (-gain(i, alloc[i]), i, alloc[i]))
    if n < 2 or not give:
        return alloc
    take = [
        (
            rems[i] * (1.0 / speedups[i](alloc[i] - 1) - inverse[i])
            if alloc[i] == given[i]
            else gain(i, alloc[i] - 1),
            i,
            alloc[i],
        )
        for i in range(n)
        if alloc[i] > lows[i]
    ]
    heapq.heapify(take)
    for _ in range(units):
        while give and give[0][2] != alloc[give[0][1]]:
            heapq.heappop(give)
        while take and take[0][2] != alloc[take[0][1]]:
            heapq.heappop(take)
        if not give or not take:
            break
        best, to, _ = give[0]
        least, frm, _ = take[0]
        if to == frm or -best <= least * _STICKINESS + _EPS:
            break
        heapq.heappop(give)
        heapq.heappop(take)
        alloc[to] += 1
        alloc[frm] -= 1
        for i in (to, frm):
            if alloc[i] < highs[i]:
                heapq.heappush(give, (-gain(i, alloc[i]), i, alloc[i]))
            if alloc[i] > lows[i]:
                heapq.heappush(take, (gain(i, alloc[i] - 1), i, alloc[i]))
    return alloc


def _total_act(
    members: list[Entry], alloc: list[int], dropped: list[Entry], units: int, now: float
) -> float:
    """Estimated sum of completion times (from now) of members and evicted newcomers.

    Evicted newcomers start, in arrival order, when the members' completions have freed
    their minimum, and run on the units freed by then (up to their maximum).
    """
    ends = [e.remaining(now) / e.speedup(a) for e, a in zip(members, alloc, strict=True)]
    total = sum(ends)
    if not dropped:
        return total
    free = float(units - sum(alloc))
    heap = list(zip(ends, alloc, strict=True))
    heapq.heapify(heap)
    clock = 0.0
    for entry in sorted(dropped, key=lambda e: e.seq):
        elastic = entry.action.demand.elastic
        assert elastic is not None
        while free + _EPS < elastic.min and heap:
            clock, freed = heapq.heappop(heap)
            free += freed
        if free + _EPS < elastic.min:
            return math.inf
        got = min(elastic.max, int(free + _EPS))
        free -= got
        end = clock + entry.t1 / entry.speedup(got)
        total += end
        heapq.heappush(heap, (end, got))
    return total


def _shadow(
    state: State, scan: _Scan, head: Entry, newcomers: list[Entry]
) -> tuple[float, dict[str, float]]:
    """When the blocked head could start at the latest estimate, and what it leaves spare.

    Walks running actions, and those admitted earlier in this pass, by estimated
    completion, adding up what each frees, until the head's minimum fits (EASY
    backfilling's reservation). Units resizable actions hold above their minimum are
    already counted as available in ``scan``, so an ending one adds only its minimum.
    """
    now = state.now
    need = head.action.demand.minimum
    deficit: dict[str, float] = {}
    start = now
    for kind, amount in need:
        if kind in scan.tokens:
            level = scan.tokens[kind]
            if amount > level:
                start = max(start, now + (amount - level) / state.rates[kind])
            continue
        deficit[kind] = amount - (scan.free[kind] + scan.surplus.get(kind, 0.0))
    if any(d > _EPS for d in deficit.values()):
        # Without the newcomers, a head blocked only by actions admitted in this same pass
        # would look unreachable (start = inf) and anything that fits would pass it.
        ends = _running_ends(state.running, now)
        ends += [
            (e.t1 / e.speed(int(_min_units(e))), e.seq, e, int(_min_units(e))) for e in newcomers
        ]
        # Usually a few of the earliest ends cover the deficit: a heap finds them without
        # sorting every running action (seq breaks ties, so entries are never compared).
        heapq.heapify(ends)
        reached = math.inf
        while ends:
            left, _, entry, units = heapq.heappop(ends)
            demand = entry.action.demand
            elastic = demand.elastic
            if elastic is not None and elastic.resizable and entry.state == RUNNING:
                units = elastic.min
            for kind in deficit:
                deficit[kind] -= demand.amount(kind, units)
            if all(d <= _EPS for d in deficit.values()):
                reached = now + left
                break
        start = max(start, reached)
    extra = {kind: max(0.0, -d) for kind, d in deficit.items()}
    return start, extra


def _remainings(entries: Iterable[Entry], now: float) -> list[float]:
    """:meth:`Entry.remaining` of each entry, spelled out (a pass calls it per member)."""
    out = []
    for e in entries:
        if e.state != RUNNING:
            out.append(e.rem)
            continue
        units = e.units
        left = e.rem - (now - e.mark) * (e.speedup(units) if units > 0 else 1.0)
        out.append(max(left, _REMAINING_FLOOR * e.t1))
    return out


def _running_ends(running: Iterable[Entry], now: float) -> list[tuple[float, int, Entry, int]]:
    """``(seconds left, seq, entry, units)`` of each running entry.

    :meth:`Entry.seconds_left` spelled out: this walks every running action of a pass that
    backfills, and three calls per action were most of a pass's time under load.
    """
    ends = []
    for e in running:
        units = e.units
        speed = e.speedup(units) if units > 0 else 1.0
        left = max(e.rem - (now - e.mark) * speed, _REMAINING_FLOOR * e.t1)
        ends.append((left / speed, e.seq, e, units))
    return ends


@attrs.frozen(kw_only=True)
class FcfsPolicy:
    """Strict first-come first-served with a fixed degree of parallelism: the baseline.

    Each elastic action gets ``dop`` units (clamped to its range; ``"min"`` or ``"max"``
    for its bounds) at start and keeps them. Nothing passes a blocked head. This is the
    paper's fixed-DoP ablation, kept to measure what elasticity buys.
    """

    dop: int | Literal["min", "max"] = "min"

    def __attrs_post_init__(self) -> None:
        if self.dop not in ("min", "max") and (
            isinstance(self.dop, bool) or not isinstance(self.dop, int) or self.dop < 1
        ):
            raise ValueError(
                f"`dop` must be 'min', 'max' or a whole number >= 1 (got {self.dop!r})"
            )

    may_admit = staticmethod(may_admit)

    def units_for(self, entry: Entry, total: float) -> int:
        elastic = entry.action.demand.elastic
        assert elastic is not None
        if self.dop == "min":
            want = elastic.min
        elif self.dop == "max":
            want = elastic.max
        else:
            want = min(max(self.dop, elastic.min), elastic.max)
        return max(elastic.min, min(want, int(total + _EPS)))

    def plan(self, state: State) -> Plan:
        scan = _Scan(state)
        scan.surplus = {}
        plan = Plan()
        for entry in state.waiting():
            demand = entry.action.demand
            units = 0
            need = demand.rigid
            if demand.elastic_kind is not None:
                units = self.units_for(entry, state.totals[demand.elastic_kind])
                need = (*need, (demand.elastic_kind, float(units)))
            if not scan.fits(need):
                plan.wake_at = _rate_wait(state, scan, need)
                break
            scan.take(need)
            plan.admits.append((entry, units))
        return plan
