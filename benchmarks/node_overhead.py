"""The adapters' shared scheduler without Ray (one process per job and node, on a Unix
socket) against a scheduler per worker process, through the adapters' own session.

What it measures
    Worker processes started as a launcher without Ray starts them (torchrun, a shell
    loop): plain ``python`` processes sharing nothing but the config file and
    ``$TANGRAM_JOB``. Each reaches its scheduler through
    ``tangram._frameworks._session.session(config)``, the call every verl tool and
    OpenRLHF executor makes; with ``mode = "shared"`` that is the job's scheduler process
    on this node (``tangram/_shared/_node.py``), with ``mode = "local"`` a runtime of its own.

    - *latency*: 16 workers each make one call per ``THINK`` (0.5 s), staggered: the
      ``session`` + ``tangram.acquire(cpu=1)`` block of a tool call, no sandbox, on a
      capacity that never binds, in windows the two modes take turns at. The median time
      of that block per call, shared against local in the same run, as extra milliseconds.
      Target: the shared scheduler adds <= 5 ms per call at 16 worker processes, as on
      Ray (``ray_overhead.py``), under 3 % of a 200 ms tool call.
    - *rollout*: ``N`` workers run ``M`` trajectories each, alternating a think sleep with
      a one-core call in the trajectory's sandbox (the docs' ``[sandbox]``: tangram's
      local backend; one sandbox per trajectory, as the docs' tool keeps) that does fixed
      work and prints when it ran and on which cores. Both arms keep the same number of
      sandboxes ready (the docs' ``warm = 2`` per worker: ``warm`` counts per node in
      shared mode, per process in local mode). Wall time of the whole
      rollout per mode (interleaved runs, best of each), the most cores held at once and
      the pairs of calls that ran at once on one core. Targets: shared finishes no later
      than per-process, holds no more cores than the host has, and never puts two calls
      on one core. Per-process schedulers each lend every core of the host. For scale,
      each mode's wall time over the bound (the calls' one-core work spread over every
      core with no gap): this work is single-threaded, so oversubscribing costs
      per-process mode nothing, and both come near the bound; the wall ratio is parity
      within the runs' noise (a few per cent) rather than a gain.

Why
    Issue 18: the adapters' default shares one scheduler among the processes of a job,
    and outside Ray that scheduler is a process of the job, so every call pays a round
    trip on a Unix socket instead of a Ray call. This is the price and what it buys.

How
    ``--quick``: 2 windows per mode of 3 s, a rollout of 4 workers x 2 trajectories x 2
    calls, 2 runs per mode. Full: 3 windows of 6 s, 4 x 4 x 3, 3 runs. The job's scheduler
    process is started by the workers' first calls (excluded, as each mode's warm-up);
    the driver starts each window or run on every worker at once, when all reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from _cores import PROBE as PROBE_TEMPLATE
from _cores import core_targets, occupancy, probes

MODES = ("shared", "local")
WORKERS = 16
THINK = 0.5
WINDOW = {True: 3.0, False: 6.0}
ROUNDS = {True: 2, False: 3}
ROLLOUT = {True: (4, 2, 2), False: (4, 4, 3)}  # workers, trajectories each, calls each
ROLLOUT_THINK = 0.1
ROLLOUT_RUNS = {True: 2, False: 3}  # per mode, interleaved; quick, full
WORK = 2_000_000  # loop iterations per call: about 0.1-0.2 s of one core here
GOAL_MS = 5.0
PROBE = PROBE_TEMPLATE.format(work=WORK)

# One worker process. argv: the plan as JSON. It warms each mode up, says READY, then
# follows the plan's windows (latency) or runs (rollout), and prints its report as JSON.
WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import anyio, anyio.lowlevel
    import tangram
    from tangram._frameworks._session import session

    plan = json.loads(sys.argv[1])
    PROBE = plan["probe"]

    async def block(config):
        async with session(config), tangram.acquire(cpu=1, kind="bench"):
            await anyio.lowlevel.checkpoint()

    async def sandbox_call(config, name):
        async with session(config) as resources:
            async with resources.sandbox_pool().sandbox(name) as sbx:
                result = await sbx.run(code=PROBE, cpu=1)
        return result.stdout.decode()

    async def trajectory(config, name, calls, outputs):
        # One sandbox for the trajectory's life (the docs' tool: scope = trajectory).
        async with session(config) as resources:
            async with resources.sandbox_pool().sandbox(name) as sbx:
                for _ in range(calls):
                    await anyio.sleep(plan["think"])
                    result = await sbx.run(code=PROBE, cpu=1)
                    outputs.append(result.stdout.decode())

    async def main():
        for mode, config in plan["configs"].items():
            if plan["arm"] == "latency":
                await block(config)
            else:
                await sandbox_call(config, f"warm-{mode}-{os.getpid()}")
        print("READY", flush=True)
        for step, mode in enumerate(plan["modes"]):
            # The driver's go, with the step's start time, once every worker reported.
            t0 = float(await anyio.to_thread.run_sync(sys.stdin.readline))
            config = plan["configs"][mode]
            if plan["arm"] == "latency":
                spans = []
                await anyio.sleep(max(0.0, t0 + plan["offset"] - time.time()))
                while time.time() < t0 + plan["window"]:
                    began = time.perf_counter()
                    await block(config)
                    spans.append(time.perf_counter() - began)
                    await anyio.sleep(plan["think"])
                print(json.dumps({"spans": spans}), flush=True)
            else:
                outputs = []
                await anyio.sleep(max(0.0, t0 - time.time()))
                async with anyio.create_task_group() as tg:
                    for i in range(plan["trajectories"]):
                        name = f"{os.getpid()}-{step}-{i}"
                        tg.start_soon(trajectory, config, name, plan["calls"], outputs)
                print(json.dumps({"end": time.time(), "outputs": outputs}), flush=True)

    asyncio.run(main())
    """
)


