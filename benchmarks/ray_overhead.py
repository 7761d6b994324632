"""Per-action overhead of the shared scheduler on Ray, against tangram.acquire in-process.

What it measures
    Acquire+release cycles of ``cpu=1`` against a capacity that never binds (64 units),
    with an ``anyio.lowlevel.checkpoint()`` as the action, at 1, 4 and 16 worker
    processes (Ray actors on a local cluster), each connected to one scheduler actor
    through ``tangram.ray.connect``. Two loads per size:

    - *latency*: one task per worker, cycling back to back. The cycle time is what one
      action pays for the shared scheduler: the acquire's round trip to the actor (a
      release rides on the next call). Compared with the same loop in-process
      (``tangram.Runtime`` in the driver), as a ratio and as extra milliseconds.
    - *throughput*: 16 tasks per worker. Actions per second over all workers, the
      scheduler's decisions per second (``Stats.decisions``) and actor calls per action,
      which shows the batching: a proxy keeps one send in flight and everything its
      tasks ask meanwhile goes in the next.

Why
    verl and OpenRLHF run many rollout processes; limits only hold globally if they share
    one scheduler, and every action then pays a message to it. A tool call, a reward or
    an API request lasts 50 ms to minutes, so a few milliseconds per action is noise,
    while a scheduler that saturates at a few hundred actions per second would throttle
    a cluster's rollouts. Targets, for this 2-core machine where the 16 workers, the
    actor, the raylet and the GCS share two cores (loose for a real cluster):

    - extra latency per action <= 10 ms with one worker: one round trip to the actor,
      5 % of a 200 ms tool call;
    - <= 100 ms with 16 single-task workers: here they queue for the two cores, so this
      is CPU contention more than messaging (under 10 % of a one-second tool call);
    - <= 2 ms of wall time per action at 16 workers x 16 tasks, i.e. the shared scheduler
      sustains at least 500 actions per second (16 processes x 32 trajectories each
      starting about one action a second);
    - <= 0.5 actor calls per action there: batching at work (unbatched, every action
      costs two).

How
    One local Ray cluster (``num_cpus=4``, no dashboard) and 16 worker actors are
    started first (excluded). For each size and load the workers connect, wait for a
    common start time, cycle for ``--seconds`` and report their counts; the in-process
    arm runs the same loop with the same number of tasks in the driver. Wall-clock rates.

The adapters' path (issue 18: ``mode = "shared"``, the adapters' default)
    What the verl and OpenRLHF adapters pay and gain with one scheduler per Ray job instead
    of one per worker process (``mode = "local"``), through their own code:

    - *adapter latency*: the 16 workers call as a tool call does, through
      ``tangram._frameworks._session.session(config)`` then ``tangram.acquire(cpu=1)`` and
      release (no sandbox), one call per ``ADAPTER_THINK`` (0.5 s) each, the workers
      staggered, in windows the two modes take turns at (2 each under ``--quick``, 3
      in a full run). Paced, not back to back: 16 processes cycling back to back only queue
      for the two cores (the latency rows above show that), and 32 calls/s is already
      three times the 200 ms tool calls two cores can run. The median time of that block
      per call (from entering ``session`` to leaving ``acquire``), shared config against
      local config in the same run, as extra milliseconds and a ratio (p90 reported
      too). Target: the shared scheduler adds <= 5 ms per call at 16 worker processes,
      under 3 % of a 200 ms tool call.
    - *rollout*: N verl agent-loop-like workers (Ray actors) build the docs' sandbox tool
      (docs/examples/verl_tools.yaml's ``SandboxTool`` entry, ``cpu: 1``, ``scope:
      trajectory``) with verl's own ``initialize_tools_from_config``, and each runs M
      trajectories that alternate a think sleep with a tool call, made as verl's
      ``ToolAgentLoop._call_tool`` makes it (``create``, ``execute`` with the
      trajectory's ``agent_data``, ``release``): 4 workers x 4 trajectories x 3 calls,
      2 x 2 x 2 under ``--quick``; the sandboxes as the docs' tangram.toml has them
      (``backend = "local"``, ``warm = 2``: per node shared, per process local). The
      call runs a fixed amount of pure Python work (a loop, not a timed spin, so
      contention shows as time) in a local sandbox and prints its start, end and
      ``Cpus_allowed_list``. Both modes have the same cores, the host's: shared gives
      the job one ledger of them (the node's host agent picks core ids); per-process
      gives each worker its own pool that believes it owns them all. Figures: wall time
      from the common start to the last trajectory's end in each mode (each arm runs
      twice, interleaved shared/local/shared/local; the better, i.e. shorter, of the two
      counts, both are reported), their ratio (target shared / per-process <= 1: sharing
      must not cost rollout time), and from the sandboxes' own records the peak cores
      held at once (the largest sum of allowed cores over commands running at one
      instant; target shared <= host cores) and the overlaps (pairs of commands running
      at once on a common core; target 0 in shared mode). Per-process mode is expected
      to oversubscribe: that is the bug the shared mode fixes. On a host other jobs load
      too, per-process mode's extra concurrent commands also take a larger share of the
      contended cores from those jobs, which favours it in wall time:
      ``load_average_at_rollout`` says how loaded the host was. Each call's mean wall,
      queued and running seconds (``rollout_call_s_mean`` and so on, the last two from
      the tool's own metrics) say where a mode's time went.

    Why: the gain the paper claims needs one scheduler to see every action of the job;
    this checks that the adapters' default gets it without slowing a tool call or a
    rollout. How: all in the same job and cluster as above. The job's shared scheduler
    is created by the first worker that asks, with the capacity its config states and
    that every later worker must state alike, so the latency arm (``[capacity] cpu``)
    runs before the rollout arm (sandbox cores only, ``cpu@<node>``). Each mode's
    scheduler and pools are started by a warm-up call per worker before its timed run
    (excluded). verl's tool modules are imported in the rollout workers while the
    cluster starts (importing verl costs about 13 CPU-seconds per process here).

The last line of stdout is one JSON object (``"bench": "ray_overhead"``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
from _cores import PROBE, core_targets, occupancy, probes

import tangram

try:
    import ray
except ImportError:  # pragma: no cover - the benchmark needs the extra
    print("ray_overhead: needs Ray (pip install 'tangram[ray]')", file=sys.stderr)
    raise

import tangram.ray as tray
from tangram._frameworks._session import session

SIZES = (1, 4, 16)
NAME = "tangram-bench"
CAPACITY = 64
THROUGHPUT_TASKS = 16
LATENCY_GOAL_MS = {1: 10.0, 16: 100.0}
AMORTIZED_GOAL_MS = 2.0
CALLS_GOAL = 0.5

# Seconds between one worker's calls in the adapter-latency arm: 16 workers then make 32
# calls/s, three times the 200 ms tool calls the host's two cores can run in a second.
ADAPTER_THINK = 0.5
ADAPTER_SECONDS = 2.0  # a window under --quick (else --seconds): 64 calls or so
ADAPTER_ROUNDS = {True: 2, False: 3}  # windows per mode, the modes alternating; quick, full
ADAPTER_GOAL_MS = 5.0
MODES = ("shared", "local")
# Rollout: (workers, trajectories per worker, tool calls per trajectory); quick, then full.
# Quick keeps to two workers: each imports verl (about 13 CPU-seconds here).
ROLLOUT = {True: (2, 2, 2), False: (4, 4, 3)}
ROLLOUT_THINK = 0.1  # seconds of "generation" before each tool call
ROLLOUT_RUNS = 2  # per mode, interleaved
WORK = 2_000_000  # loop iterations per tool call: about 0.1-0.2 s of one core here
CALL_SPLIT = ("call_s", "queue_s", "exec_s")  # a tool call's wall, queued and running time
TOOLS_YAML = Path(__file__).resolve().parents[1] / "docs" / "examples" / "verl_tools.yaml"


async def _cycle(deadline: float, counts: list[int]) -> None:
    while time.time() < deadline:
        async with tangram.acquire(cpu=1, kind="bench"):
            await anyio.lowlevel.checkpoint()
        counts[0] += 1


async def _loop(tasks: int, start: float, seconds: float) -> int:
    counts = [0]
    await anyio.sleep(max(0.0, start - time.time()))
    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(_cycle, start + seconds, counts)
    return counts[0]


@ray.remote(num_cpus=0)
class Worker:
    """One rollout process: a proxy and ``tasks`` tasks cycling through the scheduler."""

    async def ready(self) -> int:
        return os.getpid()

    async def run(self, name: str, tasks: int, start: float, seconds: float) -> dict[str, int]:
        async with tray.connect(name=name, create=False) as remote:
            actions = await _loop(tasks, start, seconds)
            return {"actions": actions, "calls": remote.calls}

    async def adapter_ready(self, config: str) -> None:
        """Start this process's session for ``config`` (its scheduler or the job's proxy)."""
        async with session(config), tangram.acquire(cpu=1, kind="bench"):
            await anyio.lowlevel.checkpoint()

    async def adapter_calls(
        self, config: str, start: float, offset: float, seconds: float
    ) -> list[float]:
        """Seconds per call of a tool call's block, one call per ``ADAPTER_THINK``.

        ``offset`` staggers the workers' calls: released at one instant, all 16 would
        queue behind each other, which a rollout's independent trajectories do not do.
        """
        await anyio.sleep(max(0.0, start + offset - time.time()))
        spans = []
        while time.time() < start + seconds:
            began = time.perf_counter()
            async with session(config), tangram.acquire(cpu=1, kind="bench"):
                await anyio.lowlevel.checkpoint()
            spans.append(time.perf_counter() - began)
            await anyio.sleep(ADAPTER_THINK)
        return spans

    async def load_verl(self) -> None:
        """Import verl's tool modules (the costly part), while the cluster starts."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import tangram_verl.tools  # noqa: F401
            import verl.tools.tool_registry  # noqa: F401

    async def load_tools(self, yamls: dict[str, str]) -> None:
        """Build the tools per mode as verl's agent-loop worker does when it starts.

        After the latency arm: building a shared-mode tool reaches the job's scheduler,
        creating it with this config's capacity if nothing made it yet.
        """
        from verl.tools.tool_registry import initialize_tools_from_config

        self.tools = {mode: initialize_tools_from_config(path)[0] for mode, path in yamls.items()}

    async def rollout(
        self, mode: str, start: float, trajectories: int, turns: int, think: float
    ) -> dict[str, Any]:
        """``trajectories`` concurrent trajectories from ``start``; when the last ended."""
        outputs: list[dict[str, Any]] = []
        await anyio.sleep(max(0.0, start - time.time()))
        async with anyio.create_task_group() as tg:
            for _ in range(trajectories):
                tg.start_soon(_trajectory, self.tools[mode], turns, think, outputs)
        return {"end": time.time(), "outputs": outputs}


