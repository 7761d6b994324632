"""The main job until real executors land: one synthetic rollout step, run live twice.

Both arms run the same trajectories (same seed) on the same cores, in real time on the
live runtime: once with :class:`~tangram.ElasticPolicy` lending cores per action and
resizing elastic actions while they run, once the way rollout frameworks do it today,
each trajectory holding a fixed slot of ``cores / trajectories`` from its first action to
its last. Actions are coroutines that take their modelled time and speed up as their
grant grows, so the numbers are measured ACTs, not the model's predictions.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

import anyio
import attrs

from .._core._demand import Elastic
from .._core._efficiency import Amdahl, Efficiency, Linear
from .._core._policy import FcfsPolicy
from .._runtime._lease import Lease
from .._runtime._run import Runtime

__all__ = ["DemoConfig", "DemoResult", "ArmResult", "make_workload", "run_demo"]


@attrs.frozen(kw_only=True)
class DemoConfig:
    """Size of the synthetic step. The defaults fit 2 real cores and take about a minute."""

    trajectories: int = 16
    turns: int = 6
    cores: int = 16
    max_cores: int = 8
    seed: int = 0
    time_scale: float = 1.0


@attrs.frozen
class DemoAction:
    kind: str
    gap: float
    seconds_at_1: float
    efficiency: Efficiency
    elastic: bool


@attrs.frozen
class ArmResult:
    """Measured outcome of one arm: per-action ACT split and the step's resource bill."""

    name: str
    acts: tuple[float, ...]
    queue: float
    exec: float
    overhead: float
    step_seconds: float
    core_seconds: float

    @property
    def avg_act(self) -> float:
        return statistics.fmean(self.acts)

    @property
    def p95_act(self) -> float:
        ordered = sorted(self.acts)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


@attrs.frozen
class DemoResult:
    config: DemoConfig
    tangram: ArmResult
    static: ArmResult

    def ratios(self) -> dict[str, float]:
        """Static over tangram: above 1 means tangram is better."""
        return {
            "avg_act": self.static.avg_act / self.tangram.avg_act,
            "p95_act": self.static.p95_act / self.tangram.p95_act,
            "step_seconds": self.static.step_seconds / self.tangram.step_seconds,
            "core_seconds": self.static.core_seconds / self.tangram.core_seconds,
        }


def make_workload(config: DemoConfig) -> list[list[DemoAction]]:
    """Coding-agent turns: generation gaps, then tests, builds or a quick lint.

    Shapes follow the paper's AI-coding workload: the environment is busy about half of a
    trajectory's life, builds and test suites parallelise (Amdahl), durations are
    heavy-tailed (Pareto, shape 1.5).
    """
    rng = random.Random(config.seed)
    scale = config.time_scale
    workload: list[list[DemoAction]] = []
    for _ in range(config.trajectories):
        turns: list[DemoAction] = []
        for _ in range(config.turns):
            gap = rng.expovariate(1 / 0.8) * scale
            roll = rng.random()
            if roll < 0.45:
                turn = DemoAction("run_tests", gap, _pareto(rng, 1.2) * scale, Amdahl(0.92), True)
            elif roll < 0.8:
                turn = DemoAction("build", gap, _pareto(rng, 1.8) * scale, Amdahl(0.96), True)
            else:
                turn = DemoAction("lint", gap, 0.25 * scale, Linear(), False)
            turns.append(turn)
        workload.append(turns)
    return workload


def _pareto(rng: random.Random, mean: float, shape: float = 1.5) -> float:
    # Pareto with the given mean, capped so one sample cannot dominate a short demo.
    scale = mean * (shape - 1) / shape
    return min(scale * rng.paretovariate(shape), 8 * mean)


async def _work(lease: Lease, seconds_at_1: float, efficiency: Efficiency) -> None:
    """Take the modelled time, re-planning whenever the grant changes."""
    remaining = seconds_at_1
    while remaining > 1e-9:
        units = lease.units or 1
        speed = efficiency.speedup(units)
        started = anyio.current_time()
        with anyio.move_on_after(remaining / speed):
            await lease.wait_resized()
        remaining -= (anyio.current_time() - started) * speed


