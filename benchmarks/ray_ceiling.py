"""The ceiling of the shared scheduler on Ray: one job actor, many workers, many nodes.

What it measures
    A local Ray cluster of several logical nodes (``ray.cluster_utils.Cluster``: a
    raylet per node, all on this machine), one job scheduler actor (``tangram.ray.connect``)
    on the head, and worker processes (Ray actors) spread round-robin over the nodes.

    - *acquire*: each worker runs 8 tasks cycling ``acquire(cpu=1)`` around a checkpoint,
      on a capacity that never binds, at 1 to 64 workers. Actions per second over all
      workers, the acquire latency (entering ``acquire`` to holding the lease) at p50 and
      p99, the job actor's CPU time per action (its process's ``time.process_time``), and
      the messages it received per action (every protocol call: a proxy's batch, a
      heartbeat, a placement). The *knee* is the first worker count after which more
      workers add less than 10 % of actions per second.
    - *probe*: one worker, one action at a time: the cost of a message that carries one
      action, which the protocol model takes (a sandbox run's messages carry one each).
    - *quota*: 4 workers each running 8 loops of GET requests through a job's quota
      (``[quota.NAME]`` in shared mode: the job's actor sends them) to a loopback
      server with no limit: requests per second and the actor's CPU per request,
      against the probe's action. No target: a quota's requests are still sent by the
      job's actor (a capacity's API rates are lent to nodes: ``ray_rates.py``).
    - *sandbox*: a host agent on each of 1 to 8 nodes (the embedded local backend, 2
      cores each), and workers on those nodes whose trajectories each open a sandbox and
      run ``true`` in it back to back: the verl adapter's path. Twice: as shipped, with
      agents that decide their node's cores (``tangram.ray.start_agent``) and workers
      that know their node's agent as the adapters' do, so a sandbox opens there while
      the node has a core per sandbox (else the job's actor places it) and an idle
      worker beats through it; and as before issue 30, with agents whose cores the job's
      actor decides (``CentralAgent``: worker -> agent -> job actor for the node's
      cores) and every sandbox placed and every proxy heard by the job's actor. Sandbox
      actions per second, the latency of ``sbx.run`` at p50 and p99, the job actor's CPU
      time and messages per sandbox action (all, and those on the action's path: less
      the heartbeats and placements, which include a worker's telling the job's actor
      which node's agent is its home, once per worker),
      and the most cores each node's kind ever held against the cores it has.
    - *fault*: after the node arm's widest window, the same workers again (for 4 s
      under ``--quick``, else twice the window), and one node's agent killed halfway:
      the runs per second of the other nodes after the kill over before (none may run
      on the dead node after it). The nodes
      share this machine's cores, so the dead node's share goes to the others: a ratio
      under 1 is a loss, one above is that share.
    - *bare*: an async Ray actor that decides nothing and only answers long polls, as
      many and as often as the job's actor gets them in the node arm's widest window
      (each agent's, passing its workers' beats on, and the driver's), its CPU per
      second: Ray's own cost of an actor that hears its proxies live, which no protocol
      removes. Spread over a window's runs it is the floor under the job
      actor's CPU per run, reported beside that target.

Why
    Issue 30: every action of every worker reaches the job's one actor, which is one
    Python event loop; its cost per action bounds the job. This is the ceiling to beat,
    and the per-message costs a model of larger clusters needs. All logical nodes share
    this machine's 2 cores, so count work (CPU and messages per action), not wall
    throughput, when reading the node sweep. Targets from the issue, printed met or not:
    messages to the job actor on a CPU-sandbox action's path <= 0.05 per action; the job
    actor's CPU time per sandbox action <= 10 % of the central arm's, in the same run,
    both read while the workers run (a worker's connecting and leaving, paid once per
    worker in a training job, are reported apart, per worker, and the whole window's
    ratio beside the target); and never more cores held on a node than it has.

How
    ``--quick``: 4 nodes, workers 1, 4 and 16 for 1.5 s each, the sandbox arm at 1 and 4
    nodes with 4 workers x 2 trajectories for 3 s each, the bare actor for two relay
    waits (three in full) beside the idle windows. Full: 8 nodes, workers 1 to 64,
    the sandbox arm at 1, 2, 4 and 8 nodes with 8 workers x 4 trajectories. The cluster, the
    workers and the agents start before any timed window (excluded). The last line of
    stdout is one JSON object (``"bench": "ray_ceiling"``); the exit status is 0 whether
    or not targets are met.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import anyio
import anyio.lowlevel

import tangram
from tangram._core._stats import nearest_rank

try:
    import ray
    import ray.cluster_utils
    import ray.exceptions
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:  # pragma: no cover - the benchmark needs the extra
    print("ray_ceiling: needs Ray (pip install 'tangram[ray]')", file=sys.stderr)
    raise

from _ceiling_model import CORES_PER_NODE, _idle_costs, model_check

import tangram.ray as tray
from tangram._core._beats import idle_wait, relay_wait
from tangram._shared._agent import HostAgentActor
from tangram._shared._protocol import DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT
from tangram.errors import SandboxBrokenError

NAME = "tangram-ceiling"
CAPACITY = 4096
TASKS = 8  # acquire loops per worker
MESSAGES_GOAL = 0.05
CPU_GOAL = 0.10  # the job actor's CPU time per sandbox action, node-decided over central
MODES = ("central", "node")  # who decides a node's cores: the job's actor (before), the node
KNEE_GAIN = 1.10
QUICK = {
    "nodes": 4,
    "workers": (1, 4, 16),
    "acquire": 1.5,
    "seconds": 2.0,
    "agents": (1, 4),
    "relays": 2,
}
QUICK_SANDBOX = {"workers": 4, "trajectories": 2, "seconds": 3.0, "fault_seconds": 4.0}
FULL = {
    "nodes": 8,
    "workers": (1, 2, 4, 8, 16, 32, 64),
    "acquire": 4.0,
    "seconds": 4.0,
    "agents": (1, 2, 4, 8),
    "relays": 3,
}
FULL_SANDBOX = {"workers": 8, "trajectories": 4, "seconds": 5.0, "fault_seconds": 10.0}


async def _acquires(deadline: float, spans: list[float]) -> None:
    while time.time() < deadline:
        began = time.perf_counter()
        async with tangram.acquire(cpu=1, kind="ceiling"):
            spans.append(time.perf_counter() - began)
            await anyio.lowlevel.checkpoint()


async def _runs(
    remote: tray.RemoteRuntime, trajectory: str, deadline: float, runs: list[tuple[float, float]]
) -> None:
    """Back-to-back runs until ``deadline``: each one's time and when it ended."""
    async with remote.sandbox(trajectory) as sbx:
        while time.time() < deadline:
            began = time.perf_counter()
            result = await sbx.run("true")
            runs.append((time.perf_counter() - began, time.time()))
            if not result.ok:
                raise RuntimeError(f"`true` failed in the sandbox: {result!r}")


