import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import make_action

from tangram import Amdahl, Elastic, ElasticPolicy, Estimate, Estimator, FcfsPolicy, Linear, Rate
from tangram._core import _line as line_module
from tangram._core._action import Action
from tangram._core._demand import build_demand
from tangram._core._entry import Entry
from tangram._core._ledger import Ledger, held_matches_grants
from tangram._core._line import Line
from tangram._core._policy import DONE, RUNNING, WAITING, Policy
from tangram._core._resources import parse_capacity
from tangram.abc import Plan


def ledger_for(capacity: dict[str, object], policy: Policy | None = None) -> Ledger:
    return Ledger(
        parse_capacity(capacity), policy if policy is not None else ElasticPolicy(), Estimator()
    )


# -- queue and accounting ------------------------------------------------------------------


def test_submit_step_finish() -> None:
    cap = {"cpu": 4}
    ledger = ledger_for(cap)
    a = ledger.submit(make_action({"cpu": 3}, cap), 0.0)
    b = ledger.submit(make_action({"cpu": 2}, cap), 0.5)
    assert (a.state, b.state) == (WAITING, WAITING)
    assert list(ledger.waiting()) == [a, b] and ledger.waiting_count == 2
    plan = ledger.step(1.0)
    assert plan.admits == [(a, 0)]
    assert a.state == RUNNING and a.admitted_at == 1.0
    assert ledger.held["cpu"] == 3 and ledger.free["cpu"] == 1
    assert list(ledger.waiting()) == [b] and list(ledger.running) == [a]
    ledger.finish(a, 3.0)
    assert a.state == DONE and ledger.held["cpu"] == 0
    assert ledger.unit_seconds["cpu"] == pytest.approx(3 * 2.0)
    assert ledger.peak["cpu"] == 3
    ledger.step(3.0)
    assert b.state == RUNNING


