"""The live GPU pool and the simulator place, evict and drain replicas the same way.

Both call the placement rules of ``tangram/_core/_placement.py``; this runs one workload
through each and compares what they did. Live: a :class:`tangram.gpu.GpuPool` on two CPU
stand-in devices (``cpu:0``, ``cpu:1``: no GPU here, and none is needed, since the pool's
decisions are the same code on any device) with model services that only take virtual
time to restore and run, on trio with ``MockClock(autojump_threshold=0)``. Simulated:
:func:`tangram.simulate` with the same services on two devices of one service's memory
each.

The two keep different books (the pool grants each device's bytes, the simulator a count
of GPUs; the pool learns run times, the simulator is told them), so the workloads are
chosen where the books agree: every service fills a device, so a device holds one
replica; one action per replica at a time (``max_batch=1``, whose merged runs and the
simulator's concurrent ones are then the same); ``max_replicas`` equal to the devices, so
only the devices bound the replicas, as in the simulator; one replica waits for a grant
at a time; each service's actions take the same time, so the pool's learnt run time is
the simulator's; no two events at one instant except those one decision causes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import anyio
import pytest
import trio.testing
from conftest import Backend, virtual_backend

import tangram
from tangram import ElasticPolicy
from tangram._core import _placement as rules
from tangram._gpu import _placing
from tangram._sim import _simulate
from tangram._sim._residency import Placement, Residency, ServiceSpec
from tangram.gpu import Device, GpuPool, ModelService

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-6
DEVICES = 2
MEMORY = 1000  # bytes live, one "GiB" simulated: a replica fills its device
# (time, "restore" or "evict", service, device indices)
Event = tuple[float, str, str, tuple[int, ...]]
# (trajectory, step) -> (start of its run, end of its run)
Runs = dict[tuple[str, int], tuple[float, float]]
# trajectory -> [(service, seconds, gap before it)]
Workload = Mapping[str, Sequence[tuple[str, float, float]]]


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return virtual_backend(autojump_clock)


# A waiter forcing a drain: a1 and a2 hold both devices with A, C comes and waits for
# cpu:0, so when a3 comes A's replica there (the least loaded, then the longest held, past
# its tenure) drains and a3 queues on the other one; C gets cpu:0 when a1 ends. Then B
# waits for cpu:0 until C ends. Three services, two devices.
DRAIN_RESTORES = {"A": 0.5, "B": 0.7, "C": 0.65}
DRAIN: Workload = {
    "a1": [("A", 3.0, 0.1)],
    "a2": [("A", 3.0, 0.2)],
    "c": [("C", 1.0, 1.0)],
    "a3": [("A", 3.0, 2.0)],
    "b": [("B", 1.0, 4.0)],
}

# Waiting in line against a restore: once A's run time (1 s) is known, a newcomer that
# finds A's replica full waits there (one run) rather than restore A beside it (2 s);
# B's actions find B resident where the pool was warmed.
QUEUE_RESTORES = {"A": 2.0, "B": 0.3}
QUEUE: Workload = {
    "a": [("A", 1.0, 0.1), ("A", 1.0, 0.4)],
    "a2": [("A", 1.0, 1.6)],
    "b": [("B", 0.5, 1.7), ("B", 0.5, 0.45)],
}


class Stand(ModelService):
    """A service that takes virtual time to restore and to run, and says what it did."""

    def __init__(self, name: str, restore_seconds: float, log: list[Any]) -> None:
        super().__init__(name, memory=MEMORY, max_replicas=DEVICES, max_batch=1)
        self.restore_seconds = restore_seconds
        self.log = log
        self.where: dict[int, tuple[int, ...]] = {}
        self.runs: Runs = {}
        self.start = 0.0

    def _now(self) -> float:
        return anyio.current_time() - self.start

    async def load(self) -> None:
        pass

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        where = tuple(int(d.name.split(":")[1]) for d in devices)
        self.where[replica] = where
        self.log.append((self._now(), "restore", self.name, where))
        await anyio.sleep(self.restore_seconds)

    async def evict(self, replica: int) -> None:
        self.log.append((self._now(), "evict", self.name, self.where[replica]))

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        [(key, seconds)] = batches
        started = self._now()
        await anyio.sleep(seconds)
        self.runs[key] = (started, self._now())
        return [None]


async def run_live(
    workload: Workload, restores: Mapping[str, float], policy: ElasticPolicy | None = None
) -> tuple[dict[str, list[tuple[int, ...]]], list[Event], Runs, dict[str, Any]]:
    log: list[Any] = []
    services = [Stand(name, seconds, log) for name, seconds in restores.items()]
    devices = [Device(f"cpu:{i}", memory=MEMORY) for i in range(DEVICES)]
    async with GpuPool(services, devices=devices, links=[]) as pool:
        warmed = {
            name: [tuple(int(n.split(":")[1]) for n in names) for names in where]
            for name, where in pool.residency().items()
            if where
        }
        log.clear()
        async with tangram.Runtime(capacity=pool.capacity(), policy=policy):
            start = anyio.current_time()
            for service in services:
                service.start = start

            async def rollout(name: str, steps: Sequence[tuple[str, float, float]]) -> None:
                for index, (service, seconds, gap) in enumerate(steps):
                    await anyio.sleep(gap)
                    async with pool.use(service) as svc:
                        await svc(((name, index), seconds))

            async with anyio.create_task_group() as tg:
                for name, steps in workload.items():
                    tg.start_soon(rollout, name, steps)
        # Before the pool closes, which evicts everything.
        events = sorted(log, key=lambda e: e[0])
        stats = pool.service_stats()
    runs = {key: times for service in services for key, times in service.runs.items()}
    return warmed, events, runs, stats


class Recording(Residency):
    """The simulator's residency model, noting each restore and eviction as it places."""

    made: ClassVar[list[Recording]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[Event] = []
        self.warmed: dict[str, list[tuple[int, ...]]] = {}
        Recording.made.append(self)

    def warm(self) -> int:
        placed = super().warm()
        self.warmed = self.resident()
        return placed

    def place(self, service: str | None, gpus: int, now: float) -> Placement:
        before, restores = self.resident(), self.restores
        placement = super().place(service, gpus, now)
        after = self.resident()
        for name, where in before.items():
            for devices in where:
                if devices not in after.get(name, []):
                    self.log.append((now, "evict", name, devices))
        if self.restores > restores:
            assert service is not None
            self.log.append((now, "restore", service, placement.devices))
        return placement


def run_simulated(
    workload: Workload,
    restores: Mapping[str, float],
    monkeypatch: pytest.MonkeyPatch,
    policy: ElasticPolicy | None = None,
) -> tuple[Recording, Runs, tangram.SimulationResult]:
    Recording.made = []
    monkeypatch.setattr(_simulate, "Residency", Recording)
    trajectories = {
        name: [
            tangram.Step(
                demand={"gpu": 1}, seconds_at_1=seconds, gap=gap, kind=service, service=service
            )
            for service, seconds, gap in steps
        ]
        for name, steps in workload.items()
    }
    services = {
        name: ServiceSpec(name=name, gpu_mem_gib=1.0, restore_seconds=seconds, max_batch=1)
        for name, seconds in restores.items()
    }
    result = tangram.simulate(
        trajectories,
        {"gpu": DEVICES},
        policy=policy,
        services=services,
        gpu_mem_gib_per_device=1.0,
    )
    [residency] = Recording.made
    runs = {(r.trajectory, r.index): (r.admitted + r.overhead, r.finished) for r in result.records}
    return residency, runs, result


def assert_same_events(simulated: Sequence[Event], live: Sequence[Event]) -> None:
    assert [e[1:] for e in live] == [e[1:] for e in simulated]
    for got, want in zip(live, simulated, strict=True):
        assert got[0] == pytest.approx(want[0], abs=TOLERANCE), f"{want} at {got[0]}"


def assert_same_runs(simulated: Runs, live: Runs) -> None:
    assert live.keys() == simulated.keys()
    assert sorted(live, key=lambda k: live[k]) == sorted(simulated, key=lambda k: simulated[k])
    for key, (start, end) in simulated.items():
        assert live[key] == (
            pytest.approx(start, abs=TOLERANCE),
            pytest.approx(end, abs=TOLERANCE),
        ), key


@pytest.mark.parametrize(
    ("workload", "restores"),
    [(DRAIN, DRAIN_RESTORES), (QUEUE, QUEUE_RESTORES)],
    ids=["drain", "queue"],
)
async def test_live_pool_places_as_the_simulator(
    workload: Workload, restores: Mapping[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    residency, simulated_runs, result = run_simulated(workload, restores, monkeypatch)
    warmed, live_events, live_runs, stats = await run_live(workload, restores)
    assert warmed == residency.warmed
    assert_same_events(residency.log, live_events)
    assert_same_runs(simulated_runs, live_runs)
    assert sum(s["restores"] for s in stats.values()) == result.restores
    assert sum(s["evictions"] for s in stats.values()) == result.unloads


def test_the_drain_workload_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the drain workload is for, spelt out: without the drain, a3 would queue on
    cpu:0 behind a1 and C would wait for a3 too."""
    residency, runs, _ = run_simulated(DRAIN, DRAIN_RESTORES, monkeypatch)
    assert residency.warmed == {"A": [(0,)], "B": [(1,)]}
    assert residency.log == [
        (pytest.approx(0.2), "evict", "B", (1,)),
        (pytest.approx(0.2), "restore", "A", (1,)),
        (pytest.approx(3.1), "evict", "A", (0,)),
        (pytest.approx(3.1), "restore", "C", (0,)),
        (pytest.approx(4.75), "evict", "C", (0,)),
        (pytest.approx(4.75), "restore", "B", (0,)),
    ]
    # a3 waits for a2 on cpu:1, not for a1 on the draining replica on cpu:0.
    assert runs["a3", 0] == (pytest.approx(3.7), pytest.approx(6.7))
    assert runs["c", 0] == (pytest.approx(3.75), pytest.approx(4.75))
    assert runs["b", 0] == (pytest.approx(5.45), pytest.approx(6.45))


def test_the_queue_workload_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    residency, runs, result = run_simulated(QUEUE, QUEUE_RESTORES, monkeypatch)
    assert residency.log == []  # nothing restored beside A: the line was shorter
    assert runs["a2", 0] == (pytest.approx(2.5), pytest.approx(3.5))
    assert (result.restores, result.unloads) == (0, 0)


# Contention: a service with work queued takes a device from one with none. A's run time
# (1 s) is learnt by a0; b (3 s) holds cpu:1. A's actions come at 2.0, 2.1, 2.2: the third
# finds two behind the one running, 2 s of queued work, as long as another replica's
# restore, so A's share of the two devices by queued work is both: a second replica asks
# for cpu:1 though it is busy, B's replica (past its tenure, nothing queued for it)
# drains, and A's second copy is restored there for a3 when b ends. The rule it replaced
# (another copy only where a device has room now) queued a3 on cpu:0.
SHARE_RESTORES = {"A": 2.0, "B": 0.5}
SHARE: Workload = {
    "a0": [("A", 1.0, 0.1)],
    "b": [("B", 3.0, 0.2)],
    **{f"a{i}": [("A", 1.0, 1.9 + 0.1 * i)] for i in range(1, 4)},
}


async def test_live_pool_shares_devices_by_queued_work_as_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    residency, simulated_runs, result = run_simulated(SHARE, SHARE_RESTORES, monkeypatch)
    assert residency.log == [
        (pytest.approx(3.2), "evict", "B", (1,)),
        (pytest.approx(3.2), "restore", "A", (1,)),
    ]
    warmed, live_events, live_runs, stats = await run_live(SHARE, SHARE_RESTORES)
    assert warmed == residency.warmed
    assert_same_events(residency.log, live_events)
    assert_same_runs(simulated_runs, live_runs)
    assert sum(s["restores"] for s in stats.values()) == result.restores


@pytest.mark.parametrize("bound", [7.0, math.inf])
async def test_the_live_pool_weighs_lines_against_its_policy_s_starvation_bound(
    bound: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The share rule's ``starved`` is the bound of the runtime's policy, as in the
    simulator (``test_simulate.py`` shows what it changes there). Live, an action is
    bound to a replica when it comes, so a replica drained for a starved line still
    serves the actions bound to it first: the rule stops it taking newcomers."""
    seen: list[float] = []

    def targets(
        lines: Sequence[rules.Backlog[str]], capacity: float, starved: float = math.inf
    ) -> dict[str, int]:
        seen.append(starved)
        return rules.targets(lines, capacity, starved)

    monkeypatch.setattr(_placing, "rules", _Without(targets=targets))
    await run_live(SHARE, SHARE_RESTORES, ElasticPolicy(starvation_bound=bound))
    assert seen and set(seen) == {bound}


# Starved: C waits behind two lines that never empty. A's actions come every second and
# take 1.9 s, B's every second and take 2.1 s, so both lines grow from the start and their
# heads age at about half the clock's pace. C, warmed on cpu:0 and evicted there for B at
# 0.57 s, comes at 1.0 s and finds both devices busy. Its line scores its wait less MOVE
# restores (8 x 4.3 s), which passes the wait of A's head only at 66.63 s (an A action
# ends); past the policy's starvation bound (30 s) it scores its wait alone, which passes
# A's at the first look after 31 s: A's arrival at 31.13 s.
STARVE_RESTORES = {"C": 4.3, "A": 1.1, "B": 1.2}
C_COMES = 1.0
STARVE: Workload = {
    "c": [("C", 1.0, C_COMES)],
    **{f"a{i}": [("A", 1.9, 0.13 + i)] for i in range(45)},
    **{f"b{i}": [("B", 2.1, 0.57 + i)] for i in range(45)},
}


def record_c_share(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Each look at the lines while C waited, in either pool: when, and the replicas the
    share rule gave C (both pools call it through the one module)."""
    seen: list[tuple[float, int]] = []
    real = rules.targets

    def targets(
        lines: Sequence[rules.Backlog[str]], capacity: float, starved: float = math.inf
    ) -> dict[str, int]:
        share = real(lines, capacity, starved)
        [c] = [line for line in lines if line.key == "C"]
        if c.count:
            seen.append((C_COMES + c.oldest, share["C"]))
        return share

    monkeypatch.setattr(rules, "targets", targets)
    return seen


def given_from(seen: Sequence[tuple[float, int]]) -> float:
    """The look from which the share gives C a device at every look while it waits.

    The first few seconds are left out: there the pools look at different moments (live
    has no learnt run time yet, and weighs no lines for a service none of whose replicas
    waits for a grant), and while the lines ahead are short the share flips between one
    device and none."""
    refused = [i for i, (_, given) in enumerate(seen) if not given]
    assert refused, "C was never refused a device: the workload no longer starves it"
    assert refused[-1] + 1 < len(seen), "C was still refused at its last look"
    return seen[refused[-1] + 1][0]


@pytest.mark.parametrize(
    ("bound", "given_at", "simulated_c_runs"),
    [(30.0, 31.13, 36.73), (31.2, 32.43, 38.63), (math.inf, 66.63, 72.83)],
)
async def test_both_pools_give_a_starved_line_a_device_at_the_same_look(
    bound: float, given_at: float, simulated_c_runs: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The starvation rule fires in the live pool's share as in the simulator's: each gives
    C a device at the first look past the bound, else at the first past the move hurdle,
    and from 3 s on every look of the simulator's is one of the live pool's, at the same
    time with the same share.

    Then both pools run every action at the same time. A's replica drains and first
    serves the action seated on it at that look (at an arrival, the one it runs; at an
    end, the next in line), then C is restored: 31.13 + 1.3 + 4.3 s with the bound, the
    arrival coming 1.3 s before A's run ends; 32.43 + 1.9 + 4.3 with a bound of 31.2 s,
    met at an A action's end; 66.63 + 1.9 + 4.3 without. Live, C's replica first waits
    for cpu:0, B's device, where no replica is above its share: it moves to A's
    (``wait_on``). And A's later actions wait in A's line, not on the draining replica.
    Without either change the live C ran at 100.57 s, when B's line was served out.
    """
    policy = ElasticPolicy(starvation_bound=bound)
    seen = record_c_share(monkeypatch)
    _, simulated, _ = run_simulated(STARVE, STARVE_RESTORES, monkeypatch, policy)
    simulated_seen, seen[:] = list(seen), []
    _, _, live, _ = await run_live(STARVE, STARVE_RESTORES, policy)
    assert given_from(simulated_seen) == pytest.approx(given_at, abs=TOLERANCE)
    assert given_from(seen) == pytest.approx(given_at, abs=TOLERANCE)
    looks = {(round(at, 6), given) for at, given in seen}
    assert {(round(at, 6), given) for at, given in simulated_seen if at > 3.0} <= looks
    assert simulated["c", 0][0] == pytest.approx(simulated_c_runs, abs=TOLERANCE)
    assert_same_runs(simulated, live)


async def test_the_share_rule_decides_the_live_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule in the live pool alone (each service keeps the replicas it has),
    the live pool no longer places as the simulator: the match above is the rule's."""
    residency, simulated_runs, _ = run_simulated(SHARE, SHARE_RESTORES, monkeypatch)

    def keep(
        lines: Sequence[rules.Backlog[str]], capacity: float, starved: float = math.inf
    ) -> dict[str, int]:
        return {line.key: line.replicas for line in lines}

    monkeypatch.setattr(_placing, "rules", _Without(targets=keep))
    _, live_events, live_runs, _ = await run_live(SHARE, SHARE_RESTORES)
    assert live_events != residency.log
    assert live_runs["a3", 0] != simulated_runs["a3", 0]


class _Without:
    """The placement rules with some replaced, for the live pool alone."""

    def __init__(self, **replaced: Any) -> None:
        self._replaced = replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name, getattr(rules, name))
