"""The scheduler's bookkeeping: who waits, who runs, what is held, and applying plans.

Pure (times are passed in), so the live runtime and the virtual-clock driver share it and
with it every rule about accounting: units held always equal the sum of live grants.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator

from ._action import Action
from ._estimator import Estimator
from ._plan_check import check_plan
from ._policy import _EPS, DONE, RUNNING, WAITING, Entry, Plan, Policy, Split
from ._queue import Queue
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
        # A plan of tangram's own policies is not checked at each pass (it costs about
        # half a pass that admits 64 actions): their rules are held by the test suite's
        # properties and the invariant checker instead. One of a user's is.
        ours = type(policy).__module__.partition(".")[0] == "tangram"
        self._check = None if ours else check_plan
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
        # A rate budget's refill and cap may sit below its capacity's while part of it is
        # lent elsewhere (``limit_rate``); demands are still judged by the capacity's.
        # Each limit holds until a time: a lent share is good only so long (``limit_rate``).
        self._limits: dict[str, tuple[float, float, float]] = {}
        self._limited_until = math.inf  # the first such time
        # Per rate kind: units taken so far, units the waiting entries ask for, and those
        # units summed over the time they waited (to ``_waited_at``). What a lender of
        # the budget reads to size this scheduler's share of it.
        self.spent: dict[str, float] = {}
        self.wanted: dict[str, float] = {}
        self._waited: dict[str, float] = {}
        self._waited_at: dict[str, float] = {}
        self.unit_seconds: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        # Kinds with a unit to give: free, or held above a resizable action's minimum;
        # and every rate budget. Kept as units move, so a pass finds them without a walk
        # over every kind (one per node when a runtime decides for many).
        self.open: set[str] = set()
        # Kinds a running resizable action holds; a dict, so a pass visits them in a
        # fixed order (a set's would change with the hash seed, and with it the plan).
        self.resizable: dict[str, None] = {}
        # A policy with a ``priority`` (size-aware admission) reads the queue in that order
        # instead of arrival order (see ``waiting``).
        self._priority = getattr(policy, "priority", None)
        self._queue = Queue(priority=self._priority is not None)
        self._running: dict[Entry, None] = {}
        self._splits: dict[str, Split] = {}
        self._seq = 0
        self._since: dict[str, float] = {}  # when each kind's unit_seconds was last billed
        self._refilled_at = 0.0
        self.resizes = 0
        self.evictions = 0
        self._install(capacity, 0.0)

    # -- what the policy reads -------------------------------------------------------

    def waiting(self, open: Collection[str] | None = None) -> Iterator[Entry]:
        """Waiting entries in the policy's order; with ``open``, those needing only those kinds.

        Arrival order, unless the policy has a ``priority``: a function of an entry and
        this state, asked once at submission, that says ``(work, due)``, or ``None`` for
        an entry that keeps arrival order. Then entries past their ``due`` time come
        first, earliest due first, and the others after them by ``work`` (ties by
        arrival): least work first, where nothing is passed by newcomers once due. An
        entry falls due at the first step at or after ``due``, so the order changes only
        when the policy plans. Entries that keep arrival order take turns with these, so
        a long line of either never hides the other from a pass's window.

        ``open`` names the kinds with something to give in this pass (``self.open``);
        waiters that need another kind cannot start, and the queue skips them by the
        kinds they need, not one by one (see :meth:`~tangram._core._queue.Queue.ordered`).
        """
        return self._queue.ordered(open)

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
        return bool(self.resizable)

    @property
    def waiting_count(self) -> int:
        return len(self._queue)

    # -- changes -----------------------------------------------------------------------

    def submit(self, action: Action, now: float) -> Entry:
        self._seq += 1
        entry = Entry(action, self._seq, now)
        if self.wanted:  # there are rate budgets
            self._want(entry, 1.0, now)
        self._queue.add(entry, None if self._priority is None else self._priority(entry, self))
        return entry

    def withdraw(self, entry: Entry, now: float | None = None) -> None:
        """Take a waiting entry out of the queue (cancelled, timed out, impossible)."""
        if entry.state == WAITING:
            entry.state = _GONE
            self._queue.remove(entry)
            self._want(entry, -1.0, self.now if now is None else now)

    def _want(self, entry: Entry, sign: float, now: float) -> None:
        for kind, amount in entry.action.demand.rigid:
            if kind in self.wanted:
                self._wait_to(kind, now)
                self.wanted[kind] = max(0.0, self.wanted[kind] + sign * amount)

    def _wait_to(self, kind: str, now: float) -> None:
        at = self._waited_at[kind]
        if now > at:
            self._waited[kind] += self.wanted[kind] * (now - at)
            self._waited_at[kind] = now

    def waited(self, kind: str, now: float) -> float:
        """Units of rate budget ``kind`` times the seconds they waited, so far: the
        difference over a span, divided by it, is the mean units waiting then. A call
        granted as it came never waited, and adds nothing."""
        return self._waited[kind] + self.wanted[kind] * max(0.0, now - self._waited_at[kind])

    def finish(
        self, entry: Entry, now: float, seconds: float | None = None, ok: bool = True
    ) -> None:
        """Return a running entry's units; teach the estimator when the action succeeded."""
        if entry.state != RUNNING:
            return
        entry.unit_time += entry.units * (now - entry.mark)
        demand = entry.action.demand
        if demand.elastic is not None:
            self._change_units(entry, entry.units, 0, -1, now)
        for kind, amount in demand.rigid:
            if kind in self.held:
                self._hold(kind, -amount, now)
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
        if self._queue.next_due() <= now:
            self._queue.fall_due(now)
        plan = self.policy.plan(self)
        if self._check is not None:
            self._check(plan, self.policy, self.free, self.tokens)
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

    def limit_rate(
        self, kind: str, per_second: float, burst: float, now: float, until: float = math.inf
    ) -> None:
        """Refill ``kind`` at ``per_second`` up to ``burst``, at most its capacity's, until
        ``until``; then nothing, and nothing saved, until limited again.

        The rest of the budget is lent elsewhere (another node's share of a job's API
        rate, good until its lease runs out): saved-up tokens above the new cap are
        dropped, none are added, and no waiter is failed, since the capacity, which
        decides what can ever fit, is unchanged. A rate of zero stops the refill. The
        time is checked at each step, before any grant, so a loop that stalled past it
        grants nothing from the lapsed share when it wakes.
        """
        self._refill(now)
        self._limits[kind] = (per_second, burst, until)
        self._limited_until = min(self._limited_until, until)
        resource = self.capacity.get(kind)
        if resource is not None:  # else it starts so when installed: empty, at this cap
            self._limit(kind, resource.total, resource.burst)

    def _expire_limits(self, now: float) -> None:
        self._limited_until = math.inf
        for kind, (_, _, until) in list(self._limits.items()):
            if until < now:
                self._limits[kind] = (0.0, 0.0, math.inf)
                if kind in self.rates:
                    self.tokens[kind] = 0.0
                    self._limit(kind, self.capacity[kind].total, self.capacity[kind].burst)
            else:
                self._limited_until = min(self._limited_until, until)

    def _limit(self, kind: str, total: float, burst: float) -> None:
        per_second, cap, _ = self._limits.get(kind, (total, burst, math.inf))
        self.rates[kind] = min(total, per_second)
        self.bursts[kind] = min(burst, cap)
        self.tokens[kind] = min(self.tokens.get(kind, self.bursts[kind]), self.bursts[kind])

    def set_capacity(self, capacity: Capacity, now: float) -> list[Entry]:
        """Install new capacities; return (and withdraw) waiting entries that can never fit."""
        self._account(now)
        self._refill(now)
        self._install(capacity, now)
        impossible = [e for e in self._queue if not self.could_ever_fit(e)]  # a rare O(n)
        for entry in impossible:
            self.withdraw(entry, now)
        return impossible

    # -- internals ---------------------------------------------------------------------

    def _install(self, capacity: Capacity, now: float) -> None:
        self.capacity = capacity
        for name, resource in capacity.items():
            if resource.shape is Shape.RATE:
                self.open.add(name)
                self._limit(name, resource.total, resource.burst)
                self.spent.setdefault(name, 0.0)
                self.wanted.setdefault(name, 0.0)
                self._waited.setdefault(name, 0.0)
                self._waited_at.setdefault(name, now)
                continue
            held = self.held.setdefault(name, 0.0)
            self.totals[name] = resource.total
            self.free[name] = resource.total - held
            self.surplus.setdefault(name, 0.0)
            self.headroom.setdefault(name, 0.0)
            self.unit_seconds.setdefault(name, 0.0)
            self._since.setdefault(name, now)
            self.peak.setdefault(name, 0.0)
            self._hold(name, 0.0, now)  # files it open or shut for its new free units

    def could_ever_fit(self, entry: Entry) -> bool:
        for kind, amount in entry.action.demand.minimum:
            limit = self.capacity[kind].burst if kind in self.rates else self.totals[kind]
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
        if now > self._limited_until:  # before any refill: a lapsed limit earns nothing
            self._expire_limits(now)
        elapsed = now - self._refilled_at
        if elapsed > 0:
            for kind, rate in self.rates.items():
                self.tokens[kind] = min(self.bursts[kind], self.tokens[kind] + elapsed * rate)
        self._refilled_at = max(self._refilled_at, now)

    def _account(self, now: float) -> None:
        """Bring every kind's ``unit_seconds`` up to ``now``, for readers of the bill."""
        for kind in self.held:
            self._hold(kind, 0.0, now)

    def _hold(self, kind: str, delta: float, now: float) -> None:
        """Change the units held of ``kind`` by ``delta`` at ``now``, billing the time before,
        and file ``kind`` in ``open`` or out of it (after any change to its surplus too).

        Each kind is billed when its own holding changes, not every kind at every step: a
        runtime that decides for many nodes has a kind per node.
        """
        since = self._since[kind]
        held = self.held[kind]
        if now > since:
            self.unit_seconds[kind] += held * (now - since)
            self._since[kind] = now
        if delta:
            held = self.held[kind] = held + delta
            self.free[kind] -= delta
            if held > self.peak[kind]:
                self.peak[kind] = held
        if self.free[kind] + self.surplus[kind] > _EPS:
            self.open.add(kind)
        else:
            self.open.discard(kind)

    def _admit(self, entry: Entry, units: int, now: float) -> None:
        demand = entry.action.demand
        for kind, amount in demand.rigid:
            if kind in self.tokens:
                self.tokens[kind] -= amount
                self.spent[kind] += amount
                self._wait_to(kind, now)
                self.wanted[kind] = max(0.0, self.wanted[kind] - amount)
            else:
                self._hold(kind, amount, now)
        entry.state = RUNNING
        self._queue.remove(entry)
        entry.admitted_at = now
        entry.mark = now
        entry.rem = entry.t1
        self._running[entry] = None
        if demand.elastic is not None:
            assert demand.elastic_kind is not None
            self._change_units(entry, 0, units, 1, now)

    def _resize(self, entry: Entry, units: int, now: float) -> None:
        if entry.state != RUNNING or units == entry.units:
            return
        entry.rem = entry.remaining(now)
        entry.unit_time += entry.units * (now - entry.mark)
        entry.mark = now
        self._change_units(entry, entry.units, units, 0, now)
        self.resizes += 1

    def _change_units(self, entry: Entry, old: int, new: int, sign: int, now: float) -> None:
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
        entry.units = new
        if not elastic.resizable:
            self._hold(kind, new - old, now)
            return
        if sign <= 0:
            self.surplus[kind] -= old - elastic.min
            self.headroom[kind] -= elastic.max - old
        if sign >= 0:
            self.surplus[kind] += new - elastic.min
            self.headroom[kind] += elastic.max - new
        self._hold(kind, new - old, now)  # after the surplus moved: it files the kind
        split = self.split(kind)
        if sign > 0:
            split.join(entry)
            self.resizable[kind] = None
        elif sign == 0:
            split.moved(entry, old)
        else:
            split.leave(entry, old)
            if not split:
                self.resizable.pop(kind, None)


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
