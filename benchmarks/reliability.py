"""Reliability: chaos actions per run, event-loop lag under load, memory per 100k actions.

What it measures
    - chaos: actions run through every way an action can end (completed, failed,
      interrupted, cancelled at any stage, wait timeouts, capacity cuts) on asyncio with
      zero-length bodies under :class:`tangram.testing.InvariantChecker`; reports the
      actions, their rate, invariant checks made and units still held at the end;
    - load: 10k concurrent trajectories of sleep-bodied actions (rigid, elastic,
      resizable) on the live runtime; reports the time inside each scheduling decision
      (max, p99, and how many actions were running at the slowest one) as CPU time of
      the loop's thread, which is the scheduler's own hold on the loop (the wall time,
      which also counts slices the OS gave other processes meanwhile, beside it), and
      the loop's lag (a 1 ms ticker's lateness,
      max and p99) beside the lag of the same trajectories through a bare
      ``anyio.CapacityLimiter`` in the same run: 10k tasks waking and sleeping make lag
      of their own, and the difference is what tangram adds;
    - soak: traced memory (``tracemalloc``) growth per 100k completed actions after a
      warm-up that fills every bounded window.

Why
    Tangram decides on the rollout's own event loop, so its decisions must never hold the
    loop for long, and a rollout service runs for days, so nothing may grow per action.

How
    The workloads are the test suite's own (``tests/test_chaos.py``, ``tests/test_load.py``,
    ``tests/test_soak.py``), imported from there so the figures describe what CI checks.
    ``--quick`` shrinks every count to run in under a minute.

The last line of stdout is one JSON object (``"bench": "reliability"``) with the figures and
whether each target was met. The exit status is 0 whether or not targets are met.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import tracemalloc
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_chaos
import test_load
import test_soak

MAX_DECISION_MS = 5.0
MAX_GROWTH_KIB = 1024.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, under a minute")
    args = parser.parse_args(argv)
    logging.getLogger("tangram").setLevel(logging.ERROR)  # capacity-cut warnings

    chaos_actions = 20_000 if args.quick else 100_000
    trajectories = 2_000 if args.quick else 10_000
    warmup = 2_500
    measured = 10_000 if args.quick else 10 * warmup

    started = time.perf_counter()
    tally = anyio.run(
        functools.partial(
            test_chaos.chaos,
            chaos_actions,
            workers=32,
            seed=7,
            scale=0.0,
            rate=test_chaos.REAL_RATE,
        ),
        backend="asyncio",
    )
    chaos_seconds = time.perf_counter() - started
    print(
        f"chaos: {chaos_actions} actions in {chaos_seconds:.1f} s "
        f"({chaos_actions / chaos_seconds:.0f}/s): completed {tally.completed}, failed "
        f"{tally.failed}, interrupted {tally.interrupted}, cancelled in body "
        f"{tally.body_cancelled}, never started {tally.never_started}, wait timeouts "
        f"{tally.wait_timeouts}, rejected {tally.rejected}; {tally.left_units:g} units left"
    )

    baseline = anyio.run(test_load.run_baseline, trajectories, 2, backend="asyncio")
    load = anyio.run(test_load.run_load, trajectories, 2, backend="asyncio")
    print(
        f"load baseline (anyio.CapacityLimiter): loop lag max "
        f"{baseline['loop_lag_max_ms']:.1f} ms, p99 {baseline['loop_lag_p99_ms']:.1f} ms"
    )
    print(
        f"load: {trajectories} trajectories, {load['actions']:.0f} actions in "
        f"{load['wall_seconds']:.1f} s; loop lag max {load['loop_lag_max_ms']:.1f} ms, "
        f"p99 {load['loop_lag_p99_ms']:.1f} ms; decision mean {load['decision_mean_ms']:.3f} "
        f"ms, p99 {load['decision_p99_ms']:.2f} ms, max {load['decision_max_ms']:.2f} ms "
        f"with {load['running_at_max_decision']:.0f} running (CPU time of the loop's thread; "
        f"by wall time, other processes' slices included, max "
        f"{load['decision_max_wall_ms']:.2f} ms)"
    )

    try:
        growths = anyio.run(test_soak.measure_growth, warmup, measured, backend="asyncio")
    finally:
        tracemalloc.stop()
    growth = max(growths)
    print(f"soak: {warmup} + {measured} actions; memory growth {growth:.1f} KiB per 100k")

    figures = {
        "chaos_actions": chaos_actions,
        "chaos_seconds": round(chaos_seconds, 2),
        "chaos_actions_per_second": round(chaos_actions / chaos_seconds),
        "load_trajectories": trajectories,
        "load_actions": int(load["actions"]),
        "max_loop_lag_ms": round(load["loop_lag_max_ms"], 2),
        "p99_loop_lag_ms": round(load["loop_lag_p99_ms"], 2),
        "baseline_max_loop_lag_ms": round(baseline["loop_lag_max_ms"], 2),
        "baseline_p99_loop_lag_ms": round(baseline["loop_lag_p99_ms"], 2),
        "decision_mean_ms": round(load["decision_mean_ms"], 4),
        "decision_p99_ms": round(load["decision_p99_ms"], 3),
        "max_decision_ms": round(load["decision_max_ms"], 3),
        "max_decision_wall_ms": round(load["decision_max_wall_ms"], 3),
        "running_at_max_decision": int(load["running_at_max_decision"]),
        "memory_growth_kib_per_100k": round(growth, 1),
        "quick": args.quick,
    }
    hold = figures["max_decision_ms"]
    targets = {
        # "Never hold the loop for more than a few milliseconds": the longest decision.
        "max_decision_ms": {
            "value": hold,
            "goal": f"<= {MAX_DECISION_MS:g}",
            "met": hold <= MAX_DECISION_MS,
        },
        "memory_growth_kib_per_100k": {
            "value": figures["memory_growth_kib_per_100k"],
            "goal": f"<= {MAX_GROWTH_KIB:g}",
            "met": growth <= MAX_GROWTH_KIB,
        },
        # What the runtime still held once every chaos worker had ended.
        "leaked_units": {
            "value": tally.left_units,
            "goal": "== 0",
            "met": tally.left_units == 0,
        },
    }
    print(json.dumps({"bench": "reliability", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
