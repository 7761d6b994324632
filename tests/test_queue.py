"""The waiting queue filed by kinds: reading only the open kinds keeps the policy's order.

A pass reads ``Queue.ordered(open)`` instead of the whole line. These properties say what
that may leave out (only entries that need a closed kind) and what it must keep (the
order, and the first entry of a shut group that shares an open kind with one read). And
entries sized by their kind's estimate, alike in kind and demand, keep arrival order.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from strategies import make_action

from tangram import Elastic
from tangram._core import _queue
from tangram._core._entry import DONE, RUNNING, Entry, Run
from tangram._core._queue import Queue, _rank
from tangram._core._resources import parse_capacity

KINDS = ("a", "b", "c", "d")
CAP = parse_capacity(dict.fromkeys(KINDS, 4))

_kinds = st.sets(st.sampled_from(KINDS), min_size=1, max_size=3)
_filing = st.one_of(
    st.none(),
    st.tuples(
        st.floats(0.0, 100.0),
        st.one_of(st.just(math.inf), st.floats(0.0, 10.0)),
    ),
)
# Learned entries of a few action kinds (sized by the kind's estimate), or sized by their
# own (None).
_sized = st.one_of(st.none(), st.sampled_from(("x", "y")))
Filed = tuple[set[str], object, str | None]


def _fill(priority: bool, entries: list[Filed], removed: list[bool]) -> Queue:
    queue = Queue(priority=priority)
    live = []
    for seq, (kinds, filing, learned) in enumerate(entries, 1):
        action = make_action(
            dict.fromkeys(sorted(kinds), 1),
            CAP,
            kind=learned or "action",
            learned=learned is not None,
        )
        entry = Entry(action, seq, float(seq))
        queue.add(entry, filing if priority else None)  # type: ignore[arg-type]
        live.append(entry)
    for entry, gone in zip(live, itertools.cycle(removed or [False]), strict=False):
        if gone:
            queue.remove(entry)
            queue.remove(entry)  # a second removal is ignored
    queue.fall_due(5.0)
    return queue


@settings(max_examples=200, deadline=None)
@given(
    priority=st.booleans(),
    entries=st.lists(st.tuples(_kinds, _filing, _sized), max_size=40),
    removed=st.lists(st.booleans(), max_size=10),
    open_=st.sets(st.sampled_from(KINDS)),
)
def test_reading_open_kinds_leaves_out_only_what_cannot_start(
    priority: bool,
    entries: list[Filed],
    removed: list[bool],
    open_: set[str],
) -> None:
    queue = _fill(priority, entries, removed)
    whole = list(queue.ordered())
    assert sorted(e.seq for e in whole) == sorted(e.seq for e in queue)
    read = list(queue.ordered(open_))
    # The same order as the whole line, with entries left out: by priority, and by arrival
    # among those that keep it (the two take turns, so only each one's order is kept).
    position = {e: i for i, e in enumerate(whole)}
    for keyed in (True, False):
        mine = [position[e] for e in read if (_rank(e) is not None) is keyed]
        assert mine == sorted(mine)
    # Every entry that could start is read.
    startable = [e for e in whole if set(e.action.demand.kinds) <= open_]
    assert set(startable) <= set(read)
    # Every other entry read is the first of its group or its longest waiting, needing
    # an open kind a read group needs too (a possible head, holding its reservation, or
    # a starved action keeping others off its kinds).
    wanted = {k for e in startable for k in e.action.demand.kinds}
    # A group's first in its own order: its line and its arrival lane take turns there,
    # line first, while the whole order takes turns across groups (so the whole order's
    # first of a group may be its lane's).
    firsts = {kinds: next(group.ordered()) for kinds, group in queue._groups.items()}
    oldest: dict[tuple[str, ...], Entry] = {}
    for entry in sorted(whole, key=lambda e: e.seq):
        oldest.setdefault(entry.action.demand.kinds, entry)
    for entry in read:
        kinds = entry.action.demand.kinds
        if set(kinds) <= open_:
            continue
        assert entry is firsts[kinds] or entry is oldest[kinds]
        assert any(k in open_ and k in wanted for k in kinds)
    # And exactly these of them (``Queue.ordered``): of the shut groups that need an open
    # kind a read group needs, the first by key and the first by arrival of their firsts
    # (the pass's possible head), and per such kind the longest waiting needing it.
    shut = [k for k in firsts if not set(k) <= open_ and any(x in open_ and x in wanted for x in k)]
    ranked = [firsts[k] for k in shut if priority and _rank(firsts[k]) is not None]
    lanes = [firsts[k] for k in shut if not (priority and _rank(firsts[k]) is not None)]
    expected = {min(ranked, key=_rank)} if ranked else set()
    if lanes:
        expected.add(min(lanes, key=lambda e: e.seq))
    for kind in {x for k in shut for x in k if x in open_ and x in wanted}:
        expected.add(min((oldest[k] for k in shut if kind in k), key=lambda e: e.seq))
    assert {e for e in read if not set(e.action.demand.kinds) <= open_} == expected


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(st.tuples(_kinds, _filing, _sized), max_size=40),
    removed=st.lists(st.booleans(), max_size=10),
)
def test_entries_sized_by_their_kinds_estimate_keep_arrival_order_among_the_alike(
    entries: list[Filed], removed: list[bool]
) -> None:
    """Whatever estimates they came with: only falling due moves one ahead of another.

    Written first, it failed with the queue before: each entry was filed by the estimate
    it came with, so a later one of the same kind passed an earlier one.
    """
    queue = _fill(True, entries, removed)
    whole = list(queue.ordered())
    assert sorted(e.seq for e in whole) == sorted(e.seq for e in queue)
    alike: dict[tuple[object, ...], list[int]] = {}
    for entry in whole:
        action = entry.action
        if action.learned and entry.key is None and _rank(entry) is not None:
            alike.setdefault((action.kind, action.demand), []).append(entry.seq)
    for seqs in alike.values():
        assert seqs == sorted(seqs)
    # Sized by their own estimates, the same kind is read by size: the rule is the alike's.
    own = [e for e in whole if not e.action.learned and e.key is not None and e.key[0] == 1]
    for group in {e.action.demand.kinds for e in own}:
        works = [e.key[1] for e in own if e.action.demand.kinds == group]  # type: ignore[index]
        assert works == sorted(works)


def test_a_run_of_alike_entries_stands_where_the_newest_estimate_puts_it() -> None:
    queue = Queue(priority=True)
    action = make_action({"a": 1}, CAP, kind="x", learned=True)
    other = Entry(make_action({"a": 1}, CAP, kind="y"), 1, 0.0)
    queue.add(other, (0.5, math.inf))
    older = Entry(action, 2, 0.0)
    queue.add(older, (1.0, math.inf))  # came with the prior's size
    assert list(queue.ordered()) == [other, older]
    newer = Entry(make_action({"a": 1}, CAP, kind="x", learned=True), 3, 0.1)
    queue.add(newer, (0.1, math.inf))  # the kind is known now: both stand by it
    assert list(queue.ordered()) == [older, newer, other]
    queue.remove(older)
    queue.remove(newer)
    assert list(queue.ordered()) == [other]
    assert queue._groups[("a",)].alike == {}


def test_entries_that_fell_due_leave_no_cycle_behind() -> None:
    """An entry that fell due, sized by its kind's estimate or by its own, and the run it
    waited in, are freed by reference counting once they leave: their keys held them, and
    a saturated runtime paid the collector 7% of its work to find them."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds, kept to read
    try:
        queue = Queue(priority=True)
        for seq, learned in enumerate((True, True, False), start=1):
            action = make_action({"a": 1}, CAP, kind="x", learned=learned)
            queue.add(Entry(action, seq, 0.0), (1.0, 0.5))
        queue.fall_due(1.0)
        entries = list(queue)
        assert all(_rank(e) is not None and _rank(e)[0] == 0 for e in entries)  # type: ignore[index]
        for entry in entries:
            entry.state = DONE
            queue.remove(entry)
        del entries, entry, action
        gc.collect()
        # Only this test's objects: another thread's garbage may be found in the pass.
        assert [o for o in gc.garbage if isinstance(o, (Entry, Run))] == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_group_that_empties_is_forgotten() -> None:
    queue = Queue(priority=True)
    entries = [Entry(make_action({"a": 1}, CAP), seq, 0.0) for seq in (1, 2)]
    for entry in entries:
        queue.add(entry, (1.0, math.inf))
    for entry in entries:
        queue.remove(entry)
    assert len(queue) == 0
    assert list(queue.ordered({"a"})) == []
    assert queue._groups == {} and queue._needing == {"a": {}}


