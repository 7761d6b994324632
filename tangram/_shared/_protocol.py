"""What the scheduler actor and its proxies agree on: the heartbeat and a lease's outcome.

Messages are batched both ways, because one actor call costs a millisecond or more while
a decision costs microseconds. A proxy keeps at most one *send* in flight (acquires,
releases and withdrawals, answered with the events decided by the time it settles) and
one *poll* waiting at the actor (answered with every event since the last). The poll
doubles as the heartbeat: it names the leases the proxy holds, and the actor reclaims a
lease whose heartbeat is older than the timeout.

Events are tuples tagged by their first item: ``("grant", request, lease, grant, units)``,
``("error", request, exception)``, ``("resize", lease, grant, units)``,
``("reclaimed", lease)``, ``("expired", requests, leases)`` and ``("home", host,
agent)`` (a worker's node has a deciding agent now: open sandboxes and beat there). This
module is the one both ends import, so the actor side never imports the worker side, nor
the other way.

The same actors run on Ray or, outside Ray, in one process per node that workers reach
over a Unix socket (:mod:`._socket`). The code that calls them catches :func:`lost` and
:func:`task_failed` instead of Ray's exceptions, so it runs on either transport and Ray
is imported only where Ray is the transport.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = [
    "CANCELLED",
    "COMPLETED",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TIMEOUT",
    "FAILED",
    "IDLE",
    "ActorLostError",
    "ActorTaskError",
    "Heard",
    "died",
    "logger",
    "lost",
    "stalled",
    "task_failed",
]

logger = logging.getLogger("tangram.ray")

DEFAULT_HEARTBEAT = 1.0
"""Seconds between a proxy's heartbeats (its polls return at least this often)."""
DEFAULT_TIMEOUT = 10.0
"""Seconds without a heartbeat after which the actor reclaims a lease."""

SCHEDULER_CALLS = 1_000_000
"""Calls the job's actor runs at once (Ray's ``max_concurrency``): two per proxy (its send
and its poll) and one per API request of a job's quota until it is answered, waiting for
its budget included, and a job's backlog of API requests can pass 10,000. A waiting call
is a coroutine, so the bound costs nothing until reached, and reached it would queue
heartbeats behind API requests: it is set past any backlog."""

IDLE = 2
"""A job's scheduler ends after this many lease timeouts with no worker's proxy.

Not one: on a starved machine every worker's proxy can miss its heartbeats at once and
be dropped, and comes back with its next poll; the job is over only when none does.
"""

# How a lease's block ended, as a release carries it: the actor's runtime records each
# outcome as it would for a block of its own (only a completed one teaches the estimator).
COMPLETED, FAILED, CANCELLED = 0, 1, 2


class ActorLostError(Exception):
    """The socket transport lost its actor: the node's scheduler process is gone."""


class ActorTaskError(ActorLostError):
    """An actor's method raised: ``cause`` is what it raised, as Ray's ``RayTaskError``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def lost() -> tuple[type[Exception], ...]:
    """What a call raises when its actor is gone or its method raised, on either transport.

    Ray's errors are named only where Ray is loaded: a process that never imported it
    cannot be handed one, and the socket transport must not pay for importing it.
    """
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is None:
        return (ActorLostError,)
    return (ray_exceptions.RayError, ActorLostError)


def died(exc: BaseException) -> bool:
    """Whether ``exc``, one of :func:`lost`, says the actor itself is gone for good.

    Not a method that raised, and on Ray not an actor unreachable for now
    (``ActorUnavailableError``, a network break): those may still answer later.
    """
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is not None and isinstance(exc, ray_exceptions.RayError):
        return isinstance(exc, ray_exceptions.ActorDiedError)
    return isinstance(exc, ActorLostError) and not isinstance(exc, ActorTaskError)


def task_failed() -> tuple[type[Any], ...]:
    """What a call raises when its actor's method raised: each carries ``cause``."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    if ray_exceptions is None:
        return (ActorTaskError,)
    return (ray_exceptions.RayTaskError, ActorTaskError)


def stalled(since: float, period: float) -> float:
    """Seconds a timer set ``period`` seconds after ``since`` (``time.monotonic()``) woke
    late: its own loop's stall (a long collection, a blocking call, a core other
    processes starved, a block of its own work). See :class:`Heard` for what a watcher
    forgives of it."""
    return max(0.0, time.monotonic() - since - period)


class Heard:
    """When a watcher last heard from someone, and how much of the silence since was the
    watcher's own lateness: it heard nothing while it stalled, so that silence is not
    theirs (the scheduler's watchdog dropped every proxy, a node's agent with its cores,
    after its own long collection).

    Forgiven: the watcher's longest late wake within the silence, or the sum of its late
    wakes up to ``cap`` (one timeout), whichever is more. The longest covers one stall of
    any length. The capped sum covers a loop late because it is busy, where a live peer's
    every round trip takes several of its late passes; uncapped, it held a dead peer's
    units for as many passes as it took the ticks' own running time to reach the timeout
    (18 s against a 0.3 s timeout). So whoever stays silent is judged at most
    ``timeout`` plus the larger of the longest late wake and ``cap`` after its last word,
    at the watcher's next wake. Only the part of a late wake after that word counts: a
    call queued during a stall runs at the wake, and its sender was heard then.
    """

    __slots__ = ("_longest", "_sum", "at")

    def __init__(self, now: float) -> None:
        self.hear(now)

    def hear(self, now: float) -> None:
        self.at = now
        self._longest = self._sum = 0.0

    def stalled(self, late: float, now: float) -> None:
        """The watcher woke at ``now``, ``late`` seconds late (see :func:`stalled`)."""
        theirs = max(0.0, min(late, now - self.at))
        self._longest = max(self._longest, theirs)
        self._sum += theirs

    def silence(self, now: float, cap: float) -> float:
        """Seconds of silence that are theirs: the wall time less what is forgiven."""
        return now - self.at - max(self._longest, min(self._sum, cap))
