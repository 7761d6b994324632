"""The protocol model beside ``ray_ceiling.py``'s measured windows: its costs, its check.

``tangram/_sim/_scaleout.py`` runs the protocol on a virtual clock; here its costs are
read from the benchmark's other arms and its prediction for each sandbox window is put
beside what that window measured (``ray_ceiling.py``'s ``model_off_by``).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

from tangram._core._beats import idle_wait
from tangram._shared._protocol import DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT
from tangram._sim._scaleout import Costs, Job, model

CORES_PER_NODE = 2
#: Halvings of the run time's range (0.1 ms to the window) on a log scale: past 2^-24 of
#: it, a step moves the time less than a microsecond.
_FIT_STEPS = 24


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


def _run_seconds(
    job: Callable[[float], Job], costs: Costs, horizon: float, rate: float, seed: int
) -> float:
    """The run time on a core at which the model finishes ``rate`` runs per second over
    ``horizon``: the inverse of the model itself, by bisection on a log scale, so no
    closed form of what the model adds to a run (its queues, its releases) can drift
    from what it does. The draws are seeded, so the model's runs fall as the time grows.
    """
    low, high = 1e-4, horizon
    for _ in range(_FIT_STEPS):
        middle = math.sqrt(low * high)
        done = model(job(middle), costs, horizon=horizon, warmup=0.0, seed=seed)
        if done.actions_per_s > rate:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


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
    charges a call and a release). The workload is the window's: its nodes, trajectories
    and workers, no think time. A run's time on a core (how long ``true`` takes in a
    sandbox here) is the one figure of the workload known from nowhere else: it is
    solved for, so the model's runs in the window are the window's (``_run_seconds``),
    and the model's runs per second are reported as fitted, not predicted. What it
    predicts are the messages and the job actor's CPU per run. Who decides what is the
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
    shipped = row["mode"] == "node"
    costs = Costs(
        actor=send,
        agent=row["agent_cpu_ms_per_action"] / 2e3,
        latency=latency,
        beat=idle[1],
        place=idle[1],
        idle=idle[0],
    )

    def job(seconds: float) -> Job:
        return Job(
            nodes=count,
            trajectories=per_node,
            cores=CORES_PER_NODE,
            workers=workers,
            think=0.0,
            seconds=seconds,
            actions=10**6,
            cores_by="node" if shipped else "job",
            placement_by="node" if shipped else "job",
            heartbeats_by="node" if shipped else "proxy",
        )

    horizon = shape["seconds"]
    rate = row["runs_in_window"] / horizon
    predicted = model(
        job(_run_seconds(job, costs, horizon, rate, count)),
        costs,
        horizon=horizon,
        warmup=0.0,
        seed=count,
    )
    spilled = count * max(0, per_node - CORES_PER_NODE) if shipped else 0
    # The driver's own poll: it holds nothing at the actor (``idle_wait``).
    extra = spilled + horizon / idle_wait(DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT)
    runs = max(predicted.actions_per_s * horizon, 1.0)
    messages = predicted.actor_messages_per_action + extra / runs
    cpu = predicted.actor_load * horizon / runs + extra * idle[1] / runs
    measured_messages = row["running_messages_per_action"]
    measured_cpu = row["running_actor_cpu_ms_per_action"]
    return {
        "fitted_actions_per_s": round(predicted.actions_per_s, 1),
        "messages_per_action": round(messages, 4),
        "actor_cpu_ms_per_action": round(1e3 * cpu, 4),
        "messages_ratio": round(messages / max(measured_messages, 1e-9), 3),
        "actor_cpu_ratio": round(1e3 * cpu / max(measured_cpu, 1e-9), 3),
    }
