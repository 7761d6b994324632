"""Per-host agents: a Ray actor pinned to a node that owns that node's sandboxes.

An action's cores must come from the machine its sandbox lives on, so each host is its
own capacity kind, ``cpu@<agent>``, registered with the shared scheduler when its agent
starts. The agent is an ordinary client of the scheduler: its :class:`tangram.SandboxPool`
acquires through a proxy, so the central policy decides how many cores each action gets
while the agent turns the count into core ids and runs the command locally.

The scheduler places a trajectory on the least loaded host when its sandbox opens and
keeps it there: every action of the trajectory runs next to its files. Commands reach the
agent as one Ray call each; files and output travel by value.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, cast

import anyio
import attrs
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ._demand import Elastic
from ._ray import RemoteRuntime, SchedulerUnavailableError, attach
from ._runtime import Runtime
from ._sandbox import (
    Host,
    RunResult,
    Sandbox,
    SandboxBackend,
    SandboxHandle,
    SandboxPool,
    default_backend,
)
from .errors import SandboxBrokenError

__all__ = ["HostAgent", "RemoteSandbox", "open_sandbox", "start_agent"]

BackendSpec = SandboxBackend | Callable[[], SandboxBackend] | None


class _HostBackend(SandboxBackend):
    """The agent's backend with its host's cores counted as ``cpu@<agent>``."""

    def __init__(self, inner: SandboxBackend, agent: str) -> None:
        self._inner = inner
        self._agent = agent
        self._hosts: dict[str, Host] = {}
        self.python = inner.python

    async def start(self) -> Sequence[Host]:
        hosts = list(await self._inner.start())
        if len(hosts) != 1:
            raise ValueError(
                f"a host agent's backend must place sandboxes on exactly one host "
                f"(got {len(hosts)}): start one agent per host"
            )
        self._hosts = {host.name: host for host in hosts}
        return [attrs.evolve(hosts[0], resource=f"cpu@{self._agent}")]

    async def create(self, host: Host) -> SandboxHandle:
        return await self._inner.create(self._hosts[host.name])

    async def aclose(self) -> None:
        await self._inner.aclose()


class HostAgentActor:
    """The body of a host agent's Ray actor; its methods are the wire protocol."""

    def __init__(self, name: str, scheduler: Any, backend: BackendSpec, warm: int) -> None:
        self._name = name
        self._scheduler = scheduler
        self._backend = backend
        self._warm = warm
        self._pool: SandboxPool | None = None
        self._sandboxes: dict[str, tuple[contextlib.AsyncExitStack, Sandbox]] = {}
        self._started: asyncio.Future[dict[str, Any]] | None = None
        self._stop: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None

    async def start(self) -> dict[str, Any]:
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_future()
            self._stop = asyncio.Event()
            self._main = loop.create_task(self._serve())
        return await asyncio.shield(self._started)

    async def _serve(self) -> None:
        assert self._started is not None and self._stop is not None
        try:
            spec = self._backend
            if spec is None:
                inner = await default_backend()
            elif isinstance(spec, SandboxBackend):
                inner = spec
            else:
                inner = spec()
            backend = _HostBackend(inner, self._name)
            async with attach(self._scheduler) as remote:
                pool = SandboxPool(backend, runtime=cast(Runtime, remote), warm=self._warm)
                async with pool:
                    self._pool = pool
                    host = pool.hosts[0]
                    me = ray.get_runtime_context().current_actor
                    await self._scheduler.add_host.remote(
                        self._name, host.resource, len(host.cores), me, remote._id
                    )
                    await remote._refresh()
                    self._started.set_result(
                        {
                            "name": self._name,
                            "resource": host.resource,
                            "units": len(host.cores),
                            "cores": host.cores,
                            "node_id": ray.get_runtime_context().get_node_id(),
                            "pid": os.getpid(),
                            "backend": repr(inner),
                        }
                    )
                    try:
                        await self._stop.wait()
                    finally:
                        for stack, _ in list(self._sandboxes.values()):
                            await stack.aclose()
                        self._sandboxes.clear()
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            raise

    async def stop(self) -> None:
        await self.start()
        assert self._stop is not None and self._main is not None
        self._stop.set()
        with contextlib.suppress(Exception):
            await self._main

    async def open(self, trajectory: str) -> None:
        await self.start()
        if trajectory in self._sandboxes:
            raise ValueError(f"trajectory {trajectory!r} already has a sandbox on this host")
        assert self._pool is not None
        stack = contextlib.AsyncExitStack()
        sandbox = await stack.enter_async_context(self._pool.sandbox(trajectory))
        self._sandboxes[trajectory] = (stack, sandbox)

    async def close(self, trajectory: str) -> None:
        entry = self._sandboxes.pop(trajectory, None)
        if entry is not None:
            await entry[0].aclose()

    def _sandbox(self, trajectory: str) -> Sandbox:
        entry = self._sandboxes.get(trajectory)
        if entry is None:
            from .errors import SandboxClosedError

            raise SandboxClosedError(f"trajectory {trajectory!r} has no open sandbox here")
        return entry[1]

    async def run(self, trajectory: str, kwargs: dict[str, Any]) -> RunResult:
        return await self._sandbox(trajectory).run(**kwargs)

    async def put(self, trajectory: str, path: str, data: bytes | str) -> None:
        await self._sandbox(trajectory).put(path, data)

    async def get(self, trajectory: str, path: str) -> bytes:
        return await self._sandbox(trajectory).get(path)


