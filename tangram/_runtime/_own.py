"""A task's own leases: the demands they make impossible, and the waits they make risky.

A task blocked in ``acquire`` cannot release what it already holds, so when its own
leases plus the new demand exceed a capacity the wait can never end: that is certain
from the task's holdings alone and is refused at the call
(:class:`~tangram.errors.SelfDeadlockError`). A wait that others' releases could end,
while the task holds units of its own, deadlocks only if those others wait for this task,
which the runtime cannot see (a parent waiting for its child task, say): that gets a
:class:`~tangram.errors.DeadlockRiskWarning`. Only the task's leases on the same runtime
count: another runtime's capacity is another pool.

The runtime keeps each task's granted leases (``Runtime._holders``); these functions run
only for a task that holds some, so an acquire by a task holding nothing pays one dict
lookup.
"""

from __future__ import annotations

import warnings

from .._core._action import Action
from .._core._demand import describe
from .._core._ledger import Ledger
from .._core._resources import Capacity, format_amount
from ..errors import DeadlockRiskWarning, SelfDeadlockError, WaitTimeoutError
from ._lease import Lease

__all__ = ["check_own", "self_deadlock", "timed_out"]

_EPS = 1e-9


def own_units(own: list[Lease], ledger: Ledger) -> dict[str, float]:
    """What ``own`` holds of each counted or sized kind that no resize can take back.

    A resizable grant counts at its ``min``: the policy may shrink it to make room.
    Rate budgets are not held, so they never count.
    """
    held: dict[str, float] = {}
    free = ledger.free
    for lease in own:
        demand = lease.action.demand
        for kind, amount in demand.rigid:
            if kind in free:
                held[kind] = held.get(kind, 0.0) + amount
        elastic, name = demand.elastic, demand.elastic_kind
        if elastic is not None and name is not None:
            units = elastic.min if elastic.resizable else lease._entry.units
            held[name] = held.get(name, 0.0) + units
    return held


def check_own(
    own: list[Lease],
    action: Action,
    wait_timeout: float | None,
    ledger: Ledger,
    capacity: Capacity,
) -> None:
    """Refuse a demand this task's own leases make impossible; warn on a risky wait.

    :raises SelfDeadlockError: own units plus the demand exceed some capacity.
    :raises WaitTimeoutError: the same, for an acquire with a ``wait_timeout``: no grant
        can come within it, so the answer is given now (``wait_timeout=0`` is "only if
        free now", a fair question while holding).
    """
    error = self_deadlock(own, action, ledger, capacity)
    if error is not None:
        if wait_timeout is not None:
            raise timed_out(error, wait_timeout) from error
        raise error
    for kind, amount in action.demand.minimum:
        free = ledger.free.get(kind)
        if free is not None and amount > free + ledger.surplus.get(kind, 0.0) + _EPS:
            need = describe(action.demand.minimum, capacity)
            held = describe(own_units(own, ledger).items(), capacity)
            warnings.warn(
                f"this task holds {held} on the runtime and waits for {need} "
                f"(kind {action.kind!r}), which is not free now: it waits for other "
                "tasks, and deadlocks if one of them waits for this task",
                DeadlockRiskWarning,
                stacklevel=4,  # here, Runtime._enter, AcquireContext.__aenter__, the caller
            )
            return


def self_deadlock(
    own: list[Lease], action: Action, ledger: Ledger, capacity: Capacity
) -> SelfDeadlockError | None:
    """The error for a demand that ``own`` makes impossible at today's capacity."""
    held = own_units(own, ledger)
    totals = ledger.totals
    for kind, amount in action.demand.minimum:
        mine = held.get(kind, 0.0)
        if mine and mine + amount > totals[kind] + _EPS:
            resource = capacity[kind]
            leases = f"{len(own)} lease{'s' if len(own) > 1 else ''}"
            return SelfDeadlockError(
                f"this task already holds {kind}={format_amount(resource, mine)} "
                f"(in {leases}) of the runtime's capacity "
                f"{kind}={format_amount(resource, totals[kind])} and asks for "
                f"{kind}={format_amount(resource, amount)} more (kind {action.kind!r}): "
                "it could never be granted while the task waits holding its own leases. "
                "Ask for everything in one demand, or acquire after the outer block ends"
            )
    return None


def timed_out(error: SelfDeadlockError, wait_timeout: float) -> WaitTimeoutError:
    """What an acquire with a ``wait_timeout`` raises instead (``error`` as its cause)."""
    return WaitTimeoutError(f"no grant can come within {wait_timeout:g} s: {error}")