class AgentData:
    """verl's trajectory state, as much as the sandbox tool reads (it keys a sandbox on it)."""

    def __init__(self) -> None:
        self.request_id = uuid.uuid4().hex


async def _trajectory(tool: Any, turns: int, think: float, outputs: list[dict[str, Any]]) -> None:
    """One trajectory: think, then a tool call as ``ToolAgentLoop._call_tool`` makes it.

    Each call's output, its wall time and the tool's own metrics (time queued for cores,
    time running) are kept: together they say where a slower mode lost its time.
    """
    agent_data = AgentData()
    for _ in range(turns):
        await anyio.sleep(think)
        began = time.perf_counter()
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, _, metrics = await tool.execute(
                instance_id, {"code": PROBE.format(work=WORK)}, agent_data=agent_data
            )
        finally:
            await tool.release(instance_id)
        outputs.append(
            {
                "text": str(response.text),
                "call_s": time.perf_counter() - began,
                "queue_s": metrics.get("queue_seconds") or 0.0,
                "exec_s": metrics.get("exec_seconds") or 0.0,
            }
        )


async def _local(tasks: int, seconds: float) -> float:
    async with tangram.Runtime(capacity={"cpu": CAPACITY}):
        actions = await _loop(tasks, time.time(), seconds)
    return actions / seconds


