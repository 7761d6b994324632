"""The waiting queue filed by kinds: reading only the open kinds keeps the policy's order.

A pass reads ``Queue.ordered(open)`` instead of the whole line. These properties say what
that may leave out (only entries that need a closed kind) and what it must keep (the
order, and the first entry of a shut group that shares an open kind with one read).
"""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import make_action

from tangram._core._entry import Entry
from tangram._core._queue import Queue
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


def _fill(priority: bool, entries: list[tuple[set[str], object]], removed: list[bool]) -> Queue:
    queue = Queue(priority=priority)
    live = []
    for seq, (kinds, filing) in enumerate(entries, 1):
        entry = Entry(make_action(dict.fromkeys(sorted(kinds), 1), CAP), seq, float(seq))
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
    entries=st.lists(st.tuples(_kinds, _filing), max_size=40),
    removed=st.lists(st.booleans(), max_size=10),
    open_=st.sets(st.sampled_from(KINDS)),
)
def test_reading_open_kinds_leaves_out_only_what_cannot_start(
    priority: bool,
    entries: list[tuple[set[str], object]],
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
        mine = [position[e] for e in read if (e.key is not None) is keyed]
        assert mine == sorted(mine)
    # Every entry that could start is read.
    startable = [e for e in whole if set(e.action.demand.kinds) <= open_]
    assert set(startable) <= set(read)
    # Every other entry read is the first of its group or its longest waiting, needing
    # an open kind a read group needs too (a possible head, holding its reservation, or
    # a starved action keeping others off its kinds).
    wanted = {k for e in startable for k in e.action.demand.kinds}
    firsts: dict[tuple[str, ...], Entry] = {}
    oldest: dict[tuple[str, ...], Entry] = {}
    for entry in whole:
        firsts.setdefault(entry.action.demand.kinds, entry)
    for entry in sorted(whole, key=lambda e: e.seq):
        oldest.setdefault(entry.action.demand.kinds, entry)
    for entry in read:
        kinds = entry.action.demand.kinds
        if set(kinds) <= open_:
            continue
        assert entry is firsts[kinds] or entry is oldest[kinds]
        assert any(k in open_ and k in wanted for k in kinds)
    # And every such one is read.
    for kinds, first in firsts.items():
        if not set(kinds) <= open_ and any(k in open_ and k in wanted for k in kinds):
            assert first in read and oldest[kinds] in read


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
