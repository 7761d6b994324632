"""An action's identity: what it is, whose it is, what it asks for and how long it should take."""

from __future__ import annotations

import attrs

from ._demand import Demand
from ._efficiency import Estimate

__all__ = ["Action"]


@attrs.frozen
class Action:
    """One external call of a rollout: a tool run, a reward computation, an API request.

    ``kind`` groups actions whose durations are alike (``"run_tests"``, ``"judge"``); the
    estimator learns per kind. ``trajectory`` names the rollout the action belongs to, for
    accounting and for executors that keep per-trajectory state (a sandbox).
    ``learned``: ``estimate`` is the kind's, from the estimator, not the action's own (a
    caller's hint, a trace's exact size): actions alike in kind and demand then look
    alike to the policy, and the queue keeps them in arrival order (``_entry.Run``).
    """

    id: int
    kind: str
    trajectory: str | None
    demand: Demand
    estimate: Estimate
    learned: bool = False
