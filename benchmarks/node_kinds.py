"""Many nodes in one runtime: does a core freed on one node wait behind another's queue?

What it measures
    A runtime that decides for many nodes has a kind per node (``cpu@node``, as the
    shared scheduler names them). Each of ``N`` nodes has 4 cores and 12 trajectories,
    so every node is always oversubscribed; each trajectory runs one-core actions (and,
    in the ``elastic`` mix, some ``Elastic(1, 4)`` ones) separated by short think gaps.
    The same trajectories are replayed in virtual time (``tangram.simulate``, the live
    runtime's ledger and policy) three ways in one run:

    - *tangram*: one ``ElasticPolicy`` over every node's kind, as shipped;
    - *one line*: the same policy reading the queue as one line, as before this change:
      its window of 128 waiting actions covers every node, so 128 waiters for full nodes
      hide the waiters for a node with a core free;
    - *per node* (the ideal): every node replayed alone under its own policy, where no
      other node's queue can be in the way.

    Busy cores: core-seconds held within a horizon (80 % of the time at which the first
    trajectory finishes under tangram or per node, so every node is still
    oversubscribed there; the one-line arm is read over the same), over cores x horizon.
    The figure is tangram's busy share over the per-node ideal's, at 8, 50 and 200
    nodes, for several action-size distributions and seeds; the worst is the target.
    The cost: CPU time of the policy's decisions (``plan``, ``time.thread_time``) per
    decision, tangram over the per-node arm's, at the most nodes, each arm replayed with
    the garbage collector off (as ``timeit`` times), so that a collection of the
    simulation's heap is not charged to the decision it happens to land in.

Why
    Issue 30: with one window across the job, busy cores fell to 93 % / 46 % / 14.5 % at
    8 / 50 / 200 oversubscribed nodes. A free unit of one kind must never wait behind
    demands for another kind. Target: busy cores >= 95 % of the ideal at 8, 50 and 200
    nodes, at a decision cost within 2x of a scheduler per node (the policy's own
    decision-cost targets, at 1k and 100k waiters on one kind, are ``overhead.py``'s).

How
    ``--quick``: 8 actions per trajectory, distributions lognormal and Pareto, one seed,
    and the *one line* arm at 8 and 50 nodes only (under a minute on 2 cores: at 200
    nodes its whole-job window makes it the slowest arm, 27 s per distribution here, and
    it is the before-figure, not a target). Full: 30 actions,
    lognormal, Pareto and bimodal sizes, seeds 0-2, every arm at every size. The last
    line of stdout is one JSON object (``"bench": "node_kinds"``); the exit status is 0
    whether or not targets are met.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from tangram import Elastic, ElasticPolicy, Step, simulate
from tangram._core._entry import Entry
from tangram._core._policy import Plan, State
from tangram._sim._simulate import SimulationResult

CORES = 4
PER_NODE = 12
NODES = (8, 50, 200)
GOAL_BUSY = 0.95
GOAL_COST = 2.0


class _WholeLine:
    """A state whose queue is read as one line, whatever the policy asks for."""

    def __init__(self, state: State) -> None:
        self._state = state

    def waiting(self, open: Collection[str] | None = None) -> Iterator[Entry]:
        return iter(self._state.waiting())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class Timed:
    """A policy that adds up the CPU time of its decisions (``plan``), and nothing else."""

    def __init__(self, policy: ElasticPolicy) -> None:
        self.policy = policy
        self.seconds = 0.0
        self.decisions = 0

    def plan(self, state: State) -> Plan:
        started = time.thread_time()
        plan = self.policy.plan(state)
        self.seconds += time.thread_time() - started
        self.decisions += 1
        return plan

    def __getattr__(self, name: str) -> Any:  # priority, may_admit: the ledger asks for them
        return getattr(self.policy, name)


class OneLinePolicy(ElasticPolicy):
    """The shipped policy, reading the waiting queue as one line (before issue 30)."""

    def plan(self, state: State) -> Plan:
        return super().plan(_WholeLine(state))  # type: ignore[arg-type]


def _size(rng: random.Random, shape: str) -> float:
    if shape == "lognormal":
        return rng.lognormvariate(0.0, 1.0)
    if shape == "pareto":
        return min(0.3 * rng.paretovariate(1.3), 60.0)
    return rng.choice((0.3, 0.3, 0.3, 6.0)) * rng.uniform(0.8, 1.2)  # bimodal


def trajectories(nodes: int, steps: int, shape: str, seed: int) -> dict[str, list[Step]]:
    rng = random.Random(f"{seed}-{shape}-{nodes}")
    out: dict[str, list[Step]] = {}
    for node in range(nodes):
        kind = f"cpu@n{node}"
        for t in range(PER_NODE):
            elastic = shape != "bimodal" and t % 4 == 0
            out[f"n{node}-t{t}"] = [
                Step(
                    demand={kind: Elastic(1, CORES) if elastic else 1},
                    seconds_at_1=_size(rng, shape) * (2.0 if elastic else 1.0),
                    gap=rng.uniform(0.0, 0.2),
                )
                for _ in range(steps)
            ]
    return out


def _horizon(result: SimulationResult) -> float:
    ends: dict[str, float] = {}
    for record in result.records:
        ends[record.trajectory] = max(ends.get(record.trajectory, 0.0), record.finished)
    return 0.8 * min(ends.values())


def _busy(results: list[SimulationResult], horizon: float) -> float:
    return sum(
        max(0.0, min(r.finished, horizon) - r.admitted) * max(r.units, 1.0)
        for result in results
        for r in result.records
    )


def _run(
    trajs: Mapping[str, list[Step]], capacity: dict[str, int], policy: ElasticPolicy
) -> tuple[SimulationResult, Timed]:
    """Replay with the collector off, as ``timeit`` times: a full collection walks the
    whole simulation's heap (its records and trajectories), and whichever decision it
    lands in was charged for it, so one arm's cost swung 2x between identical runs."""
    timed = Timed(policy)
    gc.collect()
    gc.disable()
    try:
        return simulate(trajs, capacity, policy=timed), timed  # type: ignore[arg-type]
    finally:
        gc.enable()


