"""The simulator's references: hand-computed cases, no lost units, and sanity on workloads."""

from __future__ import annotations

import random

import pytest

import tangram
from tangram import Elastic, Linear, Rate, SimulationResult, Step, simulate
from tangram._sim import _references
from tangram._sim._baselines import POLICIES, build_policy, parse_policy, run_policy
from tangram._sim._generate import GenerateConfig, generate
from tangram._sim._gpu_reference import ARM as GPU_FCFS
from tangram._sim._references import (
    REFERENCES,
    FcfsAdmission,
    ShortestFirst,
    dop_grid,
    simulate_best_fixed_dop,
)
from tangram._sim._trace import read_lines
from tangram.abc import Policy

BOTH: list[Policy] = [ShortestFirst(), FcfsAdmission()]


def _times(result: SimulationResult) -> dict[str, tuple[float, float]]:
    return {r.trajectory: (r.admitted, r.finished) for r in result.records}


def _rigid(seconds: float, gap: float = 0.0, cpu: int = 1) -> list[Step]:
    return [Step(demand={"cpu": cpu}, seconds_at_1=seconds, gap=gap)]


def _elastic(low: int, high: int, seconds: float, gap: float = 0.0, resizable: bool = True) -> Step:
    demand = {"cpu": Elastic(low, high, resizable=resizable)}
    return Step(demand=demand, seconds_at_1=seconds, efficiency=Linear(), gap=gap)


# -- admission order -------------------------------------------------------------------------


def test_shortest_first_on_one_core() -> None:
    work = {"a": _rigid(5.0), "b": _rigid(1.0), "c": _rigid(3.0, gap=0.5)}
    # b (1 s) before a (5 s) though both came at 0; c (3 s), arriving while b runs, also
    # passes a.
    assert _times(simulate(work, {"cpu": 1}, policy=ShortestFirst())) == {
        "b": (0.0, 1.0),
        "c": (1.0, 4.0),
        "a": (4.0, 9.0),
    }


def test_fcfs_admission_on_one_core() -> None:
    work = {"a": _rigid(5.0), "b": _rigid(1.0), "c": _rigid(3.0, gap=0.5)}
    assert _times(simulate(work, {"cpu": 1}, policy=FcfsAdmission())) == {
        "a": (0.0, 5.0),
        "b": (5.0, 6.0),
        "c": (6.0, 9.0),
    }


def test_fcfs_admission_never_backfills_past_a_blocked_head() -> None:
    # b needs both cores and waits for a; c would fit beside a and end long before a does
    # (EASY backfill, as tangram-fcfs does, would start it), but strict FCFS keeps it behind b.
    work = {"a": _rigid(4.0), "b": _rigid(1.0, gap=0.1, cpu=2), "c": _rigid(1.0, gap=0.2)}
    assert _times(simulate(work, {"cpu": 2}, policy=FcfsAdmission())) == {
        "a": (0.0, 4.0),
        "b": (4.0, 5.0),
        "c": (5.0, 6.0),
    }
    # Shortest first backfills anything that fits: c starts at once.
    fast = _times(simulate(work, {"cpu": 2}, policy=ShortestFirst()))
    assert fast["c"] == (0.2, 1.2)
    assert fast["b"] == (4.0, 5.0)


def test_fcfs_admission_blocks_only_actions_of_the_same_kinds() -> None:
    # The second call waits a second for its token; the CPU action behind it in arrival
    # order needs none of its kinds, so it is not held up.
    call = Step(demand={"api": 1}, seconds_at_1=0.1, kind="call")
    work = {"c1": [call], "c2": [call], "cpu": _rigid(1.0, gap=0.05)}
    capacity = {"cpu": 1, "api": Rate(1.0, burst=1.0)}
    times = _times(simulate(work, capacity, policy=FcfsAdmission()))
    assert times["c1"] == (0.0, 0.1)
    assert times["c2"][0] == pytest.approx(1.0, abs=1e-5)
    assert times["cpu"] == (0.05, 1.05)


