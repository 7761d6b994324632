"""Recording a live runtime as tangram-trace/1, reading it back and replaying it.

The live runs use trio's ``MockClock(autojump_threshold=0)``: each action's body does its
modelled work and follows its resizes (as in test_live_vs_simulated), so what the
recorder writes can be compared exactly with what the workload asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import pytest
import trio.testing
from conftest import Backend, assert_idle, virtual_backend
from test_live_vs_simulated import random_workload, work

import tangram
from tangram import Elastic, Rate, Step, read_trace
from tangram._sim._record import TraceRecorder, record_trace

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-6
Times = dict[tuple[str, int], tuple[float, float, float]]


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return virtual_backend(autojump_clock)


def workload(seed: int) -> dict[str, list[Step]]:
    """test_live_vs_simulated's random rollouts, less what the format cannot say.

    A trace line names one resource, replays elastic actions as resizable and reads
    ``min == max`` as rigid, so the non-resizable compiles, the GPU-plus-cores actions and
    builds whose range is one value are left out.
    """

    def expressible(step: Step) -> bool:
        if len(step.demand) > 1:
            return False
        elastic = step.demand.get("cpu")
        if isinstance(elastic, Elastic):
            return elastic.resizable and elastic.max > elastic.min
        return True

    return {
        name: [s for s in steps if expressible(s)]
        for name, steps in random_workload(seed, trajectories=5).items()
    }


async def act(runtime: tangram.Runtime, name: str, step: Step) -> tuple[float, float, float]:
    """One action whose body does its modelled work; its queued, admitted, finished times."""
    context = runtime.acquire(
        step.demand, kind=step.kind, trajectory=name, estimate=step.seconds_at_1
    )
    async with context as lease:
        await work(lease, step)
    return lease.queued_at, lease.admitted_at, lease.finished_at


async def run_recorded(
    steps: Mapping[str, Sequence[Step]], capacity: Mapping[str, object], path: Path
) -> Times:
    times: Times = {}

    async def rollout(runtime: tangram.Runtime, name: str) -> None:
        for index, step in enumerate(steps[name]):
            await anyio.sleep(step.gap)
            times[name, index] = await act(runtime, name, step)

    async with tangram.Runtime(capacity=capacity) as runtime:
        async with (
            record_trace(runtime, path, name="live") as recorder,
            anyio.create_task_group() as tg,
        ):
            for name in steps:
                tg.start_soon(rollout, runtime, name)
        assert recorder.actions == sum(len(a) for a in steps.values())
        with pytest.raises(KeyError):  # detached on exit
            runtime.remove_instrument(recorder)
        assert_idle(runtime)
    return times


@pytest.mark.parametrize("seed", [0, 3, 8])
async def test_a_recorded_run_reads_back_as_what_ran_and_replays_the_same(
    tmp_path: Path, seed: int
) -> None:
    capacity = {"cpu": 8, "gpu": 2}
    steps = workload(seed)
    path = tmp_path / "live.jsonl"
    live = await run_recorded(steps, capacity, path)
    trace = read_trace(path)
    assert trace.name == "live"
    assert dict(trace.capacity) == {"cpu": 8, "gpu": 2}
    assert trace.actions == len(live)
    start = min(arrival for arrival, _, _ in live.values())
    for name, actions in steps.items():
        recorded = trace.trajectories[name]
        assert [a.kind for a in recorded] == [s.kind for s in actions]
        for index, (line, step) in enumerate(zip(recorded, actions, strict=True)):
            arrival, _, _ = live[name, index]
            previous = live[name, index - 1][2] if index else start
            assert line.gap == pytest.approx(arrival - previous, abs=TOLERANCE)
            elastic = step.demand.get("cpu")
            if isinstance(elastic, Elastic):
                assert (line.resource, line.min, line.max) == ("cpu", elastic.min, elastic.max)
                assert line.efficiency == step.efficiency
            else:
                ((kind, units),) = step.demand.items()
                assert (line.resource, line.min, line.max) == (kind, units, units)
            # The work done: what the body did, however often it was resized.
            assert line.seconds_at_1 == pytest.approx(step.seconds_at_1, rel=1e-6)
    # Replayed with exact estimates, the same policy makes the same decisions at the same
    # (shifted) times as the live run did.
    result = tangram.simulate(trace.workload(), trace.runtime_capacity())
    replayed = {
        (r.trajectory, r.index): (r.arrival, r.admitted, r.finished) for r in result.records
    }
    assert replayed.keys() == live.keys()
    for key, (arrival, admitted, finished) in live.items():
        expected = (arrival - start, admitted - start, finished - start)
        assert replayed[key] == pytest.approx(expected, abs=1e-4)


async def test_withdrawn_and_unnameable_actions_stay_out(tmp_path: Path) -> None:
    capacity = {"cpu": 2, "search_api": Rate(2, burst=2), "gpu_mem:cuda:0": "1GiB"}
    path = tmp_path / "out.jsonl"
    async with tangram.Runtime(capacity=capacity) as runtime:
        recorder = TraceRecorder(runtime, name="mixed")
        async with runtime.acquire({"cpu": 2}, kind="hog", trajectory="a"):

            async def late() -> None:
                with anyio.move_on_after(1.0):  # queued behind the hog, then cancelled
                    async with runtime.acquire({"cpu": 1}, kind="late", trajectory="b"):
                        pass

            # Another task's: in the hog's own task it would be a SelfDeadlockError.
            async with anyio.create_task_group() as tg:
                tg.start_soon(late)
            await anyio.sleep(2.0)
        async with runtime.acquire({"search_api": 1}, kind="search", trajectory="a"):
            await anyio.sleep(0.5)
        async with runtime.acquire({"gpu_mem:cuda:0": "512MiB"}, kind="gpu:judge"):
            await anyio.sleep(0.5)
        recorder.detach()
        await recorder.write(path)
    trace = read_trace(path)
    assert dict(trace.capacity) == {"cpu": 2, "search_api": 2}
    assert (recorder.withdrawn, recorder.skipped, recorder.actions) == (1, 1, 3)
    hog, search = trace.trajectories["a"]
    assert (hog.kind, hog.resource, hog.min, hog.seconds_at_1) == ("hog", "cpu", 2, 3.0)
    assert (search.kind, search.resource, search.max, search.gap) == ("search", "search_api", 1, 0)
    assert "b" not in trace.trajectories


async def test_the_trace_is_written_when_the_block_fails(tmp_path: Path) -> None:
    path = tmp_path / "failed.jsonl"
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        with pytest.raises(RuntimeError, match="boom"):
            async with record_trace(runtime, path):
                async with runtime.acquire({"cpu": 1}, kind="x", trajectory="t"):
                    await anyio.sleep(1.0)
                raise RuntimeError("boom")
    (line,) = read_trace(path).trajectories["t"]
    assert (line.kind, line.seconds_at_1) == ("x", 1.0)
    with pytest.raises(TypeError, match=r"must be a tangram\.Runtime"):
        TraceRecorder(object())  # type: ignore[arg-type]
