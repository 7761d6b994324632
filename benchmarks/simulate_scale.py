"""Simulator scale: how the cost of ``tangram simulate`` grows with the batch size.

What it measures
    Generated coding traces (``tangram trace generate --workload coding``, 20 actions per
    trajectory, one core per trajectory, seed 0) at growing batch sizes, each replayed
    under tangram, static, fixed-dop-4 and the bound in the same process. For each batch:
    CPU seconds per policy, actions simulated per CPU second, and the average-ACT ratios
    static / tangram and tangram / bound. The growth of tangram's cost is the log-log slope
    of its seconds against the batch between the smallest and the largest batch.

Why
    The issue asks that 2048 trajectories x 20 actions simulate in under a minute on one
    core, so users can size clusters at the paper's scale on a laptop; and that tangram's
    average ACT stays within 1.3x of the bound on the coding traces at batch 256, 1280 and
    1536. The ratio against static, measured on the same trace in the same process, is the
    paper's headline comparison.

How
    Each policy runs once per batch; ``time.process_time`` is the cost (the simulator
    never waits). ``--quick`` runs batches 64, 128 and 256 (under a minute on a 2-core
    machine) and extrapolates the 2048 cost along the measured slope, saying so in the
    JSON; the full run measures 256, 512, 1024, 1280, 1536 and 2048. ``--plot PATH``
    writes the ratio of each baseline's average ACT to tangram's against the batch.

The last line of stdout is one JSON object (``"bench": "simulate_scale"``) with every
figure and whether each target was met. The exit status is 0 whether or not targets are
met.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from tangram._sim._baselines import run_policy
from tangram._sim._generate import GenerateConfig, generate_lines
from tangram._sim._trace import read_trace
from tangram._tools._report import plot_sweep

POLICIES = ("tangram", "static", "fixed-dop-4", "bound")
QUICK = (64, 128, 256)
FULL = (256, 512, 1024, 1280, 1536, 2048)
BOUND_BATCHES = (256, 1280, 1536)
REFERENCES = ("ref-srpt", "ref-fcfs")


def measure(batch: int) -> dict[str, Any]:
    trace = read_trace(generate_lines(GenerateConfig(workload="coding", batch=batch, seed=0)))
    seconds: dict[str, float] = {}
    avg: dict[str, float] = {}
    # Where tangram's distance to the bound is a target, the references of the policy
    # family (issue 28) say how far a simple, independent schedule gets on the same trace.
    names = POLICIES + (REFERENCES if batch in BOUND_BATCHES else ())
    for name in names:
        started = time.process_time()
        result = run_policy(name, trace)
        seconds[name] = round(time.process_time() - started, 3)
        avg[name] = result.avg_act
    return {
        "batch": batch,
        "actions": trace.actions,
        "seconds": seconds,
        "actions_per_second": {
            name: round(trace.actions / max(s, 1e-9)) for name, s in seconds.items()
        },
        "avg_act": {name: round(v, 4) for name, v in avg.items()},
        "ratio_to_tangram": {
            name: round(avg[name] / avg["tangram"], 3) for name in POLICIES if name != "tangram"
        },
        "tangram_over_bound": round(avg["tangram"] / avg["bound"], 3),
        "references_over_bound": {
            name: round(avg[name] / avg["bound"], 3) for name in REFERENCES if name in avg
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches 64-256, under a minute")
    parser.add_argument("--batches", type=str, help="comma-separated batch sizes")
    parser.add_argument("--plot", type=Path, help="PNG of ACT ratios against the batch")
    args = parser.parse_args(argv)
    batches = (
        tuple(int(b) for b in args.batches.split(","))
        if args.batches
        else (QUICK if args.quick else FULL)
    )
    points = []
    for batch in batches:
        point = measure(batch)
        points.append(point)
        shown = ", ".join(f"{k} {v:.2f}x" for k, v in point["ratio_to_tangram"].items())
        print(
            f"batch {batch:5d}: {point['actions']:6d} actions, tangram "
            f"{point['seconds']['tangram']:.2f} s ({point['actions_per_second']['tangram']}/s); "
            f"avg ACT over tangram: {shown}; tangram / bound "
            f"{point['tangram_over_bound']:.2f}x"
            + "".join(f", {k} / bound {v:.2f}x" for k, v in point["references_over_bound"].items())
        )
    first, last = points[0], points[-1]
    slope = (
        math.log(max(last["seconds"]["tangram"], 1e-6) / max(first["seconds"]["tangram"], 1e-6))
        / math.log(last["batch"] / first["batch"])
        if last["batch"] > first["batch"]
        else math.nan
    )
    measured_2048 = next((p["seconds"]["tangram"] for p in points if p["batch"] == 2048), None)
    if measured_2048 is None and math.isfinite(slope):
        at_2048 = last["seconds"]["tangram"] * (2048 / last["batch"]) ** slope
        extrapolated = True
    else:
        at_2048 = measured_2048 if measured_2048 is not None else math.nan
        extrapolated = False
    figures: dict[str, Any] = {
        "quick": args.quick,
        "points": points,
        "tangram_cost_slope": round(slope, 3),
        "tangram_seconds_2048x20": round(at_2048, 2),
        "extrapolated_2048": extrapolated,
    }
    targets: dict[str, Any] = {
        "seconds_2048x20": {
            "value": round(at_2048, 2),
            "goal": "< 60",
            "met": bool(at_2048 < 60),
            "extrapolated": extrapolated,
        }
    }
    for point in points:
        if point["batch"] in BOUND_BATCHES:
            value = point["tangram_over_bound"]
            targets[f"tangram_over_bound_{point['batch']}"] = {
                "value": value,
                "goal": "<= 1.3",
                "met": value <= 1.3,
                "best_reference": min(point["references_over_bound"].values()),
            }
    if args.plot is not None and len(points) > 1:
        ratios = {
            name: [p["ratio_to_tangram"][name] for p in points]
            for name in POLICIES
            if name != "tangram"
        }
        plot_sweep("batch", [p["batch"] for p in points], ratios, "tangram", "coding", args.plot)
    print(json.dumps({"bench": "simulate_scale", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