@pytest.mark.parametrize("policy", BOTH, ids=type)
def test_a_rate_limited_call_waits_for_its_token(policy: Policy) -> None:
    call = Step(demand={"api": 1}, seconds_at_1=0.1, kind="call")
    work = {f"t{i}": [call] for i in range(3)}
    result = simulate(work, {"api": Rate(1.0, burst=1.0)}, policy=policy)
    admitted = sorted(r.admitted for r in result.records)
    assert admitted == pytest.approx([0.0, 1.0, 2.0], abs=1e-5)


# -- the water-fill --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", BOTH, ids=type)
def test_an_elastic_action_alone_gets_the_free_cores_up_to_its_max(policy: Policy) -> None:
    (capped,) = simulate({"a": [_elastic(1, 4, 8.0)]}, {"cpu": 8}, policy=policy).records
    assert (capped.units, capped.finished) == (4.0, 2.0)
    (wide,) = simulate({"a": [_elastic(1, 16, 8.0)]}, {"cpu": 8}, policy=policy).records
    assert (wide.units, wide.finished) == (8.0, 1.0)


@pytest.mark.parametrize("policy", BOTH, ids=type)
def test_two_elastic_actions_split_the_cores_evenly(policy: Policy) -> None:
    # a runs alone on 8 cores for 0.5 s (4 s of work left); b arrives and both run on 4
    # (a ends at 1.5, b has 4 s left); b then grows to 8 and ends 0.5 s later.
    work = {"a": [_elastic(1, 8, 8.0)], "b": [_elastic(1, 8, 8.0, gap=0.5)]}
    result = simulate(work, {"cpu": 8}, policy=policy)
    assert _times(result) == {"a": (0.0, 1.5), "b": (0.5, 2.0)}
    assert result.resizes == 2
    assert result.peak_units == {"cpu": 8.0}


@pytest.mark.parametrize(
    ("cores", "shares"),
    [(7, [2.0, 2.0, 3.0]), (8, [3.0, 2.0, 3.0]), (9, [4.0, 2.0, 3.0]), (40, [8.0, 2.0, 8.0])],
)
def test_water_fill_levels(cores: int, shares: list[float]) -> None:
    # One level for all, each clamped to [min, max]; a unit left below the next level goes
    # to the earliest arrival still at the level (9 cores: level 3, one left for "a").
    work = {
        "a": [_elastic(1, 8, 8.0, resizable=False)],
        "b": [_elastic(1, 2, 8.0, resizable=False)],
        "c": [_elastic(3, 8, 8.0, resizable=False)],
    }
    for policy in BOTH:
        result = simulate(work, {"cpu": cores}, policy=policy)
        assert [r.units for r in sorted(result.records, key=lambda r: r.trajectory)] == shares


def test_a_non_resizable_grant_is_kept_until_it_ends() -> None:
    work = {"a": [_elastic(1, 8, 8.0, resizable=False)], "b": [_elastic(1, 8, 8.0, gap=0.5)]}
    for policy in BOTH:
        assert _times(simulate(work, {"cpu": 8}, policy=policy)) == {
            "a": (0.0, 1.0),
            "b": (1.0, 2.0),
        }


def test_a_rigid_newcomer_takes_units_back_from_resizable_ones() -> None:
    # a holds all 4 cores; the rigid shell command needs one, and gets it at once.
    work = {"a": [_elastic(1, 4, 8.0)], "s": _rigid(1.0, gap=1.0)}
    for policy in BOTH:
        times = _times(simulate(work, {"cpu": 4}, policy=policy))
        assert times["s"] == (1.0, 2.0)
        # 4 s of work at 4 cores, 3 s more at 3 cores, the last 1 s at 4 again.
        assert times["a"][1] == pytest.approx(1.0 + 1.0 + 0.25)


# -- no lost units, on generated workloads ---------------------------------------------------


