"""Hypothesis strategies and small builders shared by the model and policy tests.

The builders make the objects the runtime would make (a validated demand, an action with
an estimate) without a runtime, so the pure layers can be driven directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from tangram import Amdahl, Elastic, Estimate, Linear, Power, Rate, SpeedupTable, Step
from tangram._core._action import Action
from tangram._core._demand import build_demand
from tangram._core._efficiency import Efficiency
from tangram._core._resources import Capacity, parse_capacity

_ids = itertools.count(1)


def make_action(
    amounts: Mapping[str, object],
    capacity: Capacity | Mapping[str, object],
    *,
    seconds: float = 1.0,
    efficiency: Efficiency | None = None,
    kind: str = "action",
    trajectory: str | None = None,
    learned: bool = False,
) -> Action:
    """An action as ``Runtime.acquire`` would build it: with an exact estimate (a
    caller's hint), or ``learned``, one said to be its kind's."""
    cap = parse_capacity(capacity)
    return Action(
        next(_ids),
        kind,
        trajectory,
        build_demand(amounts, cap),
        Estimate(seconds, efficiency if efficiency is not None else Linear()),
        learned,
    )


# -- efficiency models -----------------------------------------------------------------

fractions = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
amdahls = st.builds(Amdahl, fractions)
powers = st.builds(Power, fractions)
tables = st.lists(
    st.floats(min_value=0.1, max_value=64.0, allow_nan=False), min_size=1, max_size=8
).map(lambda xs: SpeedupTable(sorted(xs)))
efficiencies: st.SearchStrategy[Efficiency] = st.one_of(st.just(Linear()), amdahls, powers, tables)
# Concave models only: the policy's greedy split is argued optimal for these.
concave_efficiencies: st.SearchStrategy[Efficiency] = st.one_of(st.just(Linear()), amdahls, powers)

# -- workloads for the policy ------------------------------------------------------------

#: Capacities with a count that elastic demands use, a second count, and a rate budget.
CAPACITY: dict[str, object] = {"cpu": 16, "gpu": 4, "api": Rate(4.0, burst=3.0)}


@st.composite
def demands(draw: st.DrawFn, cpu_total: int = 16) -> dict[str, object]:
    """A random valid demand against :data:`CAPACITY` (with ``cpu`` = ``cpu_total``)."""
    out: dict[str, object] = {}
    if draw(st.booleans()):
        low = draw(st.integers(1, cpu_total))
        high = draw(st.integers(low, cpu_total + 4))
        out["cpu"] = Elastic(
            low,
            high,
            resizable=draw(st.booleans()),
            efficiency=draw(st.none() | concave_efficiencies),
        )
    elif draw(st.booleans()):
        out["cpu"] = draw(st.integers(1, cpu_total))
    if draw(st.booleans()):
        out["gpu"] = draw(st.sampled_from([0.5, 1, 2, 4]))
    if draw(st.integers(0, 3)) == 0:
        out["api"] = draw(st.sampled_from([1, 2, 3]))
    if not out:
        out["cpu"] = 1
    return out


seconds = st.floats(min_value=0.01, max_value=50.0, allow_nan=False)


@st.composite
def ledger_ops(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A script for a ledger: submit actions, let time pass, finish or cancel entries.

    ``finish`` and ``withdraw`` carry an index that the driver reduces modulo the number
    of running (or waiting) entries, so every script is valid whatever the policy did.
    """
    ops: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 40))):
        op = draw(st.sampled_from(["submit", "submit", "submit", "advance", "finish", "withdraw"]))
        if op == "submit":
            ops.append(("submit", (draw(demands()), draw(seconds), draw(concave_efficiencies))))
        elif op == "advance":
            ops.append(("advance", draw(st.floats(min_value=0.0, max_value=20.0))))
        else:
            ops.append((op, draw(st.integers(0, 1000))))
    return ops


@st.composite
def workloads(
    draw: st.DrawFn,
    *,
    max_trajectories: int = 6,
    max_steps: int = 5,
    demand: st.SearchStrategy[dict[str, object]] | None = None,
) -> dict[str, list[Step]]:
    """Trajectories for :func:`tangram.simulate` against :data:`CAPACITY`."""
    demand = demand if demand is not None else demands()
    trajectories: dict[str, list[Step]] = {}
    for t in range(draw(st.integers(1, max_trajectories))):
        steps = [
            Step(
                demand=draw(demand),
                seconds_at_1=draw(seconds),
                efficiency=draw(concave_efficiencies),
                gap=draw(st.floats(min_value=0.0, max_value=10.0)),
                kind=draw(st.sampled_from(["build", "test", "judge"])),
            )
            for _ in range(draw(st.integers(1, max_steps)))
        ]
        trajectories[f"t{t}"] = steps
    return trajectories
