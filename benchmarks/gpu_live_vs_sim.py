"""Live GPU pool against the simulator: does the live pool keep the simulated schedule?

What it measures
    Random GPU-contention workloads (seeded; each draws 2 to 4 devices, one to three more
    services than devices, each filling a device, restores of 0.2 to 5 s, runs of 0.3 to
    3 s, Zipf-like popularity, 8 to 40 trajectories of 2 to 6 actions with exponential
    think times), each run twice in the same process: through a live
    :class:`tangram.gpu.GpuPool` and :class:`tangram.Runtime` on stand-in devices whose
    services sleep their restores and runs on a virtual clock (trio's ``MockClock``: no
    GPU here, and the pool's decisions are the same code on any device), and through
    :func:`tangram.simulate` with the same services. For each workload, the live mean and
    p95 action completion time (ACT) over the simulated ones; over the workloads, the
    median and the worst, and which workload is worst.

Why
    The policy's GPU figures (``policy_family.py``, docs/policy.md) are the simulator's.
    They hold for users only as far as the live pool makes the same decisions. Both call
    the rules of ``tangram/_core/_placement.py``; this says how close the schedules are on
    workloads nobody shaped to agree (``tests/test_gpu_live_vs_simulated.py`` pins them
    equal where the two keep the same books).

How
    The live pool learns each service's run time from its first run, where the simulator
    is told it, so the first seconds differ (before a run is measured, the live pool
    starts another copy wherever a device has room). Trio shuffles the order in which
    ready tasks run, so ties on the virtual clock can go differently from run to run and
    the medians move by about 0.01. ``--quick`` runs 16 workloads (a few seconds on 2
    cores), the default 64; ``--seed`` moves the first workload.

The last line of stdout is one JSON object (``"bench": "gpu_live_vs_sim"``) with every
figure and whether each target was met. The exit status is 0 whether or not targets are
met.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import trio
import trio.testing

import tangram
from tangram._sim._residency import ServiceSpec
from tangram.gpu import Device, GpuPool, ModelService

MEMORY = 1000  # bytes live, one "GiB" simulated: a replica fills its device
# trajectory -> [(service, run seconds, think time before it)]
Workload = Mapping[str, Sequence[tuple[str, float, float]]]
Key = tuple[str, int]
GOAL = 1.10


class Stand(ModelService):
    """A service that sleeps its restore and its runs on the virtual clock."""

    def __init__(self, name: str, restore_seconds: float, devices: int) -> None:
        super().__init__(name, memory=MEMORY, max_replicas=devices, max_batch=1)
        self.restore_seconds = restore_seconds

    async def load(self) -> None:
        pass

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await anyio.sleep(self.restore_seconds)

    async def evict(self, replica: int) -> None:
        pass

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        [seconds] = batches
        await anyio.sleep(seconds)
        return [None]


async def run_live(
    workload: Workload, restores: Mapping[str, float], devices: int
) -> dict[Key, float]:
    services = [Stand(name, seconds, devices) for name, seconds in restores.items()]
    acts: dict[Key, float] = {}
    memory = [Device(f"cpu:{i}", memory=MEMORY) for i in range(devices)]
    pool = GpuPool(services, devices=memory, links=[])
    async with pool, tangram.Runtime(capacity=pool.capacity()):

        async def rollout(name: str, steps: Sequence[tuple[str, float, float]]) -> None:
            for index, (service, seconds, gap) in enumerate(steps):
                await anyio.sleep(gap)
                came = anyio.current_time()
                async with pool.use(service) as svc:
                    await svc(seconds)
                acts[name, index] = anyio.current_time() - came

        async with anyio.create_task_group() as tg:
            for name, steps in workload.items():
                tg.start_soon(rollout, name, steps)
    return acts


def run_simulated(
    workload: Workload, restores: Mapping[str, float], devices: int
) -> dict[Key, float]:
    trajectories = {
        name: [
            tangram.Step(demand={"gpu": 1}, seconds_at_1=seconds, gap=gap, kind=svc, service=svc)
            for svc, seconds, gap in steps
        ]
        for name, steps in workload.items()
    }
    services = {
        name: ServiceSpec(name=name, gpu_mem_gib=1.0, restore_seconds=seconds, max_batch=1)
        for name, seconds in restores.items()
    }
    result = tangram.simulate(
        trajectories, {"gpu": devices}, services=services, gpu_mem_gib_per_device=1.0
    )
    return {(r.trajectory, r.index): r.finished - r.arrival for r in result.records}


def draw(seed: int) -> tuple[Workload, dict[str, float], int]:
    """One workload; think times are nudged apart so no two arrivals share an instant."""
    rng = random.Random(seed)
    devices = rng.choice([2, 3, 4])
    count = rng.randint(devices + 1, devices + 3)
    restores = {f"S{i}": round(rng.uniform(0.2, 5.0), 3) for i in range(count)}
    runs = {name: round(rng.uniform(0.3, 3.0), 3) for name in restores}
    weights = [1 / (i + 1) ** rng.uniform(0.5, 1.5) for i in range(count)]
    workload = {}
    for t in range(rng.randint(8, 40)):
        think = rng.uniform(0.5, 4.0)
        steps = []
        for k in range(rng.randint(2, 6)):
            service = rng.choices(list(restores), weights)[0]
            gap = round(rng.expovariate(1 / think) + 1e-3 * t + 1e-4 * k, 4)
            steps.append((service, runs[service], gap))
        workload[f"t{t}"] = steps
    return workload, restores, devices


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def measure(seed: int) -> dict[str, Any]:
    workload, restores, devices = draw(seed)
    simulated = run_simulated(workload, restores, devices)
    live = trio.run(
        run_live, workload, restores, devices, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert live.keys() == simulated.keys()
    keys = sorted(live)
    ours, theirs = [live[k] for k in keys], [simulated[k] for k in keys]
    return {
        "seed": seed,
        "devices": devices,
        "services": len(restores),
        "trajectories": len(workload),
        "actions": len(keys),
        "live_mean_act": round(statistics.mean(ours), 3),
        "simulated_mean_act": round(statistics.mean(theirs), 3),
        "mean_ratio": round(statistics.mean(ours) / statistics.mean(theirs), 3),
        "p95_ratio": round(p95(ours) / p95(theirs), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 workloads, under a minute")
    parser.add_argument("--workloads", type=int, help="how many workloads (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="the first workload's seed")
    args = parser.parse_args(argv)
    count = args.workloads or (16 if args.quick else 64)
    rows = []
    for seed in range(args.seed, args.seed + count):
        row = measure(seed)
        rows.append(row)
        print(
            f"seed {seed}: {row['devices']} devices, {row['services']} services, "
            f"{row['actions']} actions; live/simulated mean ACT {row['mean_ratio']}, "
            f"p95 {row['p95_ratio']}",
            flush=True,
        )
    figures: dict[str, Any] = {"workloads": rows}
    targets = {}
    for stat in ("mean_ratio", "p95_ratio"):
        values = [row[stat] for row in rows]
        worst = max(rows, key=lambda row: row[stat])
        median = round(statistics.median(values), 3)
        figures[stat] = {"median": median, "worst": worst[stat], "worst_seed": worst["seed"]}
        targets[f"live_over_simulated_{stat.split('_')[0]}_act_median"] = {
            "value": median,
            "goal": f"<= {GOAL}",
            "met": median <= GOAL,
        }
    print(json.dumps({"bench": "gpu_live_vs_sim", "figures": figures, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