@attrs.frozen
class HostAgent:
    """A started host agent: where it runs and what it registered.

    ``await agent.aclose()`` stops it: its sandboxes are destroyed and its capacity
    leaves the scheduler.
    """

    name: str
    resource: str
    units: int
    node_id: str
    pid: int
    actor: Any = attrs.field(repr=False)

    async def aclose(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            await self.actor.stop.remote()
        ray.kill(self.actor)


async def start_agent(
    remote: RemoteRuntime,
    *,
    name: str,
    node_id: str | None = None,
    backend: BackendSpec = None,
    warm: int = 0,
) -> HostAgent:
    """Start a host agent on ``node_id`` (default: this node) and register its cores.

    :param remote: a proxy on the scheduler the agent serves.
    :param name: the host's name; its cores become the capacity kind ``cpu@<name>``.
    :param backend: a :class:`tangram.SandboxBackend`, or a callable building one on the
        agent's node (better for anything that probes the machine), or ``None`` for
        Docker when usable there, else the embedded local backend.
    :param warm: parked sandboxes the agent keeps ready.
    :raises ValueError: a name in use, or a backend that spans several hosts.
    """
    if not isinstance(name, str) or not name or "@" in name:
        raise ValueError(f"`name` must be a non-empty string without '@' (got {name!r})")
    hosts = await remote.actor.hosts.remote()
    if name in hosts:
        raise ValueError(f"a host agent named {name!r} is already registered")
    node = node_id if node_id is not None else ray.get_runtime_context().get_node_id()
    actor_class: Any = ray.remote(HostAgentActor)
    actor = actor_class.options(
        num_cpus=0,
        max_concurrency=1_000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(name, remote.actor, backend, warm)
    try:
        info = await actor.start.remote()
    except ray.exceptions.RayTaskError as exc:
        ray.kill(actor)
        raise exc.cause from exc
    await remote._refresh()
    return HostAgent(
        name=info["name"],
        resource=info["resource"],
        units=info["units"],
        node_id=info["node_id"],
        pid=info["pid"],
        actor=actor,
    )


class RemoteSandbox:
    """A trajectory's sandbox on a host agent: ``run``, ``put`` and ``get`` as on a Sandbox."""

    def __init__(self, agent: Any, trajectory_id: str, host: str) -> None:
        self._agent = agent
        self.trajectory_id = trajectory_id
        self.host = host

    def __repr__(self) -> str:
        return f"<tangram.ray.RemoteSandbox trajectory={self.trajectory_id!r} host={self.host!r}>"

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._agent, method).remote(self.trajectory_id, *args)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from exc
        except ray.exceptions.RayError as exc:
            raise SandboxBrokenError(f"the host agent {self.host!r} is gone: {exc}") from exc

    async def run(
        self,
        command: str | Sequence[str] | None = None,
        *,
        code: str | None = None,
        cpu: int | float | Elastic = 1,
        timeout: float | None = None,  # noqa: ASYNC109 - the command's limit (see Sandbox.run)
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        kind: str | None = None,
    ) -> RunResult:
        """Run one action on the agent (see :meth:`tangram.Sandbox.run`)."""
        kwargs = {
            "command": command,
            "code": code,
            "cpu": cpu,
            "timeout": timeout,
            "stdin": stdin,
            "env": env,
            "kind": kind,
        }
        result: RunResult = await self._call("run", kwargs)
        return result

    async def put(self, path: str, data: bytes | str) -> None:
        await self._call("put", path, data)

    async def get(self, path: str) -> bytes:
        data: bytes = await self._call("get", path)
        return data


@contextlib.asynccontextmanager
async def open_sandbox(remote: RemoteRuntime, trajectory_id: str) -> AsyncIterator[RemoteSandbox]:
    if not isinstance(trajectory_id, str):
        raise TypeError(f"`trajectory_id` must be a string (got {trajectory_id!r})")
    try:
        host, agent = await remote.actor.place.remote(trajectory_id)
    except ray.exceptions.RayTaskError as exc:
        raise exc.cause from exc
    except ray.exceptions.RayError as exc:
        raise SchedulerUnavailableError(f"the scheduler actor is unreachable: {exc}") from exc
    sandbox = RemoteSandbox(agent, trajectory_id, host)
    try:
        await sandbox._call("open")
        yield sandbox
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(ray.exceptions.RayError):
            await agent.close.remote(trajectory_id)
            await remote.actor.unplace.remote(trajectory_id)
