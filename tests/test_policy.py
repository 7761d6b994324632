"""Properties of the policies, checked on random states built through the ledger."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import CAPACITY, ledger_ops, make_action, workloads

from tangram import Amdahl, Elastic, ElasticPolicy, Estimator, FcfsPolicy, Linear, Rate, simulate
from tangram._core._ledger import Ledger, held_matches_grants
from tangram._core._policy import RUNNING, WAITING, Entry, Policy
from tangram._core._resources import parse_capacity
from tangram.abc import Plan
from tangram.errors import InvalidSettingError, SettingTypeError

PROPERTY = settings(deadline=None, max_examples=100, derandomize=True)
EPS = 1e-6


def elastic_policies(order: str) -> st.SearchStrategy[ElasticPolicy]:
    return st.builds(
        ElasticPolicy,
        starvation_bound=st.sampled_from([0.5, 5.0, 30.0, math.inf]),
        window=st.sampled_from([1, 3, 128]),
        eviction_depth=st.sampled_from([0, 1, 4]),
        order=st.just(order),
        aging=st.sampled_from([0.5, 4.0, math.inf]),
        max_wait=st.sampled_from([1.0, math.inf]),
    )


fcfs_policies = st.one_of(
    elastic_policies("arrival"), st.builds(FcfsPolicy, dop=st.sampled_from(["min", "max", 1, 4]))
)
policies = st.one_of(elastic_policies("size"), fcfs_policies)


def check_plan(
    ledger: Ledger, plan: Plan, waiting_before: set[Entry], units_before: dict[Entry, int]
) -> None:
    """What must hold after any step, whatever the policy decided."""
    for kind, total in ledger.totals.items():
        assert ledger.held[kind] <= total + EPS, (kind, ledger.held[kind], total)
        assert ledger.free[kind] >= -EPS
        # Never over capacity on the way either (the peak is taken at every change).
        assert ledger.peak[kind] <= total + EPS, (kind, ledger.peak[kind], total)
    for kind, level in ledger.tokens.items():
        assert level >= -EPS, (kind, level)
        assert level <= ledger.bursts[kind] + EPS
    assert held_matches_grants(ledger)
    for entry, units in plan.admits:
        assert entry in waiting_before
        assert entry.state == RUNNING
        elastic = entry.action.demand.elastic
        if elastic is None:
            assert units == 0
        else:
            assert elastic.min <= units <= elastic.max
    for entry, units in plan.resizes:
        elastic = entry.action.demand.elastic
        assert elastic is not None and elastic.resizable, "a non-resizable action was resized"
        assert elastic.min <= units <= elastic.max
    # Shrinks come first, so that applying the plan in order never exceeds the capacity.
    grew = False
    for entry, units in plan.resizes:
        if units > units_before[entry]:
            grew = True
        else:
            assert not grew, "a shrink listed after a grow"
    admitted = [e for e, _ in plan.admits]
    resized = [e for e, _ in plan.resizes]
    assert len(set(admitted)) == len(admitted) and len(set(resized)) == len(resized)
    assert not set(admitted) & set(resized)
    surplus: dict[str, float] = dict.fromkeys(ledger.surplus, 0.0)
    headroom: dict[str, float] = dict.fromkeys(ledger.headroom, 0.0)
    for entry in ledger.running:
        demand = entry.action.demand
        elastic = demand.elastic
        if elastic is not None:
            assert elastic.min <= entry.units <= elastic.max
            assert demand.elastic_kind is not None
            if elastic.resizable:
                surplus[demand.elastic_kind] += entry.units - elastic.min
                headroom[demand.elastic_kind] += elastic.max - entry.units
    for kind in surplus:
        assert ledger.surplus[kind] == pytest.approx(surplus[kind], abs=EPS)
        assert ledger.headroom[kind] == pytest.approx(headroom[kind], abs=EPS)
        check_split(ledger, kind)
    line = list(ledger.waiting())
    assert len(line) == ledger.waiting_count and all(e.state == WAITING for e in line)
    if getattr(ledger.policy, "priority", None) is not None:
        # Size-aware: those due first by due time, then the others by expected work; those
        # on a rate budget (no key) in arrival order.
        keys = [e.key[:3] for e in line if e.key is not None]
        assert keys == sorted(keys)
        lane = [e.seq for e in line if e.key is None]
        assert lane == sorted(lane)
        assert all(e.key is None for e in line if e.action.demand.amount("api", 0))
    if not ledger.running and ledger.waiting_count:
        # Idle with work queued is only allowed while waiting for a rate budget.
        assert plan.wake_at is not None and plan.wake_at > ledger.now


def check_split(ledger: Ledger, kind: str) -> None:
    """The split index the ledger keeps across passes says what a rebuild would say."""
    split = ledger.split(kind)
    members = {
        e
        for e in ledger.running
        if e.action.demand.elastic_kind == kind and _resizable(e.action.demand.elastic)
    }
    assert set(split.members) == members
    assert split.held == sum(e.units for e in members)
    assert split.floors == sum(e.emin for e in members)
    live_give = {(r[2], r[3]) for r in split.give if r[2].state == RUNNING and r[2].units == r[3]}
    live_take = {(r[2], r[3]) for r in split.take if r[2].state == RUNNING and r[2].units == r[3]}
    assert live_give == {(e, e.units) for e in members if e.units < e.emax}
    assert live_take == {(e, e.units) for e in members if e.units > e.emin}
    for record in (*split.give, *split.take):
        entry, units = record[2], record[3]
        if entry.state == RUNNING and entry.units == units:
            worth = 1 / entry.speedup(units + (1 if record in split.give else -1))
            assert abs(record[0]) == pytest.approx(abs(worth - 1 / entry.speedup(units)))


def _resizable(elastic: Elastic | None) -> bool:
    return elastic is not None and elastic.resizable


def drive(policy: Policy, ops: list[tuple[str, Any]]) -> list[tuple[int, str, int]]:
    """Run a script against a ledger, checking every step; return what was decided."""
    cap = parse_capacity(CAPACITY)
    ledger = Ledger(cap, policy, Estimator())
    now = 0.0
    log: list[tuple[int, str, int]] = []
    for op, arg in ops:
        if op == "submit":
            amounts, seconds, efficiency = arg
            ledger.submit(make_action(amounts, cap, seconds=seconds, efficiency=efficiency), now)
        elif op == "advance":
            now += arg
        elif op == "finish":
            running = sorted(ledger.running, key=lambda e: e.seq)
            if running:
                ledger.finish(running[arg % len(running)], now)
        elif op == "withdraw":
            waiting = list(ledger.waiting())
            if waiting:
                ledger.withdraw(waiting[arg % len(waiting)])
        waiting_before = set(ledger.waiting())
        units_before = {e: e.units for e in ledger.running}
        plan = ledger.step(now)
        check_plan(ledger, plan, waiting_before, units_before)
        log += [(e.seq, "admit", u) for e, u in plan.admits]
        log += [(e.seq, "resize", u) for e, u in plan.resizes]
    return log


@PROPERTY
@given(policies, ledger_ops())
def test_invariants_on_random_states(policy: Policy, ops: list[tuple[str, Any]]) -> None:
    drive(policy, ops)


@PROPERTY
@given(policies, ledger_ops())
def test_decisions_are_deterministic(policy: Policy, ops: list[tuple[str, Any]]) -> None:
    assert drive(policy, ops) == drive(policy, ops)  # fresh ledgers, same script


EQUAL_RIGID = st.sampled_from(
    [{"cpu": 3}, {"cpu": 1, "gpu": 1}, {"gpu": 0.5}, {"api": 1, "cpu": 2}]
)


@PROPERTY
@given(fcfs_policies, EQUAL_RIGID, st.data())
def test_fcfs_among_equal_rigid_demands(
    policy: Policy, amounts: dict[str, object], data: st.DataObject
) -> None:
    # Equal rigid demands: nobody fits where an earlier one did not, so nobody passes,
    # whatever the durations (which backfilling would otherwise use to reorder).
    workload = data.draw(workloads(demand=st.just(amounts), max_trajectories=10))
    records = simulate(workload, CAPACITY, policy=policy).records
    for a, b in itertools.combinations(records, 2):
        if a.arrival < b.arrival:
            assert a.admitted <= b.admitted, (a, b)


@PROPERTY
@given(elastic_policies("size"), EQUAL_RIGID, st.data())
def test_size_aware_admission_passes_nobody_once_due(
    policy: ElasticPolicy, amounts: dict[str, object], data: st.DataObject
) -> None:
    # The starvation bound of size-aware admission: an action arriving at or after
    # another's due time (arrival + min(aging x service, max_wait)) never starts first.
    workload = data.draw(workloads(demand=st.just(amounts), max_trajectories=10))
    records = simulate(workload, CAPACITY, policy=policy).records
    service = {
        (r.trajectory, r.index): workload[r.trajectory][r.index].seconds_at_1 for r in records
    }
    for a, b in itertools.permutations(records, 2):
        due = a.arrival + min(policy.aging * service[a.trajectory, a.index], policy.max_wait)
        if b.arrival >= due:
            assert a.admitted <= b.admitted, (a, b, due)


def test_shortest_expected_service_first() -> None:
    cap = parse_capacity({"cpu": 1})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    first = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    # Queued behind ``first`` in this arrival order; started shortest first.
    waiting = [ledger.submit(make_action({"cpu": 1}, cap, seconds=s), 0.5) for s in (9.0, 3.0, 6.0)]
    ledger.step(0.5)
    assert [e.t1 for e in ledger.waiting()] == [3.0, 6.0, 9.0]
    started = []
    now = 1.0
    for _ in waiting:
        ledger.finish(next(iter(ledger.running)), now)
        ((admitted, _units),) = ledger.step(now).admits
        started.append(admitted.t1)
        now += admitted.t1
    assert started == [3.0, 6.0, 9.0]
    assert first.state != WAITING


def test_service_is_the_expected_time_at_the_minimum_grant() -> None:
    # 40 s of Amdahl(0.9) work at 4 cores minimum (13 s) goes before a rigid 20 s action.
    cap = parse_capacity({"cpu": 4})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    ledger.submit(make_action({"cpu": 4}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    rigid = ledger.submit(make_action({"cpu": 4}, cap, seconds=20.0), 0.0)
    elastic = ledger.submit(
        make_action({"cpu": Elastic(4, 8)}, cap, seconds=40.0, efficiency=Amdahl(0.9)), 0.0
    )
    assert list(ledger.waiting()) == [elastic, rigid]


def test_a_long_action_falls_due_after_aging_times_its_service() -> None:
    # A 10 s action with aging 2 is passed by shorter newcomers until t = 20, then by none.
    cap = parse_capacity({"cpu": 1})
    ledger = Ledger(cap, ElasticPolicy(aging=2.0), Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    long = ledger.submit(make_action({"cpu": 1}, cap, seconds=10.0), 0.0)
    early = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 19.0)
    ledger.step(19.0)
    assert list(ledger.waiting()) == [early, long]
    late = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.1), 20.0)
    ledger.step(20.0)
    # ``long`` is due (0 + 2 x 10 s); the others, due at 21 and 20.2, not yet.
    assert list(ledger.waiting()) == [long, late, early]


def test_max_wait_caps_the_allowance() -> None:
    cap = parse_capacity({"cpu": 1})
    ledger = Ledger(cap, ElasticPolicy(aging=100.0, max_wait=5.0), Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    long = ledger.submit(make_action({"cpu": 1}, cap, seconds=10.0), 0.0)
    short = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 5.0)
    ledger.step(5.0)
    assert list(ledger.waiting()) == [long, short]


def test_shortest_first_without_aging_never_falls_due() -> None:
    # The `srpt` reference: whatever its wait, a long action stays behind shorter ones.
    cap = parse_capacity({"cpu": 1})
    policy = ElasticPolicy(aging=math.inf, starvation_bound=math.inf)
    ledger = Ledger(cap, policy, Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    long = ledger.submit(make_action({"cpu": 1}, cap, seconds=10.0), 0.0)
    short = ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 1e6)
    ledger.step(1e6)
    assert list(ledger.waiting()) == [short, long]


def test_arrival_order_is_the_fcfs_admission_of_before() -> None:
    cap = parse_capacity({"cpu": 1})
    ledger = Ledger(cap, ElasticPolicy(order="arrival"), Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1.0), 0.0)
    ledger.step(0.0)
    waiting = [ledger.submit(make_action({"cpu": 1}, cap, seconds=s), 0.5) for s in (9.0, 3.0)]
    ledger.step(0.5)
    assert list(ledger.waiting()) == waiting
    assert ElasticPolicy(order="arrival").priority is None


def test_fcfs_policy_passes_nobody() -> None:
    cap = parse_capacity({"cpu": 4})
    ledger = Ledger(cap, FcfsPolicy(), Estimator())
    ledger.submit(make_action({"cpu": 3}, cap), 0.0)
    big = ledger.submit(make_action({"cpu": 4}, cap), 0.0)
    small = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.01), 0.0)
    plan = ledger.step(0.0)
    assert len(plan.admits) == 1
    assert big.state == WAITING and small.state == WAITING


@pytest.mark.parametrize(("dop", "units"), [("min", 2), ("max", 12), (4, 4), (1, 2), (64, 12)])
def test_fcfs_fixed_dop(dop: int | str, units: int) -> None:
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, FcfsPolicy(dop=dop), Estimator())  # type: ignore[arg-type]
    entry = ledger.submit(make_action({"cpu": Elastic(2, 12, resizable=True)}, cap), 0.0)
    ledger.step(0.0)
    assert entry.units == units
    ledger.submit(make_action({"cpu": 1}, cap), 1.0)
    plan = ledger.step(1.0)
    assert plan.resizes == []  # a fixed DoP never changes


def test_fcfs_dop_clamped_to_capacity() -> None:
    cap = parse_capacity({"cpu": 6})
    ledger = Ledger(cap, FcfsPolicy(dop="max"), Estimator())
    entry = ledger.submit(make_action({"cpu": Elastic(2, 12)}, cap), 0.0)
    ledger.step(0.0)
    assert entry.units == 6


@pytest.mark.parametrize(
    ("dop", "error"),
    [
        (0, InvalidSettingError),
        (-1, InvalidSettingError),
        (True, SettingTypeError),
        (2.5, SettingTypeError),
        ("all", SettingTypeError),
        (None, SettingTypeError),
    ],
)
def test_fcfs_rejects_bad_dop(dop: object, error: type[Exception]) -> None:
    """A tangram error that is still the ValueError these always raised (issue 20)."""
    with pytest.raises(error, match=r"`dop` must be 'min', 'max' or a whole number >= 1") as info:
        FcfsPolicy(dop=dop)  # type: ignore[arg-type]
    assert type(info.value) is error
    assert isinstance(info.value, ValueError)
    assert repr(dop) in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"starvation_bound": 0},
        {"starvation_bound": -1.0},
        {"starvation_bound": True},
        {"window": -1},
        {"window": 0},
        {"window": 2.5},
        {"eviction_depth": -1},
        {"order": "sjf"},
        {"aging": 0},
        {"aging": -1.0},
        {"max_wait": 0},
    ],
)
def test_elastic_policy_rejects_bad_settings(kwargs: dict[str, object]) -> None:
    name, value = next(iter(kwargs.items()))
    with pytest.raises(InvalidSettingError, match=name) as info:
        ElasticPolicy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert f"(got {value!r})" in str(info.value)
    wrong_type = kwargs in ({"starvation_bound": True}, {"window": 2.5})
    assert isinstance(info.value, SettingTypeError) == wrong_type


# -- the elastic policy's decisions -----------------------------------------------------------


def test_backfill_only_when_the_head_is_not_delayed() -> None:
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    first = ledger.submit(make_action({"cpu": 10}, cap, seconds=10.0), 0.0)
    head = ledger.submit(make_action({"cpu": 12}, cap, seconds=10.0), 0.0)
    # Ends at t=5, before the head can start at t=10: it may pass.
    short = ledger.submit(make_action({"cpu": 5}, cap, seconds=5.0), 0.0)
    ledger.step(0.0)
    assert first.state == RUNNING and short.state == RUNNING and head.state == WAITING


def test_no_backfill_that_delays_a_head_blocked_by_this_pass() -> None:
    # The head is blocked by an action admitted in the same pass. Ignoring that one, the
    # head looked unreachable and anything that fit passed it: here a long action that
    # would hold 5 units past t=10, when the head needs 12 of the 16.
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    first = ledger.submit(make_action({"cpu": 10}, cap, seconds=10.0), 0.0)
    head = ledger.submit(make_action({"cpu": 12}, cap, seconds=10.0), 0.0)
    long = ledger.submit(make_action({"cpu": 5}, cap, seconds=100.0), 0.0)
    ledger.step(0.0)
    assert first.state == RUNNING
    assert head.state == WAITING and long.state == WAITING


def test_no_backfill_counting_shrinkable_units_twice() -> None:
    # A resizable action holding 4 units (minimum 2) can give 2 now; when it ends it
    # frees only its other 2. Counting all 4 again made the head look like it would have
    # 2 units to spare and let a long action take them.
    cap = parse_capacity({"cpu": 8})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    ledger.submit(make_action({"cpu": 4}, cap, seconds=20.0), 0.0)
    grower = ledger.submit(
        make_action({"cpu": Elastic(2, 4, resizable=True)}, cap, seconds=40.0), 0.0
    )
    ledger.step(0.0)
    assert grower.units == 4
    head = ledger.submit(make_action({"cpu": 8}, cap, seconds=1.0), 1.0)
    long = ledger.submit(make_action({"cpu": 2}, cap, seconds=100.0), 1.0)
    plan = ledger.step(1.0)
    assert head.state == WAITING and long.state == WAITING
    assert plan.resizes == [] and grower.units == 4


def test_backfill_into_units_the_head_leaves_spare() -> None:
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    ledger.submit(make_action({"cpu": 10}, cap, seconds=10.0), 0.0)
    head = ledger.submit(make_action({"cpu": 12}, cap, seconds=10.0), 0.0)
    # When the head starts at t=10, 4 units stay free: a long 4-unit action fits there.
    long = ledger.submit(make_action({"cpu": 4}, cap, seconds=100.0), 0.0)
    ledger.step(0.0)
    assert head.state == WAITING and long.state == RUNNING


def test_a_starved_head_is_never_passed() -> None:
    # In arrival order (FCFS admission), where the head is the oldest waiting action.
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(starvation_bound=5.0, order="arrival"), Estimator())
    ledger.submit(make_action({"cpu": 10}, cap, seconds=10.0), 0.0)
    head = ledger.submit(make_action({"cpu": 12}, cap, seconds=10.0), 0.0)
    ledger.step(0.0)
    short = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.1), 6.0)
    ledger.step(6.0)  # the head has waited 6 s > 5 s: nothing passes it any more
    assert head.state == WAITING and short.state == WAITING


def test_a_starved_head_is_passed_by_nothing_once_due() -> None:
    # Size-aware: shorter newcomers go first until the head is due (0 + 2 x 10 s); from
    # then on it leads the line, and past the starvation bound nothing backfills past it.
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(starvation_bound=5.0, aging=2.0), Estimator())
    ledger.submit(make_action({"cpu": 10}, cap, seconds=100.0), 0.0)
    ledger.step(0.0)
    head = ledger.submit(make_action({"cpu": 12}, cap, seconds=10.0), 0.0)
    ledger.step(0.0)
    early = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.1), 6.0)
    ledger.step(6.0)
    assert head.state == WAITING and early.state == RUNNING
    late = ledger.submit(make_action({"cpu": 1}, cap, seconds=0.1), 21.0)
    ledger.step(21.0)
    assert head.state == WAITING and late.state == WAITING


def test_resizable_actions_share_units() -> None:
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    demand = {"cpu": Elastic(1, 16, resizable=True)}
    a = ledger.submit(make_action(demand, cap, seconds=100.0, efficiency=Amdahl(0.9)), 0.0)
    ledger.step(0.0)
    assert a.units == 16
    b = ledger.submit(make_action(demand, cap, seconds=100.0, efficiency=Amdahl(0.9)), 1.0)
    plan = ledger.step(1.0)
    assert plan.resizes == [(a, a.units)] and plan.admits == [(b, b.units)]
    assert a.units + b.units == 16 and min(a.units, b.units) >= 6


def test_greedy_eviction_runs_linear_work_one_at_a_time() -> None:
    # Two non-resizable actions with perfect scaling arrive together: split, each would
    # keep a part of the units for life; run one after the other, the short one is done
    # in 0.625 s and the long one loses nothing. The later one is left queued.
    cap = parse_capacity({"cpu": 16})
    demand = {"cpu": Elastic(1, 16)}
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    short = ledger.submit(make_action(demand, cap, seconds=10.0), 0.0)
    long = ledger.submit(make_action(demand, cap, seconds=100.0), 0.0)
    plan = ledger.step(0.0)
    assert plan.evicted == 1 and plan.admits == [(short, 16)]
    assert long.state == WAITING and ledger.evictions == 1
    ledger.finish(short, 0.625)
    assert ledger.step(0.625).admits == [(long, 16)]

    no_eviction = Ledger(cap, ElasticPolicy(eviction_depth=0), Estimator())
    a = no_eviction.submit(make_action(demand, cap, seconds=10.0), 0.0)
    b = no_eviction.submit(make_action(demand, cap, seconds=100.0), 0.0)
    no_eviction.step(0.0)
    assert a.state == b.state == RUNNING and a.units + b.units == 16


def test_resizable_newcomers_are_never_evicted() -> None:
    # Even where running one after the other would be best (perfect scaling), a resizable
    # newcomer starts at once: it grows when the other ends.
    cap = parse_capacity({"cpu": 16})
    demand = {"cpu": Elastic(1, 16, resizable=True)}
    ledger = Ledger(cap, ElasticPolicy(eviction_depth=4), Estimator())
    a = ledger.submit(make_action(demand, cap, seconds=10.0), 0.0)
    b = ledger.submit(make_action(demand, cap, seconds=100.0), 0.0)
    plan = ledger.step(0.0)
    assert plan.evicted == 0 and a.state == b.state == RUNNING


def test_no_eviction_beside_resizable_running_actions() -> None:
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(eviction_depth=4), Estimator())
    grower = ledger.submit(
        make_action({"cpu": Elastic(1, 16, resizable=True)}, cap, seconds=100.0), 0.0
    )
    ledger.step(0.0)
    assert grower.units == 16
    fixed = [
        ledger.submit(make_action({"cpu": Elastic(1, 16)}, cap, seconds=s), 1.0)
        for s in (10.0, 90.0)
    ]
    plan = ledger.step(1.0)
    assert plan.evicted == 0 and all(e.state == RUNNING for e in fixed)
    assert held_matches_grants(ledger) and ledger.held["cpu"] == 16


def test_no_resize_churn_between_events() -> None:
    # Stepping again without any event changes nothing: no units traded back and forth.
    cap = parse_capacity({"cpu": 16})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    for i in range(3):
        ledger.submit(
            make_action(
                {"cpu": Elastic(1, 16, resizable=True)},
                cap,
                seconds=10.0 + i,
                efficiency=Amdahl(0.9),
            ),
            0.0,
        )
    ledger.step(0.0)
    for t in (0.5, 1.0, 2.0):
        plan = ledger.step(t)
        assert plan.resizes == [] and plan.admits == []


def test_elastic_newcomer_does_not_wait_behind_idle_units() -> None:
    cap = parse_capacity({"cpu": 8})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    entry = ledger.submit(
        make_action({"cpu": Elastic(2, 6)}, cap, seconds=12.0, efficiency=Linear()), 0.0
    )
    ledger.step(0.0)
    assert entry.units == 6  # everything it can use, since nobody else wants it


# -- cost of a pass ---------------------------------------------------------------------------


class CountingState:
    """A state that counts how many queued entries a policy pulls from the queue."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.pulled = 0

    def waiting(self, open: Iterable[str] | None = None) -> Iterator[Entry]:
        for entry in self._ledger.waiting(None if open is None else set(open)):
            self.pulled += 1
            yield entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)


