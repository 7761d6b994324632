"""What the scheduler actor and its proxies agree on: the heartbeat and a lease's outcome.

Messages are batched both ways, because one actor call costs a millisecond or more while
a decision costs microseconds. A proxy keeps at most one *send* in flight (acquires,
releases and withdrawals, answered with the events decided by the time it settles) and
one *poll* waiting at the actor (answered with every event since the last). The poll
doubles as the heartbeat: it names the leases the proxy holds, and the actor reclaims a
lease whose heartbeat is older than the timeout.

Events are tuples tagged by their first item: ``("grant", request, lease, grant, units)``,
``("error", request, exception)``, ``("resize", lease, grant, units)``,
``("reclaimed", lease)`` and ``("expired", requests, leases)``. This module is the one
both ends import, so the actor side never imports the worker side, nor the other way.
"""

from __future__ import annotations

import logging

__all__ = ["CANCELLED", "COMPLETED", "DEFAULT_HEARTBEAT", "DEFAULT_TIMEOUT", "FAILED", "logger"]

logger = logging.getLogger("tangram.ray")

DEFAULT_HEARTBEAT = 1.0
"""Seconds between a proxy's heartbeats (its polls return at least this often)."""
DEFAULT_TIMEOUT = 10.0
"""Seconds without a heartbeat after which the actor reclaims a lease."""

# How a lease's block ended, as a release carries it: the actor's runtime records each
# outcome as it would for a block of its own (only a completed one teaches the estimator).
COMPLETED, FAILED, CANCELLED = 0, 1, 2