class QueueMachine(RuleBasedStateMachine):
    """Any interleaving of joining, leaving and falling due keeps the queue's books:
    every waiting entry read once, in the policy's order, the alike in arrival order,
    and no run left behind empty (a review's stateful check, kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = Queue(priority=True)
        self.seq = 0
        self.now = 0.0
        self.live: list[Entry] = []
        self.gone: list[Entry] = []

    @rule(
        kinds=st.one_of(
            st.just({"a"}), st.sets(st.sampled_from(KINDS[:3]), min_size=1, max_size=2)
        ),
        filing=st.one_of(
            st.none(),
            st.tuples(
                st.sampled_from([0.1, 0.5, 1.0, 2.0]), st.sampled_from([math.inf, 0.5, 1.0, 3.0])
            ),
        ),
        learned=_sized,
    )
    def add(self, kinds: set[str], filing: tuple[float, float] | None, learned: str | None) -> None:
        self.seq += 1
        action = make_action(
            dict.fromkeys(sorted(kinds), 1), CAP, kind=learned or "own", learned=bool(learned)
        )
        entry = Entry(action, self.seq, self.now)
        self.queue.add(entry, None if filing is None else (filing[0], self.now + filing[1]))
        self.live.append(entry)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000), admitted=st.booleans())
    def remove(self, index: int, admitted: bool) -> None:
        entry = self.live.pop(index % len(self.live))
        entry.state = RUNNING if admitted else DONE
        self.queue.remove(entry)
        self.gone.append(entry)

    @rule(later=st.sampled_from([0.0, 0.3, 1.0]))
    def fall_due(self, later: float) -> None:
        self.now += later
        self.queue.fall_due(self.now)

    @invariant()
    def books_kept(self) -> None:
        whole = list(self.queue.ordered())
        assert sorted(e.seq for e in whole) == sorted(e.seq for e in self.live)
        assert all(e.alike is None for e in self.gone)
        for group in self.queue._groups.values():
            assert group.line is not None
            runs = [item for item in group.line if isinstance(item, Run)]
            assert {id(r) for r in runs} == {id(r) for r in group.alike.values()}
            for run in runs:
                assert run.entries and all(e.alike is run for e in run.entries)
        ranked = [_rank(e) for e in whole if _rank(e) is not None]
        assert [r[:3] for r in ranked] == sorted(r[:3] for r in ranked)  # type: ignore[index]
        alike: dict[tuple[object, ...], list[int]] = {}
        for entry in whole:
            if entry.action.learned and _rank(entry) is not None:
                alike.setdefault((entry.action.kind, entry.action.demand), []).append(entry.seq)
        assert all(seqs == sorted(seqs) for seqs in alike.values())
        for open_ in ({"a"}, {"b"}, {"a", "b"}, {"a", "c"}):
            read = list(self.queue.ordered(open_))
            assert len(read) == len(set(read))
            assert {e for e in whole if set(e.action.demand.kinds) <= open_} <= set(read)


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_an_entry_dated_due_before_a_time_already_passed_is_read_in_due_order() -> None:
    """The fallen due of a group are kept in the order they fall, which is by due time
    while every due comes after the last pass; a policy of the caller's may date one
    earlier (a review found the fallen-due list then read out of order)."""
    cap = parse_capacity({"a": 4, "b": 4})
    queue = Queue(priority=True)
    first = Entry(make_action({"a": 1}, cap), 1, 0.0)
    queue.add(first, (1.0, 8.0))
    queue.fall_due(10.0)
    earlier = Entry(make_action({"a": 1}, cap), 2, 10.0)
    queue.add(earlier, (1.0, 5.0))  # due before the pass at 10
    other = Entry(make_action({"b": 1}, cap), 3, 10.0)
    queue.add(other, (1.0, 6.0))
    queue.fall_due(11.0)
    assert list(queue.ordered()) == [earlier, other, first]


@dataclasses.dataclass
class _Unhashable:
    """An efficiency of a caller's that defines equality and so has no hash."""

    fraction: float

    def speedup(self, units: float) -> float:
        return 1.0 / ((1.0 - self.fraction) + self.fraction / units)


