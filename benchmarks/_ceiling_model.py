"""The protocol model beside ``ray_ceiling.py``'s measured windows: its costs, its check.

``tangram/_sim/_scaleout.py`` runs the protocol on a virtual clock; here its costs are
read from the benchmark's other arms and its prediction for each sandbox window is put
beside what that window measured (``ray_ceiling.py``'s ``model_off_by``).
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from tangram._core._beats import idle_wait
from tangram._shared._protocol import DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT
from tangram._sim._scaleout import Costs, Job, model

CORES_PER_NODE = 2


def _idle_costs(points: list[tuple[float, float]], message: float) -> tuple[float, float]:
    """The actor's fixed CPU per second, and a heartbeat's, from the idle windows.

    A heartbeat (or a placement, or a proxy's arrival and departure: none decides
    anything) is priced as the probe's message, which ~1,000 messages in one window
    measure; the fixed part is what each idle window spent beyond its heartbeats, their
    mean. Fitting both from the two windows instead divided one small difference of
    noisy CPU readings by another: it priced a heartbeat at 0.9 to 8 ms between runs,
    and the model's actor CPU was off by up to 80 %.
    """
    fixed = statistics.fmean(max(cpu - beats * message, 0.0) for beats, cpu in points)
    print(
        f"  idle: actor {1e3 * fixed:.2f} ms CPU per second beyond its heartbeats "
        f"({', '.join(f'{b:.1f}' for b, _ in points)} heartbeats/s at "
        f"{1e3 * message:.3f} ms each)",
        file=sys.stderr,
        flush=True,
    )
    return fixed, message


def model_check(
    row: dict[str, Any],
    shape: dict[str, Any],
    idle: tuple[float, float],
    send: float,
    latency: float,
) -> dict[str, Any]:
    """What the protocol model (``tangram._sim._scaleout``) predicts for one sandbox
    window's running part: from its runs' start to their deadline, the workers connected.

    Its costs come from the other arms, not from this window: a message's from the
    probe, one worker acting one action at a time (``send``, each message carrying one
    action as a run's do), a heartbeat and a placement priced the same (neither decides
    anything), the actor's fixed CPU per second from the idle arm (``_idle_costs``), the
    agent's per call from the window's agents (half of their CPU per run: the model
    charges a call and a release). The workload is
    the window's: its nodes, trajectories and workers, no think time, and each run's
    time on a core inferred from the runs per second measured. Who decides what is the
    arm's: in the central arm the job's actor decides cores and places every sandbox and
    every proxy polls it; in the node arm, as shipped, the agents decide, a sandbox opens
    on its worker's node and idle workers beat through their agent. The model's nodes
    never spill a sandbox, and it has no driver: those messages are added here (in the
    node arm a placement per sandbox past a core each on its node; in both the driver's
    own poll, every ``idle_wait`` as it holds nothing there). What falls outside the
    running part (each worker's connecting and leaving, sandboxes closing) is measured
    apart, per worker, not modelled.
    """
    count = row["nodes"]
    trajectories = shape["workers"] * shape["trajectories"]
    per_node = max(1, trajectories // count)
    workers = max(1, shape["workers"] // count)
    agent = row["agent_cpu_ms_per_action"] / 2e3
    busy = min(CORES_PER_NODE, per_node) * count / max(row["actions_per_s"], 1e-9)
    if per_node <= CORES_PER_NODE:  # cores do not bind: a run's cycle is all its time
        busy -= 2 * latency + agent
    shipped = row["mode"] == "node"
    job = Job(
        nodes=count,
        trajectories=per_node,
        cores=CORES_PER_NODE,
        workers=workers,
        think=0.0,
        seconds=max(busy, 1e-3),
        actions=10**6,
        cores_by="node" if shipped else "job",
        placement_by="node" if shipped else "job",
        heartbeats_by="node" if shipped else "proxy",
    )
    costs = Costs(
        actor=send, agent=agent, latency=latency, beat=idle[1], place=idle[1], idle=idle[0]
    )
    predicted = model(job, costs, horizon=shape["seconds"], warmup=0.0, seed=count)
    spilled = count * max(0, per_node - CORES_PER_NODE) if shipped else 0
    # The driver's own poll: it holds nothing at the actor (``idle_wait``).
    extra = spilled + shape["seconds"] / idle_wait(DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT)
    runs = max(predicted.actions_per_s * shape["seconds"], 1.0)
    messages = predicted.actor_messages_per_action + extra / runs
    cpu = predicted.actor_load * shape["seconds"] / runs + extra * idle[1] / runs
    measured_messages = row["running_messages_per_action"]
    measured_cpu = row["running_actor_cpu_ms_per_action"]
    return {
        "actions_per_s": round(predicted.actions_per_s, 1),
        "messages_per_action": round(messages, 4),
        "actor_cpu_ms_per_action": round(1e3 * cpu, 4),
        "messages_ratio": round(messages / max(measured_messages, 1e-9), 3),
        "actor_cpu_ratio": round(1e3 * cpu / max(measured_cpu, 1e-9), 3),
    }
