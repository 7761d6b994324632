"""Bounded accounting: summaries, the per-kind recorder, and ``Runtime.stats()`` snapshots."""

from __future__ import annotations

import math
from collections import deque

import anyio
import attrs
import pytest
from conftest import wait_until

import tangram
from tangram._core._stats import Outcome, Recorder, Summary, most_in_window


def summary(values: list[float]) -> Summary:
    return Summary.of(deque(values), len(values), sum(values))


def test_empty_summary_is_nan() -> None:
    empty = summary([])
    assert empty.count == 0
    assert all(math.isnan(x) for x in (empty.mean, empty.p50, empty.p95, empty.p99))


@pytest.mark.parametrize(
    ("values", "p50", "p95", "p99"),
    [
        ([7.0], 7.0, 7.0, 7.0),
        ([1.0, 2.0], 1.0, 2.0, 2.0),
        ([4.0, 1.0, 3.0, 2.0], 2.0, 4.0, 4.0),
        ([float(i) for i in range(1, 21)], 10.0, 19.0, 20.0),
        ([float(i) for i in range(100, 0, -1)], 50.0, 95.0, 99.0),
        ([float(i) for i in range(1, 1001)], 500.0, 950.0, 990.0),
    ],
)
def test_quantiles_are_nearest_rank(
    values: list[float], p50: float, p95: float, p99: float
) -> None:
    result = summary(values)
    assert (result.p50, result.p95, result.p99) == (p50, p95, p99)
    assert result.mean == pytest.approx(sum(values) / len(values))


def test_recorder_keeps_a_window_but_counts_everything() -> None:
    recorder = Recorder(window=10)
    for i in range(100):
        recorder.record("k", Outcome.COMPLETED, float(i), 0.0, 1.0)
    stats = recorder.kinds()["k"]
    assert stats.completed == 100
    assert stats.queue.count == 100
    assert stats.queue.mean == pytest.approx(49.5)  # over all samples
    assert stats.queue.p50 == 94.0  # over the last ten: 90..99
    assert len(recorder._kinds["k"].queue.recent) == 10


def test_recorder_forgets_the_least_recently_used_kind() -> None:
    recorder = Recorder(max_kinds=2)
    recorder.record("a", Outcome.COMPLETED, 0.0, 0.0, 1.0)
    recorder.record("b", Outcome.COMPLETED, 0.0, 0.0, 1.0)
    recorder.record("a", Outcome.FAILED, 0.0, 0.0, 1.0)
    recorder.record("c", Outcome.COMPLETED, 0.0, 0.0, 1.0)
    kinds = recorder.kinds()
    assert set(kinds) == {"a", "c"}
    assert (kinds["a"].completed, kinds["a"].failed) == (1, 1)


def test_recorder_outcomes_and_what_each_contributes() -> None:
    recorder = Recorder()
    recorder.record("k", Outcome.COMPLETED, 1.0, 0.5, 2.0)
    recorder.record("k", Outcome.FAILED, 3.0, 0.5, 1.0)
    recorder.record("k", Outcome.CANCELLED, 4.0, 0.0, 0.0)  # cancelled while queued
    recorder.record("k", Outcome.CANCELLED, 0.0, 0.0, 5.0)  # cancelled while running
    stats = recorder.kinds()["k"]
    assert (stats.completed, stats.failed, stats.cancelled) == (1, 1, 2)
    assert stats.queue.count == 4
    assert stats.exec.count == 3  # the queued-only cancellation ran for no time
    assert stats.act.count == 3
    assert stats.act.mean == pytest.approx((3.5 + 4.5 + 5.0) / 3)


def test_snapshots_are_frozen_values() -> None:
    recorder = Recorder()
    recorder.record("k", Outcome.COMPLETED, 1.0, 0.0, 1.0)
    stats = recorder.kinds()["k"]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.completed = 5  # type: ignore[misc]
    recorder.record("k", Outcome.COMPLETED, 1.0, 0.0, 1.0)
    assert stats.completed == 1  # a snapshot does not change afterwards


def test_stats_of_a_runtime_that_never_ran() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 4, "api": "10/s"})
    stats = runtime.stats()
    assert (stats.waiting, stats.running, stats.decisions, stats.resizes) == (0, 0, 0, 0)
    assert stats.kinds == {}
    cpu = stats.resources["cpu"]
    assert (cpu.total, cpu.held, cpu.utilisation, cpu.unit_seconds, cpu.peak) == (4, 0, 0, 0, 0)
    api = stats.resources["api"]
    assert (api.total, api.held, api.utilisation) == (10, 0, 0)


@pytest.mark.anyio
async def test_runtime_stats_while_running() -> None:
    async with tangram.Runtime(capacity={"cpu": 4, "gpu": 2}) as runtime:
        async with anyio.create_task_group() as tg:
            gate = anyio.Event()

            async def action(kind: str, demand: dict[str, object]) -> None:
                async with runtime.acquire(demand, kind=kind):
                    await gate.wait()

            tg.start_soon(action, "build", {"cpu": 3})
            tg.start_soon(action, "judge", {"gpu": 1})
            await wait_until(lambda: runtime.stats().running == 2)
            tg.start_soon(action, "build", {"cpu": 2})
            tg.start_soon(action, "build", {"cpu": 4})
            await wait_until(lambda: runtime.stats().waiting == 2)
            stats = runtime.stats()
            assert (stats.running, stats.waiting) == (2, 2)
            assert stats.resources["cpu"].held == 3
            assert stats.resources["cpu"].utilisation == 0.75
            assert stats.resources["gpu"].utilisation == 0.5
            # Two arrivals that could start, two passes; the two that cannot fit cost none.
            assert stats.decisions == 2
            assert stats.decision_seconds >= 0
            assert "build" not in stats.kinds  # nothing of it has ended yet
            gate.set()
        stats = runtime.stats()
        assert (stats.running, stats.waiting) == (0, 0)
        assert stats.kinds["build"].completed == 3
        assert stats.kinds["judge"].completed == 1
        assert stats.resources["cpu"].peak == 4
        assert stats.resources["cpu"].utilisation == 0


def test_most_in_window_counts_the_densest_stretch_whatever_the_order() -> None:
    times = [5.0, 0.0, 0.4, 0.5, 3.0, 0.9, 1.6]
    assert most_in_window(times, 1.0) == 4  # 0.0, 0.4, 0.5, 0.9
    assert most_in_window(times, 0.1) == 2  # 0.4 and 0.5
    assert most_in_window(times, 10.0) == len(times)
    weights = [1.0, 1.0, 1.0, 1.0, 50.0, 1.0, 1.0]
    assert most_in_window(times, 1.0, weights) == 50.0
    assert most_in_window([], 1.0) == 0.0
