"""One scheduler per Ray job, found or created by whichever worker comes first.

verl and OpenRLHF run tangram inside Ray actors that tangram never starts and whose
driver script it cannot change. So nothing can create the scheduler ahead of them: every
worker asks for the job's scheduler actor by a name that contains the Ray job id
(``tangram-<job id>``), creating it if it does not exist yet (``get_if_exists``: two
workers racing end with one actor), and for its own node's host agent the same way
(``tangram-<job id>-<node id>``, pinned to that node). The agent owns the node's
sandboxes and GPU services and registers its cores as ``cpu@<node>`` and its devices as
``gpu@<node>``, so core ids are picked on the node that owns them and each node's
capacity is its own; the cluster's is the sum.

Both actors are detached: the worker that created one may end long before the job does.
They end with the job all the same: the scheduler counts the proxies that heartbeat to
it, and once none but its agents' has for ``IDLE`` lease timeouts (counted from the
last worker's proxy expiring, a lease timeout after its last heartbeat), it stops its
agents, their sandboxes and services first, and kills itself. An agent whose scheduler is gone ends
on its own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._core._policy import Policy
from .._runtime._run import Runtime
from ..errors import SchedulerUnavailableError
from ._agent import BackendSpec, HostAgentActor
from ._cluster import ClusterSchedulerActor
from ._protocol import DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT, IDLE, SCHEDULER_CALLS
from ._proxy import RemoteRuntime, attach, check_capacity

__all__ = ["IDLE", "NAMESPACE", "agent_name", "host_name", "open_shared", "scheduler_name"]

NAMESPACE = "tangram"
"""The Ray namespace of every job's shared actors (their names carry the job id)."""


def scheduler_name(job_id: str) -> str:
    return f"tangram-{job_id}"


def host_name(node_id: str) -> str:
    """The host's name in capacity kinds (``cpu@<host>``): its node id, shortened."""
    return node_id[:12]


def agent_name(job_id: str, node_id: str) -> str:
    return f"tangram-{job_id}-{node_id}"


@contextlib.asynccontextmanager
async def open_shared(
    *,
    capacity: Mapping[str, object],
    policy: Policy | None = None,
    agent: bool = False,
    backend: BackendSpec = None,
    warm: int = 0,
    timeout: float | None = None,
    services: Sequence[Any] = (),
    devices: Sequence[Any] | None = None,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease_timeout: float = DEFAULT_TIMEOUT,
) -> AsyncIterator[RemoteRuntime]:
    """A proxy on this job's scheduler, with this node's host agent started when asked.

    Call it inside a Ray worker (Ray initialised). ``capacity`` is what is not per node
    (an API's rate, quotas); the creator states it and every later worker must state the
    same. With ``agent``, this node's host agent is found or started: ``backend``,
    ``warm`` and ``timeout`` for its sandbox pool, ``services``/``devices`` for its GPU
    pool (each service loaded once per node, whichever worker asks first).

    :raises InvalidCapacityError: the job's scheduler states another capacity.
    :raises SchedulerUnavailableError: the scheduler actor failed.
    """
    context = ray.get_runtime_context()
    job = context.get_job_id()
    node = context.get_node_id()
    host = host_name(node)
    stated = dict(capacity) or {f"cpu@{host}": 0}  # a runtime names at least one kind
    wanted = Runtime(stated).capacity
    actor_class: Any = ray.remote(ClusterSchedulerActor)
    actor = actor_class.options(
        name=scheduler_name(job),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_concurrency=SCHEDULER_CALLS,
        num_cpus=0,
        # Beside the worker that made it: Ray would spread a zero-CPU actor anywhere.
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(stated, policy, heartbeat, lease_timeout, uuid.uuid4().hex, IDLE * lease_timeout)
    try:
        info = await actor.info.remote()
    except ray.exceptions.RayError as exc:
        raise SchedulerUnavailableError(f"the job's scheduler actor failed: {exc}") from exc
    if capacity:
        check_capacity(info["capacity"], wanted)
    async with attach(actor, heartbeat=heartbeat, info=info, node=node) as remote:
        if agent:
            await _start_agent(remote, job, node, host, backend, warm, timeout, services, devices)
        yield remote


async def _start_agent(
    remote: RemoteRuntime,
    job: str,
    node: str,
    host: str,
    backend: Any,
    warm: int,
    timeout: float | None,
    services: Sequence[Any],
    devices: Sequence[Any] | None,
) -> None:
    """Find or create this node's agent and wait until its capacity is registered."""
    agent_class: Any = ray.remote(HostAgentActor)
    agent = agent_class.options(
        name=agent_name(job, node),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=SCHEDULER_CALLS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(host, remote.actor, backend, warm, list(services), devices, timeout, True)
    try:
        await agent.start.remote()
    except ray.exceptions.RayError as exc:
        # A detached agent that failed to start would stay, failed, for every later
        # worker to find: it goes now, and the next worker tries afresh.
        ray.kill(agent, no_restart=True)
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise exc.cause from exc
        raise SchedulerUnavailableError(f"this node's host agent failed: {exc}") from exc
    # Once ``start`` answers, on any caller, the agent's ``add_host`` has returned.
    await remote._refresh()
    await remote._home(host, agent)
