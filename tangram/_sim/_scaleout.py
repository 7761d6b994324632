"""A discrete-event model of the shared scheduler's protocol, for clusters this machine cannot hold.

Issue 30 asks what one job's scheduler does at 1,000 nodes. The model runs the protocol's
messages on a virtual clock: every process that decides (the job's actor, each node's
host agent) is one event loop, a single server that spends a measured CPU time on each
message in arrival order, and every message between processes takes a one-way latency.
Grants are decided by the real :class:`~tangram._core._ledger.Ledger` and policy, as in
:func:`~tangram.simulate`: one ledger per node when nodes decide their cores, one for
every node's kind when the job's actor does.

Who decides what is the model's setting (:class:`Job`): a sandbox action's cores, a
sandbox's host, and where heartbeats go. As shipped, a sandbox action is one call from
its worker to its node's agent, which decides the node's cores and reports to the job's
actor once per ``report_every`` actions; a sandbox opens on its worker's own node's
agent (one call there when it opens and one when it closes; the model's nodes have a
core per trajectory, so none spills to the job's actor), and each worker beats to its
node's agent, which passes all their beats on in one poll of the job's actor every
:func:`~tangram._core._beats.relay_wait` seconds (3 at the default heartbeat and lease
timeout; twice a heartbeat before). Before issue 30 the agent also asked the job's
actor for the cores, and told it of the release; until the node placed its workers'
sandboxes, the job's actor placed each one (a message when it opens and one when it
closes), and every proxy beat to the job's actor every heartbeat; a worker's holds
nothing there (its agent holds the cores), and as shipped such a proxy polls at the
agents' pace instead, never faster than a heartbeat
(:func:`~tangram._core._beats.idle_wait`, ``Job.idle_polls``).

What it leaves out, on purpose: the sandbox's start-up and process spawns (an action's
seconds are its whole run), GPU services and quotas, and failures. Pure: no clock, no I/O.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Literal

import attrs

from .._core._action import Action
from .._core._beats import idle_wait, relay_wait
from .._core._demand import build_demand
from .._core._efficiency import Estimate, Linear
from .._core._estimator import Estimator
from .._core._ledger import Ledger
from .._core._policy import ElasticPolicy, Entry
from .._core._resources import parse_capacity
from .._core._stats import nearest_rank

__all__ = ["Costs", "Job", "ModelResult", "model"]


@attrs.frozen(kw_only=True)
class Costs:
    """What a message costs, measured on the real path (``benchmarks/ray_ceiling.py``).

    ``actor``: CPU seconds of the job's actor per message that asks for or releases
    units, ``beat`` per heartbeat and ``place`` per placement or report (default for
    both: ``actor``), ``idle`` per second whatever it handles (its process's timers and
    threads); ``agent``: of a node's agent per call (the ask, and again the release);
    ``latency``: one way, between any two processes.
    """

    actor: float
    agent: float
    latency: float
    beat: float | None = None
    place: float | None = None
    idle: float = 0.0


@attrs.frozen(kw_only=True)
class Job:
    """The workload: ``trajectories`` per node, each a loop of think then one-core action.

    A trajectory runs ``actions`` actions in one sandbox, then closes it and a new one
    opens (a new placement). Think and action times are lognormal with these means (a
    think of 0: back to back).

    Who decides what: ``cores`` (a sandbox action's grant) and ``placement`` (which host
    a sandbox opens on) by the job's actor or the node's agent; ``heartbeats`` from every
    proxy to the job's actor, or from each node's agent for its workers too. As shipped:
    all three on the node. ``idle_polls``: how often a worker's proxy that polls the
    job's actor itself while holding nothing there does (its node's agent holds the
    cores): at the agents' pace as shipped, or every heartbeat as before.
    """

    nodes: int
    trajectories: int
    cores: int
    workers: int
    think: float = 2.0
    seconds: float = 1.0
    sigma: float = 0.5
    actions: int = 20
    heartbeat: float = 1.0
    lease_timeout: float = 10.0
    report_every: int = 1024
    cores_by: Literal["job", "node"] = "node"
    placement_by: Literal["job", "node"] = "node"
    heartbeats_by: Literal["proxy", "node"] = "node"
    idle_polls: Literal["heartbeat", "relay"] = "relay"


@attrs.frozen
class ModelResult:
    """Cluster-wide figures over the measured part of the horizon."""

    actions_per_s: float
    decision_p50: float
    decision_p99: float
    on_node: float  # share of sandbox actions whose grant never left their node
    actor_messages_per_action: float
    actor_load: float  # the job actor's CPU seconds asked per second: over 1, it saturates
    agent_load_max: float  # the same for the busiest node's agent
    placement_p99: float  # seconds from asking for a sandbox's host to having it


class _Server:
    """One event loop: messages served one at a time, in arrival order."""

    __slots__ = ("busy", "free_at", "warmup")

    def __init__(self, warmup: float) -> None:
        self.free_at = 0.0
        self.busy = 0.0  # CPU seconds asked by messages arriving after the warm-up
        self.warmup = warmup

    def serve(self, at: float, cost: float) -> float:
        """When a message arriving at ``at`` has been handled."""
        start = max(at, self.free_at)
        self.free_at = start + cost
        if at >= self.warmup:
            self.busy += cost
        return self.free_at


def model(
    job: Job, costs: Costs, *, horizon: float = 30.0, warmup: float = 5.0, seed: int = 0
) -> ModelResult:
    """Run ``job`` for ``horizon`` virtual seconds; figures count from ``warmup``."""
    return _Model(job, costs, horizon, warmup, seed).run()


class _Model:
    def __init__(self, job: Job, costs: Costs, horizon: float, warmup: float, seed: int) -> None:
        self.job, self.costs, self.horizon, self.warmup = job, costs, horizon, warmup
        self.rng = random.Random(seed)
        self.kinds = [f"cpu@{n}" for n in range(job.nodes)]
        estimator = Estimator()
        if job.cores_by == "node":
            self.ledgers = [
                Ledger(parse_capacity({kind: job.cores}), ElasticPolicy(), estimator)
                for kind in self.kinds
            ]
        else:
            everyone = parse_capacity(dict.fromkeys(self.kinds, job.cores))
            self.ledgers = [Ledger(everyone, ElasticPolicy(), estimator)] * job.nodes
        self.actor = _Server(warmup)
        self.agents = [_Server(warmup) for _ in range(job.nodes)]
        self.freed = [0.0] * job.nodes  # when each node's last unit came back
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.ids = itertools.count(1)
        self.pending: dict[int, tuple[int, int, int, float]] = {}
        self.since = [0] * job.nodes
        self.actions = 0
        self.messages = 0
        self.decisions: list[float] = []
        self.placements: list[float] = []
        self.mu_think = math.log(job.think) - job.sigma**2 / 2 if job.think > 0 else None
        self.mu_run = math.log(job.seconds) - job.sigma**2 / 2

    def at(self, time: float, call: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (time, next(self.seq), call))

    def to_actor(
        self, now: float, then: Callable[[float], None] | None = None, cost: float | None = None
    ) -> None:
        """A message reaching the job's actor a latency later; ``then`` once handled."""
        done = self.actor.serve(
            now + self.costs.latency, self.costs.actor if cost is None else cost
        )
        if now >= self.warmup:
            self.messages += 1
        if then is not None:
            self.at(done, then)

    def open_sandbox(self, node: int, traj: int, now: float) -> None:
        latency = self.costs.latency

        def placed(time: float) -> None:
            ready = time + latency
            if now >= self.warmup:
                self.placements.append(ready - now)
            self.at(ready, lambda t: self.think(node, traj, self.job.actions, t))

        if self.job.placement_by == "job":
            self.to_actor(now, placed, self.costs.place)
        else:
            self.at(self.agents[node].serve(now + latency, self.costs.agent), placed)

    def close_sandbox(self, node: int, now: float) -> None:
        if self.job.placement_by == "job":
            self.to_actor(now, cost=self.costs.place)
        else:
            self.agents[node].serve(now + self.costs.latency, self.costs.agent)

    def think(self, node: int, traj: int, left: int, now: float) -> None:
        if left == 0:
            self.close_sandbox(node, now)
            self.open_sandbox(node, traj, now)
            return
        if self.mu_think is None:
            self.call(node, traj, left, now)
            return
        pause = self.rng.lognormvariate(self.mu_think, self.job.sigma)
        self.at(now + pause, lambda t: self.call(node, traj, left, t))

    def call(self, node: int, traj: int, left: int, now: float) -> None:
        seconds = self.rng.lognormvariate(self.mu_run, self.job.sigma)
        ledger = self.ledgers[node]
        demand = build_demand({self.kinds[node]: 1}, ledger.capacity)
        action = Action(next(self.ids), "sandbox", None, demand, Estimate(seconds, Linear()))
        self.pending[action.id] = (node, traj, left, now)
        reached = self.agents[node].serve(now + self.costs.latency, self.costs.agent)

        def decide(time: float) -> None:
            ledger.submit(action, time)
            self.step(ledger, time, action.id)

        if self.job.cores_by == "node":
            self.at(reached, decide)
        else:
            self.at(reached, lambda t: self.to_actor(t, decide))

    def granted(self, time: float) -> float:
        """When a grant decided at ``time`` reaches the agent that runs the action."""
        return time if self.job.cores_by == "node" else time + self.costs.latency

    def step(self, ledger: Ledger, time: float, asking: int | None = None) -> None:
        for entry, _ in ledger.step(time).admits:
            node, traj, left, sent = self.pending.pop(entry.action.id)
            granted = self.granted(time)
            if self.job.cores_by == "job" and entry.action.id != asking:
                # Not granted in the pass its ask made: the grant rides on the proxy's
                # waiting poll, which the proxy then sends again.
                self.to_actor(granted, cost=self.costs.beat)
            if sent >= self.warmup:
                # From the later of the ask and the unit coming free to the grant at
                # the agent: what deciding adds, not the wait for a unit.
                self.decisions.append(granted - max(sent, self.freed[node]))
            ends = granted + entry.t1
            self.at(ends, functools.partial(self.finish, entry, node, traj, left))

    def finish(self, entry: Entry, node: int, traj: int, left: int, now: float) -> None:
        if now >= self.warmup:
            self.actions += 1
        self.freed[node] = now
        ledger = self.ledgers[node]
        self.at(now + self.costs.latency, lambda t: self.think(node, traj, left - 1, t))

        def release(time: float) -> None:
            ledger.finish(entry, time)
            self.step(ledger, time)

        if self.job.cores_by == "node":
            self.at(self.agents[node].serve(now, self.costs.agent), release)
            self.since[node] += 1
            if self.since[node] >= self.job.report_every:
                self.since[node] = 0
                self.to_actor(now, cost=self.costs.place)
        else:
            self.to_actor(now, release)

    def heartbeat(self, now: float) -> None:
        job = self.job
        beat = self.costs.beat
        for node in range(job.nodes):
            if job.heartbeats_by == "proxy":  # the agent, which holds the node's cores
                idle = job.workers if job.idle_polls == "heartbeat" else 0
                for _ in range(1 + idle):
                    self.to_actor(now, cost=beat)
            else:  # the node's workers beat to their agent
                for _ in range(job.workers):
                    self.agents[node].serve(now + self.costs.latency, self.costs.agent)
        if now + job.heartbeat < self.horizon:
            self.at(now + job.heartbeat, self.heartbeat)

    def relay(self, now: float, polls: int, wait: float) -> None:
        """``polls`` proxies that hold nothing at the job's actor poll it every ``wait``:
        a node's agent passing its workers' beats on
        (:func:`~tangram._core._beats.relay_wait`), or (every proxy beating to the job's
        actor) a node's workers (:func:`~tangram._core._beats.idle_wait`)."""
        for _ in range(polls):
            self.to_actor(now, cost=self.costs.beat)
        if now + wait < self.horizon:
            self.at(now + wait, functools.partial(self.relay, polls=polls, wait=wait))

    def run(self) -> ModelResult:
        job, rng = self.job, self.rng
        for node in range(job.nodes):
            for traj in range(job.trajectories):
                start = rng.uniform(0.0, max(job.think, job.seconds))
                self.at(start, functools.partial(self.open_sandbox, node, traj))
        self.at(rng.uniform(0.0, job.heartbeat), self.heartbeat)
        # Each agent from its own start; or each node's workers, which hold nothing at
        # the job's actor (their node's agent holds the cores).
        if job.heartbeats_by == "node":
            polls, wait = 1, relay_wait(job.heartbeat, job.lease_timeout)
        else:
            polls = job.workers if job.idle_polls == "relay" else 0
            wait = idle_wait(job.heartbeat, job.lease_timeout)
        for _ in range(job.nodes if polls else 0):
            self.at(
                rng.uniform(0.0, wait),
                functools.partial(self.relay, polls=polls, wait=wait),
            )
        events = self.events
        while events and events[0][0] < self.horizon:
            now, _, handler = heapq.heappop(events)
            handler(now)
        span = self.horizon - self.warmup
        self.decisions.sort()
        self.placements.sort()
        return ModelResult(
            actions_per_s=self.actions / span,
            decision_p50=nearest_rank(self.decisions, 0.5),
            decision_p99=nearest_rank(self.decisions, 0.99),
            on_node=1.0 if job.cores_by == "node" else 0.0,
            actor_messages_per_action=self.messages / max(self.actions, 1),
            actor_load=self.actor.busy / span + self.costs.idle,
            agent_load_max=max(a.busy for a in self.agents) / span,
            placement_p99=nearest_rank(self.placements, 0.99),
        )
