"""The protocol model: hand-computed cycles, message counts, and the real policy deciding.

One trajectory alone makes every delay visible: with fixed times (``sigma=0``) its cycle
is a sum of latencies and CPU costs the test can write down.
"""

from __future__ import annotations

import attrs
import pytest

from tangram._sim._scaleout import Costs, Job, model

COSTS = Costs(actor=0.002, agent=0.001, latency=0.005)


def _alone(**settings: object) -> Job:
    base: dict[str, object] = {
        "nodes": 1,
        "trajectories": 1,
        "cores": 1,
        "workers": 1,
        "think": 0.0,
        "seconds": 0.1,
        "sigma": 0.0,
        "actions": 10**6,  # one sandbox for the whole run
        "heartbeat": 1e9,  # no heartbeat after the first
    }
    base.update(settings)
    return Job(**base)  # type: ignore[arg-type]


def test_a_node_decided_action_costs_a_call_to_its_agent() -> None:
    # Worker -> agent (latency, agent CPU) -> run -> result back (latency).
    result = model(_alone(), COSTS, horizon=50.0, warmup=10.0)
    cycle = 2 * COSTS.latency + COSTS.agent + 0.1
    assert result.actions_per_s == pytest.approx(1 / cycle, rel=0.01)
    assert result.decision_p50 == pytest.approx(COSTS.latency + COSTS.agent)
    assert result.on_node == 1.0
    assert result.actor_messages_per_action == 0.0


def test_a_centrally_decided_action_goes_through_the_jobs_actor() -> None:
    # ... and from the agent to the job's actor and back for the grant, then a release.
    result = model(_alone(cores_by="job"), COSTS, horizon=50.0, warmup=10.0)
    cycle = 4 * COSTS.latency + COSTS.agent + COSTS.actor + 0.1
    assert result.actions_per_s == pytest.approx(1 / cycle, rel=0.01)
    assert result.decision_p50 == pytest.approx(3 * COSTS.latency + COSTS.agent + COSTS.actor)
    assert result.on_node == 0.0
    assert result.actor_messages_per_action == pytest.approx(2.0, rel=0.01)


def test_heartbeats_and_placements_reach_the_jobs_actor_as_set() -> None:
    shape = {"nodes": 4, "trajectories": 2, "workers": 3, "heartbeat": 1.0, "actions": 5}
    old = _alone(**shape, placement_by="job", heartbeats_by="proxy")
    before = model(old, COSTS, horizon=30.0, warmup=5.0)
    local = model(_alone(**shape), COSTS, horizon=30.0, warmup=5.0)  # both on the node
    # Per second: 4 nodes x (1 agent, holding the node's cores, each heartbeat, and 3
    # workers, holding nothing there, every (10 s - 1 s) / 3 = 3 s); per action: 2
    # placements / 5.
    expected = 4 * (1 + 3 / 3) / before.actions_per_s + 2 / 5
    assert before.actor_messages_per_action == pytest.approx(expected, rel=0.05)
    # Before idle proxies kept the agents' pace: 4 nodes x (3 workers + 1 agent) a second.
    older = model(attrs.evolve(old, idle_polls="heartbeat"), COSTS, horizon=30.0, warmup=5.0)
    expected = 4 * 4 / older.actions_per_s + 2 / 5
    assert older.actor_messages_per_action == pytest.approx(expected, rel=0.05)
    # Relayed: each node's agent polls once for itself and its workers, every
    # (lease timeout 10 s - heartbeat 1 s) / 3 = 3 s: 4 nodes x 1/3 a second.
    assert local.actor_messages_per_action == pytest.approx((4 / 3) / local.actions_per_s, rel=0.05)
    assert before.actor_load == pytest.approx(
        before.actor_messages_per_action * before.actions_per_s * COSTS.actor, rel=0.05
    )


def test_the_policy_decides_each_nodes_cores() -> None:
    # Four trajectories on two cores back to back: the ledger keeps both cores busy.
    job = _alone(trajectories=4, cores=2, seconds=1.0)
    result = model(job, COSTS, horizon=60.0, warmup=10.0)
    assert result.actions_per_s == pytest.approx(2.0, rel=0.02)
    # A unit freed is granted by the agent's next pass: the release's own CPU.
    assert result.decision_p99 == pytest.approx(COSTS.agent)


def test_a_saturated_actor_shows_as_load_over_one() -> None:
    slow = Costs(actor=0.05, agent=0.001, latency=0.001)
    job = _alone(nodes=10, trajectories=4, cores=4, cores_by="job")
    result = model(job, slow, horizon=20.0, warmup=5.0)
    assert result.actor_load > 0.9
    assert result.actions_per_s < 40 / 0.1


def test_a_grant_made_after_its_ask_costs_the_jobs_actor_a_poll() -> None:
    # Two trajectories on one core, decided centrally: almost every grant is made when
    # the other's release comes, not in its own ask's pass, and reaches its proxy on the
    # poll waiting at the actor, which the proxy then sends again.
    result = model(_alone(trajectories=2, cores_by="job"), COSTS, horizon=50.0, warmup=10.0)
    assert result.actor_messages_per_action == pytest.approx(3.0, rel=0.02)