def test_a_learned_action_whose_demand_cannot_be_hashed_is_filed_by_its_own_size() -> None:
    """Alike actions are found by kind and demand; a demand holding an efficiency that
    cannot be hashed is filed alone, as any action sized by itself (a review found
    that filing raised TypeError in `acquire`)."""
    queue = Queue(priority=True)
    elastic = Elastic(1, 4, efficiency=_Unhashable(0.5))
    entries = [
        Entry(make_action({"a": elastic}, CAP, kind="x", learned=True), seq, 0.0) for seq in (1, 2)
    ]
    for entry, work in zip(entries, (2.0, 1.0), strict=True):
        queue.add(entry, (work, math.inf))
    assert list(queue.ordered()) == [entries[1], entries[0]]
    for entry in entries:
        queue.remove(entry)
    assert len(queue) == 0 and queue._groups == {}


@settings(max_examples=400, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from(["sized", "learned"]),
                st.one_of(st.floats(0.0, 50.0), st.sampled_from([1.0, 2.0, 3.0, 5.0])),
            ),
            st.tuples(st.just("pass"), st.floats(0.0, 50.0)),
            st.tuples(st.just("remove"), st.integers(0, 100)),
        ),
        max_size=80,
    ),
    slack=st.sampled_from([0, 64]),
)
def test_entries_fall_due_when_due_or_when_an_alike_behind_them_does(
    steps: list[tuple[str, float]], slack: int
) -> None:
    """An entry sized by its own estimate falls due at the first pass at or after its due
    time. One of a run (alike, sized by the kind's estimate) falls due when it or any
    alike that arrived after it into the same run is due, even one since cancelled (its
    estimate dates those ahead no later), at the earliest such time. The fallen due are
    read by that time, then by the pass and the puller's arrival, then their own. A run
    keeps only the dues that can come first, and only its first stands in the heap. With
    no slack, the due times of those gone are dropped at every removal, and nothing
    changes."""
    with mock.patch.object(_queue, "_SLACK", slack):
        _fall_due_as_modelled(steps)


