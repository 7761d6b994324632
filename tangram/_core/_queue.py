"""The waiting actions, filed by the kinds they need, read in the policy's order.

A pass looks at a bounded window of the queue. Read as one line, a window full of actions
for a kind with no unit free hides the actions for kinds that have some: with every node's
cores a kind of their own in one runtime (``cpu@node``), 128 waiters for node A left a core
freed on node B idle, and busy cores fell with the number of nodes. So the queue keeps a
line per *group*, the set of kinds an action needs at its minimum, and a pass reads only
the groups that need no closed kind (see :meth:`Queue.ordered`), merged back into one
order. An action that needs a closed kind cannot start in that pass, so leaving it out
changes no admission; its cost is the number of groups, not of waiters.

Within a group, actions of one kind and one demand whose sizes are the kind's estimate
(``Action.learned``) wait as one run, in arrival order, placed in the line by the newest
estimate (:class:`~._entry.Run`). Each used to be filed by the estimate it came with, frozen:
early in a kind's life the estimator still leans on its prior, so the first actions came
with estimates many times their size, and every later action of the same kind, as long
as anyone knew, passed them until they fell due: a new trajectory's first action waited
1.48 s behind 30 ms actions of its kind on a virtual clock (``tests/test_runtime_time.py``),
and a sandbox run about 3 s over Ray. When one of a run falls due, those ahead of it fall
due with it; the fallen due wait in a list per group, in the order they fell. Actions
with sizes of their own are filed by them, as before.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from operator import attrgetter, itemgetter
from typing import Any

from ._entry import WAITING, Entry, Run
from ._line import Line

__all__ = ["Queue"]

_by_seq = attrgetter("seq")
#: Due times of those gone that are kept before a rebuild, beyond twice the waiting: a
#: rebuild costs a pass over them, so not at every removal from a short queue.
_SLACK = 64
_first = itemgetter(0)


def _rank(entry: Entry) -> tuple[Any, ...] | None:
    """Where ``entry`` stands in its group's line: its own key, or its run's; ``None``
    for an entry that keeps arrival order."""
    alike = entry.alike
    return entry.key if alike is None else alike.key


def _ahead(entry: Entry, run: Run) -> list[Entry]:
    """``entry``, if still in ``run``, and those ahead of it there, in arrival order.

    An entry that left its run (cancelled; or admitted before them, which a policy of
    the caller's may do) still takes those ahead of it along at its time: the estimate
    it came with dates them no later, and its record stood for theirs.
    """
    entries = run.entries
    if entry.alike is run and next(iter(entries)) is entry:  # most often its first
        return [entry]
    seq = entry.seq
    return [*itertools.takewhile(lambda e: e.seq <= seq, entries)]


def _standing(record: tuple[Any, ...]) -> bool:
    """Whether a record of the due heap may still make anyone fall due."""
    if len(record) == 4:
        dues = record[3].dues
        return bool(dues) and dues[0] is record
    entry: Entry = record[2]
    return entry.state == WAITING


def _entries(line: Line) -> Iterator[Entry]:
    """The line's entries in order, each run of alike entries in arrival order."""
    for item in line:
        if item.__class__ is Run:
            yield from item.entries
        else:
            yield item


class _Group:
    """The waiting actions that need exactly ``kinds``, in arrival and in priority order."""

    __slots__ = ("alike", "due", "kinds", "lane", "line", "queue")

    def __init__(self, kinds: tuple[str, ...], priority: bool) -> None:
        self.kinds = kinds
        self.queue: OrderedDict[Entry, None] = OrderedDict()
        self.line = Line() if priority else None
        self.lane: OrderedDict[Entry, None] = OrderedDict()  # entries keeping arrival order
        self.alike: dict[tuple[str, Any], Run] = {}  # the runs in the line, by name
        # Entries fallen due, in the order they fell: by due time, as they fall in that
        # order (``Queue.fall_due``), so they need no sorted line, and once the line is
        # longer than a pass reads, many do.
        self.due: OrderedDict[Entry, None] = OrderedDict()

    def keyed(self) -> Iterator[Entry]:
        """The entries filed by priority: those fallen due, then the line."""
        assert self.line is not None
        line = _entries(self.line) if self.alike else iter(self.line)
        return itertools.chain(self.due, line) if self.due else line

    def ordered(self) -> Iterator[Entry]:
        if self.line is None:
            return iter(self.queue)
        if not self.lane:
            return self.keyed()
        if not self.line and not self.due:
            return iter(self.lane)
        return _alternate(self.keyed(), iter(self.lane))

    def file(self, entry: Entry, work: float) -> None:
        """File a priority entry by ``work``: with the entries alike to it, if learned."""
        assert self.line is not None
        action = entry.action
        name = (action.kind, action.demand) if action.learned else None
        alike = None
        if name is not None:
            try:
                alike = self.alike.get(name)
            except TypeError:  # an efficiency of the caller's that cannot be hashed:
                name = None  # filed by its own size, as a sized action is
        if name is None:
            entry.key = (1, work, entry.seq, entry)
            self.line.add(entry.key)
            return
        if alike is None:
            alike = self.alike[name] = Run(name)
            alike.key = (1, work, entry.seq, alike)
            self.line.add(alike.key)
        elif work != alike.key[1]:
            self.line.remove(alike.key)
            alike.key = (1, work, alike.key[2], alike)
            self.line.add(alike.key)
        alike.entries[entry] = None
        entry.alike = alike

    def unfile(self, entry: Entry) -> None:
        """Take a priority entry out of the line (or out of its run, or the fallen due)."""
        assert self.line is not None
        alike = entry.alike
        if alike is None:
            key = entry.key
            assert key is not None
            if key[0] == 0:
                del self.due[entry]
            else:
                self.line.remove(key)
            return
        entry.alike = None
        del alike.entries[entry]
        if not alike.entries:
            self.line.remove(alike.key)
            del self.alike[alike.name]
            alike.key = ()  # it holds the run: see ``Queue.remove``
            alike.dues.clear()  # and its record in the due heap is then passed over


class Queue:
    """Waiting entries in arrival order, or by a priority where the policy has one.

    ``priority``: entries are filed with ``(work, due)`` (or ``None`` to keep arrival
    order). Entries past their ``due`` come first, earliest due first, then the others by
    ``work`` (ties by arrival); entries keeping arrival order take turns with those, so a
    long line of either never hides the other from a pass's window.
    """

    __slots__ = ("_all", "_anywhere", "_due", "_fallen", "_groups", "_needing", "_priority")

    def __init__(self, priority: bool) -> None:
        self._priority = priority
        # Every waiting entry in arrival order. An OrderedDict is a hash table threaded on
        # a linked list, and its iterator follows the list, so reading the first
        # ``window`` entries costs ``window`` steps however many left from the middle
        # before, and removal from anywhere is O(1).
        self._all: OrderedDict[Entry, None] = OrderedDict()
        # Only groups with someone waiting; the key is the group's kinds, sorted.
        self._groups: dict[tuple[str, ...], _Group] = {}
        # The same groups by each kind they need, and those that need no kind at all.
        self._needing: dict[str, dict[_Group, None]] = {}
        self._anywhere: dict[_Group, None] = {}
        # When entries fall due, earliest first: ``(due, seq, entry)`` of those filed by
        # their own size, and ``(due, seq, entry, run)`` for each run of alike entries,
        # the first of its own ``dues`` (see ``add``).
        self._due: list[tuple[Any, ...]] = []
        self._fallen = 0  # entries fallen due so far: the order they fell in

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Entry]:
        """Every waiting entry in arrival order."""
        return iter(self._all)

    @property
    def dues(self) -> int:
        """Due times kept, in the heap and the runs', live or not (for tests of their
        compaction)."""
        runs = (run for group in self._groups.values() for run in group.alike.values())
        return len(self._due) + sum(len(run.dues) for run in runs)

    def add(self, entry: Entry, order: tuple[float, float] | None) -> None:
        """File ``entry``: with ``(work, due)`` by priority, with ``None`` by arrival."""
        self._all[entry] = None
        kinds = entry.action.demand.kinds
        group = self._groups.get(kinds)
        if group is None:
            group = self._groups[kinds] = _Group(kinds, self._priority)
            for kind in kinds:
                self._needing.setdefault(kind, {})[group] = None
            if not kinds:
                self._anywhere[group] = None
        group.queue[entry] = None
        if group.line is None:
            return
        if order is None:
            group.lane[entry] = None
            return
        work, due = order
        group.file(entry, work)
        if due == math.inf:
            return
        run = entry.alike
        if run is None:
            heapq.heappush(self._due, (due, entry.seq, entry))
            return
        # A run falls due from its front, and each of its entries takes the alike ahead
        # of it along when it falls due: an entry falls due at the earliest due time of
        # itself and those behind it. So a run keeps only the dues that come first that
        # way, ascending, and an arrival drops those behind it that are no earlier; only
        # the first stands in the heap. With a record per entry, left until its own time
        # though a later alike had taken it along, the heap held 78k records at 100k
        # waiters, each pop walked 17 levels of long-cold tuples, and a pass there cost
        # up to 3.4 times one at 1k (``benchmarks/overhead.py``), falling due most of it.
        record = (due, entry.seq, entry, run)
        dues = run.dues
        while dues and dues[-1] > record:
            dues.pop()
        dues.append(record)
        if len(dues) == 1:
            heapq.heappush(self._due, record)

    def remove(self, entry: Entry) -> None:
        """Take ``entry`` out, wherever it is; an entry not here is ignored."""
        if entry not in self._all:
            return
        del self._all[entry]
        kinds = entry.action.demand.kinds
        group = self._groups[kinds]
        del group.queue[entry]
        if group.line is not None:
            if _rank(entry) is None:
                del group.lane[entry]
            else:
                run = entry.alike
                group.unfile(entry)
                if run is not None and len(run.dues) > 2 * len(run.entries) + _SLACK:
                    self._compact(run)
                # A key holds its entry: left in place, each entry that ever had one
                # (every action that fell due) stayed alive in a cycle until the
                # collector found it, and finding them cost 12k of an
                # acquire/release cycle's 182k instructions (``benchmarks/overhead.py``).
                entry.key = None
        if not group.queue:
            del self._groups[kinds]
            for kind in kinds:
                del self._needing[kind][group]
            self._anywhere.pop(group, None)
        # Entries that left before falling due, and runs' firsts since passed, stay in the
        # heap until their time; rebuild once they outnumber the waiting, so it stays
        # O(waiting).
        if len(self._due) > 2 * len(self._all) + _SLACK:
            self._due = [d for d in self._due if _standing(d)]
            heapq.heapify(self._due)

    def _compact(self, run: Run) -> None:
        """Drop the due times of ``run`` that can bring no one due any more.

        One of an entry that left still brings those ahead of it due at its time (see
        :func:`_ahead`), so it is kept while it covers someone still waiting whom no
        earlier time covers: at most one per waiting entry. Without this, actions
        cancelled behind one that waits long would each keep a record until their time.
        """
        entries = iter(run.entries)  # in arrival order, as the records are
        here = next(entries, None)
        last: Entry | None = None  # the newest still waiting at or ahead of a record
        covered: Entry | None = None  # the newest that an earlier record kept brings due
        kept: deque[tuple[float, int, Entry, Run]] = deque()
        for record in run.dues:
            while here is not None and here.seq <= record[1]:
                last, here = here, next(entries, None)
            if last is not covered:
                kept.append(record)
                covered = last
        first = run.dues[0] if run.dues else None
        run.dues = kept
        if kept and kept[0] is not first:
            heapq.heappush(self._due, kept[0])

    def fall_due(self, now: float) -> None:
        """Move entries whose due time has come ahead of every entry not yet due."""
        due = self._due
        while due and due[0][0] <= now:
            record = heapq.heappop(due)
            at, entry = record[0], record[2]
            if len(record) == 4:
                if not _standing(record):
                    continue  # its run fell due from a later one, or is gone
                dues = record[3].dues
                dues.popleft()
                if dues:
                    heapq.heappush(due, dues[0])
                moving = _ahead(entry, record[3])
                if not moving:
                    continue
            else:
                rank = _rank(entry)
                if entry.state != WAITING or rank is None or rank[0] == 0 or entry not in self._all:
                    continue  # gone, in arrival order, or due already
                moving = [entry]
            group = self._groups[moving[0].action.demand.kinds]
            # The alike ahead of it in its run fall due with it, at its time, in arrival
            # order: each has its own allowance, from the estimate it came with, and a
            # later one, sized by a lower estimate learned since, falls due first (each
            # moves once, whoever falls due first). Ranked by due time, then by the
            # order they fell in, which is the order of the group's fallen due.
            fallen = group.due
            # In the order they fall, which is by due time, unless a policy of the caller's
            # dated one before a time already passed: then sorted again (rare, and so
            # paid only then).
            late = bool(fallen) and at < next(reversed(fallen)).key[1]  # type: ignore[index]
            for mover in moving:
                group.unfile(mover)
                self._fallen += 1
                mover.key = (0, at, self._fallen, mover)
                fallen[mover] = None
            if late:
                group.due = OrderedDict.fromkeys(sorted(fallen, key=_rank))  # type: ignore[arg-type]

    def next_due(self) -> float:
        """When the earliest entry not yet due falls due (``inf``: none)."""
        return self._due[0][0] if self._due else math.inf

    def ordered(self, open: Collection[str] | None = None) -> Iterator[Entry]:
        """Waiting entries in order; with ``open``, only those needing no other kind.

        ``open``: the kinds with something to give in this pass. The groups read are found
        through the open kinds, so a pass costs a step per group that needs one, however
        many groups are shut. Of the shut groups that need an open kind a group read also
        needs, two kinds of entry are still read: the first in the pass's order (the
        first ranked and the first keeping arrival order, as lines and lanes take turns),
        which may be the pass's blocked head, whose reservation keeps backfill from
        delaying it; and for each such open kind, the longest waiting of those needing it,
        which keeps others off the kinds it needs if it is starved (if any of them is, it
        is). No other entry of a shut group can start or change the pass. Read a first and
        an oldest per shut group, 200 full nodes sharing one open kind filled the policy's
        window of 128, and a waiter on the one node with a free core was never read.
        """
        if open is None:
            return _merge(list(self._groups.values())) if self._priority else iter(self._all)
        read: dict[_Group, None] = dict.fromkeys(self._anywhere)
        shut: dict[_Group, None] = {}
        # Whichever is fewer: the groups, or the open kinds and the groups needing them.
        if len(self._groups) <= len(open):
            candidates: Iterable[_Group] = self._groups.values()
        else:
            needing = self._needing
            candidates = (g for kind in open if kind in needing for g in needing[kind])
        for group in candidates:
            if group in read or group in shut:
                continue
            kinds = group.kinds
            if len(kinds) == 1:  # most groups (a node's cores, one service): read or not
                if kinds[0] in open:
                    read[group] = None
            elif all(k in open for k in kinds):
                read[group] = None
            elif any(k in open for k in kinds):
                shut[group] = None
        if len(read) == len(self._groups):
            return _merge(list(read)) if self._priority else iter(self._all)
        heads: list[Entry] = []
        if shut and read:
            heads = self._shut_heads(shut, open, {kind for g in read for kind in g.kinds})
        if not self._priority:
            streams = [iter(group.queue) for group in read]
            if heads:
                streams.append(iter(sorted(heads, key=_by_seq)))
            return _one(streams, _by_seq) or iter(())
        return _merge(list(read), heads)

    def _shut_heads(
        self, shut: Iterable[_Group], open: Collection[str], wanted: set[str]
    ) -> list[Entry]:
        """The entries of shut groups a pass reads (see ``ordered``)."""
        ranked: Entry | None = None  # the first by its line's key
        lane: Entry | None = None  # the first keeping arrival order
        oldest: dict[str, Entry] = {}  # per open kind wanted
        for group in shut:
            kinds = [kind for kind in group.kinds if kind in open and kind in wanted]
            if not kinds:
                continue
            first = next(group.ordered())
            rank = _rank(first) if self._priority else None
            if rank is None:
                if lane is None or first.seq < lane.seq:
                    lane = first
            elif ranked is None or rank < _rank(ranked):  # type: ignore[operator]
                ranked = first
            longest = next(iter(group.queue))
            for kind in kinds:
                known = oldest.get(kind)
                if known is None or longest.seq < known.seq:
                    oldest[kind] = longest
        found = [entry for entry in (ranked, lane) if entry is not None]
        return list(dict.fromkeys([*found, *oldest.values()]))


