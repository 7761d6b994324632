"""Reaching the shared scheduler: create or find its named actor, attach a proxy.

The driver creates the actor (pinned to its own node) with a capacity; workers find it
by name in the job's namespace. An existing actor with another capacity is refused,
never silently reused, and the actor a proxy created dies with it unless detached.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._core._policy import Policy
from .._core._resources import Capacity
from .._core._validate import seconds
from .._runtime._run import Runtime, _enter_current, _exit_current
from ..errors import (
    AsyncioRequiredError,
    InvalidCapacityError,
    SchedulerUnavailableError,
    SettingTypeError,
)
from ._cluster import ClusterSchedulerActor
from ._protocol import DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT, SCHEDULER_CALLS, lost
from ._proxy import RemoteRuntime, attach

__all__ = ["LOOKUP_SECONDS", "connect"]

LOOKUP_SECONDS = 30.0
"""How long ``connect`` without a capacity waits for the actor to be created."""


async def _lookup(name: str, namespace: str | None, wait: float) -> Any:
    deadline = time.monotonic() + wait
    while True:
        try:
            return await anyio.to_thread.run_sync(lambda: ray.get_actor(name, namespace=namespace))
        except ValueError as exc:
            if time.monotonic() >= deadline:
                where = f"namespace {namespace!r}" if namespace else "this job's namespace"
                raise SchedulerUnavailableError(
                    f"no tangram scheduler actor named {name!r} in {where} after {wait:g} s: "
                    "create it with tangram.ray.connect(capacity=...) in the driver first"
                ) from exc
            await anyio.sleep(0.2)


@contextlib.asynccontextmanager
async def connect(
    *,
    name: str = "tangram",
    namespace: str | None = None,
    address: str | None = None,
    capacity: Mapping[str, object] | None = None,
    create: bool = True,
    policy: Policy | None = None,
    detached: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease_timeout: float = DEFAULT_TIMEOUT,
    lookup_timeout: float = LOOKUP_SECONDS,
) -> AsyncIterator[RemoteRuntime]:
    """Reach the shared scheduler ``name`` (creating it when given a capacity).

    ``async with tangram.ray.connect(capacity={"cpu": 64}) as remote:`` in the driver
    creates the actor; ``async with tangram.ray.connect() as remote:`` in a worker (a Ray
    task or actor of the same job) finds it by name. Inside the block
    ``tangram.acquire(...)`` reaches the shared scheduler. On a node whose host agent
    decides its cores (:func:`start_agent`), that agent is this worker's home: its
    sandboxes open there while the node has a core per sandbox, and, idle, it beats
    through it instead of polling the scheduler. An agent that starts on the node later,
    or replaces one that died, becomes the home of the node's workers then (not of the
    process whose ``connect`` created the scheduler).

    :param name: the actor's name.
    :param namespace: its Ray namespace; ``None`` is the job's own, which no other job
        sees, so a new job never finds a stale scheduler. Name one to share a
        ``detached`` scheduler across jobs, and put the job id in ``name``.
    :param address: the Ray cluster, for ``ray.init`` when Ray is not initialised yet.
    :param capacity: create the actor with this capacity if it does not exist. An
        existing actor with another capacity is refused, never silently reused.
    :param create: ``False`` only looks the actor up (waiting ``lookup_timeout``).
    :param policy: the scheduling policy of a new actor.
    :param detached: a new actor outlives this job (``ray.kill`` it when done).
    :param heartbeat: seconds between this proxy's heartbeats.
    :param lease_timeout: seconds without heartbeats after which a new actor reclaims a lease.
    :raises SchedulerUnavailableError: there is no such actor and none was created.
    :raises AsyncioRequiredError: not on asyncio (trio cannot await a Ray call).
    :raises InvalidCapacityError: a bad capacity, or one that differs from the actor's.
    :raises SettingTypeError: ``name`` is not a non-empty string (also a ``TypeError``).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise AsyncioRequiredError(
            "tangram.ray needs an asyncio event loop (Ray calls are awaited there)"
        ) from None
    heartbeat = seconds(
        "heartbeat",
        heartbeat,
        strict=True,
        type_error=InvalidCapacityError,
        value_error=InvalidCapacityError,
    )
    lease_timeout = seconds(
        "lease_timeout",
        lease_timeout,
        strict=True,
        type_error=InvalidCapacityError,
        value_error=InvalidCapacityError,
    )
    if lease_timeout < 2 * heartbeat:
        raise InvalidCapacityError(
            "`lease_timeout` must be at least twice `heartbeat` "
            f"(got {lease_timeout:g} < 2 x {heartbeat:g})"
        )
    if not isinstance(name, str) or not name:
        raise SettingTypeError(f"`name` must be a non-empty string (got {name!r})")
    wanted = Runtime(capacity).capacity if capacity is not None else None
    if not ray.is_initialized():
        await anyio.to_thread.run_sync(
            lambda: ray.init(address=address, namespace=namespace, include_dashboard=False)
        )
    token = uuid.uuid4().hex
    actor: Any
    if capacity is not None and create:
        options: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "get_if_exists": True,
            "max_concurrency": SCHEDULER_CALLS,
            "num_cpus": 0,
            # Ray spreads zero-CPU actors over the nodes; the scheduler stays with its
            # creator, so losing a worker node never takes the limits with it. Not soft:
            # a soft affinity left it on another node in 3 of 4 tries (Ray 2.60).
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        }
        if detached:
            options["lifetime"] = "detached"
        actor_class: Any = ray.remote(ClusterSchedulerActor)
        actor = actor_class.options(**options).remote(
            dict(capacity), policy, heartbeat, lease_timeout, token
        )
    else:
        actor = await _lookup(name, namespace, lookup_timeout)
    node = ray.get_runtime_context().get_node_id()
    try:
        info = await actor.info.remote(node)
    except lost() as exc:
        raise SchedulerUnavailableError(f"the scheduler actor {name!r} failed: {exc}") from exc
    owner = info["token"] == token
    if wanted is not None and not owner and _totals(info["capacity"]) != _totals(wanted):
        raise InvalidCapacityError(
            f"a scheduler named {name!r} already exists with capacity "
            f"{_totals(info['capacity'])!r}, not {_totals(wanted)!r}: use a new name (per "
            "job) or set_capacity"
        )
    # Its node said in each poll makes an agent started there later this process's home;
    # not the driver's that created the scheduler, whose sandboxes the scheduler places.
    located = None if owner else node
    async with attach(actor, heartbeat=heartbeat, info=info, node=located) as remote:
        if info.get("home") is not None:
            # This node's agent decides its cores: open sandboxes there and beat through
            # it, as a worker that started it does (``open_shared(agent=True)``).
            try:
                await remote._home(*info["home"])
            except lost() as exc:
                raise SchedulerUnavailableError(
                    f"the scheduler actor {name!r} failed: {exc}"
                ) from exc
        token_var = _enter_current(remote)
        try:
            yield remote
        finally:
            _exit_current(token_var)
    if owner and not detached:
        with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
            await actor.close.remote()
            ray.kill(actor)


def _totals(capacity: Capacity) -> dict[str, float]:
    return {name: res.total for name, res in capacity.items()}