def measure(nodes: int, steps: int, shape: str, seed: int, *, one_line: bool) -> dict[str, Any]:
    trajs = trajectories(nodes, steps, shape, seed)
    capacity = {f"cpu@n{n}": CORES for n in range(nodes)}
    joint, joint_cost = _run(trajs, capacity, ElasticPolicy())
    line = _run(trajs, capacity, OneLinePolicy())[0] if one_line else None
    alone: list[SimulationResult] = []
    alone_seconds = 0.0
    alone_decisions = 0
    for node in range(nodes):
        kind = f"cpu@n{node}"
        mine = {name: t for name, t in trajs.items() if name.startswith(f"n{node}-")}
        result, cost = _run(mine, {kind: CORES}, ElasticPolicy())
        alone.append(result)
        alone_seconds += cost.seconds
        alone_decisions += cost.decisions
    # Read where every node is oversubscribed under tangram and per node, so the target
    # does not depend on whether the before-figure ran (the one-line arm is read there).
    horizon = min(_horizon(r) for r in (joint, *alone))
    whole = nodes * CORES * horizon
    busy = {
        "tangram": _busy([joint], horizon) / whole,
        "per_node": _busy(alone, horizon) / whole,
    }
    if line is not None:
        busy["one_line"] = _busy([line], horizon) / whole
    return {
        "nodes": nodes,
        "shape": shape,
        "seed": seed,
        "busy": {k: round(v, 4) for k, v in busy.items()},
        "tangram_vs_ideal": round(busy["tangram"] / busy["per_node"], 4),
        "one_line_vs_ideal": (
            round(busy["one_line"] / busy["per_node"], 4) if line is not None else None
        ),
        "us_per_decision": {
            "tangram": round(1e6 * joint_cost.seconds / max(joint_cost.decisions, 1), 1),
            "per_node": round(1e6 * alone_seconds / max(alone_decisions, 1), 1),
        },
    }


def _one_line_worst(points: list[dict[str, Any]], nodes: int) -> float | None:
    """The one-line arm's worst busy share over the ideal at ``nodes``; ``None`` where
    it did not run (``--quick`` at the most nodes)."""
    ratios = [p["one_line_vs_ideal"] for p in points if p["nodes"] == nodes]
    return None if None in ratios else min(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version, under a minute")
    args = parser.parse_args(argv)
    steps = 8 if args.quick else 30
    shapes = ("lognormal", "pareto") if args.quick else ("lognormal", "pareto", "bimodal")
    seeds = (0,) if args.quick else (0, 1, 2)
    points = []
    for nodes in NODES:
        for shape in shapes:
            for seed in seeds:
                one_line = not args.quick or nodes < NODES[-1]
                point = measure(nodes, steps, shape, seed, one_line=one_line)
                points.append(point)
                line = f"{point['busy']['one_line']:.3f}" if one_line else "not run (--quick)"
                print(
                    f"{nodes:4d} nodes {shape:9s} seed {seed}: busy cores tangram "
                    f"{point['busy']['tangram']:.3f}, one line {line}"
                    f", per node {point['busy']['per_node']:.3f}; us/decision "
                    f"{point['us_per_decision']['tangram']} vs "
                    f"{point['us_per_decision']['per_node']}"
                )
    targets: dict[str, Any] = {}
    for nodes in NODES:
        mine = [p for p in points if p["nodes"] == nodes]
        worst = min(p["tangram_vs_ideal"] for p in mine)
        targets[f"busy_vs_ideal_{nodes}"] = {
            "value": worst,
            "goal": f">= {GOAL_BUSY}",
            "met": worst >= GOAL_BUSY,
        }
    most = [p for p in points if p["nodes"] == NODES[-1]]
    cost = max(p["us_per_decision"]["tangram"] / p["us_per_decision"]["per_node"] for p in most)
    targets[f"decision_cost_vs_per_node_{NODES[-1]}"] = {
        "value": round(cost, 3),
        "goal": f"<= {GOAL_COST}",
        "met": cost <= GOAL_COST,
    }
    figures = {
        "quick": args.quick,
        "one_line_vs_ideal_worst": {str(n): _one_line_worst(points, n) for n in NODES},
        "points": points,
    }
    print(json.dumps({"bench": "node_kinds", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