def _merge(groups: list[_Group], heads: list[Entry] | None = None) -> Iterator[Entry]:
    """The groups' priority lines merged by key, their arrival lanes by arrival, in turns."""
    if not heads and len(groups) == 1:
        return groups[0].ordered()
    if not groups:
        return iter(())
    lines: list[Iterator[Entry]] = []
    lanes: list[Iterator[Entry]] = []
    for group in groups:
        assert group.line is not None
        if group.line or group.due:
            lines.append(group.keyed())
        if group.lane:
            lanes.append(iter(group.lane))
    if heads:
        ranked = [(key, e) for e in heads if (key := _rank(e)) is not None]
        lines.append(e for _, e in sorted(ranked, key=_first))
        lanes.append(iter(sorted((e for e in heads if _rank(e) is None), key=_by_seq)))
    line = _one(lines, _rank)
    lane = _one(lanes, _by_seq)
    if line is None:
        return lane if lane is not None else iter(())
    return line if lane is None else _alternate(line, lane)


def _one(streams: list[Iterator[Entry]], key: Callable[[Entry], Any]) -> Iterator[Entry] | None:
    """The streams merged by ``key``; ``None`` for none."""
    if not streams:
        return None
    return streams[0] if len(streams) == 1 else heapq.merge(*streams, key=key)


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