def test_finish_twice_or_before_running_is_a_no_op() -> None:
    cap = {"cpu": 4}
    ledger = ledger_for(cap)
    waiting = ledger.submit(make_action({"cpu": 8 // 2}, cap), 0.0)
    other = ledger.submit(make_action({"cpu": 1}, cap), 0.0)
    ledger.step(0.0)
    ledger.finish(other, 1.0)  # still waiting: nothing to give back
    assert other.state == WAITING and ledger.held["cpu"] == 4
    ledger.finish(waiting, 1.0)
    ledger.finish(waiting, 2.0)
    assert ledger.held["cpu"] == 0 and ledger.free["cpu"] == 4


def test_withdraw_from_the_middle() -> None:
    cap = {"cpu": 1}
    ledger = ledger_for(cap, FcfsPolicy())
    entries = [ledger.submit(make_action({"cpu": 1}, cap), float(i)) for i in range(5)]
    ledger.withdraw(entries[2])
    ledger.withdraw(entries[2])  # twice is harmless
    assert list(ledger.waiting()) == [entries[i] for i in (0, 1, 3, 4)]
    assert ledger.waiting_count == 4
    admitted = []
    now = 0.0
    while ledger.waiting_count:
        now += 1.0
        for entry, _ in ledger.step(now).admits:
            admitted.append(entry)
            ledger.finish(entry, now + 0.5)
    assert admitted == [entries[i] for i in (0, 1, 3, 4)]


def test_withdraw_a_running_entry_is_a_no_op() -> None:
    cap = {"cpu": 2}
    ledger = ledger_for(cap)
    entry = ledger.submit(make_action({"cpu": 2}, cap), 0.0)
    ledger.step(0.0)
    ledger.withdraw(entry)
    assert entry.state == RUNNING and ledger.held["cpu"] == 2


def test_queue_iteration_skips_removed_entries_cheaply() -> None:
    # Entries removed from the middle must not be walked again by later passes.
    cap = {"cpu": 1}
    ledger = ledger_for(cap)
    head = ledger.submit(make_action({"cpu": 1}, cap), 0.0)
    middle = [ledger.submit(make_action({"cpu": 1}, cap), 0.0) for _ in range(1000)]
    tail = ledger.submit(make_action({"cpu": 1}, cap), 0.0)
    for entry in middle:
        ledger.withdraw(entry)
    assert list(ledger.waiting()) == [head, tail]


def test_finish_teaches_the_estimator() -> None:
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    entry = ledger.submit(make_action({"cpu": Elastic(4, 4)}, cap, kind="build", seconds=1.0), 0.0)
    ledger.step(0.0)
    ledger.finish(entry, 10.0)
    learned = ledger.estimator.predict("build")
    assert learned.seconds(4) > 4.0  # it moved towards the 10 s seen on 4 units


def test_failed_actions_do_not_teach() -> None:
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    entry = ledger.submit(make_action({"cpu": 1}, cap, kind="flaky"), 0.0)
    ledger.step(0.0)
    ledger.finish(entry, 0.001, ok=False)
    assert len(ledger.estimator) == 0


def test_unit_seconds_follow_resizes() -> None:
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    a = ledger.submit(make_action({"cpu": Elastic(1, 8, resizable=True)}, cap, seconds=80.0), 0.0)
    ledger.step(0.0)
    assert a.units == 8
    b = ledger.submit(make_action({"cpu": 4}, cap, seconds=1.0), 2.0)
    ledger.step(2.0)  # the rigid newcomer takes 4 units from the elastic one
    assert b.state == RUNNING and a.units == 4 and ledger.resizes == 1
    ledger.finish(b, 3.0)
    ledger.step(3.0)
    assert a.units == 8
    ledger.finish(a, 5.0)
    # 8 units for 2 s, 4 + 4 for 1 s, 8 for 2 s.
    assert ledger.unit_seconds["cpu"] == pytest.approx(16 + 8 + 16)
    assert ledger.held["cpu"] == 0 and held_matches_grants(ledger)


# -- rate budgets --------------------------------------------------------------------------


def test_rate_tokens_refill_up_to_burst() -> None:
    cap = {"api": Rate(2.0, burst=3.0)}
    ledger = ledger_for(cap)
    assert ledger.tokens["api"] == 3.0  # a budget starts full
    for _ in range(3):
        ledger.submit(make_action({"api": 1}, cap), 0.0)
    ledger.step(0.0)
    assert ledger.tokens["api"] == pytest.approx(0.0)
    ledger.step(0.25)
    assert ledger.tokens["api"] == pytest.approx(0.5)
    ledger.step(1.0)
    assert ledger.tokens["api"] == pytest.approx(2.0)
    ledger.step(100.0)
    assert ledger.tokens["api"] == 3.0  # never more than the burst


def test_rate_units_are_never_given_back() -> None:
    cap = {"api": Rate(1.0, burst=2.0)}
    ledger = ledger_for(cap)
    entry = ledger.submit(make_action({"api": 2}, cap), 0.0)
    ledger.step(0.0)
    ledger.finish(entry, 0.1)
    ledger.step(0.1)
    assert ledger.tokens["api"] == pytest.approx(0.1)
    assert "api" not in ledger.held


@pytest.mark.parametrize("policy", [ElasticPolicy(), FcfsPolicy()])
def test_blocked_rate_head_wakes_at_refill_time(policy: Policy) -> None:
    cap = {"api": Rate(2.0, burst=2.0), "cpu": 4}
    ledger = ledger_for(cap, policy)
    entries = [ledger.submit(make_action({"api": 1, "cpu": 1}, cap), 0.0) for _ in range(3)]
    plan = ledger.step(10.0)
    assert [e for e, _ in plan.admits] == entries[:2]
    # One token short at 2 per second: the third can start half a second later.
    assert plan.wake_at == pytest.approx(10.5, abs=1e-5)
    assert plan.wake_at is not None and plan.wake_at >= 10.5
    early = ledger.step(10.4)
    assert early.admits == [] and early.wake_at == pytest.approx(10.5, abs=1e-5)
    late = ledger.step(plan.wake_at)
    assert late.admits == [(entries[2], 0)] and late.wake_at is None


def test_no_wake_when_blocked_by_a_count() -> None:
    cap = {"api": Rate(5.0), "cpu": 1}
    ledger = ledger_for(cap)
    ledger.submit(make_action({"cpu": 1}, cap), 0.0)
    ledger.submit(make_action({"cpu": 1, "api": 1}, cap), 0.0)
    plan = ledger.step(0.0)
    assert len(plan.admits) == 1 and plan.wake_at is None  # a completion will wake it


# -- a rate budget lent elsewhere (a node's share of a job's API rate) -----------------------


@pytest.mark.parametrize("policy", [ElasticPolicy(), FcfsPolicy()])
def test_a_rate_limited_to_nothing_grants_nothing_and_books_no_wake(policy: Policy) -> None:
    cap = {"api": Rate(10.0, burst=5.0)}
    ledger = ledger_for(cap, policy)
    ledger.limit_rate("api", 0.0, 0.0, 0.0)
    entry = ledger.submit(make_action({"api": 1}, cap), 0.0)
    plan = ledger.step(100.0)
    assert plan.admits == [] and plan.wake_at is None  # no refill: lending it back plans
    assert entry.state == WAITING and ledger.wanted["api"] == 1.0
    ledger.limit_rate("api", 2.0, 1.0, 100.0)
    plan = ledger.step(100.0)
    assert plan.admits == [] and plan.wake_at == pytest.approx(100.5, abs=1e-5)
    assert ledger.step(100.5).admits == [(entry, 0)]
    assert ledger.spent["api"] == 1.0 and ledger.wanted["api"] == 0.0


def test_a_kind_limited_before_it_is_installed_starts_empty() -> None:
    """A node's share of a job's rate grows from nothing, never from a full bucket."""
    cap = {"cpu": 1}
    ledger = ledger_for(cap)
    ledger.limit_rate("api@n", 4.0, 2.0, 0.0)
    wider = {"cpu": 1, "api@n": Rate(100.0, burst=50.0)}
    ledger.set_capacity(parse_capacity(wider), 0.0)
    assert ledger.tokens["api@n"] == 2.0  # the limit's burst, not the capacity's 50
    assert (ledger.rates["api@n"], ledger.bursts["api@n"]) == (4.0, 2.0)


def test_a_limit_cuts_saved_tokens_and_keeps_waiters_the_capacity_could_fit() -> None:
    cap = {"api": Rate(10.0, burst=8.0)}
    ledger = ledger_for(cap)
    assert ledger.tokens["api"] == 8.0
    ledger.limit_rate("api", 1.0, 2.0, 0.0)
    assert ledger.tokens["api"] == 2.0
    big = ledger.submit(make_action({"api": 5}, cap), 0.0)  # more than the limit's burst
    ledger.step(0.0)
    assert big.state == WAITING  # not failed: the capacity, 8, could fit it
    assert ledger.set_capacity(parse_capacity(cap), 1.0) == []  # the limit stays
    assert (ledger.rates["api"], ledger.bursts["api"]) == (1.0, 2.0)
    ledger.limit_rate("api", 10.0, 8.0, 1.0)
    ledger.step(1.3)
    assert big.state == RUNNING


def test_a_limit_never_raises_a_rate_past_its_capacity() -> None:
    cap = {"api": Rate(3.0, burst=3.0)}
    ledger = ledger_for(cap)
    ledger.limit_rate("api", 50.0, 50.0, 0.0)
    assert (ledger.rates["api"], ledger.bursts["api"]) == (3.0, 3.0)


def test_a_limit_lapses_at_its_time_and_grants_nothing_saved_before() -> None:
    """A node's share is good until its lease runs out; a loop that stalled past that
    must not grant from the tokens it saved or refilled meanwhile when it wakes."""
    cap = {"api": Rate(10.0, burst=10.0)}
    ledger = ledger_for(cap)
    ledger.limit_rate("api", 0.0, 0.0, 0.0)
    ledger.limit_rate("api", 10.0, 10.0, 0.0, until=1.0)
    entries = [ledger.submit(make_action({"api": 1}, cap), 0.9) for _ in range(5)]
    assert len(ledger.step(0.9).admits) == 5  # 9 tokens saved by then
    late = [ledger.submit(make_action({"api": 1}, cap), 3.0) for _ in range(5)]
    plan = ledger.step(3.0)  # woke long past the limit's time
    assert plan.admits == [] and plan.wake_at is None
    assert ledger.tokens["api"] == 0.0 and ledger.rates["api"] == 0.0
    ledger.limit_rate("api", 10.0, 10.0, 3.0, until=5.0)  # lent again: from nothing
    assert ledger.step(3.05).admits == [] and ledger.step(3.1).admits == [(late[0], 0)]
    assert all(entry.state == RUNNING for entry in entries)


def test_a_lapsed_limit_carries_nothing_into_the_next() -> None:
    """No decision ran between the lapse and the next share: the refill up to the new
    limit must not run at the lapsed one."""
    cap = {"api": Rate(10.0, burst=10.0)}
    ledger = ledger_for(cap)
    ledger.limit_rate("api", 0.0, 0.0, 0.0)
    ledger.limit_rate("api", 10.0, 10.0, 0.0, until=1.0)
    ledger.limit_rate("api", 5.0, 5.0, 5.0, until=10.0)
    assert ledger.tokens["api"] == 0.0


def test_a_withdrawn_waiter_is_no_longer_wanted() -> None:
    cap = {"api": Rate(1.0, burst=1.0)}
    ledger = ledger_for(cap)
    ledger.limit_rate("api", 0.0, 0.0, 0.0)
    entries = [ledger.submit(make_action({"api": 1}, cap), 0.0) for _ in range(3)]
    assert ledger.wanted["api"] == 3.0
    ledger.withdraw(entries[0])
    ledger.withdraw(entries[0])  # twice: counted once
    assert ledger.wanted["api"] == 2.0


def test_the_units_waited_sum_each_waiters_seconds_and_nothing_for_a_call_served_at_once() -> None:
    """A lender splits a saturated rate by each borrower's mean queue: the difference of
    ``waited`` over a span, divided by it. A call granted as it came waited no time."""
    cap = {"api": Rate(10.0, burst=2.0)}
    ledger = ledger_for(cap)
    for _ in range(2):  # two calls, served at once from the saved burst
        ledger.submit(make_action({"api": 1}, cap), 1.0)
    assert len(ledger.step(1.0).admits) == 2
    assert ledger.waited("api", 1.0) == 0.0
    slow = ledger.submit(make_action({"api": 2}, cap), 1.0)  # waits for 2 tokens: 0.2 s
    gone = ledger.submit(make_action({"api": 1}, cap), 1.0)
    assert ledger.step(1.0).admits == []
    assert ledger.waited("api", 1.1) == pytest.approx(0.3)  # 3 units for 0.1 s
    ledger.withdraw(gone, 1.1)
    assert ledger.step(1.1).admits == []
    assert ledger.step(1.2).admits == [(slow, 0)]
    assert ledger.waited("api", 1.2) == pytest.approx(0.3 + 2 * 0.1)
    assert ledger.waited("api", 9.0) == pytest.approx(0.5)  # nothing waits since


# -- capacity changes -----------------------------------------------------------------------


def test_lowering_capacity_withdraws_what_can_never_fit() -> None:
    cap = {"cpu": 8, "api": Rate(5.0, burst=5.0)}
    ledger = ledger_for(cap)
    running = ledger.submit(make_action({"cpu": 8}, cap), 0.0)
    ledger.step(0.0)
    big = ledger.submit(make_action({"cpu": 6}, cap), 1.0)
    small = ledger.submit(make_action({"cpu": 4}, cap), 1.0)
    elastic = ledger.submit(make_action({"cpu": Elastic(5, 8)}, cap), 1.0)
    greedy = ledger.submit(make_action({"api": 5}, cap), 1.0)
    gone = ledger.set_capacity(parse_capacity({"cpu": 4, "api": Rate(5.0, burst=3.0)}), 2.0)
    assert gone == [big, elastic, greedy]
    assert list(ledger.waiting()) == [small]
    assert running.state == RUNNING  # a running grant is never taken away
    assert ledger.free["cpu"] == -4 and ledger.tokens["api"] == 3.0
    ledger.finish(running, 3.0)
    assert ledger.step(3.0).admits == [(small, 0)]


def test_lowered_capacity_shrinks_resizable_and_admits_nothing_while_over() -> None:
    cap = {"cpu": 16}
    ledger = ledger_for(cap)
    rigid = ledger.submit(make_action({"cpu": 10}, cap, seconds=100.0), 0.0)
    elastic = ledger.submit(
        make_action({"cpu": Elastic(2, 6, resizable=True)}, cap, seconds=100.0), 0.0
    )
    fixed = ledger.submit(make_action({"cpu": Elastic(1, 6)}, cap, seconds=100.0), 0.0)
    ledger.step(0.0)
    assert ledger.held["cpu"] == 16 and elastic.units + fixed.units == 6
    before_fixed = fixed.units
    late = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 1.0)
    ledger.set_capacity(parse_capacity({"cpu": 8}), 2.0)
    plan = ledger.step(2.0)
    # Shrinking the resizable action to its minimum is all that can be done; the rigid
    # and the non-resizable grants stay, so use is still over capacity: admit nothing.
    assert plan.resizes == [(elastic, 2)] and plan.admits == []
    assert fixed.units == before_fixed
    assert ledger.held["cpu"] == 10 + 2 + before_fixed
    assert late.state == WAITING
    ledger.finish(rigid, 5.0)
    plan = ledger.step(5.0)
    assert late.state == RUNNING
    assert ledger.held["cpu"] <= 8
    assert held_matches_grants(ledger)


def test_lowered_capacity_shrink_makes_room() -> None:
    # When shrinking resizable actions brings use back under the new capacity, the room
    # left over is used in the same pass, never more.
    cap = {"cpu": 16}
    ledger = ledger_for(cap)
    elastic = ledger.submit(
        make_action({"cpu": Elastic(1, 16, resizable=True)}, cap, seconds=100.0), 0.0
    )
    ledger.step(0.0)
    assert elastic.units == 16
    waiting = ledger.submit(make_action({"cpu": 2}, cap, seconds=100.0), 1.0)
    ledger.set_capacity(parse_capacity({"cpu": 6}), 1.0)
    ledger.step(1.0)
    assert waiting.state == RUNNING
    assert elastic.units == 4 and ledger.held["cpu"] == 6


def test_raising_capacity_grows_resizable() -> None:
    cap = {"cpu": 4}
    ledger = ledger_for(cap)
    entry = ledger.submit(
        make_action({"cpu": Elastic(1, 16, resizable=True)}, cap, seconds=100.0), 0.0
    )
    ledger.step(0.0)
    assert entry.units == 4
    ledger.set_capacity(parse_capacity({"cpu": 12}), 1.0)
    ledger.step(1.0)
    assert entry.units == 12 and ledger.free["cpu"] == 0


class FixedPlan:
    """A policy that returns whatever plan the test sets."""

    def __init__(self) -> None:
        self.next = Plan()

    def plan(self, state: object) -> Plan:
        return self.next


def test_plan_applies_shrinks_before_grows() -> None:
    # A policy may list a grow before the shrink that makes room for it; the ledger still
    # never holds more than the capacity, not even for a moment (the peak would show it).
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    demand = {"cpu": Elastic(1, 8, resizable=True)}
    a = ledger.submit(make_action(demand, cap, seconds=10.0, efficiency=Amdahl(0.9)), 0.0)
    b = ledger.submit(make_action(demand, cap, seconds=10.0, efficiency=Amdahl(0.9)), 0.0)
    ledger.step(0.0)
    assert (a.units, b.units) == (4, 4) and ledger.peak["cpu"] == 8
    fixed = FixedPlan()
    fixed.next = Plan(resizes=[(a, 6), (b, 2)])
    ledger.policy = fixed
    ledger.step(1.0)
    assert (a.units, b.units) == (6, 2)
    assert ledger.peak["cpu"] == 8 and held_matches_grants(ledger)
    assert ledger.resizes == 2


def test_held_matches_grants_detects_drift() -> None:
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    ledger.submit(make_action({"cpu": Elastic(1, 4)}, cap), 0.0)
    ledger.step(0.0)
    assert held_matches_grants(ledger)
    ledger.held["cpu"] += 1
    assert not held_matches_grants(ledger)


def test_elastic_grant_prefers_the_efficient_action() -> None:
    # Two elastic newcomers share 8 units; the one that scales gets the spare units.
    cap = {"cpu": 8}
    ledger = ledger_for(cap)
    serial = ledger.submit(
        make_action({"cpu": Elastic(1, 8)}, cap, seconds=10.0, efficiency=Amdahl(0.0)), 0.0
    )
    parallel = ledger.submit(
        make_action({"cpu": Elastic(1, 8)}, cap, seconds=10.0, efficiency=Linear()), 0.0
    )
    ledger.step(0.0)
    assert (serial.units, parallel.units) == (1, 7)
    assert math.isclose(ledger.held["cpu"], 8)


# -- the priority-ordered line of size-aware admission ---------------------------------------


@settings(
    deadline=None,
    max_examples=50,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=400))
def test_line_stays_sorted_through_adds_and_removes(
    monkeypatch: pytest.MonkeyPatch, ops: list[tuple[bool, int]]
) -> None:
    # Small chunks, so that a few hundred operations split and empty many of them.
    monkeypatch.setattr(line_module, "_SPLIT", 4)
    line = Line()
    present: dict[int, tuple[float, int, str]] = {}
    for seq, (add, value) in enumerate(ops):
        if add or not present:
            key = (float(value), seq, f"item{seq}")
            line.add(key)
            present[seq] = key
        else:
            victim = sorted(present)[value % len(present)]
            line.remove(present.pop(victim))
        assert list(line) == [k[-1] for k in sorted(present.values())]
        assert len(line) == len(present)
    line.remove((0.0, -1, "absent"))  # not in the line: ignored
    assert len(line) == len(present)


def test_entries_that_leave_before_falling_due_do_not_pile_up() -> None:
    cap = {"cpu": 1}
    ledger = ledger_for(cap)
    for i in range(5_000):
        entry = ledger.submit(make_action({"cpu": 1}, cap, seconds=100.0), float(i))
        ledger.withdraw(entry)
    assert ledger.waiting_count == 0
    assert ledger._queue.dues <= 64


def test_falling_due_happens_at_a_step() -> None:
    # Due at 0 + 4 x 10 s: from the first step at or after t = 40 nothing newer passes it.
    cap = {"cpu": 1}
    ledger = ledger_for(cap)
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1e6), 0.0)
    ledger.step(0.0)
    long = ledger.submit(make_action({"cpu": 1}, cap, seconds=10.0), 0.0)
    short = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 1.0)
    ledger.step(4.0)
    assert list(ledger.waiting()) == [short, long]
    # The short one falls due at 1 + 4 x 1 s, then the long one: earliest due first.
    ledger.step(39.0)
    assert [e.key[0] for e in ledger.waiting() if e.key] == [0, 1]
    ledger.step(40.0)
    assert list(ledger.waiting()) == [short, long]
    assert long.key is not None and long.key[0] == 0
    late = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.5), 41.0)
    ledger.step(41.0)
    assert list(ledger.waiting()) == [short, long, late]