def _fall_due_as_modelled(steps: list[tuple[str, float]]) -> None:
    queue = Queue(priority=True)
    due_of: dict[Entry, float] = {}
    behind: dict[Entry, list[Entry]] = {}  # a run's entry: itself and every alike after it
    waiting: list[Entry] = []  # not yet fallen due
    fell: dict[Entry, tuple[float, int, int, int]] = {}  # fallen, by where it is read
    now, passes = 0.0, 0
    for seq, (step, value) in enumerate(steps, 1):
        if step in ("sized", "learned"):
            learned = step == "learned"
            entry = Entry(make_action({"a": 1}, CAP, kind="k", learned=learned), seq, now)
            queue.add(entry, (1.0, now + value))
            due_of[entry] = now + value
            if learned:
                behind[entry] = [entry]
                for other in waiting:
                    if other in behind:  # in the same run: it has someone waiting
                        behind[other].append(entry)
            waiting.append(entry)
        elif step == "remove" and waiting + list(fell):
            everyone = waiting + list(fell)
            entry = everyone[int(value) % len(everyone)]
            entry.state = DONE
            queue.remove(entry)
            if entry in waiting:
                waiting.remove(entry)
            fell.pop(entry, None)
        elif step == "pass":
            now += value
            passes += 1
            queue.fall_due(now)
            for entry in list(waiting):
                pullers = behind.get(entry, [entry])
                at, by = min((due_of[p], p.seq) for p in pullers)
                if at <= now:
                    fell[entry] = (at, passes, by, entry.seq)
                    waiting.remove(entry)
        read = [e for e in queue.ordered() if _rank(e)[0] == 0]  # type: ignore[index]
        assert read == sorted(fell, key=fell.__getitem__)
        # Records of those that left stay until their time: never later than the next.
        later = [min(due_of[p] for p in behind.get(e, [e])) for e in waiting]
        assert queue.next_due() <= min(later, default=math.inf)


