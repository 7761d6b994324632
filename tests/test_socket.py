"""The actors' transport without Ray: what one call can and cannot do to the others.

A real server and connection on a Unix socket in a temporary directory. Every case here
was a hang or a dead connection before it was fixed: a worker must get an answer or a
typed error for every call, and one bad call must never take the others down.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tangram._shared import _socket
from tangram._shared._protocol import ActorLostError, ActorTaskError
from tangram._shared._socket import Connection, LocalHandle, Server

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def _fails_to_load() -> None:
    raise RuntimeError("this class is not importable here")


class Unloadable:
    """Pickles, and cannot be loaded: a class the other process does not have."""

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_fails_to_load, ())


class TwoArgError(Exception):
    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


class Agent:
    def __init__(self) -> None:
        self.work: asyncio.Future[None] | None = None
        self.finished = asyncio.Event()

    async def run(self) -> str:
        self.work = asyncio.ensure_future(asyncio.sleep(60))
        await self.work
        return "done"

    async def close(self) -> None:
        assert self.work is not None
        self.work.cancel()

    async def echo(self, value: Any) -> Any:
        return value

    async def unloadable(self) -> Unloadable:
        return Unloadable()

    async def raises_unloadable(self) -> None:
        raise TwoArgError("a", "b")

    async def slow(self) -> str:
        await asyncio.sleep(0.3)
        self.finished.set()
        return "slow"


@pytest.fixture
async def connection() -> AsyncIterator[tuple[Connection, Agent]]:
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    server = Server()
    agent = Agent()
    server.add("agent", agent)
    await server.listen(listener)
    conn = await Connection.open(path)
    try:
        yield conn, agent
    finally:
        await conn.aclose()
        server.close()
        listener.close()
        os.unlink(path)
        os.rmdir(folder)


async def test_a_call_whose_work_is_cancelled_in_the_server_is_answered_as_lost(
    connection: tuple[Connection, Agent],
) -> None:
    """A sandbox closed under a running command (the agent cancels its task): the
    caller gets ActorLostError, which the sandbox handle turns into SandboxBrokenError,
    not silence."""
    conn, _ = connection
    agent = conn.handle("agent")
    run = agent.run.remote()
    await asyncio.sleep(0.1)
    await agent.close.remote()
    with pytest.raises(ActorLostError, match="cancelled") as caught:
        await asyncio.wait_for(run, 5)
    assert not isinstance(caught.value, ActorTaskError)
    assert await agent.echo.remote(1) == 1


async def test_an_answer_that_cannot_be_loaded_fails_that_call_alone(
    connection: tuple[Connection, Agent],
) -> None:
    conn, _ = connection
    agent = conn.handle("agent")
    with pytest.raises(ActorTaskError, match="could not be loaded"):
        await asyncio.wait_for(agent.unloadable.remote(), 5)
    with pytest.raises(ActorTaskError, match="could not be sent"):
        await asyncio.wait_for(agent.raises_unloadable.remote(), 5)
    assert await asyncio.wait_for(agent.echo.remote("still"), 5) == "still"


async def test_an_argument_that_cannot_be_loaded_fails_that_call_alone(
    connection: tuple[Connection, Agent],
) -> None:
    conn, _ = connection
    agent = conn.handle("agent")
    with pytest.raises(ActorTaskError, match="not importable"):
        await asyncio.wait_for(agent.echo.remote(Unloadable()), 5)
    assert await asyncio.wait_for(agent.echo.remote(2), 5) == 2


async def test_a_frame_over_the_limit_fails_that_call_at_the_caller(
    connection: tuple[Connection, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, _ = connection
    monkeypatch.setattr(_socket, "MAX_FRAME", 1000)
    agent = conn.handle("agent")
    with pytest.raises(ActorTaskError, match="over the limit"):
        await agent.echo.remote(b"x" * 5000)
    assert await agent.echo.remote(b"y") == b"y"


async def test_an_awaiter_cancelled_leaves_the_call_running_and_awaitable(
    connection: tuple[Connection, Agent],
) -> None:
    """As a Ray ObjectRef: a proxy stopped while its send travels awaits it again."""
    conn, agent_object = connection
    call = conn.handle("agent").slow.remote()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(call, 0.05)
    assert await call == "slow"
    assert agent_object.finished.is_set()


async def test_a_local_handle_reports_a_cancelled_method_as_lost() -> None:
    agent = Agent()
    handle = LocalHandle("agent", agent)
    run = handle.run.remote()
    await asyncio.sleep(0.05)
    await handle.close.remote()
    with pytest.raises(ActorLostError, match="cancelled"):
        await run
    with pytest.raises(ActorTaskError):
        await handle.echo.remote()  # a wrong call: the method's TypeError, wrapped


async def test_every_call_fails_typed_when_the_server_goes(
    connection: tuple[Connection, Agent],
) -> None:
    conn, _ = connection
    agent = conn.handle("agent")
    run = agent.run.remote()
    await asyncio.sleep(0.05)
    conn._writer.transport.abort()  # the scheduler process gone, as the kernel says it
    with pytest.raises(ActorLostError):
        await asyncio.wait_for(run, 5)
    with pytest.raises(ActorLostError):
        await agent.echo.remote(1)