async def _run_tangram(config: DemoConfig, workload: Sequence[Sequence[DemoAction]]) -> ArmResult:
    acts: list[float] = []
    runtime = Runtime({"cpu": config.cores})
    async with runtime:
        start = anyio.current_time()

        async def trajectory(index: int, turns: Sequence[DemoAction]) -> None:
            for turn in turns:
                await anyio.sleep(turn.gap)
                issued = anyio.current_time()
                demand: object = (
                    Elastic(1, config.max_cores, efficiency=turn.efficiency, resizable=True)
                    if turn.elastic
                    else 1
                )
                async with runtime.acquire(
                    cpu=demand, kind=turn.kind, trajectory=f"t{index}"
                ) as lease:
                    await _work(lease, turn.seconds_at_1, turn.efficiency)
                acts.append(anyio.current_time() - issued)

        async with anyio.create_task_group() as group:
            for index, turns in enumerate(workload):
                group.start_soon(trajectory, index, turns)
        step = anyio.current_time() - start
        stats = runtime.stats()
    kinds = stats.kinds.values()
    total = sum(k.act.count for k in kinds)
    return ArmResult(
        "tangram",
        tuple(acts),
        sum(k.queue.mean * k.queue.count for k in kinds) / total,
        sum(k.exec.mean * k.exec.count for k in kinds) / total,
        sum(k.overhead.mean * k.overhead.count for k in kinds) / total,
        step,
        stats.resources["cpu"].unit_seconds,
    )


async def _run_static(config: DemoConfig, workload: Sequence[Sequence[DemoAction]]) -> ArmResult:
    """Today's frameworks: a slot per trajectory from its first action to its last."""
    slot = max(1, config.cores // config.trajectories)
    acts: list[float] = []
    queue: list[float] = []
    execs: list[float] = []
    overhead: list[float] = []
    runtime = Runtime({"cpu": config.cores}, policy=FcfsPolicy())
    async with runtime:
        start = anyio.current_time()

        async def trajectory(index: int, turns: Sequence[DemoAction]) -> None:
            await anyio.sleep(turns[0].gap)
            issued = anyio.current_time()
            async with runtime.acquire(cpu=slot, kind="slot", trajectory=f"t{index}") as lease:
                waited = anyio.current_time() - issued
                for number, turn in enumerate(turns):
                    if number:
                        await anyio.sleep(turn.gap)
                        issued = anyio.current_time()
                        waited = 0.0
                    began = anyio.current_time()
                    units = min(slot, config.max_cores) if turn.elastic else 1
                    await anyio.sleep(turn.seconds_at_1 / turn.efficiency.speedup(units))
                    done = anyio.current_time()
                    acts.append(done - issued)
                    queue.append(waited)
                    execs.append(done - began)
                    overhead.append(max(0.0, began - issued - waited))
                del lease

        async with anyio.create_task_group() as group:
            for index, turns in enumerate(workload):
                group.start_soon(trajectory, index, turns)
        step = anyio.current_time() - start
        stats = runtime.stats()
    return ArmResult(
        "static",
        tuple(acts),
        statistics.fmean(queue),
        statistics.fmean(execs),
        statistics.fmean(overhead),
        step,
        stats.resources["cpu"].unit_seconds,
    )


def run_demo(config: DemoConfig) -> DemoResult:
    """Run both arms, one after the other, on the same workload."""
    if config.trajectories < 1 or config.turns < 1 or config.cores < 1:
        raise ValueError("trajectories, turns and cores must be >= 1")
    if not (math.isfinite(config.time_scale) and config.time_scale > 0):
        raise ValueError(f"`time_scale` must be > 0 (got {config.time_scale!r})")
    workload = make_workload(config)
    tangram_arm = anyio.run(_run_tangram, config, workload)
    static_arm = anyio.run(_run_static, config, workload)
    return DemoResult(config, tangram_arm, static_arm)
