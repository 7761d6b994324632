"""Scheduling decisions as pure functions of the scheduler's state.

No clock, no I/O, no awaits: the live runtime and the virtual-clock driver hand the same
state to the same :meth:`Policy.plan` and apply what it returns, which is how a simulated
step and a live one make the same decisions.

:class:`ElasticPolicy` is the paper's action-level scheduler with the gaps it leaves filled:

1. *Admission* walks the queue shortest expected service first (seconds at the minimum
   grant), except that an action waiting longer than ``aging`` times its own service (or
   ``max_wait``) is *due* and goes ahead of every action not yet due, so nothing arriving
   later passes it: SRPT with a starvation bound (docs/policy.md has the measurements;
   ``order="arrival"`` is FCFS, and actions on a rate budget keep arrival order). It
   admits each action whose minimum demand fits, counting units that resizable running
   actions hold above their minimum as available (they can be shrunk). The first action
   that does not fit is the *head*; later ones may pass it (backfill) only when the
   estimate says they end before the head could start anyway, or use units the head will
   not need. An action that has waited longer than ``starvation_bound`` is never passed
   by backfill again.
2. *Distribution*: per elastic kind, the units not needed at minimum go one at a time to
   the action whose *speedup* grows most relatively, ``1/s(m) - 1/s(m+1)``, the drop in its
   completion time per second of work left (a heap of marginal gains). That is the greedy
   split minimising the sum of slowdowns if every grant were held to the end; weighting by
   the work left instead (the sum of completion times under the same assumption) hands
   long actions the most units, which is wrong when short ones end soon and their units go
   to the others. Measured on our generated coding trace (256 trajectories, 256 cores)
   the slowdown split lowered the mean ACT from 1.58x to 1.39x the bound's, and on the
   Pareto-burst variant from 2.35x to 1.75x; the split also needs no estimate of the work
   left, so a wrong estimate cannot skew it. Resizable running actions take part, so they
   grow when units free up and shrink when that lowers the total.
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

from ..errors import InvalidSettingError, SettingTypeError

# The entry and its states live in their own module; importers find them here as before.
from ._entry import _REMAINING_FLOOR
from ._entry import DONE as DONE
from ._entry import RUNNING as RUNNING
from ._entry import WAITING as WAITING
from ._entry import Entry as Entry
from ._validate import number, validator, whole

__all__ = [
    "AGING",
    "ElasticPolicy",
    "Entry",
    "Plan",
    "Policy",
    "Split",
    "State",
    "View",
]

_EPS = 1e-9  # the tolerance of every rule on units: less than this of a kind is nothing
# Keeping a unit where it is counts this much more than moving it: without it two
# running actions with nearly equal gains would trade a unit back and forth at every event.
_STICKINESS = 1.1


def _inverse(entry: Entry, units: int) -> float:
    """``1 / speedup(units)`` of ``entry``, from a table grown on first use.

    A split asks for the same few values again and again (the gain of the next unit is a
    difference of two), and a speedup model is a Python call each time.
    """
    table = entry.inv
    if table is None:
        table = entry.inv = [1.0]
    if units >= len(table):
        speedup = entry.speedup
        table.extend(1.0 / speedup(m) for m in range(len(table), units + 1))
    return table[units]


# A heap record: (key, seq, entry, units the key was computed at). seq breaks ties, so
# entries are never compared; a record whose entry no longer holds ``units`` is stale.
_Record = tuple[float, int, Entry, int]


class Split:
    """The running resizable actions of one kind, indexed by the worth of one unit.

    ``give`` orders them by what one more unit would save (``1/s(u) - 1/s(u+1)``, negated
    for the min-heap), ``take`` by what one unit less would cost. Because a unit's worth
    depends only on the speedup model, not on time or on the work left, a record stays
    true until its action is resized, so the ledger keeps the index across passes (a push
    per change) and a pass costs O(moves x log n) instead of rebuilding over every running
    action: at 2048 trajectories that rebuild was most of a simulated step.

    The ledger changes it (:meth:`join`, :meth:`moved`, :meth:`leave`); a policy only
    reads it, and may drop stale records it meets, which changes nothing it holds.
    """

    __slots__ = ("floors", "give", "held", "members", "take")

    def __init__(self) -> None:
        self.members: dict[Entry, None] = {}
        self.held = 0
        self.floors = 0
        self.give: list[_Record] = []
        self.take: list[_Record] = []

    def __len__(self) -> int:
        return len(self.members)

    def join(self, entry: Entry) -> None:
        self.members[entry] = None
        self.held += entry.units
        self.floors += entry.emin
        self._index(entry)

    def moved(self, entry: Entry, old: int) -> None:
        self.held += entry.units - old
        self._index(entry)

    def leave(self, entry: Entry, old: int) -> None:
        del self.members[entry]
        self.held -= old
        self.floors -= entry.emin
        if not self.members:
            self.give.clear()
            self.take.clear()

    def _index(self, entry: Entry) -> None:
        _push(self.give, self.take, entry, entry.units)
        # Stale records pile up as actions are resized; rebuild once they outnumber the
        # live ones, so the heaps stay O(members) for amortised O(log n) per change.
        if len(self.give) + len(self.take) > 4 * len(self.members) + 64:
            self.give, self.take = [], []
            for member in self.members:
                _push(self.give, self.take, member, member.units)


_EMPTY = Split()


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
    def bursts(self) -> Mapping[str, float]:
        """Most units each rate budget saves up."""

    @property
    def surplus(self) -> Mapping[str, float]:
        """Units resizable running actions hold above their minimum, per kind."""

    @property
    def headroom(self) -> Mapping[str, float]:
        """Units resizable running actions could still grow by, per kind."""

    @property
    def resizable(self) -> Collection[str]:
        """Kinds a running resizable action holds units of."""

    @property
    def open(self) -> Collection[str]:
        """Kinds with a unit to give: free, or above a resizable action's minimum; rates."""

    def waiting(self, open: Collection[str] | None = None) -> Iterable[Entry]:
        """Waiting entries in the policy's order; with ``open``, those needing only those."""

    @property
    def running(self) -> Collection[Entry]: ...

    def split(self, kind: str) -> Split:
        """The running resizable actions of ``kind``, indexed by what a unit is worth to each."""


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