def _configs(folder: Path, workers: int) -> dict[str, dict[str, str]]:
    bodies = {
        "latency": "[capacity]\ncpu = 64\n",  # a capacity that never binds
        "rollout": '[sandbox]\nbackend = "local"\nwarm = {warm}\ntimeout = 30\n',  # the docs'
    }
    paths: dict[str, dict[str, str]] = {}
    for arm, body in bodies.items():
        paths[arm] = {}
        for mode in MODES:
            # `warm` counts per node in shared mode and per process in local mode: both
            # arms keep the docs' 2 per rollout worker ready, 2 x N in all.
            warm = 2 * workers if mode == "shared" else 2
            path = folder / f"{arm}-{mode}.toml"
            path.write_text(f'mode = "{mode}"\n' + body.format(warm=warm))
            paths[arm][mode] = str(path)
    return paths


def _run(
    plans: list[dict[str, Any]], env: dict[str, str], steps: int, budget: float
) -> list[list[dict[str, Any]]]:
    """Start a worker per plan, wait until each is warm, then start each step on all of
    them together: a step's reports per worker, for every step."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(plan)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for plan in plans
    ]
    deadline = time.monotonic() + budget
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "READY":
                raise RuntimeError(f"a worker did not start: {line!r}")
        reports = []
        for _ in range(steps):
            start = time.time() + 0.3
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{start}\n")
                proc.stdin.flush()
            step = []
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if not line or time.monotonic() > deadline:
                    raise RuntimeError("a worker ended or ran past the budget")
                step.append(json.loads(line) | {"start": start})
            reports.append(step)
        return reports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version (under a minute)")
    args = parser.parse_args(argv)
    quick = args.quick
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(
        f"node_overhead: python {platform.python_version()}, {cores} cores, load average "
        f"{load:.1f} at start",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tangram-node-overhead-") as folder:
        configs = _configs(Path(folder), ROLLOUT[quick][0])
        env = dict(os.environ, TANGRAM_JOB=f"node-overhead-{os.getpid()}")
        env["TANGRAM_RUN_DIR"] = str(Path(folder) / "run")
        window, rounds = WINDOW[quick], ROUNDS[quick]
        order = [m for r in range(rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
        latency_plans = [
            {
                "arm": "latency",
                "configs": configs["latency"],
                "modes": order,
                "window": window,
                "offset": THINK * i / WORKERS,
                "think": THINK,
                "probe": PROBE,
            }
            for i in range(WORKERS)
        ]
        steps = _run(latency_plans, env, len(order), budget=120 + len(order) * (window + 2))
        spans: dict[str, list[float]] = {m: [] for m in MODES}
        for mode, step in zip(order, steps, strict=True):
            spans[mode].extend(s for report in step for s in report["spans"])
        for taken in spans.values():
            taken.sort()
        median = {m: statistics.median(spans[m]) * 1e3 for m in MODES}
        p90 = {m: spans[m][int(0.9 * (len(spans[m]) - 1))] * 1e3 for m in MODES}
        extra = median["shared"] - median["local"]
        print(
            f"  latency, {WORKERS} workers: "
            + ", ".join(f"{m} {median[m]:.2f} ms/call" for m in MODES),
            file=sys.stderr,
            flush=True,
        )
        n, trajectories, calls = ROLLOUT[quick]
        runs_order = [m for _ in range(ROLLOUT_RUNS[quick]) for m in MODES]
        rollout_plans = [
            {
                "arm": "rollout",
                "configs": configs["rollout"],
                "modes": runs_order,
                "trajectories": trajectories,
                "calls": calls,
                "think": ROLLOUT_THINK,
                "probe": PROBE,
            }
            for _ in range(n)
        ]
        steps = _run(rollout_plans, env, len(runs_order), budget=120 + 60 * len(runs_order))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    alone: list[float] = []  # a call's span on a core of its own: its one-core work
    for mode, step in zip(runs_order, steps, strict=True):
        found, _ = probes([o for report in step for o in report["outputs"]])
        held, shared_cores = occupancy(found)
        if mode == "shared":
            alone += [end - start for start, end, _ in found]
        wall = max(r["end"] for r in step) - step[0]["start"]
        runs[mode].append({"wall_s": wall, "peak_cores": held, "core_overlaps": shared_cores})
        print(
            f"  rollout {mode:>6}: {wall:.2f} s, peak {held} cores at once, {shared_cores} "
            "core overlaps",
            file=sys.stderr,
            flush=True,
        )
    best = {m: min(r["wall_s"] for r in runs[m]) for m in MODES}
    wall_ratio = best["shared"] / best["local"]
    # The reference: the rollout's work spread over every core with no gap, after the
    # first think. Per-process mode oversubscribes the cores, which for this
    # single-threaded work costs nothing, so both modes can only come near it.
    bound = ROLLOUT_THINK + n * trajectories * calls * statistics.median(alone) / cores
    peak_cores = {m: max(r["peak_cores"] for r in runs[m]) for m in MODES}
    overlaps = {m: max(r["core_overlaps"] for r in runs[m]) for m in MODES}
    print(
        f"shared scheduler process vs a scheduler per process, {WORKERS} workers: "
        f"{median['shared']:.2f} vs {median['local']:.2f} ms per call, {extra:.2f} ms extra "
        f"(goal <= {GOAL_MS:g}); rollout of {n} workers x {trajectories} trajectories x "
        f"{calls} calls on {cores} cores: shared {best['shared']:.2f} s, per-process "
        f"{best['local']:.2f} s (ratio {wall_ratio:.2f}, goal <= 1), peak cores shared "
        f"{peak_cores['shared']} (goal <= {cores}) vs per-process {peak_cores['local']}, core "
        f"overlaps shared {overlaps['shared']} (goal 0) vs per-process {overlaps['local']}"
    )
    figures = {
        "quick": quick,
        "cores": cores,
        "load_average_at_start": round(load, 2),
        "workers": WORKERS,
        "think_s": THINK,
        "window_s": window,
        "windows_per_mode": rounds,
        "ms_per_call": {m: round(median[m], 3) for m in MODES},
        "p90_ms_per_call": {m: round(p90[m], 3) for m in MODES},
        "calls": {m: len(spans[m]) for m in MODES},
        "shared_extra_ms_per_call": round(extra, 3),
        "shared_over_local_per_call": round(median["shared"] / median["local"], 2),
        "rollout_workers": n,
        "rollout_trajectories_per_worker": trajectories,
        "rollout_calls_per_trajectory": calls,
        "rollout_wall_s_runs": {m: [round(r["wall_s"], 3) for r in runs[m]] for m in MODES},
        "rollout_wall_s_best": {m: round(best[m], 3) for m in MODES},
        "rollout_wall_ratio": round(wall_ratio, 3),
        "rollout_bound_s": round(bound, 3),
        "rollout_over_bound": {m: round(best[m] / bound, 3) for m in MODES},
        "rollout_peak_cores": peak_cores,
        "rollout_core_overlaps": overlaps,
    }
    targets = {
        "shared_extra_ms_per_call_16": {
            "value": round(extra, 3),
            "goal": f"<= {GOAL_MS:g}",
            "met": extra <= GOAL_MS,
        },
        "rollout_wall_ratio": {
            "value": round(wall_ratio, 3),
            "goal": "<= 1",
            "met": wall_ratio <= 1.0,
        },
    }
    targets.update(core_targets(peak_cores["shared"], overlaps["shared"], cores))
    print(json.dumps({"bench": "node_overhead", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
