"""The live runtime and the simulator make the same decisions on the same workload.

The workload runs twice: through :func:`tangram.simulate`, and live through
:class:`tangram.Runtime` on trio with ``MockClock(autojump_threshold=0)``, where each
action's body does the modelled work and follows its resizes (work left over the speedup
of the units it holds now; wait for a resize or for the time that work takes; subtract
the progress made). Both give the policy the exact estimates, so the same admissions at
the same times, and the same finish times, are expected up to float rounding.

Event times are kept distinct (no arrival or finish at the same instant as another):
the simulator plans once per instant, the runtime once per event, so simultaneous events
may legitimately be decided in a different grouping.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

import anyio
import pytest
import trio.testing
from conftest import Backend, assert_idle, virtual_backend

import tangram
from tangram import Amdahl, Elastic, Linear, Power, Step

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-6
Workload = Mapping[str, Sequence[Step]]
Times = dict[tuple[str, int], tuple[float, float, float]]


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return virtual_backend(autojump_clock)


def elastic(low: int, high: int, efficiency: tangram.Efficiency, resizable: bool) -> Elastic:
    return Elastic(low, high, efficiency=efficiency, resizable=resizable)


CAPACITY = {"cpu": 8, "gpu": 1}
# Four rollouts: resizable builds that share the cores, a rigid test, a non-resizable
# compile, a judge that needs the one GPU. Gaps are "thinking" between actions.
WORKLOAD: Workload = {
    "t0": [
        Step(
            demand={"cpu": elastic(2, 8, Amdahl(0.9), True)},
            seconds_at_1=6.0,
            efficiency=Amdahl(0.9),
            gap=0.11,
            kind="build",
        ),
        Step(demand={"cpu": 2}, seconds_at_1=1.5, gap=0.23, kind="test"),
        Step(
            demand={"cpu": elastic(1, 8, Amdahl(0.9), True)},
            seconds_at_1=3.0,
            efficiency=Amdahl(0.9),
            gap=0.05,
            kind="build",
        ),
    ],
    "t1": [
        Step(demand={"gpu": 1, "cpu": 1}, seconds_at_1=2.2, gap=0.31, kind="judge"),
        Step(
            demand={"cpu": elastic(1, 6, Power(0.8), True)},
            seconds_at_1=5.0,
            efficiency=Power(0.8),
            gap=0.47,
            kind="build",
        ),
    ],
    "t2": [
        Step(
            demand={"cpu": elastic(1, 4, Amdahl(0.7), False)},
            seconds_at_1=4.4,
            efficiency=Amdahl(0.7),
            gap=0.62,
            kind="compile",
        ),
        Step(demand={"cpu": 3}, seconds_at_1=0.9, gap=0.19, kind="test"),
    ],
    "t3": [
        # Arrives while t1's judge holds the GPU: it queues whatever the policy.
        Step(demand={"gpu": 1}, seconds_at_1=1.7, gap=1.03, kind="judge"),
        Step(
            demand={"cpu": elastic(1, 8, Amdahl(0.95), True)},
            seconds_at_1=8.0,
            efficiency=Amdahl(0.95),
            gap=0.29,
            kind="build",
        ),
    ],
}


def random_workload(seed: int, trajectories: int = 6, steps: int = 4) -> Workload:
    """Mixed rollouts with irregular gaps and durations (so no two events coincide)."""
    rng = random.Random(seed)
    workload: dict[str, list[Step]] = {}
    for t in range(trajectories):
        actions: list[Step] = []
        for _ in range(steps):
            kind = rng.choice(["build", "test", "judge", "compile", "mixed"])
            gap = rng.uniform(0.05, 1.5)
            seconds = rng.uniform(0.3, 8.0)
            efficiency = rng.choice([Amdahl(0.9), Amdahl(0.6), Power(0.8), Linear()])
            demand: dict[str, object]
            if kind == "build":
                low = rng.randint(1, 3)
                demand = {"cpu": elastic(low, rng.randint(low, 8), efficiency, True)}
            elif kind == "compile":
                low = rng.randint(1, 2)
                demand = {"cpu": elastic(low, rng.randint(low, 6), efficiency, False)}
            elif kind == "mixed":
                demand = {"gpu": 1, "cpu": elastic(1, 4, efficiency, True)}
            else:
                demand = {"gpu": 1} if kind == "judge" else {"cpu": rng.randint(1, 4)}
                efficiency = Linear()
            actions.append(
                Step(demand=demand, seconds_at_1=seconds, efficiency=efficiency, gap=gap, kind=kind)
            )
        workload[f"t{t}"] = actions
    return workload


async def work(lease: tangram.Lease, step: Step) -> None:
    """Do ``step``'s modelled work, going faster or slower as the grant is resized."""
    left = step.seconds_at_1  # work left, in seconds on one unit
    elastic = lease.action.demand.elastic
    if elastic is None or not elastic.resizable:  # its grant is what it keeps
        units = lease.units
        await anyio.sleep(left / (step.efficiency.speedup(units) if units else 1.0))
        return
    since = anyio.current_time()
    while True:
        units = lease.units
        speed = step.efficiency.speedup(units) if units else 1.0
        with anyio.move_on_after(left / speed) as scope:
            await lease.wait_resized()
        now = anyio.current_time()
        left = max(0.0, left - (now - since) * speed)
        since = now
        if scope.cancelled_caught:  # the work ran out before any further resize
            return