# A wrong type is a ValueError here too (SettingTypeError is both), as these settings have
# always raised.
_positive = validator(
    number,
    strict=True,
    finite=False,
    type_error=SettingTypeError,
    value_error=InvalidSettingError,
)
_count = validator(whole, type_error=SettingTypeError, value_error=InvalidSettingError)
# A window of 0 looks at nothing and so admits nothing, ever.
_window = validator(whole, minimum=1, type_error=SettingTypeError, value_error=InvalidSettingError)


def _order(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in ("size", "arrival"):
        raise InvalidSettingError(f"`order` must be 'size' or 'arrival' (got {value!r})")


# The default multiple of its expected service time an action may be passed for (see
# docs/policy.md, "The trade-off": 2 to 8 land within a few percent of each other).
AGING = 4.0


class _Scan:
    """Working copy of free units for one pass."""

    __slots__ = ("free", "live", "surplus", "tokens")

    def __init__(self, state: State) -> None:
        self.free = dict(state.free)
        self.surplus = dict(state.surplus)
        self.tokens = dict(state.tokens)
        # How many held kinds have units left in this pass (``open`` holds every rate
        # budget and the held kinds with units); a pass may stop when none is left.
        self.live = len(state.open) - len(self.tokens)

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
            surplus = self.surplus.get(kind, 0.0)
            was = free + surplus > _EPS
            if amount <= free:
                free = self.free[kind] = free - amount
            else:  # the rest comes from shrinking resizable actions (free may be < 0)
                surplus = self.surplus[kind] = surplus - (amount - free)
                free = self.free[kind] = 0.0
            if was and free + surplus <= _EPS:
                self.live -= 1

    def exhausted(self) -> bool:
        """Whether no later action can start in this pass, so the scan may stop.

        Never true while there are rate budgets: an action that needs only a budget still
        has to be seen, to book the scheduler's wake-up for when the budget refills.
        """
        return not self.tokens and self.live <= 0


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
            if state.rates[kind] <= 0:
                return None  # no refill until the budget is lent back, which plans anew
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
    :param order: ``"size"`` admits by aging deadline (size-aware), ``"arrival"`` first
        come first served, as tangram did before.
    :param aging: under size-aware admission, an action is passed by no action that
        arrives more than ``aging`` times its own expected service time after it;
        ``math.inf`` (with an infinite ``starvation_bound``) is shortest-first, no aging.
    :param max_wait: under size-aware admission, an absolute cap on that allowance in
        seconds: an action is passed by no action arriving more than ``max_wait`` after it.
    """

    starvation_bound: float = attrs.field(default=30.0, validator=_positive)
    window: int = attrs.field(default=128, validator=_window)
    eviction_depth: int = attrs.field(default=4, validator=_count)
    order: Literal["size", "arrival"] = attrs.field(default="size", validator=_order)
    aging: float = attrs.field(default=AGING, validator=_positive)
    max_wait: float = attrs.field(default=math.inf, validator=_positive)

    may_admit = staticmethod(may_admit)

    @property
    def priority(self) -> Callable[[Entry, State], tuple[float, float] | None] | None:
        """How the ledger lines waiting actions up; ``None`` keeps arrival order.

        ``(work, due)`` of an entry: it waits in order of ``work`` (expected seconds at
        its minimum grant) until ``due``, then
        ahead of every action not yet due, in order of ``due``; ``None`` for an entry
        that keeps arrival order (see :meth:`~tangram._core._ledger.Ledger.waiting`).
        """
        return self._work_and_due if self.order == "size" else None

    def _work_and_due(self, entry: Entry, state: State) -> tuple[float, float] | None:
        """The expected seconds at the minimum grant, and the action's due time.

        An action on a rate budget keeps arrival order: a call costs a rate-bound API one
        token however long it runs, so size order only reorders such calls (measured on
        the contended deepsearch trace: p95 ACT +45%, the average no better).
        """
        rates = state.rates
        if rates and any(kind in rates for kind, _ in entry.action.demand.minimum):
            return None
        service = entry.t1 / entry.speed(entry.emin)
        return service, self.due(entry.arrival, service)

    def due(self, arrival: float, seconds: float) -> float:
        """When an action that came at ``arrival`` and runs ``seconds`` stops being passed.

        The aging rule, in one place: the CPU admission above orders by it, and the
        simulator's GPU seat lines (:class:`~tangram._core._placement.Waiting`) do too.
        Under ``order="arrival"`` nothing is passed: an action is due when it comes.
        """
        if self.order == "arrival":
            return arrival
        return arrival + min(self.aging * seconds if seconds > 0 else 0.0, self.max_wait)

    def plan(self, state: State) -> Plan:
        now = state.now
        scan = _Scan(state)
        plan = Plan()
        newcomers: list[Entry] = []
        head: Entry | None = None
        head_need: tuple[tuple[str, float], ...] = ()
        shadow: tuple[float, dict[str, float]] | None = None
        # Kinds an action starved past the bound needs and could not get: nobody who needs
        # any of them passes it. One who needs none of them cannot delay it (units of other
        # kinds are not its units), so the scan goes on for those instead of stopping:
        # a GPU action starved behind busy replicas no longer holds up every API call.
        guarded: set[str] = set()
        # Only waiters whose kinds all have a unit to give can start in this pass; read in
        # the window, the others would hide them (one kind per node in one runtime: a core
        # freed on node B idled behind 128 waiters for node A).
        # islice stops before pulling entry window + 1: the queue is never touched past it.
        for entry in itertools.islice(state.waiting(state.open), self.window):
            need = entry.action.demand.minimum
            protected = now - entry.arrival > self.starvation_bound
            if (
                guarded
                and not (entry.holding and entry.holding & guarded)
                and any(kind in guarded for kind, _ in need)
            ):
                if protected:  # passed over, so what it needs is guarded as well
                    guarded.update(kind for kind, _ in need)
                continue
            fits = scan.fits(need)
            if head is None:
                if fits:
                    scan.take(need)
                    newcomers.append(entry)
                    if scan.exhausted():
                        break
                    continue
                head, head_need = entry, need
                wake = _rate_wait(state, scan, need)
                if wake is not None:
                    plan.wake_at = wake
                if scan.exhausted():
                    break
                if protected:
                    guarded.update(kind for kind, _ in need)
                continue
            if not fits:
                if protected:
                    guarded.update(kind for kind, _ in need)
                    continue
                if scan.tokens:
                    # Blocked by a budget alone? Wake when it refills, to backfill then.
                    wake = _rate_wait(state, scan, need)
                    if wake is not None and (plan.wake_at is None or wake < plan.wake_at):
                        plan.wake_at = wake
                continue
            if entry.holding and any(kind in entry.holding for kind, _ in head_need):
                # Its caller holds units of a kind the head needs, which the head may be
                # waiting for: kept waiting, it would never give them back (the priority
                # inheritance of lock schedulers). It takes only what is free.
                scan.take(need)
                newcomers.append(entry)
                if scan.exhausted():
                    break
                continue
            if shadow is None:
                shadow = _shadow(state, scan, head, newcomers)
            start, extra = shadow
            end = now + entry.t1 / entry.speed(int(_min_units(entry)))
            # What an action ending before the head starts holds is back by then; a rate's
            # tokens are not, so they come out of what the head leaves spare either way.
            early = end <= start
            if all(
                amount <= extra.get(kind, math.inf) + _EPS
                for kind, amount in need
                if not early or kind in scan.tokens
            ):
                scan.take(need)
                for kind, amount in need:
                    if kind in extra and (not early or kind in scan.tokens):
                        extra[kind] -= amount
                newcomers.append(entry)
            elif protected:
                # Behind a younger head (size-aware order puts one there; arrival order
                # never does): an action starved past the bound is still passed by nobody
                # who needs what it needs.
                guarded.update(kind for kind, _ in need)
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
        # Only where resizable actions run can units move without an admission.
        for kind in state.resizable:
            if kind in by_kind:
                continue
            spare = scan.free[kind]
            reclaimed = state.surplus[kind] - scan.surplus[kind]
            if reclaimed > _EPS or spare < -_EPS or (spare >= 1.0 and state.headroom[kind] > 0):
                by_kind[kind] = []
        for kind, fresh in by_kind.items():
            split = state.split(kind)
            lows = sum(e.emin for e in fresh)
            # Units the members may share: what they hold, what is free after this pass's
            # other admissions, minus what the blocked head will need of this kind.
            pool = scan.free[kind] + lows
            pool += split.held - (state.surplus.get(kind, 0.0) - scan.surplus.get(kind, 0.0))
            if head is not None:
                reserve = head.action.demand.amount(kind, 0)
                if head.action.demand.elastic_kind == kind:
                    reserve += _bounds(head)[0]
                pool -= min(reserve, max(0.0, pool - split.floors - lows))
            units = math.floor(pool + _EPS)
            alloc = _allocate(split, fresh, units)
            # The eviction walk holds every member's grant until it ends, which is only
            # true when no resizable action of this kind runs (see the module docstring).
            if self.eviction_depth > 0 and len(fresh) > 1 and not split:
                alloc = self._evict(fresh, alloc, units, now, plan)
            for entry, target in alloc.items():
                if entry.state != RUNNING:
                    plan.admits.append((entry, target))
                elif target != entry.units:
                    plan.resizes.append((entry, target))

    def _evict(
        self, fresh: list[Entry], alloc: dict[Entry, int], units: int, now: float, plan: Plan
    ) -> dict[Entry, int]:
        """Leave queued the newcomers whose units lower the others' estimated total more."""
        members = fresh
        dropped: list[Entry] = []
        best = _total_act(members, alloc, [], units, now)
        candidates = [
            e for e in fresh if now - e.arrival <= self.starvation_bound and not _resizable(e)
        ]
        for _ in range(self.eviction_depth):
            if not candidates:
                break
            victim = candidates.pop()
            trial_members = [e for e in members if e is not victim]
            trial_alloc = _allocate(_EMPTY, trial_members, units)
            trial_dropped = [victim, *dropped]
            trial = _total_act(trial_members, trial_alloc, trial_dropped, units, now)
            if trial >= best * (1.0 - 1e-6):
                break
            best, members, alloc, dropped = trial, trial_members, trial_alloc, trial_dropped
        plan.evicted += len(dropped)
        return alloc


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


def _allocate(split: Split, fresh: list[Entry], units: int) -> dict[Entry, int]:
    """Split ``units`` among ``split``'s members and ``fresh``, each within its [min, max].

    Returns the newcomers' grants and the running members' new sizes (a member absent
    from the result keeps its units). Starts from what each member holds (a newcomer from
    its minimum), adds or takes back the difference one unit at a time where it gains most
    or costs least, then moves single units from the member that loses least to the one
    that gains most while the gain beats the loss by ``_STICKINESS``. With concave
    speedups no single move improving is what optimality means, so this lands where a
    split from scratch would (up to the hysteresis). The running members' records come
    from the split's heaps, kept across passes, and the moves of this pass go to small
    heaps of its own, so a pass costs O((changes + stale records) x log n).
    """
    alloc = {e: e.emin for e in fresh}
    local_give: list[_Record] = []
    local_take: list[_Record] = []
    for e in fresh:
        _push(local_give, local_take, e, e.emin)
    give, take = split.give, split.take
    # Shared records this pass popped although the ledger still holds them true (their
    # member moved in this pass): pushed back at the end, so the index loses nothing.
    kept_give: list[_Record] = []
    kept_take: list[_Record] = []

    def top(shared: list[_Record], kept: list[_Record], local: list[_Record]) -> _Record | None:
        while shared:
            record = shared[0]
            entry, at = record[2], record[3]
            if entry.state != RUNNING or entry.units != at:
                heapq.heappop(shared)  # stale for good: the ledger pushed a newer one
            elif alloc.get(entry, at) != at:
                kept.append(heapq.heappop(shared))
            else:
                break
        while local and alloc[local[0][2]] != local[0][3]:
            heapq.heappop(local)
        if shared and (not local or shared[0] < local[0]):
            return shared[0]
        return local[0] if local else None

    def move(record: _Record, step: int) -> None:
        entry, at = record[2], record[3]
        alloc[entry] = at + step
        _push(local_give, local_take, entry, at + step)

    spare = units - split.held - sum(alloc.values())
    while spare < 0:
        least = top(take, kept_take, local_take)
        if least is None:  # over capacity even at every minimum: nothing to rebalance
            break
        move(least, -1)
        spare += 1
    rebalance = spare >= 0
    while spare > 0:
        best = top(give, kept_give, local_give)
        if best is None or -best[0] <= _EPS:
            rebalance = False
            break
        move(best, 1)
        spare -= 1
    if rebalance and len(split) + len(fresh) > 1:
        for _ in range(units):
            best = top(give, kept_give, local_give)
            least = top(take, kept_take, local_take)
            if best is None or least is None:
                break
            if best[2] is least[2] or -best[0] <= least[0] * _STICKINESS + _EPS:
                break
            move(best, 1)
            move(least, -1)
    for record in kept_give:
        heapq.heappush(give, record)
    for record in kept_take:
        heapq.heappush(take, record)
    return alloc


def _push(give: list[_Record], take: list[_Record], entry: Entry, units: int) -> None:
    here = _inverse(entry, units)
    if units < entry.emax:
        heapq.heappush(give, (_inverse(entry, units + 1) - here, entry.seq, entry, units))
    if units > entry.emin:
        heapq.heappush(take, (_inverse(entry, units - 1) - here, entry.seq, entry, units))


def _total_act(
    members: list[Entry], alloc: Mapping[Entry, int], dropped: list[Entry], units: int, now: float
) -> float:
    """Estimated sum of completion times (from now) of members and evicted newcomers.

    Evicted newcomers start, in arrival order, when the members' completions have freed
    their minimum, and run on the units freed by then (up to their maximum).
    """
    grants = [alloc[e] for e in members]
    ends = [e.remaining(now) / e.speedup(a) for e, a in zip(members, grants, strict=True)]
    total = sum(ends)
    if not dropped:
        return total
    free = float(units - sum(grants))
    heap = list(zip(ends, grants, strict=True))
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
                rate = state.rates[kind]
                start = max(start, now + (amount - level) / rate if rate > 0 else math.inf)
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
    # A rate's tokens never come back: what a later action may take of one the head needs
    # is what the budget will hold at the head's start beyond the head's need.
    for kind, amount in need:
        if kind in scan.tokens:
            rate, level = state.rates[kind], scan.tokens[kind]
            by_start = level + rate * (start - now) if rate > 0 else level
            extra[kind] = max(0.0, min(state.bursts[kind], by_start) - amount)
    return start, extra


def _running_ends(running: Iterable[Entry], now: float) -> list[tuple[float, int, Entry, int]]:
    """``(seconds left, seq, entry, units)`` of each running entry.

    :meth:`Entry.remaining` over the speed, spelled out: this walks every running action of
    a pass that backfills, and three calls per action were most of a pass's time under load.
    """
    ends = []
    for e in running:
        units = e.units
        speed = e.speedup(units) if units > 0 else 1.0
        left = max(e.rem - (now - e.mark) * speed, _REMAINING_FLOOR * e.t1)
        ends.append((left / speed, e.seq, e, units))
    return ends
