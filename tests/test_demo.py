"""The synthetic demo: same workload in both arms, every action measured."""

from __future__ import annotations

import pytest

from tangram._tools._demo import DemoConfig, make_workload, run_demo


def test_workload_is_seeded_and_shaped_as_configured() -> None:
    config = DemoConfig(trajectories=5, turns=3, seed=7)
    first, again = make_workload(config), make_workload(config)
    assert first == again
    assert make_workload(DemoConfig(trajectories=5, turns=3, seed=8)) != first
    assert [len(turns) for turns in first] == [3] * 5
    kinds = {turn.kind for turns in first for turn in turns}
    assert kinds <= {"run_tests", "build", "lint"}
    assert all(turn.seconds_at_1 > 0 and turn.gap >= 0 for turns in first for turn in turns)


def test_both_arms_run_every_action_on_the_same_cores() -> None:
    config = DemoConfig(trajectories=4, turns=2, cores=4, time_scale=0.05)
    result = run_demo(config)
    for arm in (result.tangram, result.static):
        assert len(arm.acts) == 8
        assert all(act > 0 for act in arm.acts)
        # A slot of one core per trajectory is held from first to last action, so the
        # static bill is at least the sum of its actions' execution times.
        assert arm.core_seconds > 0
    assert result.static.core_seconds >= sum(result.static.acts) * 0.99
    assert set(result.ratios()) == {"avg_act", "p95_act", "step_seconds", "core_seconds"}


@pytest.mark.parametrize(
    "config",
    [DemoConfig(trajectories=0), DemoConfig(cores=0), DemoConfig(time_scale=0.0)],
)
def test_bad_config_is_rejected(config: DemoConfig) -> None:
    with pytest.raises(ValueError):
        run_demo(config)