async def _remote(
    remote: tray.RemoteRuntime, workers: list[Any], tasks: int, seconds: float
) -> dict[str, float]:
    before = await remote.stats()
    start = time.time() + 0.5 + 0.05 * len(workers)  # all connected by then
    refs = [w.run.remote(NAME, tasks, start, seconds) for w in workers]
    reports = [await ref for ref in refs]
    after = await remote.stats()
    actions = sum(r["actions"] for r in reports)
    calls = sum(r["calls"] for r in reports)
    return {
        "actions_per_s": actions / seconds,
        "decisions_per_s": (after.decisions - before.decisions) / seconds,
        "calls_per_action": calls / max(actions, 1),
        "actions": actions,
    }


async def _bench(workers: list[Any], seconds: float) -> list[dict[str, Any]]:
    # One scheduler actor for every arm: each new actor is a new process to start.
    async with tray.connect(name=NAME, capacity={"cpu": CAPACITY}) as remote:
        return await _arms(remote, workers, seconds)


async def _arms(
    remote: tray.RemoteRuntime, workers: list[Any], seconds: float
) -> list[dict[str, Any]]:
    rows = []
    for size in SIZES:
        chosen = workers[:size]
        row: dict[str, Any] = {"workers": size}
        # Latency: one task per worker against the same number of tasks in-process.
        local = await _local(size, seconds)
        lat = await _remote(remote, chosen, 1, seconds)
        row["local_us"] = size / local * 1e6
        row["ray_us"] = size / lat["actions_per_s"] * 1e6
        row["ratio"] = row["ray_us"] / row["local_us"]
        row["extra_ms"] = (row["ray_us"] - row["local_us"]) / 1e3
        row["latency_calls_per_action"] = lat["calls_per_action"]
        # Throughput: many tasks per worker, so batching has something to batch.
        tasks = THROUGHPUT_TASKS
        row["local_actions_per_s"] = await _local(size * tasks, seconds)
        thr = await _remote(remote, chosen, tasks, seconds)
        row["actions_per_s"] = thr["actions_per_s"]
        row["decisions_per_s"] = thr["decisions_per_s"]
        row["calls_per_action"] = thr["calls_per_action"]
        row["amortized_ms"] = (1 / row["actions_per_s"] - 1 / row["local_actions_per_s"]) * 1e3
        rows.append(row)
        print(
            f"  {size:>2} workers: latency {row['ray_us'] / 1e3:.2f} ms/action "
            f"({row['ratio']:.0f}x in-process), {row['actions_per_s']:,.0f} actions/s at "
            f"{tasks} tasks/worker, {row['calls_per_action']:.2f} calls/action",
            file=sys.stderr,
            flush=True,
        )
    return rows