async def run_live(
    workload: Workload, capacity: Mapping[str, object], policy: tangram.abc.Policy | None = None
) -> tuple[Times, tangram.Stats]:
    times: Times = {}
    async with tangram.Runtime(capacity=capacity, policy=policy) as runtime:

        async def rollout(name: str, steps: Sequence[Step]) -> None:
            for index, step in enumerate(steps):
                await anyio.sleep(step.gap)
                context = runtime.acquire(
                    step.demand, kind=step.kind, trajectory=name, estimate=step.seconds_at_1
                )
                async with context as lease:
                    await work(lease, step)
                times[name, index] = (lease.queued_at, lease.admitted_at, lease.finished_at)

        async with anyio.create_task_group() as tg:
            for name, steps in workload.items():
                tg.start_soon(rollout, name, steps)
        assert_idle(runtime)
        return times, runtime.stats()


def admission_order(times: Times) -> list[tuple[str, int]]:
    return sorted(times, key=lambda key: (times[key][1], times[key][0]))


def simulated_times(result: tangram.SimulationResult) -> Times:
    return {(r.trajectory, r.index): (r.arrival, r.admitted, r.finished) for r in result.records}


def assert_distinct_event_times(times: Times) -> None:
    events = sorted([arrival for arrival, _, _ in times.values()] + [f for *_, f in times.values()])
    gaps = [b - a for a, b in itertools.pairwise(events)]
    assert min(gaps) > 1e-6, "the workload has simultaneous events; see the module docstring"


def assert_same_decisions(simulated: Times, live: Times) -> None:
    assert live.keys() == simulated.keys()
    assert admission_order(live) == admission_order(simulated)
    for key, (arrival, admitted, finished) in simulated.items():
        got = live[key]
        assert got[0] == pytest.approx(arrival, abs=TOLERANCE), f"{key} arrival"
        assert got[1] == pytest.approx(admitted, abs=TOLERANCE), f"{key} admitted"
        assert got[2] == pytest.approx(finished, abs=TOLERANCE), f"{key} finished"


async def test_live_runtime_decides_as_the_simulator() -> None:
    result = tangram.simulate(WORKLOAD, CAPACITY)
    simulated = simulated_times(result)
    assert_distinct_event_times(simulated)
    # The workload exercises what it is meant to: queueing, sharing and resizing.
    assert any(admitted > arrival for arrival, admitted, _ in simulated.values())
    assert result.resizes > 0
    live, stats = await run_live(WORKLOAD, CAPACITY)
    assert_same_decisions(simulated, live)
    assert stats.resizes == result.resizes
    last_finish = max(finished for *_, finished in simulated.values())
    assert anyio.current_time() == pytest.approx(last_finish, abs=TOLERANCE)


def test_simulated_step_ends_with_its_last_action() -> None:
    result = tangram.simulate(WORKLOAD, CAPACITY)
    assert result.step_seconds == max(r.finished for r in result.records)