_ids = itertools.count(10**6)


@pytest.mark.parametrize("learned", [True, False])
def test_a_later_action_of_a_kind_passes_an_earlier_one_only_by_sizes_of_their_own(
    learned: bool,
) -> None:
    """Early in a kind's life its estimate leans on the prior: an action that came then is
    filed many times its size. With the estimate the kind's (``learned``), a later action
    of the kind, filed by the lower estimate learned since, is as alike as anyone knows,
    and does not pass it (before, it did: a new trajectory's first run waited 1.45 s
    behind 30 ms runs of its kind, until it fell due). With sizes of their own (a hint
    each), the smaller goes first, as size-aware admission says."""
    cap = {"cpu": 2}
    ledger = ledger_for(cap)
    demand = build_demand({"cpu": 1}, parse_capacity(cap))

    def submit(kind: str, now: float, seconds: float | None = None) -> Entry:
        estimate = ledger.estimator.predict(kind)
        if seconds is not None:
            estimate = Estimate(seconds, estimate.efficiency)
        action = Action(next(_ids), kind, None, demand, estimate, learned and seconds is None)
        return ledger.submit(action, now)

    long = submit("other", 0.0, seconds=100.0)
    first = submit("run", 0.0)
    ledger.step(0.0)
    assert (long.state, first.state) == (RUNNING, RUNNING)
    older = submit("run", 0.01)  # the prior's size
    ledger.finish(first, 0.03)  # the kind's first sample: 30 ms
    newer = submit("run", 0.03)
    assert newer.t1 < older.t1 / 1.5
    ledger.step(0.03)
    assert (older.state, newer.state) == ((RUNNING, WAITING) if learned else (WAITING, RUNNING))


