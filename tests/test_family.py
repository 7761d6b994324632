"""The workload family: deterministic, readable, stratified, within its ranges, servable."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from itertools import product

import pytest

from tangram._sim._baselines import run_policy
from tangram._sim._family import ARRIVALS, MIXES, RANGES, TAILS, Member, family, member
from tangram._sim._trace import Trace, read_lines
from tangram.errors import InvalidSettingError, SettingTypeError

CAP = 256


@pytest.fixture(scope="module")
def members() -> tuple[Member, ...]:
    return family(max_trajectories=CAP)


@pytest.fixture(scope="module")
def traces(members: tuple[Member, ...]) -> list[Trace]:
    return [m.trace() for m in members]


def _within(value: float, key: str) -> bool:
    low, high = RANGES[key]
    return low <= value <= high


def test_same_seed_same_bytes_other_seed_other_bytes(members: tuple[Member, ...]) -> None:
    assert family(max_trajectories=CAP) == members
    assert family(0, 8, max_trajectories=CAP) == members[:8]
    other = family(1, 8, max_trajectories=CAP)
    assert all(a.lines != b.lines for a, b in zip(other, members, strict=False))
    assert member(0, 5, max_trajectories=CAP) == members[5]


def test_every_member_reads_back_as_its_header_says(
    members: tuple[Member, ...], traces: list[Trace]
) -> None:
    assert len(members) >= 60
    assert len({m.name for m in members}) == len(members)
    for m, trace in zip(members, traces, strict=True):
        assert all(line.endswith("\n") for line in m.lines)
        assert read_lines(m.lines) == trace
        assert trace.name == m.name
        header = json.loads(m.lines[0])
        assert header["generator"] == {"family": 0, "member": members.index(m), **m.params}
        assert json.loads(json.dumps(m.params)) == m.params
        assert len(trace.trajectories) == m.params["trajectories"]
        assert trace.capacity == m.params["capacity"]


def test_classes_are_stratified(members: tuple[Member, ...], traces: list[Trace]) -> None:
    combos = {(m.params["mix"], m.params["tail"], m.params["arrival"]) for m in members[:60]}
    assert combos == set(product(MIXES, TAILS, ARRIVALS))
    for key, classes in (("mix", MIXES), ("tail", TAILS), ("arrival", ARRIVALS)):
        counts = Counter(m.params[key] for m in members[:60])
        assert set(counts) == set(classes) and min(counts.values()) >= 10
    for m, trace in zip(members, traces, strict=True):
        used = {
            a.resource if a.resource in ("cpu", "gpu") else "api"
            for actions in trace.trajectories.values()
            for a in actions
        }
        assert used == m.kinds
        assert (len(m.kinds) > 1) == (m.params["mix"] == "mixed")
        if m.params["mix"] != "mixed":
            assert m.kinds == {m.params["mix"]}
    # Rigid and elastic CPU actions both occur.
    shapes = {
        a.max > a.min for trace in traces for acts in trace.trajectories.values() for a in acts
    }
    assert shapes == {True, False}


def test_parameters_stay_in_their_ranges(members: tuple[Member, ...], traces: list[Trace]) -> None:
    for m, trace in zip(members, traces, strict=True):
        p = m.params
        assert 64 <= p["trajectories_drawn"] <= 4096
        assert p["trajectories"] == min(p["trajectories_drawn"], CAP)
        firsts = [actions[0].gap for actions in trace.trajectories.values()]
        if p["arrival"] == "burst":
            assert set(firsts) == {0.0}
        else:
            assert _within(p["spread_seconds"], "spread_seconds")
            assert all(0 <= gap <= p["spread_seconds"] for gap in firsts)
        if p["tail"] == "pareto":
            assert 1.1 <= p["pareto_alpha"] <= 3
        elif p["tail"] == "lognormal":
            assert _within(p["lognormal_sigma"], "lognormal_sigma")
        else:
            assert _within(p["long_share"], "long_share") and _within(p["long_ratio"], "long_ratio")
        if "gpu" in m.kinds:
            assert 2 <= trace.capacity["gpu"] == p["gpus"] <= 40
            assert 2 <= len(trace.services) == p["services"] <= 12
            for spec in trace.gpu_services().values():
                assert 0.2 <= spec.restore_seconds <= 10
                assert spec.gpus <= trace.capacity["gpu"]
                assert spec.per_device <= trace.gpu_mem_gib_per_device
        if "api" in m.kinds:
            assert 0.5 <= p["api_factor"] <= 2
            offered = p["offered"]["api_rate"]
            assert trace.capacity[p["api_kind"]] == max(0.001, round(p["api_factor"] * offered, 4))
        if "cpu" in m.kinds:
            assert 0.2 <= p["cpu_factor"] <= 2
            assert trace.capacity["cpu"] >= math.ceil(p["cpu_factor"] * p["offered"]["cpu"])
        for actions in trace.trajectories.values():
            for a in actions:
                # Servable: no demand above what the header offers.
                if not trace.is_rate(a.resource):
                    assert a.max <= trace.capacity[a.resource]
                if a.service is not None:
                    assert a.min == a.max == trace.services[a.service]["gpus"]


def test_the_cap_clips_only_the_trajectory_count(members: tuple[Member, ...]) -> None:
    derived = {"trajectories", "capacity", "offered"}
    clipped = [i for i, m in enumerate(members) if m.params["trajectories_drawn"] > CAP]
    whole = [i for i, m in enumerate(members) if m.params["trajectories_drawn"] <= CAP]
    assert clipped and whole
    # The smallest clipped members: building the largest uncapped takes seconds.
    for i in sorted(clipped, key=lambda i: members[i].params["trajectories_drawn"])[:3]:
        capped, full = members[i], member(0, i)
        assert full.params["trajectories"] == full.params["trajectories_drawn"] > CAP
        assert {k: v for k, v in capped.params.items() if k not in derived} == {
            k: v for k, v in full.params.items() if k not in derived
        }
        assert capped.name.rsplit("-n", 1)[0] == full.name.rsplit("-n", 1)[0]
        # The capped member's actions are the first trajectories of the whole one.
        assert capped.lines[1:] == full.lines[1 : len(capped.lines)]
    assert member(0, whole[0]) == members[whole[0]]


def test_members_replay_under_policies() -> None:
    for m in family(3, 4, max_trajectories=64):  # one of each mix
        trace = m.trace()
        for policy in ("tangram", "static"):
            assert len(run_policy(policy, trace).records) == trace.actions


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: family(members=0), InvalidSettingError),
        (lambda: family(max_trajectories=0), InvalidSettingError),
        (lambda: family(members=2.5), SettingTypeError),  # type: ignore[arg-type]
        (lambda: family(seed="0"), SettingTypeError),  # type: ignore[arg-type]
        (lambda: member(0, -1), InvalidSettingError),
    ],
)
def test_bad_arguments(call: Callable[[], object], error: type[Exception]) -> None:
    with pytest.raises(error):
        call()