def _generated(workload: str, **options: object) -> tangram.Trace:
    text = generate(GenerateConfig(workload=workload, batch=32, seed=1, **options))  # type: ignore[arg-type]
    return read_lines(text.splitlines())


@pytest.mark.parametrize("workload", ["coding", "deepsearch", "mopd"])
def test_every_arm_runs_every_action(workload: str) -> None:
    trace = _generated(workload, contended=True)
    capacity = {k: v for k, v in trace.capacity.items() if not trace.is_rate(k)}
    bound = {(r.trajectory, r.index): r.exec for r in run_policy("bound", trace).records}
    for name in REFERENCES:
        if name == GPU_FCFS and workload != "mopd":
            with pytest.raises(tangram.errors.InvalidSettingError, match="GPU actions only"):
                run_policy(name, trace)
            continue
        result = run_policy(name, trace)
        # Every action ran, so every grant was asked for and given: a lost unit would
        # leave some action waiting for ever (the run would end with it unrecorded).
        assert len(result.records) == trace.actions, name
        for kind, peak in result.peak_units.items():
            assert peak <= capacity[kind] + 1e-9, (name, kind)
        for r in result.records:
            assert bound[(r.trajectory, r.index)] <= r.act + 1e-9, (name, r)


def _burst(seed: int) -> dict[str, list[Step]]:
    """A heavy-tailed burst on 8 cores: Pareto work, a third rigid, the rest elastic."""
    rng = random.Random(seed)
    work: dict[str, list[Step]] = {}
    for t in range(24):
        steps = []
        for i in range(3):
            seconds = round(0.5 * rng.paretovariate(1.5), 3)
            gap = 0.0 if i == 0 else round(rng.uniform(0.1, 2.0), 3)
            if rng.random() < 1 / 3:
                steps.append(Step(demand={"cpu": 1}, seconds_at_1=seconds, gap=gap))
            else:
                steps.append(_elastic(1, 4, seconds, gap=gap))
        work[f"t{t:02d}"] = steps
    return work


@pytest.mark.parametrize("seed", range(4))
def test_shortest_first_is_not_worse_than_fcfs_on_a_heavy_tailed_burst(seed: int) -> None:
    work = _burst(seed)
    fast = simulate(work, {"cpu": 8}, policy=ShortestFirst())
    fair = simulate(work, {"cpu": 8}, policy=FcfsAdmission())
    assert len(fast.records) == len(fair.records) == 72
    assert fast.peak_units["cpu"] <= 8 and fair.peak_units["cpu"] <= 8
    assert fast.avg_act <= 1.1 * fair.avg_act


# -- best fixed DoP --------------------------------------------------------------------------


def test_best_fixed_dop_is_the_best_of_its_grid() -> None:
    trace = _generated("coding", contended=True)
    assert dop_grid(trace) == [1, 2, 4, 8, "max"]  # generated builds go up to 16 cores
    best, k = simulate_best_fixed_dop(trace)
    runs = {
        str(dop): _references.replay(trace, tangram.FcfsPolicy(dop=dop)) for dop in dop_grid(trace)
    }
    assert best.records == runs[k].records
    assert all(best.avg_act <= run.avg_act for run in runs.values())
    assert run_policy("best-fixed-dop", trace).records == best.records


def test_best_fixed_dop_without_elastic_actions_tries_only_max() -> None:
    trace = _generated("deepsearch")
    assert dop_grid(trace) == ["max"]
    assert simulate_best_fixed_dop(trace)[1] == "max"


# -- the arms --------------------------------------------------------------------------------


def test_references_are_arms_but_not_tangram_policies() -> None:
    for name in REFERENCES:
        assert parse_policy(name) == name
        assert name in POLICIES
        assert name not in tangram.abc.POLICIES
        with pytest.raises(tangram.errors.InvalidSettingError, match="not a tangram policy"):
            build_policy(name)
    # A separate implementation, not a mode of the policy under test.
    assert not hasattr(_references, "ElasticPolicy")
