"""Bounded accounting of what the scheduler did: per-kind time splits and resource use.

Quantiles come from the most recent ``window`` samples of each action kind and means from
running sums, so memory stays flat over millions of actions. Pure: callers pass times in.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from ._action import Action

__all__ = ["KindStats", "Outcome", "Recorder", "ResourceStats", "Stats", "Summary"]


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The smallest sample with at least a share ``q`` of samples at or below it.

    So p50 of [1, 2, 3, 4] is 2, not 3, and p99 of 100 samples is the 99th, not the
    largest. The epsilon keeps 0.95 * 20 from rounding up to 20. NaN when empty.
    """
    n = len(ordered)
    if n == 0:
        return math.nan
    return ordered[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]


class Outcome(enum.Enum):
    """How an action ended: its body returned, raised, or was cancelled or timed out."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Read at every action's end: an enum member read off its class costs five plain reads.
COMPLETED, FAILED, CANCELLED = Outcome.COMPLETED, Outcome.FAILED, Outcome.CANCELLED


@attrs.frozen
class Summary:
    """Mean and quantiles of a duration, in seconds (NaN when there is no sample).

    ``total`` is the sum, kept as it ran: ``mean * count`` rounds, and could come out a
    step lower after a zero was added, which a reader of changes took for a restart.
    """

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    total: float = 0.0

    @classmethod
    def of(cls, samples: deque[float], count: int, total: float) -> Summary:
        if count == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        ordered = sorted(samples)

        return cls(
            count,
            total / count,
            nearest_rank(ordered, 0.50),
            nearest_rank(ordered, 0.95),
            nearest_rank(ordered, 0.99),
            total,
        )


@attrs.frozen
class KindStats:
    """What happened to actions of one kind. ``act`` is queue + overhead + exec."""

    completed: int
    failed: int
    cancelled: int
    queue: Summary
    exec: Summary
    overhead: Summary
    act: Summary


@attrs.frozen
class ResourceStats:
    """Use of one resource kind. ``unit_seconds`` integrates units held over time: the bill."""

    total: float
    held: float
    utilisation: float
    unit_seconds: float
    peak: float


@attrs.frozen
class Stats:
    """A snapshot from :meth:`tangram.Runtime.stats`."""

    resources: Mapping[str, ResourceStats]
    waiting: int
    running: int
    kinds: Mapping[str, KindStats]
    decisions: int
    decision_seconds: float
    resizes: int
    evictions: int


class _Series:
    __slots__ = ("count", "recent", "total")

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.recent.append(value)
        self.count += 1
        self.total += value

    def summary(self) -> Summary:
        return Summary.of(self.recent, self.count, self.total)


class _KindRecord:
    __slots__ = ("act", "cancelled", "completed", "exec", "failed", "overhead", "queue")

    def __init__(self, window: int) -> None:
        # Plain counters, not a dict keyed by Outcome: an enum member hashes in Python,
        # twice per completed action.
        self.completed = self.failed = self.cancelled = 0
        self.queue = _Series(window)
        self.exec = _Series(window)
        self.overhead = _Series(window)
        self.act = _Series(window)


class Timed(Protocol):
    """What the recorder reads of an action that ended: a lease's four times."""

    @property
    def action(self) -> Action: ...

    queued_at: float
    admitted_at: float
    started_at: float
    finished_at: float


def most_in_window(
    times: Sequence[float], window: float, weights: Sequence[float] | None = None
) -> float:
    """The most units (one per time, unless weighted) at times within ``window`` of each
    other: what a rate limit of ``burst + rate x window`` is judged against."""
    order = sorted(range(len(times)), key=times.__getitem__)
    best = total = 0.0
    first = 0
    for at in order:
        total += 1.0 if weights is None else weights[at]
        while times[order[first]] < times[at] - window:
            total -= 1.0 if weights is None else weights[order[first]]
            first += 1
        best = max(best, total)
    return best


def split(lease: Timed) -> tuple[float, float, float]:
    """An ended action's queue, overhead and exec seconds.

    An action withdrawn from the queue has no admission time (NaN) and spent all its
    time queued.
    """
    admitted = lease.admitted_at
    if math.isnan(admitted):
        return lease.finished_at - lease.queued_at, 0.0, 0.0
    started = lease.started_at
    return admitted - lease.queued_at, started - admitted, lease.finished_at - started


class Recorder:
    """Collects per-kind outcomes and durations; keeps at most ``max_kinds`` kinds.

    The runtime's statistics listen to the same event as a :class:`tangram.Instrument`
    (:meth:`action_finished`), but the runtime calls them directly, ahead of the attached
    instruments: its own figures cannot be detached, and every action pays for them.
    """

    def __init__(self, *, window: int = 2048, max_kinds: int = 1024) -> None:
        self._window = window
        self._max_kinds = max_kinds
        self._kinds: OrderedDict[str, _KindRecord] = OrderedDict()
        self._last: str | None = None  # most recent kind: already at the LRU's end

    def record(
        self, kind: str, outcome: Outcome, queue: float, overhead: float, exec_: float
    ) -> None:
        rec = self._kinds.get(kind)
        if rec is None:
            rec = self._kinds[kind] = _KindRecord(self._window)
            if len(self._kinds) > self._max_kinds:
                self._kinds.popitem(last=False)
        elif self._last is not kind:
            self._kinds.move_to_end(kind)
        self._last = kind
        if outcome is COMPLETED:
            rec.completed += 1
        elif outcome is FAILED:
            rec.failed += 1
        else:
            rec.cancelled += 1
        # Each series spelled out, not a loop or a call per series: paid at every
        # completion, and the recorder was a tenth of an acquire/release cycle.
        series = rec.queue
        series.recent.append(queue)
        series.count += 1
        series.total += queue
        if outcome is CANCELLED and exec_ <= 0:
            return  # withdrawn from the queue: it has a wait and nothing else
        series = rec.overhead
        series.recent.append(overhead)
        series.count += 1
        series.total += overhead
        series = rec.exec
        series.recent.append(exec_)
        series.count += 1
        series.total += exec_
        act = queue + overhead + exec_
        series = rec.act
        series.recent.append(act)
        series.count += 1
        series.total += act

    def action_finished(self, lease: Timed, outcome: Outcome) -> None:
        """Record an action that ended: the three parts of its time if it ran, else its wait."""
        queue, overhead, exec_ = split(lease)
        self.record(lease.action.kind, outcome, queue, overhead, exec_)

    def kinds(self) -> dict[str, KindStats]:
        return {
            kind: KindStats(
                completed=rec.completed,
                failed=rec.failed,
                cancelled=rec.cancelled,
                queue=rec.queue.summary(),
                exec=rec.exec.summary(),
                overhead=rec.overhead.summary(),
                act=rec.act.summary(),
            )
            for kind, rec in self._kinds.items()
        }
