"""The GPU placement rules alone: pure functions of loads, free amounts and times.

The live pool and the simulator both decide with these (``tests/test_gpu_live_vs_simulated.py``
checks they then decide alike); here each rule is checked on small cases and, with
hypothesis, on arbitrary inputs.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tangram
from tangram._core import _placement as rules
from tangram._core._placement import (
    HORIZON,
    MOVE,
    TENURE,
    Backlog,
    Holding,
    Idle,
    Unserved,
    Waiting,
    Wanted,
)

loads = st.lists(st.integers(0, 8), max_size=6)


# -- newcomers -----------------------------------------------------------------------------


def test_seats_are_the_batch_of_a_batching_service_else_one() -> None:
    assert rules.seats(4, batching=True) == 4
    assert rules.seats(4, batching=False) == 1
    assert rules.seats(None, batching=True) == 1


@given(loads, st.integers(1, 4), st.booleans())
def test_a_newcomer_joins_the_least_loaded_replica_with_a_seat(
    seen: list[int], seats: int, may_grow: bool
) -> None:
    index = rules.seat(seen, seats=seats, may_grow=may_grow)
    if not seen:
        assert index is None
        return
    least = min(seen)
    if least < seats or not may_grow:
        # The first of the least loaded: the oldest replica wins a tie.
        assert index == seen.index(least)
    else:
        assert index is None  # every one is full and another may start: weigh it


def backlog(
    key: str,
    count: int = 0,
    oldest: float = 0.0,
    replicas: int = 1,
    queued: float | None = None,
    restore: float = 1.0,
    seats: int = 1,
) -> Backlog[str]:
    seconds = float(count) if queued is None else queued
    return Backlog(key, seconds, oldest, count, replicas, seats, 1.0, restore)


def test_a_full_line_grows_where_there_is_room_once_it_is_a_restore_long() -> None:
    # One replica, 1 s runs, a 3 s restore, room for three: two behind the one running
    # wait there, three get another replica, six a third.
    assert rules.targets([backlog("a", 2, restore=3.0)], 3.0) == {"a": 1}
    assert rules.targets([backlog("a", 3, restore=3.0)], 3.0) == {"a": 2}
    assert rules.targets([backlog("a", 6, restore=3.0)], 3.0) == {"a": 3}
    # Four seats: a seat frees every 0.25 s, so four behind wait 1 s, not 2.
    assert rules.targets([backlog("a", 4, restore=2.0, seats=4)], 3.0) == {"a": 1}
    # An idle copy resident costs no restore: any line takes the room.
    assert rules.targets([backlog("a", 1, restore=0.0)], 3.0) == {"a": 3}


def test_a_service_with_no_replica_takes_free_room_or_waits_to_be_the_oldest_line() -> None:
    # Free room: it takes it, before another replica of a service that has one.
    assert rules.targets([backlog("a", 1, replicas=1), backlog("b", 1, replicas=0)], 2.0) == {
        "a": 1,
        "b": 1,
    }
    # No room: a line that came after the busy one's waits (no replica of right) ...
    busy = backlog("busy", 50, oldest=90.0, replicas=2)
    assert rules.targets([busy, backlog("cold", 1, replicas=0)], 2.0) == {"busy": 2, "cold": 0}
    # ... until it has waited MOVE restores longer than what a device serves there.
    cold = backlog("cold", 1, oldest=90.0 + MOVE + 1.0, replicas=0)
    assert rules.targets([busy, cold], 2.0) == {"busy": 1, "cold": 1}
    # Nothing queued and no replica: none.
    assert rules.targets([backlog("idle", replicas=0)], 2.0) == {"idle": 0}


def test_a_service_s_share_follows_its_work_among_the_longest_waiting() -> None:
    # Lines that waited alike, neither with a replica: each replica ahead serves HORIZON
    # restores of its line first, so the line with three times the work gets three times
    # the devices, as one first-come-first-served queue over all of them would give it.
    turns = HORIZON  # 1 s runs, 1 s restores
    lines = [
        backlog("popular", int(9 * turns), oldest=30.0, replicas=0),
        backlog("rare", int(3 * turns), oldest=30.0, replicas=0),
    ]
    assert rules.targets(lines, 4.0) == {"popular": 3, "rare": 1}
    assert rules.targets(lines, 8.0) == {"popular": 6, "rare": 2}


def test_a_device_moves_only_to_a_line_that_waited_far_longer() -> None:
    # b's line has waited MOVE + 2 restores (of 1 s) more than a's: one of a's two devices
    # goes to b; MOVE - 2 more is not enough.
    for more, share in ((MOVE + 2.0, {"a": 1, "b": 2}), (MOVE - 2.0, {"a": 2, "b": 1})):
        lines = [
            backlog("a", 100, oldest=10.0, replicas=2),
            backlog("b", 100, oldest=10.0 + more, replicas=1),
        ]
        assert rules.targets(lines, 3.0) == share


@pytest.mark.parametrize("waited", [29.0, 30.0, 66.0])
@pytest.mark.parametrize("replicas", [0, 1])
def test_a_line_no_replica_serves_gets_one_past_the_starvation_bound(
    waited: float, replicas: int
) -> None:
    """Under a sustained overload the busy line's head ages as fast as the waiting one's,
    so the hurdle (MOVE restores longer) is never crossed. Past the policy's bound
    (``starved``) a line with no replica competes by its wait alone; one a replica
    serves keeps the hurdle, and so does every line below the bound."""
    busy = backlog("busy", 1000, oldest=waited - 1.0, replicas=2)
    cold = backlog("cold", 20, oldest=waited, replicas=replicas)
    share = rules.targets([busy, cold], 2.0 + replicas, starved=30.0)
    moves = replicas == 0 and waited >= 30.0
    assert share == {"busy": 1 if moves else 2, "cold": replicas + (1 if moves else 0)}
    # Without a bound (the default), the hurdle holds however long the line waited.
    assert rules.targets([busy, cold], 2.0 + replicas) == {"busy": 2, "cold": replicas}
    # A starved line that waited less than the busy one's head does not take its device.
    behind = backlog("cold", 20, oldest=waited - 5.0, replicas=replicas)
    assert rules.targets([busy, behind], 2.0 + replicas, starved=30.0) == {
        "busy": 2,
        "cold": replicas,
    }


def test_a_served_line_keeps_the_hurdle_past_the_starvation_bound() -> None:
    """A line some replica serves waits as long as it does because of its own load: past
    the bound, its next replica still faces the hurdle. Without it, ``busy``'s second
    replica (its action waited about 64 s) would take the device of ``other``, whose
    head waited 40 s; with it, 64 - MOVE x 4 s is less."""
    busy = backlog("busy", 1000, oldest=66.0, replicas=1, restore=4.0)
    other = backlog("other", 1000, oldest=40.0, replicas=1, restore=4.0)
    assert rules.targets([busy, other], 2.0, starved=30.0) == {"busy": 1, "other": 1}
    # The same line with no replica would take it: the rule is for unserved lines.
    unserved = backlog("busy", 1000, oldest=66.0, replicas=0, restore=4.0)
    assert rules.targets([unserved, other], 1.0, starved=30.0) == {"busy": 1, "other": 0}


@pytest.mark.parametrize("unserved", [0.0, 29.0, 30.0, 500.0])
def test_the_bound_counts_the_time_a_line_went_unserved_as_well_as_its_wait(
    unserved: float,
) -> None:
    """The bound counts the time the line has gone unserved as well as its head's wait:
    a rare service whose head came early in a burst, and that lost its replica a moment
    ago, would otherwise take a device back each time it lost one (the contended MOPD
    trace: 72-83 restores against 43-54)."""
    busy = backlog("busy", 1000, oldest=65.0, replicas=2)
    cold = Backlog("cold", 20.0, 66.0, 20, 0, 1, 1.0, 1.0, unserved)
    share = rules.targets([busy, cold], 2.0, starved=30.0)
    assert share["cold"] == (1 if unserved >= 30.0 else 0)


def test_the_time_unserved_counts_from_the_first_look_and_from_the_last_service() -> None:
    clock: Unserved[str] = Unserved()
    assert clock.seconds("a", False, now=10.0) == 0.0  # first weighed now
    assert clock.seconds("a", False, now=25.0) == 15.0
    assert clock.seconds("a", True, now=40.0) == 0.0  # a replica takes its newcomers
    assert clock.seconds("a", False, now=41.0) == 1.0  # counted from the last service
    assert clock.seconds("b", False, now=41.0) == 0.0  # each service its own
    # From the last look that saw it served: with no look between, the whole gap.
    assert clock.seconds("a", True, now=50.0) == 0.0
    assert clock.seconds("a", False, now=500.0) == 450.0


class _Bound:
    def __init__(self, bound: object) -> None:
        self.starvation_bound = bound


@pytest.mark.parametrize(
    ("policy", "bound"),
    [
        (tangram.ElasticPolicy(), 30.0),
        (tangram.ElasticPolicy(starvation_bound=5.0), 5.0),
        (tangram.ElasticPolicy(starvation_bound=math.inf), math.inf),
        (tangram.FcfsPolicy(), math.inf),
        (object(), math.inf),
        (_Bound(7), 7.0),
        (_Bound(None), math.inf),
        (_Bound("30"), math.inf),
        (_Bound(True), math.inf),
        (_Bound(math.nan), math.inf),
        (_Bound(datetime.timedelta(seconds=30)), math.inf),
    ],
)
def test_the_pool_reads_a_policy_s_bound_only_where_it_is_a_number(
    policy: object, bound: float
) -> None:
    """A policy of the user's own may have no bound or one that is not seconds: the
    pool then keeps the hurdle, rather than fail when a line first starves."""
    assert rules.starvation_bound(policy) == bound


def test_a_replica_nothing_waits_for_goes_to_a_line_a_restore_long() -> None:
    lines = [backlog("a", 0, replicas=1), backlog("b", 2, oldest=0.5, replicas=1, restore=2.0)]
    assert rules.targets(lines, 2.0) == {"a": 0, "b": 2}
    # The line is shorter than a restore: a keeps its replica.
    lines[1] = backlog("b", 1, oldest=0.5, replicas=1, restore=2.0)
    assert rules.targets(lines, 2.0) == {"a": 1, "b": 1}


backlogs = st.lists(
    st.builds(
        backlog,
        st.sampled_from("abcdef"),
        st.integers(0, 40),
        st.floats(0.0, 200.0),
        st.integers(0, 4),
        st.none() | st.floats(0.0, 60.0),
        st.floats(0.0, 5.0),
        st.integers(1, 4),
    ),
    max_size=6,
    unique_by=lambda b: b.key,
)


@given(backlogs, st.integers(0, 12), st.sampled_from([math.inf, 0.0, 10.0, 50.0, 150.0]))
def test_shares_fit_need_work_and_the_quick_look_agrees_with_the_walk(
    lines: list[Backlog[str]], capacity: int, starved: float
) -> None:
    share = rules.targets(lines, float(capacity), starved)
    assert sum(share.values()) <= capacity
    for line in lines:
        if line.count == 0:
            assert share[line.key] <= line.replicas  # nothing waits: nothing new
    for line in lines:
        if line.count > 0 and share[line.key] == 0:
            # A line with no replica waits only for room: the share fills the capacity.
            assert sum(share.values()) + 1 > capacity
    # The full walk, without the look at each service first, gives the same share.
    original = rules._settled
    try:
        rules._settled = lambda *args: False  # type: ignore[assignment]
        assert rules.targets(lines, float(capacity), starved) == share
    finally:
        rules._settled = original


def test_the_line_is_shortest_first_until_an_action_is_due() -> None:
    line: Waiting[str] = Waiting(tangram.ElasticPolicy(aging=4.0).due)
    line.push("long", arrival=0.0, seconds=10.0)
    line.push("short", arrival=1.0, seconds=1.0)
    line.push("gone", arrival=1.5, seconds=0.5)
    line.remove("gone")
    assert (len(line), line.seconds, line.oldest()) == (2, 11.0, 0.0)
    assert line.pop(now=2.0) == "short"  # long is due at 40 s
    line.push("short2", arrival=41.0, seconds=1.0)
    assert line.pop(now=41.0) == "long"  # due: passed by nobody who came since
    assert line.pop(now=41.0) == "short2"
    assert (len(line), line.seconds, line.oldest()) == (0, 0.0, None)


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        (tangram.ElasticPolicy(), ["short", "long"]),
        (tangram.ElasticPolicy(order="arrival"), ["long", "short"]),
        (tangram.FcfsPolicy(), ["long", "short"]),
        (tangram.ElasticPolicy(max_wait=0.5), ["long", "short"]),
    ],
)
def test_the_seat_line_follows_the_policy_the_cores_follow(
    policy: tangram.ElasticPolicy | tangram.FcfsPolicy, order: list[str]
) -> None:
    # The same rule orders both: what the policy calls due at ``now`` goes first.
    line: Waiting[str] = Waiting(policy.due)
    line.push("long", arrival=0.0, seconds=10.0)
    line.push("short", arrival=1.0, seconds=1.0)
    assert [line.pop(now=2.0), line.pop(now=2.0)] == order


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.01, 20)), max_size=30))
def test_the_line_gives_everything_back_once(items: list[tuple[float, float]]) -> None:
    line: Waiting[int] = Waiting()
    for i, (arrival, seconds) in enumerate(items):
        line.push(i, arrival, seconds)
    out = [line.pop(now=50.0) for _ in items]
    assert sorted(out) == list(range(len(items)))
    assert len(line) == 0


def test_only_services_above_their_share_drain_and_no_more_of_each() -> None:
    running = [
        Holding("a1", {"d": 1.0}, 1, 0.0, 1.0, service="a"),
        Holding("a2", {"d": 1.0}, 1, 0.0, 1.0, service="a"),
        Holding("b1", {"d": 1.0}, 0, 0.0, 1.0, service="b"),
    ]
    # b is the least loaded, but a is the one above its share, by one.
    chosen = rules.drains(running, wanted={"d": 2.0}, free={}, now=5.0, surplus={"a": 1, "b": 0})
    assert chosen == ["a1"]
    assert rules.drains(running, wanted={"d": 2.0}, free={}, now=5.0) == ["b1", "a1"]


def test_a_waiting_replica_moves_where_a_replica_above_its_share_can_drain_for_it() -> None:
    """C waits on d0, held by B at its share; A, above its share, holds d1: C waits on d1.
    Room now comes first, here or elsewhere; else nothing moves where its own devices
    will give way (a draining holder, one with no action left, one above its share),
    nor to a device held by a service at its share."""
    b = Holding("b", {"d0": 1.0}, 1, 0.0, 1.0, service="B")
    a = Holding("a", {"d1": 1.0}, 1, 0.0, 1.0, service="A")
    options = [("d0",), ("d1",)]
    surplus = {"A": 1, "B": 0}
    free = {"d0": 0.0, "d1": 0.0}
    assert rules.wait_on(["d0"], options, [b, a], need=1.0, free=free, surplus=surplus) == ("d1",)
    # Its own device gives way: free room, B draining, or B above its share.
    roomy = {"d0": 1.0, "d1": 0.0}
    assert rules.wait_on(["d0"], options, [b, a], need=1.0, free=roomy, surplus=surplus) is None
    draining = Holding("b", {"d0": 1.0}, 1, 0.0, 1.0, draining=True, service="B")
    assert (
        rules.wait_on(["d0"], options, [draining, a], need=1.0, free=free, surplus=surplus) is None
    )
    both = {"A": 1, "B": 1}
    assert rules.wait_on(["d0"], options, [b, a], need=1.0, free=free, surplus=both) is None
    # Nowhere better: every other holder is at its share.
    level = {"A": 0, "B": 0}
    assert rules.wait_on(["d0"], options, [b, a], need=1.0, free=free, surplus=level) is None
    # A holder with no action left gives way too (its grant is on its way back).
    idle_b = Holding("b", {"d0": 1.0}, 0, 0.0, 1.0, service="B")
    assert rules.wait_on(["d0"], options, [idle_b, a], need=1.0, free=free, surplus=surplus) is None
    # Room now beats a drain, here or elsewhere.
    roomy_d1 = {"d0": 0.0, "d1": 1.0}
    assert rules.wait_on(
        ["d0"], options, [draining, a], need=1.0, free=roomy_d1, surplus=surplus
    ) == ("d1",)
    # A device with room is as good as a drain.
    assert rules.wait_on(
        ["d0"], options, [b], need=1.0, free={"d0": 0.0, "d1": 1.0}, surplus=level
    ) == ("d1",)


def test_the_live_pool_seats_a_second_run_behind_a_batching_replica_s_first() -> None:
    assert [rules.room(seats) for seats in (1, 2, 8)] == [1, 4, 16]


# -- draining ------------------------------------------------------------------------------


def holding(
    key: str,
    users: int = 1,
    granted_at: float = 0.0,
    restore: float = 1.0,
    where: str = "d0",
    **kw: bool,
) -> Holding[str]:
    return Holding(key, {where: 1.0}, users, granted_at, restore, **kw)


def test_the_least_loaded_replica_past_its_tenure_drains_for_a_waiter() -> None:
    running = [
        holding("busy", users=3, granted_at=0.0),
        holding("light", users=1, granted_at=1.0),
        holding("fresh", users=0, granted_at=9.5),  # granted 0.5 s ago: not past tenure
    ]
    assert rules.drains(running, wanted={"d0": 1.0}, free={"d0": 0.0}, now=10.0) == ["light"]
    # Two waiters: the next least loaded goes too.
    assert rules.drains(running, wanted={"d0": 2.0}, free={"d0": 0.0}, now=10.0) == [
        "light",
        "busy",
    ]


def test_nothing_drains_while_the_free_or_draining_amounts_cover_the_waiters() -> None:
    running = [holding("a"), holding("b", draining=True)]
    assert rules.drains(running, wanted={"d0": 1.0}, free={"d0": 1.0}, now=10.0) == []
    assert rules.drains(running, wanted={"d0": 1.0}, free={"d0": 0.0}, now=10.0) == []
    assert rules.drains(running, wanted={"d0": 2.0}, free={"d0": 0.0}, now=10.0) == ["a"]
    assert rules.drains(running, wanted={}, free={}, now=10.0) == []


def test_only_replicas_on_the_resources_the_waiters_lack_drain() -> None:
    running = [holding("there", where="d1"), holding("here", users=5, where="d0")]
    assert rules.drains(running, wanted={"d0": 1.0}, free={"d0": 0.0, "d1": 0.0}, now=10.0) == [
        "here"
    ]


def test_the_tenure_is_counted_in_restore_times_and_waits_for_the_restore() -> None:
    now = 10.0
    at_tenure = holding("a", granted_at=now - TENURE * 2.0, restore=2.0)
    short = holding("b", granted_at=now - TENURE * 2.0 + 0.01, restore=2.0)
    restoring = holding("c", granted_at=0.0, restored=False)
    got = rules.drains([at_tenure, short, restoring], wanted={"d0": 3.0}, free={}, now=now)
    assert got == ["a"]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.floats(0.0, 10.0),
            st.floats(0.0, 3.0),
            st.booleans(),
            st.sampled_from(["d0", "d1", "d2"]),
        ),
        max_size=8,
    ),
    st.dictionaries(st.sampled_from(["d0", "d1", "d2"]), st.floats(0.0, 4.0)),
    st.dictionaries(st.sampled_from(["d0", "d1", "d2"]), st.floats(-1.0, 4.0)),
)
def test_drains_only_eligible_replicas_least_loaded_first_and_no_more_than_needed(
    specs: list[tuple[int, float, float, bool, str]],
    wanted: dict[str, float],
    free: dict[str, float],
) -> None:
    now = 10.0
    running = [
        Holding(i, {where: 1.0}, users, granted, restore, draining=draining)
        for i, (users, granted, restore, draining, where) in enumerate(specs)
    ]
    chosen = rules.drains(running, wanted=wanted, free=free, now=now)
    picked = [running[i] for i in chosen]
    assert len(set(chosen)) == len(chosen)
    for h in picked:
        assert not h.draining and now - h.granted_at >= TENURE * h.restore_seconds
    assert [(h.users, h.granted_at) for h in picked] == sorted(
        (h.users, h.granted_at) for h in picked
    )
    # Each drained replica was still needed: the waiters lacked what it holds, beyond the
    # free amounts and what the draining replicas before it give back.
    given_back: dict[str, float] = {}
    for h in running:
        if h.draining:
            for k, v in h.holds.items():
                given_back[k] = given_back.get(k, 0.0) + v
    for h in picked:
        [(where, amount)] = h.holds.items()
        lack = wanted.get(where, 0.0) - max(0.0, free.get(where, 0.0)) - given_back.get(where, 0)
        assert lack > 0
        given_back[where] = given_back.get(where, 0.0) + amount


# -- eviction and warming ------------------------------------------------------------------


def test_evictions_take_a_going_replica_first_then_the_least_recently_used() -> None:
    idle = [Idle("new", 1.0, 5.0), Idle("old", 1.0, 1.0), Idle("going", 1.0, 9.0, going=True)]
    assert rules.evictions(idle, free=0.0, need=1.0) == ["going"]
    assert rules.evictions(idle, free=0.0, need=2.0) == ["going", "old"]
    assert rules.evictions(idle, free=1.0, need=1.0) == []
    assert rules.evictions(idle, free=0.0, need=9.0) == ["going", "old", "new"]  # runs out


@given(
    st.lists(st.tuples(st.floats(0.1, 4.0), st.floats(-5.0, 5.0), st.booleans()), max_size=6),
    st.floats(0.0, 4.0),
    st.floats(0.0, 8.0),
)
def test_evictions_are_the_fewest_in_lru_order_that_make_room(
    specs: list[tuple[float, float, bool]], free: float, need: float
) -> None:
    idle = [Idle(i, size, used, going) for i, (size, used, going) in enumerate(specs)]
    chosen = rules.evictions(idle, free=free, need=need)
    order = sorted(idle, key=lambda r: (not r.going, r.last_used))
    assert chosen == [r.key for r in order[: len(chosen)]]
    freed = free + sum(idle[i].size for i in chosen)
    assert rules.fits(freed, need) or len(chosen) == len(idle)
    if chosen:
        assert not rules.fits(freed - idle[chosen[-1]].size, need)


def first_fit(
    wanted: Wanted, free: Mapping[int, float], taken: Collection[int], gpus: int = 1
) -> tuple[int, ...] | None:
    room = [d for d in sorted(free) if d not in taken and rules.fits(free[d], wanted.need)]
    return tuple(room[:gpus]) if len(room) >= gpus else None


def test_fill_warms_one_of_each_service_then_a_second_while_there_is_room() -> None:
    services = [Wanted("a", 40.0, most=2), Wanted("b", 40.0), Wanted("c", 60.0)]
    plan = rules.fill(services, {0: 80.0, 1: 80.0, 2: 80.0}, first_fit)
    assert plan == [("a", (0,)), ("b", (0,)), ("c", (1,)), ("a", (2,)), ("b", (2,))]


@given(
    st.lists(
        st.tuples(st.floats(1.0, 50.0), st.none() | st.integers(0, 3)), min_size=1, max_size=4
    ),
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=4),
)
def test_fill_never_overcommits_nor_doubles_a_service_on_a_device(
    specs: list[tuple[float, int | None]], memory: list[float]
) -> None:
    services = [Wanted(f"s{i}", need, most) for i, (need, most) in enumerate(specs)]
    free = dict(enumerate(memory))
    plan = rules.fill(services, free, first_fit)
    used = dict.fromkeys(free, 0.0)
    seen: set[tuple[str, int]] = set()
    count: dict[str, int] = {}
    by_name = {s.name: s for s in services}
    for name, devices in plan:
        count[name] = count.get(name, 0) + 1
        for d in devices:
            assert (name, d) not in seen
            seen.add((name, d))
            used[d] += by_name[name].need
    for d in free:
        assert used[d] <= free[d] + 1e-6
    for s in services:
        assert s.most is None or count.get(s.name, 0) <= s.most
    # Round by round: a service's k-th replica comes after every service's (k-1)-th.
    rounds = [sum(1 for n, _ in plan[: i + 1] if n == name) for i, (name, _) in enumerate(plan)]
    assert rounds == sorted(rounds)


# -- devices -------------------------------------------------------------------------------


def test_a_replica_goes_where_its_service_is_resident_or_the_memory_is_freest() -> None:
    groups = [(0, 1), (2, 3)]
    free = {0: 10.0, 1: 10.0, 2: 50.0, 3: 40.0}
    pick = rules.replica_devices(
        [],
        groups=groups,
        count=1,
        need=10.0,
        free=free,
        open_devices=[0, 1, 2, 3],
        resident=set(),
        room_now=False,
    )
    assert pick == (2,)
    # A resident copy with room beats freer memory elsewhere.
    pick = rules.replica_devices(
        [(1,)],
        groups=groups,
        count=1,
        need=10.0,
        free=free,
        open_devices=[0, 1, 2, 3],
        resident={(1,)},
        room_now=True,
    )
    assert pick == (1,)


def test_a_multi_gpu_replica_waits_inside_one_nvlink_group_rather_than_straddle() -> None:
    groups = [(0, 1), (2, 3)]
    free = {0: 0.0, 1: 20.0, 2: 20.0, 3: 0.0}  # room now only across the groups
    args = {"groups": groups, "count": 2, "need": 10.0, "free": free, "resident": set()}
    waits = rules.replica_devices([], open_devices=[0, 1, 2, 3], room_now=False, **args)
    assert waits in {(0, 1), (2, 3)}
    assert rules.replica_devices([], open_devices=[0, 1, 2, 3], room_now=True, **args) == (1, 2)
    assert rules.replica_devices([], open_devices=None, room_now=True, **args) is None


@given(
    st.dictionaries(st.integers(0, 5), st.floats(0.0, 100.0), min_size=1),
    st.integers(1, 3),
    st.floats(1.0, 60.0),
    st.booleans(),
)
def test_with_room_now_a_replica_only_goes_where_it_fits(
    free: dict[int, float], count: int, need: float, room_now: bool
) -> None:
    groups = rules.nvlink_groups(free, [(0, 1), (2, 3)])
    pick = rules.replica_devices(
        [],
        groups=groups,
        count=count,
        need=need,
        free=free,
        open_devices=list(free),
        resident=set(),
        room_now=room_now,
    )
    if pick is None:
        assert len(free) < count or room_now
        return
    assert len(set(pick)) == count and set(pick) <= set(free)
    if room_now:
        assert all(rules.fits(free[d], need) for d in pick)


def test_the_tenure_is_defined_once() -> None:
    package = Path(tangram.__file__).parent
    defined = [
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if re.search(r"^_?TENURE\s*=", path.read_text(encoding="utf-8"), re.MULTILINE)
    ]
    assert defined == ["_core/_placement.py"]
    assert math.isfinite(TENURE) and TENURE > 0