@ray.remote(num_cpus=0)
class Worker:
    """One rollout process with a proxy on the job's scheduler."""

    async def ready(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def acquire(self, tasks: int, start: float, seconds: float) -> list[float]:
        spans: list[float] = []
        async with tray.connect(name=NAME, create=False):
            await anyio.sleep(max(0.0, start - time.time()))
            async with anyio.create_task_group() as tg:
                for _ in range(tasks):
                    tg.start_soon(_acquires, start + seconds, spans)
        return spans

    async def idle(self, start: float, seconds: float) -> list[float]:
        """Connected and doing nothing: what the job's actor pays for a proxy's heartbeats."""
        async with tray.connect(name=NAME, create=False):
            await anyio.sleep(max(0.0, start + seconds - time.time()))
        return []

    async def quota(self, url: str, start: float, seconds: float) -> list[float]:
        """``TASKS`` loops of GET requests through the job's quota (its actor sends them)."""
        from tangram._shared._quotas import JobQuota

        spans: list[float] = []
        async with tray.connect(name=NAME, create=False) as remote:
            quota = JobQuota(remote, "api", [{"name": "k", "concurrency": 64}], {})
            async with quota.client(base_url=url) as http:
                await http.get("/warm")  # the quota built at the actor: not timed
                await anyio.sleep(max(0.0, start - time.time()))

                async def loop() -> None:
                    while time.time() < start + seconds:
                        began = time.perf_counter()
                        await http.get("/q")
                        spans.append(time.perf_counter() - began)

                async with anyio.create_task_group() as tg:
                    for _ in range(TASKS):
                        tg.start_soon(loop)
        return spans

    async def timed(
        self, trajectories: int, start: float, seconds: float
    ) -> list[tuple[str, float]]:
        """Each run's host and end time, trajectories ending where their host dies."""
        runs: list[tuple[str, float]] = []
        async with tray.connect(name=NAME, create=False) as remote:
            await anyio.sleep(max(0.0, start - time.time()))
            async with anyio.create_task_group() as tg:
                for _ in range(trajectories):
                    tg.start_soon(_timed_runs, remote, start + seconds, runs)
        return runs

    async def sandbox(
        self, trajectories: int, start: float, seconds: float
    ) -> list[tuple[float, float]]:
        runs: list[tuple[float, float]] = []
        async with tray.connect(name=NAME, create=False) as remote:
            await anyio.sleep(max(0.0, start - time.time()))
            async with anyio.create_task_group() as tg:
                for _ in range(trajectories):
                    tg.start_soon(_runs, remote, uuid.uuid4().hex, start + seconds, runs)
        return runs


@ray.remote(num_cpus=0)
class Bare:
    """An async actor that decides nothing: what Ray costs any actor that is polled."""

    async def pid(self) -> int:
        return os.getpid()

    async def poll(self, wait: float) -> list[Any]:
        await asyncio.sleep(wait)
        return []


async def _bare_arm(bare: Any, seconds: float, waits: list[float]) -> float:
    """CPU seconds per second of an actor that only answers long polls, one poller per
    entry of ``waits``, each waiting that long per call.

    The node arm's widest window as shipped polls the job's actor so: each agent passing
    its workers' beats on, and the driver's own proxy, which holds nothing there (every
    ``relay_wait`` and ``idle_wait``), with the scheduler's concurrency. The floor under the job
    actor's CPU per action: the actor must hear that its proxies live, and at this
    machine's action rates Ray's own cost of an actor (most of it fixed, whatever it
    answers) is most of what is left.
    Read from ``/proc`` in clock ticks (10 ms), so over ``seconds`` it is good to
    ``10 ms / seconds`` per second.
    """
    pid = await bare.pid.remote()  # started with the workers: past its start-up
    stop = time.monotonic() + seconds

    async def poller(wait: float) -> None:
        while (left := stop - time.monotonic()) > 0:
            await bare.poll.remote(min(wait, left))

    began, before = time.monotonic(), _cpu(pid)
    async with anyio.create_task_group() as tg:
        for wait in waits:
            tg.start_soon(poller, wait)
    cpu = (_cpu(pid) - before) / (time.monotonic() - began)
    ray.kill(bare)
    print(
        f"  bare actor, {len(waits)} pollers: {1e3 * cpu:.2f} ms CPU per second",
        file=sys.stderr,
        flush=True,
    )
    return cpu


async def _timed_runs(
    remote: tray.RemoteRuntime, deadline: float, runs: list[tuple[str, float]]
) -> None:
    """Run ``true`` back to back in one sandbox until ``deadline`` or until its host dies."""
    async with remote.sandbox(uuid.uuid4().hex) as sbx:
        while time.time() < deadline:
            try:
                result = await sbx.run("true")
            except SandboxBrokenError:
                return  # its host agent was killed: this trajectory ends here
            if not result.ok:
                raise RuntimeError(f"`true` failed in the sandbox: {result!r}")
            runs.append((sbx.host, time.time()))


async def _counters(remote: tray.RemoteRuntime) -> dict[str, float]:
    counters: dict[str, float] = await remote.actor.counters.remote()
    return counters


async def _window(
    remote: tray.RemoteRuntime, calls: list[Any], seconds: float
) -> tuple[list[float], dict[str, float]]:
    began = time.monotonic()
    before = await _counters(remote)
    spans = [s for report in [await ref for ref in calls] for s in report]
    after = await _counters(remote)
    wall = time.monotonic() - began
    n = max(len(spans), 1)
    spans.sort()
    return spans, {
        "wall_s": round(wall, 3),
        "actions": len(spans),
        "actions_per_s": round(len(spans) / seconds, 1),
        "p50_ms": round(1e3 * nearest_rank(spans, 0.5), 3) if spans else None,
        "p99_ms": round(1e3 * nearest_rank(spans, 0.99), 3) if spans else None,
        "actor_cpu_ms_per_action": round(
            1e3 * (after["cpu_seconds"] - before["cpu_seconds"]) / n, 4
        ),
        "messages_per_action": round((after["messages"] - before["messages"]) / n, 4),
        # Less the heartbeats (per proxy per second) and placements (per sandbox block).
        "action_messages_per_action": round(
            (
                (after["messages"] - before["messages"])
                - (after["heartbeats"] - before["heartbeats"])
                - (after["placements"] - before["placements"])
            )
            / n,
            4,
        ),
        "heartbeats_per_s": round((after["heartbeats"] - before["heartbeats"]) / seconds, 2),
        "placements": after["placements"] - before["placements"],
    }


async def _running(
    remote: tray.RemoteRuntime, start: float, seconds: float
) -> tuple[dict[str, float], dict[str, float]]:
    """The job actor's counters when a window's runs start and when they end.

    Between the two the workers are connected and running: what a job pays per action
    once its workers are up, over the runs that ended in between. The whole window adds
    each worker's connecting (its first poll, its home), its trajectories' last runs
    (ending after the deadline) and its leaving, which a training job pays once per
    worker, not per action; in a window of seconds they are close to half the actor's
    CPU per run.
    """
    await anyio.sleep(max(0.0, start - time.time()))
    first = await _counters(remote)
    await anyio.sleep(max(0.0, start + seconds - time.time()))
    return first, await _counters(remote)


def _start_at(workers: int) -> float:
    return time.time() + 0.5 + 0.05 * workers


async def _acquire_arm(
    remote: tray.RemoteRuntime, workers: list[Any], sizes: tuple[int, ...], seconds: float
) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        start = _start_at(size)
        calls = [w.acquire.remote(TASKS, start, seconds) for w in workers[:size]]
        _, row = await _window(remote, calls, seconds)
        row = {"workers": size, **row}
        rows.append(row)
        print(
            f"  acquire, {size:2d} workers: {row['actions_per_s']:8.0f} actions/s, "
            f"p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, actor "
            f"{row['actor_cpu_ms_per_action']} ms CPU and "
            f"{row['messages_per_action']} messages per action",
            file=sys.stderr,
            flush=True,
        )
    return rows


async def _probe_arm(remote: tray.RemoteRuntime, worker: Any, seconds: float) -> dict[str, Any]:
    """One worker, one action at a time: what a message carrying one action costs the
    job's actor, and a round trip with no batch to wait for (the model's costs)."""
    _, row = await _window(remote, [worker.acquire.remote(1, _start_at(1), seconds)], seconds)
    print(
        f"  probe, one action at a time: p50 {row['p50_ms']} ms, actor "
        f"{row['actor_cpu_ms_per_action']} ms CPU and {row['messages_per_action']} messages "
        "per action",
        file=sys.stderr,
        flush=True,
    )
    return row


async def _quota_arm(
    remote: tray.RemoteRuntime, workers: list[Any], seconds: float
) -> dict[str, Any]:
    """API requests through the job's quota, which its actor sends (a loopback server
    here, with no limit): what a quota request costs the job's actor, against the probe's
    action. No target: a quota's requests, with their keys, retries and AIMD, are not
    lent to nodes (a capacity's API rates are: ``ray_rates.py``)."""
    from tangram.testing import QuotaServer

    async with QuotaServer() as server:
        start = _start_at(len(workers))
        calls = [w.quota.remote(server.url, start, seconds) for w in workers]
        _, row = await _window(remote, calls, seconds)
    print(
        f"  quota, {len(workers)} workers: {row['actions_per_s']} requests/s, p50 "
        f"{row['p50_ms']} ms, actor {row['actor_cpu_ms_per_action']} ms CPU and "
        f"{row['messages_per_action']} messages per request",
        file=sys.stderr,
        flush=True,
    )
    return row


class CentralAgent(HostAgentActor):
    """A host agent as before issue 30: the job's actor decides its node's cores."""

    decides_cores = False


async def _start_central(
    remote: tray.RemoteRuntime, name: str, node: str, root: str
) -> tuple[Any, int]:
    """Start a :class:`CentralAgent` as ``tangram.ray.start_agent`` starts a host agent."""
    actor = (
        ray.remote(CentralAgent)
        .options(
            num_cpus=0,
            max_concurrency=1_000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        )
        .remote(name, remote.actor, _backend(root), 0)
    )
    info = await actor.start.remote()
    await remote._refresh()
    return actor, int(info["pid"])


async def _stop(actor: Any) -> None:
    with contextlib.suppress(ray.exceptions.RayError):  # the fault window killed one
        await actor.stop.remote()
    ray.kill(actor)


async def _sandbox_arm(
    remote: tray.RemoteRuntime,
    workers: list[Any],
    node_ids: list[str],
    agents_at: tuple[int, ...],
    shape: dict[str, Any],
    roots: list[str],
) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        agents: list[tuple[str, int, Any]] = []  # kind, pid, actor

        async def start(index: int, mode: str = mode) -> tuple[str, int, Any]:
            root = tempfile.mkdtemp(prefix=f"tangram-ceiling-{mode}-{index}-")
            os.chmod(root, 0o755)  # the sandbox user (nobody, as root) walks through
            roots.append(root)
            name = f"{mode[0]}{index}"
            if mode == "central":
                actor, pid = await _start_central(remote, name, node_ids[index], root)
            else:
                agent = await tray.start_agent(
                    remote, name=name, node_id=node_ids[index], backend=_backend(root)
                )
                actor, pid = agent.actor, agent.pid
            return f"cpu@{name}", pid, actor

        try:
            for count in agents_at:
                # Started together, outside the windows: only their number is measured.
                new = range(len(agents), count)
                agents.extend(await asyncio.gather(*(start(index) for index in new)))
                window = _sandbox_window(remote, workers, len(node_ids), mode, agents, shape)
                rows.append(await window)
            if mode == "node" and len(agents) > 1:
                rows[-1]["fault"] = await _fault_window(workers, len(node_ids), agents, shape)
        finally:
            await asyncio.gather(*(_stop(actor) for _, _, actor in agents))
    return rows


def _placed(workers: list[Any], nodes: int, agents: int, count: int) -> list[Any]:
    """``count`` workers on the nodes that have an agent, round-robin over those nodes.

    Worker ``i`` lives on node ``i % nodes`` (created so), and agent ``k`` on node ``k``:
    so a window on fewer nodes has its workers there too, as a job that size would. A
    worker connecting on a node whose agent decides its cores (the node arm) opens its
    sandboxes there and beats through it, as the adapters' workers do.
    """
    chosen = [i for i in range(len(workers)) if i % nodes < agents][:count]
    if len(chosen) < count:
        raise RuntimeError(f"{count} workers asked on {agents} nodes; too few started")
    return [workers[i] for i in chosen]


async def _sandbox_window(
    remote: tray.RemoteRuntime,
    workers: list[Any],
    nodes: int,
    mode: str,
    agents: list[tuple[str, int, Any]],
    shape: dict[str, Any],
) -> dict[str, Any]:
    count = len(agents)
    chosen = _placed(workers, nodes, count, shape["workers"])
    start = _start_at(len(chosen))
    ends: list[float] = []

    async def spans_of(call: Any) -> list[float]:
        report = await call
        ends.extend(ended for _, ended in report)
        return [span for span, _ in report]

    calls = [
        spans_of(w.sandbox.remote(shape["trajectories"], start, shape["seconds"])) for w in chosen
    ]
    before = sum(_cpu(pid) for _, pid, _ in agents)
    running = asyncio.ensure_future(_running(remote, start, shape["seconds"]))
    spans, row = await _window(remote, calls, shape["seconds"])
    first, last = await running
    agent_cpu = sum(_cpu(pid) for _, pid, _ in agents) - before
    # The runs that ended while the workers ran: each trajectory's last run ends after
    # the deadline, and its messages fall outside the running part.
    runs = max(sum(1 for ended in ends if ended <= start + shape["seconds"]), 1)
    running_cpu = last["cpu_seconds"] - first["cpu_seconds"]
    stats = await remote.stats()
    peaks = {kind: stats.resources[kind].peak for kind, _, _ in agents}
    row = {
        "mode": mode,
        "nodes": count,
        **row,
        "running_actor_cpu_ms_per_action": round(1e3 * running_cpu / runs, 4),
        "runs_in_window": runs,
        "running_messages_per_action": round((last["messages"] - first["messages"]) / runs, 4),
        "actor_cpu_ms_per_worker_start": round(
            (row["actor_cpu_ms_per_action"] * len(spans) - 1e3 * running_cpu) / len(chosen), 3
        ),
        "mean_run_ms": round(1e3 * statistics.fmean(spans), 3) if spans else None,
        "agent_cpu_ms_per_action": round(1e3 * agent_cpu / max(len(spans), 1), 4),
        "peak_cores": peaks,
        "cores_within_node": all(peaks[kind] <= CORES_PER_NODE for kind, _, _ in agents),
    }
    print(
        f"  sandbox, {mode:7s} {count} nodes: {row['actions_per_s']:6.1f} runs/s, "
        f"p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms; per run: actor "
        f"{row['actor_cpu_ms_per_action']} ms CPU ({row['running_actor_cpu_ms_per_action']} "
        f"while running), {row['messages_per_action']} messages "
        f"({row['action_messages_per_action']} on the action's path); per worker's start "
        f"and end {row['actor_cpu_ms_per_worker_start']} ms; peak cores {peaks}",
        file=sys.stderr,
        flush=True,
    )
    return row


async def _fault_window(
    workers: list[Any], nodes: int, agents: list[tuple[str, int, Any]], shape: dict[str, Any]
) -> dict[str, Any]:
    """Kill one node's agent halfway through a window; the other nodes' runs per second
    after, over before. All nodes share this machine's cores, so the dead node's share
    of them goes to the others: read a ratio under 1 as a loss, one above as that."""
    chosen = _placed(workers, nodes, len(agents), shape["workers"])
    seconds = shape["fault_seconds"]
    start = _start_at(len(chosen))
    calls = [w.timed.remote(shape["trajectories"], start, seconds) for w in chosen]
    await anyio.sleep(max(0.0, start + seconds / 2 - time.time()))
    killed_at = time.time()
    dead = agents[0][0].split("@", 1)[1]
    ray.kill(agents[0][2])
    runs = [run for report in [await ref for ref in calls] for run in report]
    others = [at for host, at in runs if host != dead]
    before = sum(1 for at in others if start + 0.5 <= at < killed_at) / (killed_at - start - 0.5)
    after = sum(1 for at in others if killed_at <= at) / max(start + seconds - killed_at, 1e-9)
    row = {
        "killed": dead,
        "others_runs_per_s_before": round(before, 1),
        "others_runs_per_s_after": round(after, 1),
        "others_ratio": round(after / max(before, 1e-9), 3),
        "dead_runs_after": sum(1 for host, at in runs if host == dead and at > killed_at + 0.1),
    }
    print(
        f"  fault: agent {dead} killed; the other nodes ran {before:.1f} runs/s before, "
        f"{after:.1f} after ({row['others_ratio']}x)",
        file=sys.stderr,
        flush=True,
    )
    return row


def _cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (user and system), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _idle_arm(
    remote: tray.RemoteRuntime, workers: list[Any], seconds: float
) -> list[tuple[float, float]]:
    """The job actor's heartbeats and CPU, per second, while proxies only heartbeat.

    Twice, with one proxy and with all of ``workers``, read once they are connected and
    until they leave (as the sandbox windows' running part is). The CPU per second is a
    fixed part (the actor process's own timers and threads) and a part per heartbeat;
    the fixed part is read in ``_idle_costs``, with a heartbeat priced as the probe's
    message.
    """
    points = []
    for chosen in (workers[:1], workers):
        start = _start_at(len(chosen))
        running = asyncio.ensure_future(_running(remote, start, seconds))
        await asyncio.gather(*[w.idle.remote(start, seconds) for w in chosen])
        first, last = await running
        beats = (last["heartbeats"] - first["heartbeats"]) / seconds
        points.append((beats, (last["cpu_seconds"] - first["cpu_seconds"]) / seconds))
    return points


def _backend(root: str) -> Any:
    return functools.partial(tangram.LocalBackend, cores=list(range(CORES_PER_NODE)), root=root)


def knee(rows: list[dict[str, Any]]) -> int:
    """The first worker count after which more workers add less than 10 % throughput."""
    for here, there in itertools.pairwise(rows):
        if there["actions_per_s"] < KNEE_GAIN * here["actions_per_s"]:
            return int(here["workers"])
    return int(rows[-1]["workers"])


async def _bench(
    workers: list[Any],
    bare_actor: Any,
    node_ids: list[str],
    plan: dict[str, Any],
    shape: dict[str, Any],
) -> dict[str, Any]:
    roots: list[str] = []
    try:
        async with tray.connect(name=NAME, capacity={"cpu": CAPACITY}) as remote:
            acquire = await _acquire_arm(remote, workers, plan["workers"], plan["acquire"])
            probe = await _probe_arm(remote, workers[0], plan["seconds"])
            # The node arm's widest window's polls: each agent's, passing its workers'
            # beats on, and this driver's, which holds nothing there.
            relay = relay_wait(DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT)
            waits = [relay] * max(plan["agents"]) + [idle_wait(DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT)]
            # Together: each reads one actor's CPU, and neither loads the machine (their
            # proxies and pollers only wait), so neither window moves the other's. The
            # idle arm's two windows fill the bare arm's time (each window's start takes
            # about half a second): its fixed CPU a second, most of the model's actor CPU
            # in the node arm, is read over as long as the time allows.
            seconds = max(2 * plan["seconds"], plan["relays"] * relay)
            idle, bare = await asyncio.gather(
                _idle_arm(
                    remote, workers[: shape["workers"]], max(plan["seconds"], seconds / 2 - 0.5)
                ),
                _bare_arm(bare_actor, seconds, waits),
            )
            sandbox = await _sandbox_arm(remote, workers, node_ids, plan["agents"], shape, roots)
            # Last: its requests' garbage and connections stay out of the windows the
            # protocol model's costs come from.
            quota = await _quota_arm(remote, workers[:4], plan["seconds"])
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "acquire": acquire,
        "probe": probe,
        "quota": quota,
        "sandbox": sandbox,
        "idle": idle,
        "bare": bare,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version, about a minute")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    shape = QUICK_SANDBOX if args.quick else FULL_SANDBOX
    started = time.monotonic()
    cluster = ray.cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        for _ in range(plan["nodes"] - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False, namespace="tangram-ceiling")
        cluster.wait_for_nodes()
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        count = max(max(plan["workers"]), shape["workers"])
        workers = [
            Worker.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=node_ids[i % len(node_ids)], soft=False
                )
            ).remote()
            for i in range(count)
        ]
        # The bare arm's actor, started with them: its start-up is not in its window.
        bare = Bare.options(max_concurrency=10_000).remote()  # type: ignore[attr-defined]
        ray.get([w.ready.remote() for w in workers] + [bare.pid.remote()])
        setup = time.monotonic() - started
        print(
            f"ray_ceiling: {len(node_ids)} nodes, {count} workers up in {setup:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows = anyio.run(_bench, workers, bare, node_ids, plan, shape)
    finally:
        ray.shutdown()
        cluster.shutdown()
    acquire, sandbox = rows["acquire"], rows["sandbox"]
    # A sandbox run's messages each carry one action (its acquire, its release), not the
    # acquire arm's batches of eight, which cost the actor less per action: calibrated on
    # those, the model's central arm was off by up to 0.6.
    one = rows["probe"]
    send = one["actor_cpu_ms_per_action"] / max(one["messages_per_action"], 1e-9) / 1e3
    # One way: half the single worker's acquire round trip, less the actor's part of it.
    latency = max((one["p50_ms"] / 1e3 - send * one["messages_per_action"]) / 2, 1e-4)
    idle = _idle_costs(rows["idle"], send)
    for row in sandbox:
        row["model"] = model_check(row, shape, idle, send, latency)
        print(
            f"  model, {row['mode']:7s} {row['nodes']} nodes: runs/s "
            f"{row['model']['fitted_actions_per_s']} (fitted to {row['runs_in_window']} runs), "
            "messages/run "
            f"{row['model']['messages_per_action']} (measured "
            f"{row['running_messages_per_action']}), actor ms/run "
            f"{row['model']['actor_cpu_ms_per_action']} (measured "
            f"{row['running_actor_cpu_ms_per_action']}), while the workers run",
            file=sys.stderr,
            flush=True,
        )
    off = max(
        abs(row["model"][key] - 1.0)
        for row in sandbox
        for key in ("messages_ratio", "actor_cpu_ratio")
    )
    node = [r for r in sandbox if r["mode"] == "node"]
    central = {r["nodes"]: r for r in sandbox if r["mode"] == "central"}
    worst_messages = max(r["action_messages_per_action"] for r in node)

    def worst_ratio(key: str) -> float:
        return max(r[key] / central[r["nodes"]][key] for r in node)

    # Read while the workers run: a worker's start and end are paid once per worker in
    # a training job, not per action (the whole window's ratio is reported beside it).
    cpu_ratio = worst_ratio("running_actor_cpu_ms_per_action")
    with_starts = worst_ratio("actor_cpu_ms_per_action")
    # The same ratio for an actor that only answers as many proxies' heartbeats: what no
    # protocol gets under at these action rates (the bound the CPU target is read against).
    floor = max(
        1e3
        * rows["bare"]
        * shape["seconds"]
        / max(r["actions"], 1)
        / central[r["nodes"]]["running_actor_cpu_ms_per_action"]
        for r in node
    )
    figures = {
        "quick": args.quick,
        "nodes": plan["nodes"],
        "acquire": acquire,
        "probe": one,
        "quota": rows["quota"],
        "quota_actor_cpu_vs_probe": round(
            rows["quota"]["actor_cpu_ms_per_action"] / one["actor_cpu_ms_per_action"], 3
        ),
        "sandbox": sandbox,
        "knee_workers": knee(acquire),
        "actor_cpu_ms_per_action_median": statistics.median(
            r["actor_cpu_ms_per_action"] for r in acquire
        ),
        "messages_per_sandbox_action": {
            mode: max(r["messages_per_action"] for r in sandbox if r["mode"] == mode)
            for mode in MODES
        },
        "bare_actor_cpu_ms_per_s": round(1e3 * rows["bare"], 3),
        "actor_cpu_floor_vs_central": round(floor, 3),
        "actor_cpu_vs_central_with_starts": round(with_starts, 3),
        "setup_s": round(setup, 1),
        "costs": {
            "actor_idle_ms_per_s": round(1e3 * idle[0], 4),
            "actor_beat_ms": round(1e3 * idle[1], 4),
            "actor_send_ms": round(1e3 * send, 4),
            "latency_ms": round(1e3 * latency, 4),
            "agent_call_ms": max(r["agent_cpu_ms_per_action"] for r in node),
        },
    }
    within = all(r["cores_within_node"] for r in sandbox)
    fault = next(r["fault"] for r in sandbox if "fault" in r)
    figures["fault"] = fault
    targets = {
        "action_messages_per_sandbox_action": {
            "value": worst_messages,
            "goal": f"<= {MESSAGES_GOAL}",
            "met": worst_messages <= MESSAGES_GOAL,
        },
        "actor_cpu_per_sandbox_action_vs_central": {
            "value": round(cpu_ratio, 3),
            "goal": f"<= {CPU_GOAL}",
            "met": cpu_ratio <= CPU_GOAL,
            "floor": round(floor, 3),
        },
        "cores_within_node": {"value": within, "goal": "== true", "met": within},
        # A node's agent killed mid-window: the others' runs per second after, over before.
        "fault_other_nodes_ratio": {
            "value": fault["others_ratio"],
            "goal": ">= 0.9",
            "met": fault["others_ratio"] >= 0.9 and fault["dead_runs_after"] == 0,
        },
        "model_off_by": {"value": round(off, 3), "goal": "<= 0.25", "met": off <= 0.25},
    }
    print(json.dumps({"bench": "ray_ceiling", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