async def test_the_body_follows_resizes_to_the_modelled_duration() -> None:
    """One resizable action alone, then shrunk by a second: its time is the model's."""
    amdahl = Amdahl(0.8)
    big = Step(demand={"cpu": elastic(1, 4, amdahl, True)}, seconds_at_1=10.0, efficiency=amdahl)
    small = Step(demand={"cpu": 2}, seconds_at_1=1.0, gap=1.0)
    workload = {"a": [big], "b": [small]}
    live, _ = await run_live(workload, {"cpu": 4})
    # 1 s on 4 units, 1 s on 2 while "b" holds 2, then 4 units again until done.
    done_first = amdahl.speedup(4) + amdahl.speedup(2)
    expected = 2.0 + (10.0 - done_first) / amdahl.speedup(4)
    assert live["a", 0] == (0.0, 0.0, pytest.approx(expected, abs=TOLERANCE))
    assert live["b", 0] == (1.0, 1.0, 2.0)
    assert_same_decisions(simulated_times(tangram.simulate(workload, {"cpu": 4})), live)


@pytest.mark.parametrize("seed", [0, 5, 6, 7, 14])
async def test_live_runtime_decides_as_the_simulator_on_random_workloads(seed: int) -> None:
    capacity = {"cpu": 8, "gpu": 2}
    workload = random_workload(seed)
    result = tangram.simulate(workload, capacity)
    simulated = simulated_times(result)
    assert_distinct_event_times(simulated)
    live, stats = await run_live(workload, capacity)
    assert_same_decisions(simulated, live)
    # Not only the same outcome: the same number of policy passes, resizes and evictions.
    assert (stats.decisions, stats.resizes, stats.evictions) == (
        result.decisions,
        result.resizes,
        result.evictions,
    )


# Size-aware admission with a short aging allowance, so that actions fall due while they
# wait; its `srpt` reference (shortest first, never due); and first-come-first-served.
ORDERS = {
    "size": tangram.ElasticPolicy(aging=0.5),
    "srpt": tangram.ElasticPolicy(aging=math.inf, starvation_bound=math.inf),
    "arrival": tangram.ElasticPolicy(order="arrival"),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_live_runtime_orders_the_queue_as_the_simulator(order: str, seed: int) -> None:
    capacity = {"cpu": 4, "gpu": 1}
    workload = random_workload(seed, trajectories=8)
    policy = ORDERS[order]
    result = tangram.simulate(workload, capacity, policy=policy)
    simulated = simulated_times(result)
    assert_distinct_event_times(simulated)
    # Contended enough that the order of the queue decides: some action starts before
    # one that arrived earlier and was still waiting (under every order, by backfill).
    assert any(
        b[0] > a[0] and b[1] < a[1] for a, b in itertools.permutations(simulated.values(), 2)
    )
    live, stats = await run_live(workload, capacity, policy)
    assert_same_decisions(simulated, live)
    assert (stats.decisions, stats.resizes, stats.evictions) == (
        result.decisions,
        result.resizes,
        result.evictions,
    )


def test_the_orders_decide_differently() -> None:
    """The test above compares three different schedules, not one schedule three times."""
    capacity = {"cpu": 4, "gpu": 1}
    for seed in (1, 2, 3):
        workload = random_workload(seed, trajectories=8)
        orders = [
            admission_order(simulated_times(tangram.simulate(workload, capacity, policy=p)))
            for p in ORDERS.values()
        ]
        assert orders[0] != orders[2] and orders[1] != orders[2]


def test_random_workloads_have_no_simultaneous_events() -> None:
    for seed in range(20):
        assert_distinct_event_times(
            simulated_times(tangram.simulate(random_workload(seed), CAPACITY))
        )


def test_finish_times_are_not_rounded_together() -> None:
    """The tolerance is far below the spacing of events, so it cannot hide a decision."""
    times = simulated_times(tangram.simulate(WORKLOAD, CAPACITY))
    finishes = sorted(f for *_, f in times.values())
    assert min(b - a for a, b in itertools.pairwise(finishes)) > 1000 * TOLERANCE
    assert all(math.isfinite(f) for f in finishes)
