"""How often an agent passes its node's heartbeats on: the one timing rule both the proxy
(``tangram/_shared/_proxy.py``) and the protocol model (``tangram/_sim/_scaleout.py``)
follow, pure so both compute it alike.

A worker with nothing at the job's actor beats to its node's agent once a ``heartbeat``;
the agent passes every beat it heard on in its own poll to the job's actor, which drops
a worker it has not heard from for ``lease_timeout``. A beat reaches the actor at most a
heartbeat (the worker's) plus the agent's wait (its poll's) after the worker sent the one
before. The agent waits a third of the slack the timeout leaves past a heartbeat and
keeps two thirds as the margin for late calls: at the defaults (1 s, 10 s) it polls every
3 s instead of twice a second, which is most of the job actor's calls at 1,000 nodes
(``benchmarks/scale_model.py``). Never more often than twice a heartbeat, as before;
at the tightest timeout allowed (twice the heartbeat) that is the pace, and the margin
half a heartbeat. A proxy that polls the job's actor itself while it holds nothing
there and waits for nothing (a driver, a worker on a node with no agent) keeps the same
pace, though never more often than a heartbeat: only leases need a beat a heartbeat.
"""

from __future__ import annotations

__all__ = ["idle_wait", "relay_wait"]


def relay_wait(heartbeat: float, lease_timeout: float) -> float:
    """Seconds an agent that passes beats on waits in each poll of the job's actor."""
    return max(heartbeat / 2, (lease_timeout - heartbeat) / 3)


def idle_wait(heartbeat: float, lease_timeout: float) -> float:
    """Seconds a proxy that holds nothing at the job's actor and waits for nothing there
    waits in each poll of it: the relay's pace, but never more often than a heartbeat
    (under a lease timeout of less than four heartbeats the relay's is the faster)."""
    return max(heartbeat, relay_wait(heartbeat, lease_timeout))
