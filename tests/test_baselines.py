"""The baselines tangram is measured against: static slots, fixed DoP, and the bound."""

from __future__ import annotations

import json
import math

import pytest

import tangram
from tangram._sim._baselines import (
    parse_policy,
    run_policy,
    service_shares,
    simulate_k8s,
    simulate_static,
    slot_sizes,
)
from tangram._sim._generate import GenerateConfig, generate


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
    for name in ("tangram", "tangram-fcfs", "srpt", "static", "pooled", "fixed-dop-4"):
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


def test_the_admission_references_are_the_elastic_policy() -> None:
    # tangram-fcfs is tangram with first-come-first-served admission; srpt is shortest
    # first with no aging and no starvation bound; both keep the elastic split.
    trace = tangram.read_trace(
        generate(GenerateConfig(workload="coding", batch=40, seed=3, contended=True)).splitlines()
    )
    policies = {
        "tangram-fcfs": tangram.ElasticPolicy(order="arrival"),
        "srpt": tangram.ElasticPolicy(aging=math.inf, starvation_bound=math.inf),
    }
    results = {}
    for name, policy in policies.items():
        results[name] = run_policy(name, trace)
        direct = tangram.simulate(trace.workload(), trace.runtime_capacity(), policy=policy)
        assert results[name].records == direct.records
    tangram_result = run_policy("tangram", trace)
    # Contended: the order of admission decides, and shortest first lowers the average.
    assert results["srpt"].avg_act < results["tangram-fcfs"].avg_act
    assert tangram_result.avg_act < results["tangram-fcfs"].avg_act
    assert tangram_result.records != results["tangram-fcfs"].records


@pytest.mark.parametrize(
    "name",
    ["tangram", "tangram-fcfs", "srpt", "static", "pooled", "bound", "fixed-dop-1", "fixed-dop-16"],
)
def test_known_policy_names(name: str) -> None:
    assert parse_policy(name) == name


@pytest.mark.parametrize("name", ["k9s", "fixed-dop-0", "fixed-dop-x", "fixed-dop-", "SRPT"])
def test_unknown_policy_names(name: str) -> None:
    with pytest.raises(ValueError):
        parse_policy(name)


def _gpu_trace(gpus: int, *actions: dict[str, object]) -> tangram.Trace:
    services = {
        name: {"gpus": 1, "gpu_mem_gib": 60, "restore_seconds": 5, "max_batch": 1}
        for name in ("a", "b")
    }
    return _trace({"capacity": {"gpu": gpus}, "services": services}, *actions)


def _judge(name: str, service: str, gap: float = 0.0) -> dict[str, object]:
    return {
        "trajectory": name,
        "index": 0,
        "gap": gap,
        "kind": service,
        "resource": "gpu",
        "units": 1,
        "seconds": 1,
        "service": service,
    }


def test_static_gives_each_service_a_fixed_resident_share() -> None:
    trace = _gpu_trace(4, *(_judge(f"t{i}", "a") for i in range(3)), _judge("u", "b"))
    assert service_shares(trace) == {"a": 2, "b": 2}
    result = simulate_static(trace)
    queues = sorted(r.queue for r in result.records if r.kind == "a")
    # Two replicas of a, always resident (no restore), FCFS: the third waits for one.
    assert queues == [0, 0, 1]
    assert all(r.overhead == 0 for r in result.records)
    assert result.step_seconds == 2
    # Dedicated GPUs are billed for the whole step, busy or not.
    assert result.unit_seconds["gpu"] == pytest.approx(4 * 2)
    assert result.peak_units["gpu"] == 4


def test_static_hands_the_rounding_left_over_out_in_name_order() -> None:
    trace = _gpu_trace(5, _judge("t", "a"))
    assert service_shares(trace) == {"a": 3, "b": 2}
    assert service_shares(trace, {"gpu": 7}) == {"a": 4, "b": 3}


def test_static_serves_every_service_even_on_too_few_gpus() -> None:
    trace = _gpu_trace(1, _judge("t", "a"), _judge("u", "b"))
    assert service_shares(trace) == {"a": 1, "b": 1}
    assert [r.queue for r in simulate_static(trace).records] == [0, 0]


def test_tangram_restores_evicted_services_where_static_pins_them() -> None:
    # One GPU, two 60 GiB services used in turn: a starts resident (declared first), then
    # tangram restores at every switch, static (given a GPU per service) never; tangram
    # bills one GPU, static two for the step.
    actions = [_judge("t", "a"), _judge("u", "b", gap=10), _judge("v", "a", gap=20)]
    trace = _gpu_trace(1, *actions)
    tangram_run = run_policy("tangram", trace)
    assert [r.overhead for r in tangram_run.records] == [0, 5, 5]
    assert (tangram_run.restores, tangram_run.unloads) == (2, 2)
    assert tangram_run.unit_seconds["gpu"] == pytest.approx(1 + 2 * 6)
    static_run = run_policy("static", trace)
    assert [r.act for r in static_run.records] == [1, 1, 1]
    assert static_run.unit_seconds["gpu"] == pytest.approx(2 * 21)


def test_pooled_serves_every_gpu_request_fcfs_on_any_device_without_a_restore() -> None:
    # Two GPUs, three a requests and one b, all at once: static gives each service one
    # GPU (the third a waits two runs); pooled serves the first two on both GPUs in
    # arrival order and the next two when they free, never restoring, billing both GPUs.
    actions = [*(_judge(f"t{i}", "a") for i in range(3)), _judge("u", "b", gap=0.5)]
    trace = _gpu_trace(2, *actions)
    pooled = run_policy("pooled", trace)
    by_name = {r.trajectory: r for r in pooled.records}
    assert [by_name[n].queue for n in ("t0", "t1", "t2", "u")] == [0, 0, 1, 0.5]
    assert all(r.overhead == 0 for r in pooled.records)
    assert (pooled.restores, pooled.step_seconds) == (0, 2)
    assert pooled.unit_seconds["gpu"] == pytest.approx(2 * 2)
    static = run_policy("static", trace)
    assert sorted(r.queue for r in static.records) == [0, 0, 1, 2]
    assert parse_policy("pooled") == "pooled"


