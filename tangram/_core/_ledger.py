"""The scheduler's bookkeeping: who waits, who runs, what is held, and applying plans.

Pure (times are passed in), so the live runtime and the virtual-clock driver share it and
with it every rule about accounting: units held always equal the sum of live grants.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Iterator

from ._action import Action
from ._estimator import Estimator
from ._line import Line
from ._policy import DONE, RUNNING, WAITING, Entry, Plan, Policy, Split
from ._resources import Capacity, Shape

__all__ = ["Ledger"]

_GONE = 3


class Ledger:
    """State of one scheduler, changed only through its methods.

    The attributes the policy reads (``now``, ``totals``, ``free``, ``tokens``, ``rates``,
    ``surplus``, ``headroom``, ``running``, ``waiting()``, ``split()``) form the
    :class:`tangram._core._policy.State` it plans from.
    """

    def __init__(self, capacity: Capacity, policy: Policy, estimator: Estimator) -> None:
        self.policy = policy
        self._may_admit = getattr(policy, "may_admit", None)
        self.estimator = estimator
        self.now = 0.0
        self.capacity = capacity
        self.totals: dict[str, float] = {}
        self.held: dict[str, float] = {}
        self.free: dict[str, float] = {}
        self.surplus: dict[str, float] = {}
        self.headroom: dict[str, float] = {}
        self.rates: dict[str, float] = {}
        self.bursts: dict[str, float] = {}
        self.tokens: dict[str, float] = {}
        self.unit_seconds: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        # Waiting entries in arrival order. An OrderedDict is a hash table threaded on a
        # linked list, and its iterator follows the list, so a pass that looks at the first
        # ``window`` entries costs ``window`` steps however many entries left from the
        # middle before (a deque with lazy deletion made every pass walk the dead entries
        # left behind by backfills and cancellations until a compaction), and removal from
        # anywhere is O(1).
        self._queue: OrderedDict[Entry, None] = OrderedDict()
        # A policy with a ``priority`` (size-aware admission) reads the queue in that order
        # instead, from a line kept sorted as entries come and go (see ``waiting``), and
        # entries not yet due wait in a heap by the time they fall due.
        self._priority = getattr(policy, "priority", None)
        self._line = Line() if self._priority is not None else None
        self._due: list[tuple[float, int, Entry]] = []
        self._lane: OrderedDict[Entry, None] = OrderedDict()  # entries keeping arrival order
        self._running: dict[Entry, None] = {}
        self._splits: dict[str, Split] = {}
        self._seq = 0
        self._accounted_at = 0.0
        self._refilled_at = 0.0
        self.resizes = 0
        self.evictions = 0
        self._install(capacity, 0.0)

    # -- what the policy reads -------------------------------------------------------

    def waiting(self) -> Iterator[Entry]:
        """Waiting entries in the policy's order.

        Arrival order, unless the policy has a ``priority``: a function of an entry and
        this state, asked once at submission, that says ``(work, due)``, or ``None`` for
        an entry that keeps arrival order. Then entries past their ``due`` time come
        first, earliest due first, and the others after them by ``work`` (ties by
        arrival): least work first, where nothing is passed by newcomers once due. An
        entry falls due at the first step at or after ``due``, so the order changes only
        when the policy plans. Entries that keep arrival order take turns with these, so
        a long line of either never hides the other from a pass's window.
        """
        if self._line is None:
            return iter(self._queue)
        if not self._lane:
            return iter(self._line)
        if not self._line:
            return iter(self._lane)
        return _alternate(iter(self._line), iter(self._lane))

    @property
    def running(self) -> Collection[Entry]:
        return self._running.keys()

    def split(self, kind: str) -> Split:
        split = self._splits.get(kind)
        if split is None:
            split = self._splits[kind] = Split()
        return split

    @property
    def resizing(self) -> bool:
        """Whether a resizable action runs: a release may then grow it."""
        return any(self._splits.values())

    @property
    def waiting_count(self) -> int:
        return len(self._queue)

    # -- changes -----------------------------------------------------------------------

    def submit(self, action: Action, now: float) -> Entry:
        self._seq += 1
        entry = Entry(action, self._seq, now)
        self._queue[entry] = None
        if self._line is not None:
            assert self._priority is not None
            order = self._priority(entry, self)
            if order is None:
                self._lane[entry] = None
            else:
                work, due = order
                entry.key = (1, work, entry.seq, entry)
                self._line.add(entry.key)
                if due < math.inf:
                    heapq.heappush(self._due, (due, entry.seq, entry))
        return entry

    def withdraw(self, entry: Entry) -> None:
        """Take a waiting entry out of the queue (cancelled, timed out, impossible)."""
        if entry.state == WAITING:
            entry.state = _GONE
            self._queue.pop(entry, None)
            self._unline(entry)

    def finish(
        self, entry: Entry, now: float, seconds: float | None = None, ok: bool = True
    ) -> None:
        """Return a running entry's units; teach the estimator when the action succeeded."""
        if entry.state != RUNNING:
            return
        if now > self._accounted_at:
            self._account(now)
        entry.unit_time += entry.units * (now - entry.mark)
        demand = entry.action.demand
        if demand.elastic is not None:
            self._change_units(entry, entry.units, 0, sign=-1)
        for kind, amount in demand.rigid:
            if kind in self.held:
                self.held[kind] -= amount
                self.free[kind] += amount
        del self._running[entry]
        entry.state = DONE
        ran = now - entry.admitted_at
        if ok:
            if seconds is None:
                seconds = ran
            units = entry.unit_time / ran if demand.elastic and ran > 0 else max(entry.units, 1)
            self.estimator.observe(entry.action.kind, units, seconds)

    def may_admit(self, entry: Entry) -> bool:
        """Whether a pass right after ``entry`` arrived could change anything.

        Asked by the policy when it knows (``may_admit``); otherwise always yes. Skipping
        the pass for an arrival that cannot start halves the passes of a saturated queue.
        """
        check = self._may_admit
        return True if check is None else bool(check(self, entry))

    def step(self, now: float) -> Plan:
        """Ask the policy what to do now and apply it."""
        self.now = now
        if self.rates:
            self._refill(now)
        if self._due and self._due[0][0] <= now:
            self._fall_due(now)
        plan = self.policy.plan(self)
        if (plan.admits or plan.resizes) and now > self._accounted_at:
            self._account(now)
        # Shrinks before grows and admissions: applied in the plan's order, a grow listed
        # before the shrink that makes room for it would briefly hold more than the
        # capacity (and count it in ``peak``).
        for entry, units in plan.resizes:
            if units < entry.units:
                self._resize(entry, units, now)
        for entry, units in plan.resizes:
            self._resize(entry, units, now)
        for entry, units in plan.admits:
            self._admit(entry, units, now)
        self.evictions += plan.evicted
        return plan

    def set_capacity(self, capacity: Capacity, now: float) -> list[Entry]:
        """Install new capacities; return (and withdraw) waiting entries that can never fit."""
        self._account(now)
        self._refill(now)
        self._install(capacity, now)
        impossible = [e for e in self._queue if not self.could_ever_fit(e)]  # a rare O(n)
        for entry in impossible:
            self.withdraw(entry)
        return impossible

    # -- internals ---------------------------------------------------------------------

    def _install(self, capacity: Capacity, now: float) -> None:
        self.capacity = capacity
        for name, resource in capacity.items():
            if resource.shape is Shape.RATE:
                self.rates[name] = resource.total
                self.bursts[name] = resource.burst
                self.tokens[name] = min(self.tokens.get(name, resource.burst), resource.burst)
                continue
            held = self.held.setdefault(name, 0.0)
            self.totals[name] = resource.total
            self.free[name] = resource.total - held
            self.surplus.setdefault(name, 0.0)
            self.headroom.setdefault(name, 0.0)
            self.unit_seconds.setdefault(name, 0.0)
            self.peak.setdefault(name, 0.0)

    def could_ever_fit(self, entry: Entry) -> bool:
        for kind, amount in entry.action.demand.minimum:
            limit = self.bursts[kind] if kind in self.rates else self.totals[kind]
            if amount > limit + 1e-9:
                return False
        return True

    def level(self, kind: str, now: float) -> float:
        """A rate budget's level at ``now``, refilled since the last step, without changing it.

        Budgets refill lazily, at each scheduling step; readers between steps (statistics,
        an executor choosing a key) want the level as of now.
        """
        idle = max(0.0, now - self._refilled_at)
        return min(self.bursts[kind], self.tokens[kind] + idle * self.rates[kind])

    def _refill(self, now: float) -> None:
        elapsed = now - self._refilled_at
        if elapsed > 0:
            for kind, rate in self.rates.items():
                self.tokens[kind] = min(self.bursts[kind], self.tokens[kind] + elapsed * rate)
        self._refilled_at = max(self._refilled_at, now)

    def _account(self, now: float) -> None:
        elapsed = now - self._accounted_at
        if elapsed > 0:
            for kind, held in self.held.items():
                self.unit_seconds[kind] += held * elapsed
            self._accounted_at = now

    def _admit(self, entry: Entry, units: int, now: float) -> None:
        demand = entry.action.demand
        for kind, amount in demand.rigid:
            if kind in self.tokens:
                self.tokens[kind] -= amount
            else:
                self.held[kind] += amount
                self.free[kind] -= amount
        entry.state = RUNNING
        self._queue.pop(entry, None)
        self._unline(entry)
        entry.admitted_at = now
        entry.mark = now
        entry.rem = entry.t1
        self._running[entry] = None
        if demand.elastic is not None:
            assert demand.elastic_kind is not None
            self._change_units(entry, 0, units, sign=1)
        for kind in self.held:
            if self.held[kind] > self.peak[kind]:
                self.peak[kind] = self.held[kind]

    def _unline(self, entry: Entry) -> None:
        if self._line is not None and entry.key is None:
            self._lane.pop(entry, None)
        elif self._line is not None and entry.key is not None:
            self._line.remove(entry.key)
            # Entries that left before falling due stay in the heap until their time;
            # rebuild once they outnumber the waiting ones, so it stays O(waiting).
            if len(self._due) > 2 * len(self._queue) + 64:
                self._due = [d for d in self._due if d[2].state == WAITING]
                heapq.heapify(self._due)

    def _fall_due(self, now: float) -> None:
        """Move entries whose due time has come ahead of every entry not yet due."""
        line, due = self._line, self._due
        assert line is not None
        while due and due[0][0] <= now:
            at, seq, entry = heapq.heappop(due)
            if entry.state == WAITING and entry.key is not None:
                line.remove(entry.key)
                entry.key = (0, at, seq, entry)
                line.add(entry.key)

    def _resize(self, entry: Entry, units: int, now: float) -> None:
        if entry.state != RUNNING or units == entry.units:
            return
        entry.rem = entry.remaining(now)
        entry.unit_time += entry.units * (now - entry.mark)
        entry.mark = now
        self._change_units(entry, entry.units, units, sign=0)
        self.resizes += 1
        kind = entry.action.demand.elastic_kind
        if kind is not None and self.held[kind] > self.peak[kind]:
            self.peak[kind] = self.held[kind]

    def _change_units(self, entry: Entry, old: int, new: int, sign: int) -> None:
        """Move an entry's elastic units from ``old`` to ``new``; keep surplus/headroom exact.

        ``sign`` says whether the entry joins (1), leaves (-1) or stays in (0) the
        resizable set, whose surplus and headroom sums it counts in.
        """
        demand = entry.action.demand
        elastic = demand.elastic
        if elastic is None:
            return
        kind = demand.elastic_kind
        assert kind is not None
        self.held[kind] += new - old
        self.free[kind] -= new - old
        entry.units = new
        if not elastic.resizable:
            return
        if sign <= 0:
            self.surplus[kind] -= old - elastic.min
            self.headroom[kind] -= elastic.max - old
        if sign >= 0:
            self.surplus[kind] += new - elastic.min
            self.headroom[kind] += elastic.max - new
        split = self.split(kind)
        if sign > 0:
            split.join(entry)
        elif sign == 0:
            split.moved(entry, old)
        else:
            split.leave(entry, old)


def _alternate(first: Iterator[Entry], second: Iterator[Entry]) -> Iterator[Entry]:
    """One from each in turn, then the rest of the longer."""
    for a in first:
        yield a
        b = next(second, None)
        if b is None:
            break
        yield b
    yield from first
    yield from second


def held_matches_grants(ledger: Ledger) -> bool:
    """Invariant: units held per kind equal the sum of live grants (within rounding)."""
    expected = dict.fromkeys(ledger.held, 0.0)
    for entry in ledger.running:
        demand = entry.action.demand
        for kind, amount in demand.rigid:
            if kind in expected:
                expected[kind] += amount
        if demand.elastic_kind is not None:
            expected[demand.elastic_kind] += entry.units
    return all(math.isclose(expected[k], ledger.held[k], abs_tol=1e-6) for k in expected)
