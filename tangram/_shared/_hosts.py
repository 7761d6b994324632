"""A worker's handles on host agents: a trajectory's sandbox, a block on a GPU service.

What ``remote.sandbox(...)`` and ``remote.service(...)`` open: a sandbox on the worker's
own node while it has a core per sandbox, else the scheduler actor picks the host
(:mod:`._placement`); then every call goes straight to that host's agent as one Ray
call, by value. A Ray error on the way is converted here into the error the local
executor would raise for a dead sandbox or service.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import (
    GpuPoolClosedError,
    GpuServiceError,
    SandboxBrokenError,
    SchedulerUnavailableError,
)
from ._protocol import lost, task_failed

if TYPE_CHECKING:
    from .._core._demand import Elastic
    from .._sandbox._backend import RunResult

__all__ = ["RemoteSandbox", "RemoteService", "open_sandbox", "open_service"]


class RemoteSandbox:
    """A trajectory's sandbox on a host agent: ``run``, ``put`` and ``get`` as on a Sandbox.

    ``python`` is the interpreter ``run(code=...)`` uses inside it, for callers that run
    Python with flags of their own (a grading harness).
    """

    def __init__(self, agent: Any, trajectory_id: str, host: str, python: str = "python3") -> None:
        self._agent = agent
        self.trajectory_id = trajectory_id
        self.host = host
        self.python = python

    def __repr__(self) -> str:
        return f"<tangram.ray.RemoteSandbox trajectory={self.trajectory_id!r} host={self.host!r}>"

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._agent, method).remote(self.trajectory_id, *args)
        except task_failed() as exc:
            raise exc.cause from exc
        except lost() as exc:
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
async def open_sandbox(
    scheduler: Any,
    trajectory_id: str,
    cid: str | None = None,
    local: tuple[str, Any] | None = None,
) -> AsyncIterator[RemoteSandbox]:
    """Open ``trajectory_id``'s sandbox on this node's agent, or where the scheduler places it.

    ``local``: this worker's node, as (host, its agent). The sandbox opens there while
    that node has a core per open sandbox, without a message to the job's ``scheduler``
    actor; otherwise (or with no agent here) the scheduler places it on the least
    loaded host. ``cid`` (the opening proxy) owns the sandbox: if that proxy goes
    silent, the scheduler has the agent close it, cancelling what still runs in it.
    """
    sandbox: RemoteSandbox | None = None
    spilled: tuple[str, int] | None = None
    if local is not None:
        host, agent = local
        python = await _open_here(agent, trajectory_id, cid)
        if isinstance(python, str):
            sandbox = RemoteSandbox(agent, trajectory_id, host, python)
        elif python is not None:  # full: the job's book learns how many it holds
            spilled = (host, python)
    if sandbox is not None:
        try:
            yield sandbox
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
                await sandbox._agent.close.remote(trajectory_id)
        return
    try:
        host, agent = await scheduler.place.remote(trajectory_id, cid, spilled)
    except task_failed() as exc:
        raise exc.cause from exc
    except lost() as exc:
        raise SchedulerUnavailableError(f"the scheduler actor is unreachable: {exc}") from exc
    sandbox = RemoteSandbox(agent, trajectory_id, host)
    try:
        sandbox.python = await sandbox._call("open")
        yield sandbox
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
            await agent.close.remote(trajectory_id)
            await scheduler.unplace.remote(trajectory_id)


async def _open_here(agent: Any, trajectory_id: str, cid: str | None) -> str | int | None:
    """The sandbox's interpreter if this node's agent opened it; else how many sandboxes
    its workers hold there (it is full), or ``None`` if it is gone.

    Cancelled while the agent opens it, the call still runs there: its sandbox is
    closed once it answers, not left holding a core for a block that never began.
    """
    call = agent.open_here.remote(trajectory_id, cid)
    try:
        python, count = await call
    except task_failed() as exc:
        raise exc.cause from exc
    except lost():
        return None  # this node's agent is gone: another host will do
    except BaseException:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            if (await call)[0] is not None:
                await agent.close.remote(trajectory_id)
        raise
    return count if python is None else str(python)


class RemoteService:
    """A GPU model service lent to one block on a host agent: ``await svc(batch)``.

    The cluster form of :class:`tangram.gpu.ServiceHandle`. The block stays on one host;
    each call is one Ray call to its agent, which runs it as one action of its GpuPool
    (joining a live replica, or restoring one, evicting idle services for room).
    Batches and results travel by value.
    """

    def __init__(self, agent: Any, name: str, host: str) -> None:
        self._agent = agent
        self.name = name
        self.host = host
        self._open = True
        self._seq = 0
        self._resident: list[str] = []

    def __repr__(self) -> str:
        return f"<tangram.ray.RemoteService {self.name!r} host={self.host!r}>"

    async def __call__(self, batch: Any) -> Any:
        """Run ``batch`` on the service (see :class:`tangram.gpu.ServiceHandle`).

        :raises GpuServiceError: the service failed, or its host agent is gone (the
            Ray error in ``__cause__``).
        :raises GpuPoolClosedError: the handle is used after its block ended.
        """
        if not self._open:
            raise GpuPoolClosedError("the block ended: use the handle inside its `async with`")
        try:
            result, seq, resident = await self._agent.call_service.remote(self.name, batch)
        except task_failed() as exc:
            raise exc.cause from exc
        except lost() as exc:
            raise GpuServiceError(
                f"the host agent {self.host!r} serving {self.name!r} is gone: {exc}"
            ) from exc
        if seq > self._seq:
            self._seq, self._resident = seq, resident
        return result


@contextlib.asynccontextmanager
async def open_service(scheduler: Any, cid: str, name: str) -> AsyncIterator[RemoteService]:
    """Place one block on service ``name`` for the proxy ``cid``; ends its ticket after."""
    try:
        ticket, host, agent = await scheduler.place_service.remote(cid, name)
    except task_failed() as exc:
        raise exc.cause from exc
    except lost() as exc:
        raise SchedulerUnavailableError(f"the scheduler actor is unreachable: {exc}") from exc
    service = RemoteService(agent, name, host)
    try:
        yield service
    finally:
        service._open = False
        with anyio.CancelScope(shield=True), contextlib.suppress(*lost()):
            await scheduler.unplace_service.remote(ticket, service._seq, service._resident)