def _configs(folder: Path) -> dict[str, dict[str, str]]:
    """The adapters' config files per arm and mode, and the verl tool YAML per mode."""
    from omegaconf import OmegaConf  # verl's own YAML loader

    latency = "[capacity]\ncpu = 64\n"  # as the rows above: a capacity that never binds
    sandbox = '[sandbox]\nbackend = "local"\nwarm = 2\ntimeout = 30\n'  # the docs' own
    docs: Any = OmegaConf.to_container(OmegaConf.load(TOOLS_YAML))
    tool = docs["tools"][0]  # the docs' SandboxTool
    paths: dict[str, dict[str, str]] = {"latency": {}, "rollout": {}, "tools": {}}
    for mode in MODES:
        for arm, body in (("latency", latency), ("rollout", sandbox)):
            path = folder / f"{arm}-{mode}.toml"
            path.write_text(f'mode = "{mode}"\n{body}')
            paths[arm][mode] = str(path)
        entry = {**tool, "config": {**tool["config"], "tangram_config": paths["rollout"][mode]}}
        tools = folder / f"tools-{mode}.yaml"
        tools.write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
        paths["tools"][mode] = str(tools)
    return paths


async def _adapter_latency(
    workers: list[Any], configs: dict[str, str], seconds: float, rounds: int
) -> dict[str, dict[str, float]]:
    """Per-call time of the adapters' session + acquire block in each mode, 16 workers.

    ``rounds`` windows per mode, the modes taking turns (and turns about who goes first):
    one window each, one after the other, put any change in the host's load between them
    on one mode alone (the figure moved between 4 and 10 ms from run to run).
    """
    for mode in MODES:
        for ref in [w.adapter_ready.remote(configs[mode]) for w in workers]:
            await ref
    spans: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            start = time.time() + 0.5 + 0.05 * len(workers)
            refs = [
                w.adapter_calls.remote(
                    configs[mode], start, ADAPTER_THINK * i / len(workers), seconds
                )
                for i, w in enumerate(workers)
            ]
            for ref in refs:
                spans[mode].extend(await ref)
    found: dict[str, dict[str, float]] = {}
    for mode, taken in spans.items():
        taken.sort()
        found[mode] = {
            "median_ms": statistics.median(taken) * 1e3,
            "p90_ms": taken[int(0.9 * (len(taken) - 1))] * 1e3,
            "calls": len(taken),
        }
    return found