def crowded_ledger(policy: Policy, n: int = 100_000) -> Ledger:
    cap = parse_capacity({"cpu": 4, "gpu": 1})
    ledger = Ledger(cap, policy, Estimator())
    running = ledger.submit(make_action({"cpu": 2}, cap, seconds=1e6), 0.0)
    ledger.step(0.0)
    assert running.state == RUNNING
    # No waiting action fits (each needs 3 of the 2 free cores) while cores and the GPU
    # stay free, so a pass has a reason to look at every one of them: only the window
    # stops it.
    action = make_action({"cpu": Elastic(3, 4), "gpu": 1}, cap, seconds=1.0)
    for i in range(n):
        ledger.submit(action, 1.0 + i * 1e-6)
    return ledger


@pytest.mark.parametrize("window", [1, 128, 1000])
def test_pass_inspects_at_most_window_entries(window: int) -> None:
    policy = ElasticPolicy(window=window)
    ledger = crowded_ledger(policy)
    state = CountingState(ledger)
    plan = policy.plan(state)  # type: ignore[arg-type]
    assert state.pulled == window
    assert plan.admits == []


def test_pass_cost_does_not_grow_with_queue_length() -> None:
    policy = ElasticPolicy(window=64)
    counts = []
    for n in (1_000, 100_000):
        ledger = crowded_ledger(policy, n)
        # Leave a hole in the middle of the queue, as backfills and cancellations do.
        for entry in list(itertools.islice(ledger.waiting(), 10, n // 2)):
            ledger.withdraw(entry)
        state = CountingState(ledger)
        policy.plan(state)  # type: ignore[arg-type]
        counts.append(state.pulled)
    assert counts[0] == counts[1] == 64


@pytest.mark.parametrize("order", ["size", "arrival"])
def test_waiters_for_a_full_kind_hide_nobody_from_the_window(order: str) -> None:
    # One kind per node, as a runtime that decides for many nodes has: 1,000 waiters for
    # a full node come first, yet a core freed on another node is granted at once, and
    # the pass reads only what could start.
    cap = parse_capacity({"cpu@a": 1, "cpu@b": 1})
    policy = ElasticPolicy(window=4, order=order)  # type: ignore[arg-type]
    ledger = Ledger(cap, policy, Estimator())
    hog = ledger.submit(make_action({"cpu@a": 1}, cap, seconds=1e6), 0.0)
    busy = ledger.submit(make_action({"cpu@b": 1}, cap, seconds=5.0), 0.0)
    ledger.step(0.0)
    assert hog.state == busy.state == RUNNING
    for i in range(1_000):
        ledger.submit(make_action({"cpu@a": 1}, cap, seconds=1.0), 1.0 + i * 1e-6)
    late = ledger.submit(make_action({"cpu@b": 1}, cap, seconds=9.0), 2.0)
    ledger.finish(busy, 5.0)
    ledger.now = 5.0
    state = CountingState(ledger)
    plan = policy.plan(state)  # type: ignore[arg-type]
    assert plan.admits == [(late, 0)]
    assert state.pulled == 1


@pytest.mark.parametrize("order", ["size", "arrival"])
def test_waiters_for_full_nodes_sharing_an_open_kind_hide_nobody_from_the_window(
    order: str,
) -> None:
    """Each action needs its node's core and memory beside: 200 full nodes with a waiter
    each shared the open kind (memory) with the one node with a free core, and their
    first and oldest each were read, filling the window of 128: that node's waiter was
    never granted. The pass reads, of the full nodes' waiters, only its possible head and
    the longest waiting (found by a hostile review)."""
    nodes = 200
    cap = parse_capacity({**{f"cpu@n{i}": 1 for i in range(nodes)}, "cpu@free": 1, "mem": 1e4})
    policy = ElasticPolicy(order=order)  # type: ignore[arg-type]
    ledger = Ledger(cap, policy, Estimator())
    for i in range(nodes):
        ledger.submit(make_action({f"cpu@n{i}": 1, "mem": 1}, cap, seconds=1e6), 0.0)
    while ledger.waiting_count:  # a pass admits a window of the queue at a time
        ledger.step(0.0)
    for i in range(nodes):
        ledger.submit(make_action({f"cpu@n{i}": 1, "mem": 1}, cap, seconds=1.0), 1.0 + i * 1e-3)
    late = ledger.submit(make_action({"cpu@free": 1, "mem": 1}, cap, seconds=1.0), 2.0)
    ledger.now = 2.0
    state = CountingState(ledger)
    plan = policy.plan(state)  # type: ignore[arg-type]
    assert plan.admits == [(late, 0)]
    assert state.pulled <= 3  # the free node's waiter, one head, one longest waiting


@pytest.mark.parametrize("order", ["size", "arrival"])
def test_later_calls_on_a_rate_do_not_take_the_tokens_the_blocked_head_needs(order: str) -> None:
    """A rate's tokens are spent, not given back when the call ends: a later call that
    "ends before the head could start" or "uses what the head leaves" took the head's
    tokens all the same, and with a call a second at a rate of 1/s the head, needing 2,
    waited out the starvation bound (32 s) instead of its 2 s refill (a hostile review)."""
    cap = parse_capacity({"api": Rate(1, burst=2)})
    ledger = Ledger(cap, ElasticPolicy(order=order), Estimator())  # type: ignore[arg-type]
    drain = ledger.submit(make_action({"api": 2}, cap, seconds=0.1), 0.0)
    ledger.step(0.0)
    ledger.finish(drain, 0.0)
    head = ledger.submit(make_action({"api": 2}, cap, seconds=0.1), 0.0)
    for second in (1.0, 1.5):  # a token, then one and a half: the head needs both by 2 s
        late = ledger.submit(make_action({"api": 1}, cap, seconds=0.1), second)
        ledger.step(second)
        assert head.state == late.state == WAITING
        ledger.withdraw(late)
    ledger.step(2.0)
    assert head.state == RUNNING


@pytest.mark.parametrize("order", ["size", "arrival"])
def test_a_nested_acquire_passes_the_starved_action_waiting_for_its_callers_units(
    order: str,
) -> None:
    """X, starved past the bound, waits for the one ``b`` that T holds; T asks, inside, for
    one of two free ``a`` to finish. The starved action kept everyone off every kind it
    needs, so T never got its ``a``, never gave back ``b``, and both waited for ever with
    ``a`` idle (a hostile review). An action whose caller holds units of a kind the
    waiting one needs is held back by no reservation for it; any other still is."""
    cap = parse_capacity({"a": 2, "b": 1, "c": 1})
    policy = ElasticPolicy(order=order, starvation_bound=10.0)  # type: ignore[arg-type]
    ledger = Ledger(cap, policy, Estimator())
    outer = ledger.submit(make_action({"b": 1}, cap, seconds=1e3), 0.0)
    ledger.step(0.0)
    starved = ledger.submit(make_action({"a": 1, "b": 1}, cap, seconds=1.0), 0.0)
    late = ledger.submit(make_action({"a": 1}, cap, seconds=5.0), 20.0)
    late.holding = frozenset({"c"})  # holding what the starved one does not need
    inner = ledger.submit(make_action({"a": 1}, cap, seconds=5.0), 20.0)
    inner.holding = frozenset({"b"})  # as the runtime marks an acquire made holding ``b``
    ledger.step(20.0)
    assert inner.state == RUNNING
    assert late.state == starved.state == WAITING  # nobody else passes the starved one
    ledger.finish(inner, 22.0)
    ledger.finish(outer, 22.0)
    ledger.step(22.0)
    assert starved.state == RUNNING


def test_a_head_blocked_on_one_kind_keeps_its_reservation_of_another() -> None:
    # The head needs a core (none free) and memory (free); a later action that needs
    # only memory may not take what the head will need when a core frees, unless it
    # ends before then. Leaving the head out of the pass because a core is closed would
    # lose that reservation.
    cap = parse_capacity({"cpu": 1, "mem": "4GiB"})
    policy = ElasticPolicy(order="arrival")
    ledger = Ledger(cap, policy, Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=10.0), 0.0)
    ledger.step(0.0)
    head = ledger.submit(make_action({"cpu": 1, "mem": "3GiB"}, cap, seconds=1.0), 1.0)
    long = ledger.submit(make_action({"mem": "2GiB"}, cap, seconds=100.0), 2.0)
    short = ledger.submit(make_action({"mem": "2GiB"}, cap, seconds=1.0), 3.0)
    ledger.step(3.0)
    assert head.state == WAITING
    assert long.state == WAITING  # would still hold 2 GiB when the core frees at t=10
    assert short.state == RUNNING  # ends before the head could start


def test_a_starved_action_blocked_on_one_kind_still_guards_another() -> None:
    # X has waited past the starvation bound for a core (none free) and needs memory;
    # a younger, shorter Y with the same needs comes first in size order. Z needs only
    # memory and would end before a core frees, so backfill would admit it; X being
    # starved, nobody who needs what X needs may pass it.
    cap = parse_capacity({"cpu": 1, "mem": "4GiB"})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    ledger.submit(make_action({"cpu": 1}, cap, seconds=1e6), 0.0)
    ledger.step(0.0)
    starved = ledger.submit(make_action({"cpu": 1, "mem": "3GiB"}, cap, seconds=100.0), 1.0)
    young = ledger.submit(make_action({"cpu": 1, "mem": "3GiB"}, cap, seconds=0.1), 35.0)
    later = ledger.submit(make_action({"mem": "2GiB"}, cap, seconds=1000.0), 36.0)
    ledger.step(36.5)
    assert starved.state == young.state == WAITING
    assert later.state == WAITING


def test_policy_reads_no_more_than_the_state_protocol() -> None:
    # The policy only reads: planning twice from the same state gives the same plan and
    # leaves the ledger as it was.
    cap = parse_capacity(CAPACITY)
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    for amounts in ({"cpu": Elastic(2, 8, resizable=True)}, {"cpu": 10}, {"gpu": 4}):
        ledger.submit(make_action(amounts, cap, seconds=3.0), 0.0)
    ledger.step(0.0)
    for amounts in ({"cpu": Elastic(1, 8)}, {"cpu": 12}, {"api": 2}):
        ledger.submit(make_action(amounts, cap, seconds=3.0), 1.0)
    snapshot = _snapshot(ledger)
    first = ledger.policy.plan(ledger)
    second = ledger.policy.plan(ledger)
    assert first == second
    assert _snapshot(ledger) == snapshot


def _snapshot(ledger: Ledger) -> tuple[Any, ...]:
    entries: Iterable[Entry] = [*ledger.running, *ledger.waiting()]
    per_entry = sorted((e.seq, e.state, e.units, e.rem, e.mark) for e in entries)
    maps: list[Mapping[str, float]] = [
        ledger.free,
        ledger.held,
        ledger.tokens,
        ledger.surplus,
        ledger.headroom,
    ]
    return (tuple(per_entry), *(tuple(sorted(m.items())) for m in maps))


# -- the split of an elastic kind -------------------------------------------------------------


def test_units_are_split_by_speedup_not_by_the_work_left() -> None:
    # Same speedup model, 1 s and 100 s of work: the slowdown split gives each half. The
    # completion-time split (work left x time saved) gave the long one nearly all of it,
    # which kept short actions, most of them, slow.
    cap = parse_capacity({"cpu": 8})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    amounts = {"cpu": Elastic(1, 8, resizable=True)}
    short = ledger.submit(make_action(amounts, cap, seconds=1.0, efficiency=Amdahl(0.9)), 0.0)
    long = ledger.submit(make_action(amounts, cap, seconds=100.0, efficiency=Amdahl(0.9)), 0.0)
    ledger.step(0.0)
    assert (short.units, long.units) == (4, 4)


def test_a_steeper_speedup_gets_more_units() -> None:
    cap = parse_capacity({"cpu": 8})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    amounts = {"cpu": Elastic(1, 8, resizable=True)}
    serial = ledger.submit(make_action(amounts, cap, efficiency=Amdahl(0.5)), 0.0)
    parallel = ledger.submit(make_action(amounts, cap, efficiency=Amdahl(0.99)), 0.0)
    ledger.step(0.0)
    assert parallel.units > serial.units >= 1
    assert parallel.units + serial.units == 8


def test_a_pass_after_one_finish_looks_at_a_few_of_thousands_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The split's heaps persist across passes; rebuilding them would look at every one
    # of the 5,000 running actions at each event (the cost that made a 2048-trajectory
    # simulation take two minutes).
    import tangram._core._policy as policy_module

    cap = parse_capacity({"cpu": 12_000})
    ledger = Ledger(cap, ElasticPolicy(), Estimator())
    amounts = {"cpu": Elastic(1, 4, resizable=True)}
    entries = [
        ledger.submit(make_action(amounts, cap, seconds=10.0, efficiency=Amdahl(f)), 0.0)
        for f in (0.5, 0.7, 0.9, 0.99) * 1250
    ]
    while ledger.waiting_count:  # a pass admits a window of the queue at a time
        ledger.step(0.0)
    assert all(e.state == RUNNING for e in entries)
    assert sum(e.units for e in entries) == 12_000
    looked = 0
    real = policy_module._inverse

    def counting(entry: Entry, units: int) -> float:
        nonlocal looked
        looked += 1
        return real(entry, units)

    monkeypatch.setattr(policy_module, "_inverse", counting)
    ledger.finish(entries[0], 1.0)
    ledger.step(1.0)
    assert 0 < looked < 100
    assert sum(e.units for e in entries[1:]) == 12_000
    check_split(ledger, "cpu")
