"""The baselines tangram is measured against: static slots, fixed DoP, and the bound."""

from __future__ import annotations

import json

import pytest

import tangram
from tangram._baselines import parse_policy, run_policy, simulate_static, slot_sizes
from tangram._generate import GenerateConfig, generate


def _trace(header: dict[str, object], *actions: dict[str, object]) -> tangram.Trace:
    lines = [json.dumps({"format": "tangram-trace/1", "name": "t", **header})]
    return tangram.read_trace([*lines, *(json.dumps(a) for a in actions)])


def _two_turns(name: str) -> list[dict[str, object]]:
    # 10 s of work, 5 s of generation, 10 s more: a 25 s life holding the slot throughout.
    common = {"trajectory": name, "kind": "run", "resource": "cpu", "units": 1, "seconds": 10}
    return [{**common, "index": 0, "gap": 0}, {**common, "index": 1, "gap": 5}]


def test_static_holds_slots_for_the_whole_life() -> None:
    trace = _trace({"capacity": {"cpu": 4}}, *_two_turns("a"), *_two_turns("b"))
    result = simulate_static(trace)
    # Two trajectories on 4 cores: a slot of 2 capped at what the actions use (1).
    assert slot_sizes(trace)["a"] == {"cpu": 1}
    assert result.unit_seconds["cpu"] == pytest.approx(2 * 1 * 25)
    assert result.step_seconds == 25
    assert all(r.queue == 0 for r in result.records)


def test_static_queues_when_slots_exceed_capacity() -> None:
    names = ["a", "b", "c", "d"]
    trace = _trace({"capacity": {"cpu": 2}}, *(a for n in names for a in _two_turns(n)))
    result = simulate_static(trace, static_units=1)
    firsts = sorted(r.queue for r in result.records if r.index == 0)
    # Four slots of one core on two cores: two trajectories wait a whole 25 s life, and
    # that wait is booked as queueing of their first action.
    assert firsts == [0, 0, 25, 25]
    assert all(r.queue == 0 for r in result.records if r.index == 1)
    assert result.step_seconds == 50
    assert result.unit_seconds["cpu"] == pytest.approx(4 * 25)
    assert result.peak_units["cpu"] == 2


def test_static_elastic_actions_run_at_the_slot_size() -> None:
    trace = _trace(
        {"capacity": {"cpu": 8}},
        {
            "trajectory": "a",
            "index": 0,
            "gap": 1,
            "kind": "build",
            "resource": "cpu",
            "min": 1,
            "max": 16,
            "seconds_at_1": 8,
        },
    )
    # One trajectory on 8 cores: the slot is all 8 (below the action's max of 16).
    (record,) = simulate_static(trace).records
    assert record.units == 8
    assert record.exec == pytest.approx(1.0)
    (record,) = simulate_static(trace, static_units={"cpu": 2}).records
    assert record.exec == pytest.approx(4.0)


def test_static_shares_api_actions_fcfs() -> None:
    calls = [
        {
            "trajectory": name,
            "index": 0,
            "gap": 0,
            "kind": "search",
            "resource": "search_api",
            "units": 1,
            "seconds": 2,
        }
        for name in "abc"
    ]
    trace = _trace({"capacity": {"search_api": 100, "search_api_concurrency": 1}}, *calls)
    result = simulate_static(trace)
    # One connection: the three calls run one after another, none holds a slot.
    assert sorted(r.queue for r in result.records) == [0, 2, 4]
    assert result.step_seconds == 6


@pytest.mark.parametrize("workload", ["coding", "deepsearch", "mopd"])
def test_bound_is_below_every_policy_per_action(workload: str) -> None:
    trace = tangram.read_trace(
        generate(GenerateConfig(workload=workload, batch=12, seed=2, turns=4)).splitlines()
    )
    bound = {(r.trajectory, r.index): r.exec for r in run_policy("bound", trace).records}
    for name in ("tangram", "static", "fixed-dop-4"):
        records = run_policy(name, trace).records
        assert len(records) == len(bound)
        for r in records:
            assert bound[(r.trajectory, r.index)] <= r.act + 1e-9, (name, r)


def test_simulated_policies_are_the_products() -> None:
    trace = tangram.read_trace(
        generate(GenerateConfig(workload="coding", batch=8, seed=1, turns=3)).splitlines()
    )
    ours = run_policy("fixed-dop-4", trace)
    direct = tangram.simulate(
        trace.workload(), trace.runtime_capacity(), policy=tangram.FcfsPolicy(dop=4)
    )
    assert ours.records == direct.records
    assert (
        run_policy("tangram", trace).records
        == tangram.simulate(trace.workload(), trace.runtime_capacity()).records
    )


@pytest.mark.parametrize("name", ["tangram", "static", "bound", "fixed-dop-1", "fixed-dop-16"])
def test_known_policy_names(name: str) -> None:
    assert parse_policy(name) == name


@pytest.mark.parametrize("name", ["k9s", "fixed-dop-0", "fixed-dop-x", "fixed-dop-"])
def test_unknown_policy_names(name: str) -> None:
    with pytest.raises(ValueError):
        parse_policy(name)