async def _rollouts(workers: list[Any], trajectories: int, turns: int) -> dict[str, Any]:
    """Each mode's warm-up, then ``ROLLOUT_RUNS`` timed runs per mode, interleaved."""
    for mode in MODES:  # start each mode's scheduler, agent or pools (excluded)
        for ref in [w.rollout.remote(mode, time.time(), 1, 1, 0.0) for w in workers]:
            await ref
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(ROLLOUT_RUNS):
        for mode in MODES:
            start = time.time() + 0.5
            refs = [
                w.rollout.remote(mode, start, trajectories, turns, ROLLOUT_THINK) for w in workers
            ]
            reports = [await ref for ref in refs]
            calls = [o for r in reports for o in r["outputs"]]
            found, failed = probes([c["text"] for c in calls])
            peak, overlaps = occupancy(found)
            wall = max(r["end"] for r in reports) - start
            runs[mode].append(
                {
                    "wall_s": wall,
                    "peak_cores": peak,
                    "core_overlaps": overlaps,
                    "failed": failed,
                    **{k: statistics.fmean(c[k] for c in calls) for k in CALL_SPLIT},
                }
            )
            print(
                f"  rollout {mode:>6}: {wall:.2f} s, peak {peak} cores at once, "
                f"{overlaps} core overlaps, {failed} failed calls; per call "
                + ", ".join(f"{k} {runs[mode][-1][k]:.2f}" for k in CALL_SPLIT),
                file=sys.stderr,
                flush=True,
            )
    return runs


