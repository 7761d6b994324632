"""``ref-gpu-fcfs``: first come, first served on one pool of GPUs, restores paid.

Hand-computed cases for each rule (warm start, restores, LRU eviction, batch-mates, a
multi-GPU head that nothing passes), typed errors, and no lost devices on the family.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tangram._sim._baselines import run_policy
from tangram._sim._family import family
from tangram._sim._gpu_reference import ARM, simulate_gpu_fcfs
from tangram._sim._trace import Trace, read_lines
from tangram.errors import InvalidSettingError, TraceFormatError


def _trace(
    services: dict[str, dict[str, Any]],
    actions: list[tuple[str, str | None, float, float]],
    gpus: int = 1,
    **header: Any,
) -> Trace:
    """``actions``: (trajectory, service, gap, seconds), in index order per trajectory."""
    lines = [
        json.dumps(
            {
                "format": "tangram-trace/1",
                "name": "t",
                "capacity": {"gpu": gpus},
                "services": services,
                **header,
            }
        )
    ]
    index: dict[str, int] = {}
    for trajectory, service, gap, seconds in actions:
        line: dict[str, Any] = {
            "trajectory": trajectory,
            "index": index.setdefault(trajectory, 0),
            "gap": gap,
            "kind": "score",
            "resource": "gpu",
            "units": services[service].get("gpus", 1) if service is not None else 1,
            "seconds": seconds,
        }
        if service is not None:
            line["service"] = service
        index[trajectory] += 1
        lines.append(json.dumps(line))
    return read_lines(lines)


def _times(trace: Trace) -> dict[tuple[str, int], tuple[float, float, float]]:
    result = simulate_gpu_fcfs(trace)
    return {(r.trajectory, r.index): (r.admitted, r.overhead, r.finished) for r in result.records}


FULL = {"gpus": 1, "gpu_mem_gib": 80, "restore_seconds": 2.0, "max_batch": 1}


def test_the_warm_service_pays_nothing_and_the_other_a_restore_then_evicts_it() -> None:
    # One 80 GiB device: `a` is loaded before the step (first in name order), `b` is not.
    trace = _trace(
        {"a": FULL, "b": FULL},
        [("x", "a", 0.0, 1.0), ("y", "b", 0.5, 1.0), ("z", "a", 0.6, 1.0)],
    )
    assert _times(trace) == {
        ("x", 0): (0.0, 0.0, 1.0),  # resident: no restore
        ("y", 0): (1.0, 2.0, 4.0),  # waits for the device, then restores b, evicting a
        ("z", 0): (4.0, 2.0, 7.0),  # a was evicted: restored again
    }
    result = simulate_gpu_fcfs(trace)
    assert (result.restores, result.unloads) == (2, 2)
    assert result.peak_units == {"gpu": 1.0}
    assert result.unit_seconds == {"gpu": pytest.approx(7.0)}


def test_the_least_recently_used_idle_replica_is_the_one_evicted() -> None:
    # 80 GiB device, three 40 GiB services: a and b warm; c evicts whichever was used last
    # longest ago (a, used at 0-1, not b, used at 1-2), so b is still loaded for its next.
    half = {**FULL, "gpu_mem_gib": 40}
    trace = _trace(
        {"a": half, "b": half, "c": half},
        [("p", "a", 0.0, 1.0), ("q", "b", 0.1, 1.0), ("r", "c", 0.2, 1.0), ("s", "b", 0.3, 1.0)],
    )
    assert _times(trace) == {
        ("p", 0): (0.0, 0.0, 1.0),
        ("q", 0): (1.0, 0.0, 2.0),
        ("r", 0): (2.0, 2.0, 5.0),
        ("s", 0): (5.0, 0.0, 6.0),
    }
    assert simulate_gpu_fcfs(trace).unloads == 1


def test_a_new_replica_takes_its_services_waiting_requests_along() -> None:
    # One device, b batches 3. While a runs, three b requests and then an a request
    # queue; b's replica, started for the oldest, seats the other two at once, and the
    # a request behind them waits for the device, though its own service comes first.
    batched = {**FULL, "max_batch": 3}
    trace = _trace(
        {"a": FULL, "b": batched},
        [
            ("w", "a", 0.0, 4.0),
            ("x", "b", 1.0, 1.0),
            ("y", "b", 1.5, 1.0),
            ("v", "a", 1.7, 1.0),
            ("z", "b", 2.0, 1.0),
        ],
    )
    times = _times(trace)
    assert times[("x", 0)] == (4.0, 2.0, 7.0)
    assert times[("y", 0)] == (4.0, 2.0, 7.0)
    assert times[("z", 0)] == (4.0, 2.0, 7.0)
    assert times[("v", 0)] == (7.0, 2.0, 10.0)


def test_a_seat_on_a_replica_that_serves_now_before_one_still_restoring() -> None:
    # Two devices, `s` warm on device 1 (`a` on 0). r3 finds s's replica full and
    # restores s over `a` on device 0 (10 s). When r1 ends, r4 takes its seat on the
    # ready replica rather than the free one still restoring.
    slow = {"gpus": 1, "gpu_mem_gib": 80, "restore_seconds": 10.0, "max_batch": 2}
    trace = _trace(
        {"a": slow, "s": slow},
        [
            ("r1", "s", 0.0, 1.0),
            ("r2", "s", 0.0, 5.0),
            ("r3", "s", 0.0, 1.0),
            ("r4", "s", 1.5, 1.0),
        ],
        gpus=2,
    )
    times = _times(trace)
    assert times[("r3", 0)] == (0.0, 10.0, 11.0)
    assert times[("r4", 0)] == (1.5, 0.0, 2.5)


def test_a_two_gpu_head_is_passed_by_nothing() -> None:
    # Two devices. `big` needs both; the single-GPU requests behind it wait although a
    # device is free, so the head is not starved by a stream of small ones.
    small = {"gpus": 1, "gpu_mem_gib": 10, "restore_seconds": 0.0, "max_batch": 1}
    big = {"gpus": 2, "gpu_mem_gib": 20, "restore_seconds": 0.0, "max_batch": 1}
    trace = _trace(
        {"big": big, "small": small},
        [("a", "small", 0.0, 3.0), ("b", "big", 0.5, 1.0), ("c", "small", 1.0, 1.0)],
        gpus=2,
    )
    assert _times(trace) == {
        ("a", 0): (0.0, 0.0, 3.0),
        ("b", 0): (3.0, 0.0, 4.0),
        ("c", 0): (4.0, 0.0, 5.0),
    }


def test_a_plain_gpu_action_holds_its_devices_with_no_restore() -> None:
    trace = _trace({"a": FULL}, [("x", None, 0.0, 2.0), ("y", "a", 0.0, 1.0)])
    assert _times(trace) == {("x", 0): (0.0, 0.0, 2.0), ("y", 0): (2.0, 0.0, 3.0)}


def test_a_trajectorys_next_action_comes_its_gap_after_the_last_ends() -> None:
    trace = _trace({"a": FULL}, [("x", "a", 0.5, 1.0), ("x", "a", 2.0, 1.0)])
    assert _times(trace) == {("x", 0): (0.5, 0.0, 1.5), ("x", 1): (3.5, 0.0, 4.5)}


def test_what_it_cannot_replay_is_a_typed_error() -> None:
    lines = [
        json.dumps({"format": "tangram-trace/1", "name": "c", "capacity": {"cpu": 2}}),
        json.dumps(
            {"trajectory": "t", "index": 0, "gap": 0, "kind": "k", "resource": "cpu",
             "units": 1, "seconds": 1}
        ),
    ]  # fmt: skip
    with pytest.raises(InvalidSettingError, match="GPU actions only"):
        simulate_gpu_fcfs(read_lines(lines))
    wide = {**FULL, "gpus": 2}
    with pytest.raises(TraceFormatError, match="needs 2 GPUs"):  # refused as it is read
        _trace({"a": wide}, [("x", "a", 0.0, 1.0)])
    with pytest.raises(InvalidSettingError, match="GPU actions only"):
        run_policy(ARM, read_lines(lines))


@pytest.mark.parametrize("seed", [0, 1])
def test_every_gpu_member_of_the_family_runs_every_action_within_its_gpus(seed: int) -> None:
    members = [m for m in family(seed, 24, max_trajectories=24) if m.kinds == {"gpu"}]
    assert len(members) == 6
    for member in members:
        trace = member.trace()
        result = run_policy(ARM, trace)
        bound = {(r.trajectory, r.index): r.exec for r in run_policy("bound", trace).records}
        # A device lost to a replica that never let it go would leave actions unrun.
        assert len(result.records) == trace.actions, member.name
        assert result.peak_units["gpu"] <= trace.capacity["gpu"], member.name
        for r in result.records:
            assert r.exec == pytest.approx(bound[(r.trajectory, r.index)]), member.name
        # Each replica runs at most max_batch actions at once on its devices, and they
        # are billed while held: never fewer device-seconds than the actions need.
        specs = trace.gpu_services()
        need = sum(
            a.seconds_at_1 * specs[a.service].gpus / specs[a.service].max_batch
            for actions in trace.trajectories.values()
            for a in actions
            if a.service is not None
        )
        assert result.unit_seconds["gpu"] >= need - 1e-6, member.name