def test_pooled_counts_a_batching_replica_as_seats_of_one_device() -> None:
    # max_batch 2: one GPU serves two requests at once, so four on one GPU take two runs.
    services = {"a": {"gpus": 1, "gpu_mem_gib": 60, "restore_seconds": 5, "max_batch": 2}}
    trace = _trace(
        {"capacity": {"gpu": 1}, "services": services}, *(_judge(f"t{i}", "a") for i in range(4))
    )
    assert sorted(r.queue for r in run_policy("pooled", trace).records) == [0, 0, 1, 1]


def _elastic(name: str, index: int, seconds: float, gap: float = 0.0) -> dict[str, object]:
    return {
        "trajectory": name,
        "index": index,
        "gap": gap,
        "kind": "build",
        "resource": "cpu",
        "min": 1,
        "max": 8,
        "seconds_at_1": seconds,
        "efficiency": {"model": "linear"},
    }


def test_k8s_resizes_take_effect_after_the_lag() -> None:
    trace = _trace({"capacity": {"cpu": 8}}, _elastic("a", 0, 100))
    result = simulate_k8s(trace, static_units=1, lag=10)
    (record,) = result.records
    # 10 s at the pod's one core (10 of 100 s of work), then 8 cores for the other 90.
    assert record.finished == pytest.approx(10 + 90 / 8)
    assert result.unit_seconds["cpu"] == pytest.approx(1 * record.finished + 7 * 90 / 8)
    assert result.peak_units["cpu"] == 8
    # A lag longer than the action: it never grows, as a static slot.
    slow = simulate_k8s(trace, static_units=1, lag=200)
    assert slow.records[0].finished == pytest.approx(100)
    assert slow.records[0].finished == simulate_static(trace, static_units=1).records[0].finished


def test_k8s_keeps_grown_units_until_the_shrink_lands() -> None:
    trace = _trace({"capacity": {"cpu": 8}}, _elastic("a", 0, 80), _elastic("a", 1, 16, gap=2))
    first, second = simulate_k8s(trace, static_units=1, lag=10).records
    assert first.finished == pytest.approx(10 + 70 / 8)
    # The second build starts 2 s later, before the shrink (10 s after the first ended):
    # it runs on all 8 cores from the start.
    assert second.admitted == pytest.approx(first.finished + 2)
    assert second.exec == pytest.approx(16 / 8)


def test_k8s_growth_waits_for_free_units() -> None:
    # Two one-core pods on 9 cores. a's build asks at t=5 to grow by 7 and gets them; b's,
    # issued at t=6, asks at t=11 when nothing is free, and grows only when a's pod is
    # deleted (its last action ended).
    trace = _trace({"capacity": {"cpu": 9}}, _elastic("a", 0, 100), _elastic("b", 0, 50, gap=6))
    records = {r.trajectory: r for r in simulate_k8s(trace, static_units=1, lag=5).records}
    a_end = 5 + 95 / 8
    assert records["a"].finished == pytest.approx(a_end)
    done = a_end - 6  # b's work at one core until then
    assert records["b"].finished == pytest.approx(a_end + (50 - done) / 8)


def test_k8s_pods_queue_fcfs_behind_grown_pods() -> None:
    # a's pod grows to all 8 cores; b's pod (one core) must wait for a's pod to go.
    trace = _trace({"capacity": {"cpu": 8}}, _elastic("a", 0, 50), _elastic("b", 0, 50, gap=6))
    records = {r.trajectory: r for r in simulate_k8s(trace, static_units=1, lag=5).records}
    a_end = 5 + 45 / 8
    assert records["a"].finished == pytest.approx(a_end)
    assert records["b"].admitted == pytest.approx(a_end)
    assert records["b"].queue == pytest.approx(a_end - 6)


def test_k8s_is_a_policy_and_checks_its_lag() -> None:
    assert parse_policy("k8s") == "k8s"
    trace = _trace({"capacity": {"cpu": 8}}, _elastic("a", 0, 100))
    assert run_policy("k8s", trace, static_units=1, k8s_lag=10).records[0].finished < 100
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="`lag` must be >= 0"):
            simulate_k8s(trace, lag=bad)


def test_the_simulators_policy_arms_are_built_through_the_policy_registry() -> None:
    import math

    import tangram
    import tangram.abc
    from tangram._sim._baselines import BASELINES, POLICIES, build_policy, parse_policy

    for name in tangram.abc.POLICIES:  # every registered policy is an arm, with defaults
        assert parse_policy(name) == name
        assert build_policy(name) == tangram.abc.policy_class(name)()
    assert build_policy("tangram") == tangram.ElasticPolicy()
    assert build_policy("tangram-fcfs") == tangram.ElasticPolicy(order="arrival")
    assert build_policy("srpt") == tangram.ElasticPolicy(aging=math.inf, starvation_bound=math.inf)
    assert build_policy("fixed-dop-3") == tangram.FcfsPolicy(dop=3)
    for name in BASELINES:
        assert name in POLICIES
        with pytest.raises(tangram.errors.InvalidSettingError, match="baseline"):
            build_policy(name)
    with pytest.raises(tangram.errors.InvalidSettingError, match="unknown policy"):
        build_policy("lottery")