def _work_seconds() -> float:
    """One core's time for a tool call's work, in this process (for the reader's scale)."""
    began = time.perf_counter()
    x = 0
    for i in range(WORK):
        x += i
    return time.perf_counter() - began


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'workers':>7}  {'local us':>8}  {'ray us':>8}  {'ratio':>6}  {'extra ms':>8}  "
        f"{'actions/s':>9}  {'decisions/s':>11}  {'calls/act':>9}  {'local act/s':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['workers']:>7}  {r['local_us']:>8.1f}  {r['ray_us']:>8.0f}  {r['ratio']:>6.0f}  "
            f"{r['extra_ms']:>8.2f}  {r['actions_per_s']:>9,.0f}  {r['decisions_per_s']:>11,.0f}  "
            f"{r['calls_per_action']:>9.3f}  {r['local_actions_per_s']:>11,.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (about a minute)")
    parser.add_argument("--seconds", type=float, help="seconds each arm cycles")
    args = parser.parse_args(argv)
    seconds = args.seconds or (1.0 if args.quick else 8.0)
    load = os.getloadavg()[0]
    print(
        f"ray_overhead: cpu=1 actions on {CAPACITY} units, {seconds:g} s per arm; "
        f"python {platform.python_version()}, ray {ray.__version__}, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at start",
        flush=True,
    )
    n_rollout, trajectories, turns = ROLLOUT[args.quick]
    work_s = _work_seconds()
    started = time.perf_counter()
    folder = tempfile.TemporaryDirectory(prefix="tangram-ray-overhead-")
    configs = _configs(Path(folder.name))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        # Created last first: the last workers are the rollout's, so verl loads there
        # while the others start, and the first ones (the 1- and 4-worker rows) never load it.
        created = [Worker.remote() for _ in range(max(SIZES))]  # type: ignore[attr-defined]
        workers = created[::-1]
        rollout_workers = workers[-n_rollout:]
        loading = [w.load_verl.remote() for w in rollout_workers]
        ray.get([w.ready.remote() for w in workers] + loading)
        print(f"  cluster and workers up in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        rows = anyio.run(_bench, workers, seconds, backend="asyncio")
        # Latency first: it creates the job's scheduler with its [capacity] (see above).
        window = ADAPTER_SECONDS if args.quick and not args.seconds else seconds
        adapter = anyio.run(
            _adapter_latency, workers, configs["latency"], window, ADAPTER_ROUNDS[args.quick]
        )
        print(
            "  adapter path, 16 workers: "
            + ", ".join(f"{m} {adapter[m]['median_ms']:.2f} ms/call" for m in MODES),
            file=sys.stderr,
            flush=True,
        )
        ray.get([w.load_tools.remote(configs["tools"]) for w in rollout_workers])
        rollout_load = os.getloadavg()[0]
        runs = anyio.run(_rollouts, rollout_workers, trajectories, turns)
    finally:
        ray.shutdown()
        folder.cleanup()
    print(_table(rows))
    by_size = {row["workers"]: row for row in rows}
    top = by_size[max(SIZES)]
    print(
        f"extra latency per action: {by_size[1]['extra_ms']:.2f} ms at 1 worker (goal <= "
        f"{LATENCY_GOAL_MS[1]:g}), {top['extra_ms']:.2f} ms at {max(SIZES)} (goal <= "
        f"{LATENCY_GOAL_MS[16]:g}); at {max(SIZES)} x {THROUGHPUT_TASKS} tasks "
        f"{top['actions_per_s']:,.0f} actions/s, {top['amortized_ms']:.3f} ms per action "
        f"(goal <= {AMORTIZED_GOAL_MS:g}), {top['calls_per_action']:.3f} calls/action "
        f"(goal <= {CALLS_GOAL:g})"
    )
    shared_ms, local_ms = adapter["shared"]["median_ms"], adapter["local"]["median_ms"]
    adapter_extra = shared_ms - local_ms
    best = {mode: min(r["wall_s"] for r in runs[mode]) for mode in MODES}
    wall_ratio = best["shared"] / best["local"]
    peak = {mode: max(r["peak_cores"] for r in runs[mode]) for mode in MODES}
    overlaps = {mode: max(r["core_overlaps"] for r in runs[mode]) for mode in MODES}
    cores = os.cpu_count() or 1
    print(
        f"adapter path at {max(SIZES)} workers: {shared_ms:.2f} ms per call shared, "
        f"{local_ms:.3f} ms per-process, {adapter_extra:.2f} ms extra (goal <= "
        f"{ADAPTER_GOAL_MS:g}); rollout of {n_rollout} workers x {trajectories} trajectories "
        f"x {turns} calls on {cores} cores: shared {best['shared']:.2f} s, per-process "
        f"{best['local']:.2f} s (ratio {wall_ratio:.2f}, goal <= 1), peak cores shared "
        f"{peak['shared']} (goal <= {cores}) vs per-process {peak['local']}, core overlaps "
        f"shared {overlaps['shared']} (goal 0) vs per-process {overlaps['local']}"
    )

    def per_size(key: str, digits: int) -> dict[str, float]:
        return {str(r["workers"]): round(r[key], digits) for r in rows}

    figures = {
        "workers": list(SIZES),
        "capacity": CAPACITY,
        "seconds_per_arm": seconds,
        "throughput_tasks_per_worker": THROUGHPUT_TASKS,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "local_us_per_action": per_size("local_us", 2),
        "ray_us_per_action": per_size("ray_us", 1),
        "ratio": per_size("ratio", 1),
        "extra_ms_per_action": per_size("extra_ms", 3),
        "actions_per_s": per_size("actions_per_s", 0),
        "decisions_per_s": per_size("decisions_per_s", 0),
        "calls_per_action": per_size("calls_per_action", 3),
        "latency_calls_per_action": per_size("latency_calls_per_action", 3),
        "local_actions_per_s": per_size("local_actions_per_s", 0),
        "amortized_ms_per_action": per_size("amortized_ms", 3),
        "adapter_think_s": ADAPTER_THINK,
        "adapter_seconds_per_window": window,
        "adapter_windows_per_mode": ADAPTER_ROUNDS[args.quick],
        "adapter_ms_per_call": {m: round(adapter[m]["median_ms"], 3) for m in MODES},
        "adapter_p90_ms_per_call": {m: round(adapter[m]["p90_ms"], 3) for m in MODES},
        "adapter_calls": {m: adapter[m]["calls"] for m in MODES},
        "adapter_ratio": round(shared_ms / local_ms, 1),
        "adapter_extra_ms_per_call": round(adapter_extra, 3),
        "rollout_workers": n_rollout,
        "rollout_trajectories_per_worker": trajectories,
        "rollout_calls_per_trajectory": turns,
        "rollout_think_s": ROLLOUT_THINK,
        "load_average_at_rollout": round(rollout_load, 2),
        "rollout_work_s_one_core": round(work_s, 3),
        "rollout_wall_s_runs": {m: [round(r["wall_s"], 3) for r in runs[m]] for m in MODES},
        "rollout_wall_s_best": {m: round(best[m], 3) for m in MODES},
        "rollout_wall_ratio": round(wall_ratio, 3),
        "rollout_peak_cores": peak,
        "rollout_core_overlaps": overlaps,
        "rollout_failed_calls": {m: sum(r["failed"] for r in runs[m]) for m in MODES},
        **{
            f"rollout_{key}_mean": {
                m: round(statistics.fmean(r[key] for r in runs[m]), 3) for m in MODES
            }
            for key in CALL_SPLIT
        },
    }
    targets = {
        f"extra_ms_per_action_{size}": {
            "value": round(by_size[size]["extra_ms"], 3),
            "goal": f"<= {goal:g}",
            "met": by_size[size]["extra_ms"] <= goal,
        }
        for size, goal in LATENCY_GOAL_MS.items()
    }
    targets["amortized_ms_per_action_16"] = {
        "value": round(top["amortized_ms"], 3),
        "goal": f"<= {AMORTIZED_GOAL_MS:g}",
        "met": top["amortized_ms"] <= AMORTIZED_GOAL_MS,
    }
    targets["calls_per_action_16"] = {
        "value": round(top["calls_per_action"], 3),
        "goal": f"<= {CALLS_GOAL:g}",
        "met": top["calls_per_action"] <= CALLS_GOAL,
    }
    targets["shared_extra_ms_per_call_16"] = {
        "value": round(adapter_extra, 3),
        "goal": f"<= {ADAPTER_GOAL_MS:g}",
        "met": adapter_extra <= ADAPTER_GOAL_MS,
    }
    targets["rollout_wall_ratio"] = {
        "value": round(wall_ratio, 3),
        "goal": "<= 1",
        "met": wall_ratio <= 1.0,
    }
    targets.update(core_targets(peak["shared"], overlaps["shared"], cores))
    print(json.dumps({"bench": "ray_overhead", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