def test_alike_actions_ahead_of_one_that_falls_due_fall_due_with_it() -> None:
    """Each falls due by the estimate it came with: a later alike action, sized by the
    lower estimate learned since, falls due first, and alone it would pass the older
    ones (review of the change above: under load every new trajectory's first action
    waited its prior's allowance again, 4.7 s at 60 trajectories on two cores)."""
    cap = parse_capacity({"cpu": 1})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    demand = build_demand({"cpu": 1}, cap)
    blocker = ledger.submit(
        Action(next(_ids), "other", None, demand, Estimate(100.0, Linear())), 0.0
    )
    ledger.step(0.0)
    assert blocker.state == RUNNING
    older = ledger.submit(
        Action(next(_ids), "run", None, demand, Estimate(1.0, Linear()), True), 0.0
    )
    newer = ledger.submit(
        Action(next(_ids), "run", None, demand, Estimate(0.03, Linear()), True), 0.01
    )
    later = ledger.submit(
        Action(next(_ids), "run", None, demand, Estimate(0.03, Linear()), True), 0.02
    )
    ledger.step(0.125)  # ``newer`` falls due at 0.01 + 4 x 0.03, ``later`` at 0.14
    assert list(ledger.waiting()) == [older, newer, later]
    ledger.step(0.2)
    assert list(ledger.waiting()) == [older, newer, later]
    ledger.finish(blocker, 0.2)
    ledger.step(0.2)
    assert (older.state, newer.state, later.state) == (RUNNING, WAITING, WAITING)
