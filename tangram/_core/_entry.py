"""The scheduler's mutable record of one waiting or running action.

Shared by the policy, which reads it, and the ledger, which changes it; its own module so
that the policy's steps and the structures they use (the split index, the waiting line)
can live beside it without importing each other.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from ._action import Action

__all__ = ["DONE", "RUNNING", "WAITING", "Entry", "Run"]

WAITING, RUNNING, DONE = 0, 1, 2
# Remaining work never drops below this share of the estimate, so an action that runs past
# its estimate still looks like it needs some time.
_REMAINING_FLOOR = 0.05


class Entry:
    """The scheduler's mutable record of one action, shared by the policy and the ledger."""

    __slots__ = (
        "action",
        "admitted_at",
        "alike",
        "arrival",
        "deadline",
        "emax",
        "emin",
        "holding",
        "inv",
        "key",
        "mark",
        "rem",
        "seq",
        "speedup",
        "state",
        "t1",
        "unit_time",
        "units",
    )

    def __init__(self, action: Action, seq: int, arrival: float) -> None:
        self.action = action
        self.seq = seq
        self.arrival = arrival
        self.state = WAITING
        self.units = 0
        estimate = action.estimate
        elastic = action.demand.elastic
        self.emin, self.emax = (elastic.min, elastic.max) if elastic is not None else (0, 0)
        self.t1 = estimate.seconds_at_1
        efficiency = elastic.efficiency if elastic and elastic.efficiency else estimate.efficiency
        self.speedup: Callable[[float], float] = efficiency.speedup
        self.inv: list[float] | None = None
        self.rem = self.t1
        self.mark = arrival
        self.admitted_at = math.nan
        self.unit_time = 0.0
        self.deadline = math.inf
        # The kinds its caller holds units of already (a nested acquire): a reservation
        # for an action needing one of them does not hold it back (``ElasticPolicy.plan``).
        self.holding: frozenset[str] = frozenset()
        # Where the ledger files it in a priority-ordered line (None: arrival order), or
        # the run of actions alike to it that it waits in.
        self.key: tuple[int, float, int, Entry] | None = None
        self.alike: Run | None = None

    def __repr__(self) -> str:
        return f"<Entry #{self.action.id} {self.action.kind} state={self.state} units={self.units}>"

    @property
    def elastic(self) -> bool:
        return self.action.demand.elastic is not None

    def speed(self, units: int) -> float:
        return self.speedup(units) if units > 0 else 1.0

    def remaining(self, now: float) -> float:
        """Estimated work left, in seconds at one unit."""
        if self.state != RUNNING:
            return self.rem
        left = self.rem - (now - self.mark) * self.speed(self.units)
        return max(left, _REMAINING_FLOOR * self.t1)


class Run:
    """Waiting actions of one kind and demand sized by the kind's estimate: as alike as
    anyone knows, so they keep arrival order among themselves, and stand in the line as
    one key, which the newest of them moves to the kind's newest estimate (one move,
    however many wait)."""

    __slots__ = ("dues", "entries", "key", "name")

    def __init__(self, name: tuple[str, Any]) -> None:
        self.name = name
        self.entries: OrderedDict[Entry, None] = OrderedDict()
        self.key: tuple[Any, ...] = ()
        # When its entries fall due: ``(due, seq, entry, run)`` of those that fall due
        # first, ascending both ways (see ``Queue.add``).
        self.dues: deque[tuple[float, int, Entry, Run]] = deque()
