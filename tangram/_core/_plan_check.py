"""A plan is checked before the ledger applies it.

A policy of one's own (docs/policy.md, "Writing your own") plans from the same state as
tangram's, and a mistake in it (admitting an action twice, or one that is running,
granting units outside an elastic range, admitting past the free units) used to be
applied as it came: a greedy policy ran four one-core actions at once on one core, with
no error anywhere. Checked here, the pass fails with :class:`~tangram.errors.PolicyError`
naming the policy and the first fault, and nothing of the plan is applied, so every unit
stays accounted for. The check costs a walk of the plan's own lines, not of the queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn, cast

from ..errors import PolicyError
from ._policy import _EPS, RUNNING, WAITING, Entry, Plan, Policy

__all__ = ["check_plan"]


def check_plan(
    plan: Plan,
    policy: Policy,
    free: Mapping[str, float],
    tokens: Mapping[str, float],
) -> None:
    """Raise :class:`PolicyError` for the first line of ``plan`` that breaks a rule.

    ``free`` and ``tokens`` are the units and rate budget free before the plan. A kind
    already held past its capacity (lowered while actions ran) may not be given more.
    """
    if not isinstance(plan, Plan):
        _fault(policy, f"returned {plan!r}, not a Plan")
    change: dict[str, float] = {}
    resized: set[Entry] = set()
    for line in plan.resizes:
        entry, units = _line(policy, line, "resizes")
        elastic = entry.action.demand.elastic
        if entry.state != RUNNING or elastic is None or not elastic.resizable:
            _fault(policy, f"resizes action {entry.action.id}, which is not a running resizable")
        if entry in resized:
            _fault(policy, f"resizes action {entry.action.id} twice")
        resized.add(entry)
        _within(policy, entry, units)
        kind = entry.action.demand.elastic_kind
        assert kind is not None
        change[kind] = change.get(kind, 0.0) + units - entry.units
    admitted: set[Entry] = set()
    for line in plan.admits:
        entry, units = _line(policy, line, "admits")
        if entry.state != WAITING or entry in admitted:
            _fault(policy, f"admits action {entry.action.id}, which is not waiting for it")
        admitted.add(entry)
        demand = entry.action.demand
        for kind, amount in demand.rigid:
            change[kind] = change.get(kind, 0.0) + amount
        if demand.elastic_kind is not None:
            _within(policy, entry, units)
            change[demand.elastic_kind] = change.get(demand.elastic_kind, 0.0) + units
    for kind, delta in change.items():
        left = tokens[kind] if kind in tokens else free[kind]
        if delta > _EPS and left - delta < -_EPS:
            _fault(policy, f"grants {delta:g} more {kind!r} with {max(left, 0.0):g} free")


def _line(policy: Policy, line: object, where: str) -> tuple[Entry, int]:
    if not (isinstance(line, tuple) and len(line) == 2 and isinstance(line[0], Entry)):
        _fault(policy, f"lists {line!r} in `{where}`, not an (entry, units) pair")
    entry, units = cast("tuple[Entry, object]", line)
    if isinstance(units, bool) or not isinstance(units, int):
        _fault(policy, f"gives action {entry.action.id} {units!r} units, not a whole number")
    return entry, units


def _within(policy: Policy, entry: Entry, units: int) -> None:
    elastic = entry.action.demand.elastic
    assert elastic is not None
    if not elastic.min <= units <= elastic.max:
        _fault(
            policy,
            f"gives action {entry.action.id} {units} units, outside its "
            f"{elastic.min}..{elastic.max}",
        )


def _fault(policy: Policy, what: str) -> NoReturn:
    raise PolicyError(f"policy {type(policy).__name__} {what}; nothing of its plan was applied")