def test_an_alike_cancelled_behind_an_entry_still_brings_it_due_at_its_time() -> None:
    """The later alike came with a lower estimate, due at 3 where the first is due at 10:
    it stood for both in the run's dues, and leaving does not take that back from the one
    ahead (dated by the newer estimate, that one was due by 3 too)."""
    queue = Queue(priority=True)
    first = Entry(make_action({"a": 1}, CAP, learned=True), 1, 0.0)
    queue.add(first, (1.0, 10.0))
    later = Entry(make_action({"a": 1}, CAP, learned=True), 2, 0.0)
    queue.add(later, (1.0, 3.0))
    assert first.alike is not None
    assert [r[2] for r in first.alike.dues] == [later]  # the first's own can never come first
    later.state = DONE
    queue.remove(later)
    assert queue.next_due() == 3.0
    queue.fall_due(3.0)
    assert _rank(first) == (0, 3.0, 1, first)
    queue.fall_due(10.0)  # its own record, passed over: it fell due once
    assert _rank(first) == (0, 3.0, 1, first)
    assert queue.next_due() == math.inf


@pytest.mark.parametrize("own", [50.0, 1e6])
def test_alike_cancelled_behind_a_long_wait_do_not_pile_up(own: float) -> None:
    """5,000 alike arrive behind one that waits and are cancelled, each due later than the
    last, from 102 on: the run's due times stay O(waiting), and the one that waits still
    falls due at the earliest time it or any of them had (its own at 50; at 1e6, the
    first cancelled one's)."""
    queue = Queue(priority=True)
    waits = Entry(make_action({"a": 1}, CAP, learned=True), 1, 0.0)
    queue.add(waits, (1.0, own))
    for seq in range(2, 5_002):
        gone = Entry(make_action({"a": 1}, CAP, learned=True), seq, 0.0)
        queue.add(gone, (1.0, 100.0 + seq))
        gone.state = DONE
        queue.remove(gone)
    assert queue.dues <= 2 * 1 + 64 + 1
    expected = min(own, 102.0)
    queue.fall_due(expected - 0.5)
    assert _rank(waits)[0] == 1  # type: ignore[index]
    queue.fall_due(expected)
    assert _rank(waits) == (0, expected, 1, waits)


@pytest.mark.parametrize("behind", [0, 70])
def test_a_rebuild_of_a_runs_due_times_keeps_the_order_they_fall_in(behind: int) -> None:
    """At one due time, an entry sized by its own falls before the alike brought due by
    a later (cancelled) one, as the later one arrived after it; a rebuild of the run's
    due times (70 more cancelled) must not move the alike ahead (a review found it did:
    the rebuilt record named the alike, and so its arrival)."""
    queue = Queue(priority=True)
    alike = Entry(make_action({"a": 1}, CAP, learned=True), 1, 0.0)
    queue.add(alike, (1.0, 100.0))
    sized = Entry(make_action({"a": 1}, CAP), 2, 0.0)
    queue.add(sized, (1.0, 5.0))
    gone = [Entry(make_action({"a": 1}, CAP, learned=True), 3 + i, 0.0) for i in range(behind + 1)]
    for i, entry in enumerate(gone):
        queue.add(entry, (1.0, 5.0 + i))
    for entry in gone:
        entry.state = DONE
        queue.remove(entry)
    queue.fall_due(5.0)
    assert list(queue.ordered()) == [sized, alike]
