"""The actors' transport without Ray: objects served by one process on a Unix socket.

Ray gives the shared scheduler a process, a name and remote calls; a job that runs
without Ray (torchrun, multiprocessing, a shell loop of workers) has none of them. Here a
server process holds the same actor objects and answers their calls on a Unix socket,
and a worker's :class:`SocketHandle` mirrors a Ray actor handle: ``handle.method.remote(
*args)`` sends at once and returns an awaitable. The proxy, the host handles and the
agent then run unchanged on either transport. Inside the server, objects reach each other
through a :class:`LocalHandle` of the same shape.

A frame is a 4-byte length and a pickle of ``(call, target, method, args)`` one way and
``(call, ok, value)`` the other. A handle inside arguments or answers travels as its
object's name and arrives as a handle on the other side (the scheduler hands a worker its
host agent this way). Only processes of the server's own user are answered: the socket's
directory is theirs alone, and each peer's uid is checked, because the server runs what
a pickle from the socket says.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pickle
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ._protocol import ActorLostError, ActorTaskError, logger

__all__ = ["Connection", "LocalHandle", "Server", "SocketHandle"]

_LENGTH = struct.Struct("!I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_FRAME = 1 << 30
"""The largest frame either side accepts: a sandbox file read travels by value."""


class _Method:
    __slots__ = ("_call", "_name")

    def __init__(self, call: Callable[[str, tuple[Any, ...]], Any], name: str) -> None:
        self._call = call
        self._name = name

    def remote(self, *args: Any) -> Any:
        return self._call(self._name, args)


class LocalHandle:
    """An object in the server's process, called the way a Ray actor handle is.

    ``remote`` starts the call as a task at once, as Ray submits one: a caller may fire
    and forget (``agent.close.remote(...)``) or await later. What the method raises comes
    back as :class:`ActorTaskError`, as a remote method's error does.
    """

    def __init__(self, name: str, target: Any) -> None:
        self.name = name
        self.target = target
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"<LocalHandle {self.name}>"

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self._start, method)

    def _start(self, method: str, args: tuple[Any, ...]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(self._run(method, args))
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._done)
        return task

    async def _run(self, method: str, args: tuple[Any, ...]) -> Any:
        try:
            return await getattr(self.target, method)(*args)
        except Exception as exc:
            raise ActorTaskError(exc) from exc

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a fire-and-forget call's error is not left unretrieved


class SocketHandle:
    """A worker's handle on an object its connection's server holds."""

    def __init__(self, connection: Connection, name: str) -> None:
        self._connection = connection
        self.name = name

    def __repr__(self) -> str:
        return f"<SocketHandle {self.name}>"

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        connection, name = self._connection, self.name
        return _Method(lambda m, args: connection.call(name, m, args), method)


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME:
        raise ActorLostError(f"a frame of {size} bytes is over the limit of {MAX_FRAME}")
    return await reader.readexactly(size)


class Connection:
    """A worker's connection to the server: calls out, answers back, matched by number.

    Every call in flight fails with :class:`ActorLostError` when the connection ends;
    a later call fails at once.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next = 0
        self._error: ActorLostError | None = None
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    @classmethod
    async def open(cls, path: str) -> Connection:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        return cls(reader, writer)

    def handle(self, name: str) -> SocketHandle:
        return SocketHandle(self, name)

    def call(self, target: str, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
            return future
        self._next += 1
        self._calls[self._next] = future
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump((self._next, target, method, args))
        self._writer.write(_frame(buffer.getvalue()))
        return future

    async def _receive(self) -> None:
        try:
            while True:
                frame = await _read_frame(self._reader)
                call, ok, value = _Unpickler(io.BytesIO(frame), self).load()
                future = self._calls.pop(call, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(ActorTaskError(value))
        except (OSError, EOFError, asyncio.IncompleteReadError, ActorLostError) as exc:
            self._lose(ActorLostError(f"the node's scheduler process closed the connection: {exc}"))
        except asyncio.CancelledError:
            self._lose(ActorLostError("the connection to the node's scheduler was closed"))
            raise

    def _lose(self, error: ActorLostError) -> None:
        self._error = error
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # a call nobody awaits any more is not reported

    async def aclose(self) -> None:
        self._writer.close()
        self._receiver.cancel()
        with contextlib.suppress(BaseException):
            await self._receiver
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


class _Pickler(pickle.Pickler):
    """A worker's pickler: its handles travel as their names."""

    def __init__(self, file: io.BytesIO, connection: Connection) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._connection = connection

    def persistent_id(self, obj: Any) -> str | None:
        if isinstance(obj, SocketHandle):
            return obj.name
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, connection: Connection) -> None:
        super().__init__(file)
        self._connection = connection

    def persistent_load(self, pid: Any) -> SocketHandle:
        return SocketHandle(self._connection, str(pid))


class _ServerPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> str | None:
        if isinstance(obj, LocalHandle):
            return obj.name
        return None


class _ServerUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, objects: Mapping[str, LocalHandle]) -> None:
        super().__init__(file)
        self._objects = objects

    def persistent_load(self, pid: Any) -> LocalHandle:
        return self._objects[str(pid)]


def _dump_answer(call: int, ok: bool, value: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _ServerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((call, ok, value))
    except Exception as exc:  # an answer or an error that cannot travel: say so instead
        buffer = io.BytesIO()
        error = RuntimeError(f"the answer could not be sent: {type(exc).__name__}: {exc}")
        _ServerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((call, False, error))
    return _frame(buffer.getvalue())


class Server:
    """Serves named objects' public async methods to the connections of this user.

    ``on_lost`` hears, when a connection ends, the first arguments of its calls of
    ``tracked`` methods (the proxy ids that spoke on it): their process is gone, or
    has let go of the scheduler, and what they hold can return at once.
    """

    def __init__(
        self,
        tracked: frozenset[str] = frozenset(),
        on_lost: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.objects: dict[str, LocalHandle] = {}
        self.connections = 0
        self._tracked = tracked
        self._on_lost = on_lost
        self._server: asyncio.AbstractServer | None = None

    def add(self, name: str, target: Any) -> LocalHandle:
        handle = self.objects[name] = LocalHandle(name, target)
        return handle

    async def listen(self, sock: socket.socket) -> None:
        """Serve on ``sock``, a Unix socket already bound and listening."""
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=1 << 20)

    def close(self) -> None:
        """Stop accepting connections; those open stay open."""
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        _, uid, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        if uid != os.getuid():
            logger.warning("refused a connection from uid %d", uid)
            writer.close()
            return
        self.connections += 1
        speakers: set[str] = set()
        calls: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    frame = await _read_frame(reader)
                except (OSError, asyncio.IncompleteReadError, ActorLostError):
                    return
                call, target, method, args = _ServerUnpickler(
                    io.BytesIO(frame), self.objects
                ).load()
                if method in self._tracked and args and isinstance(args[0], str):
                    speakers.add(args[0])
                task = asyncio.get_running_loop().create_task(
                    self._answer(writer, call, target, method, args)
                )
                calls.add(task)
                task.add_done_callback(calls.discard)
        finally:
            self.connections -= 1
            for task in calls:
                task.cancel()
            writer.close()
            if speakers and self._on_lost is not None:
                self._on_lost(speakers)

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        call: int,
        target: str,
        method: str,
        args: tuple[Any, ...],
    ) -> None:
        handle = self.objects.get(target)
        try:
            if handle is None or method.startswith("_"):
                raise AttributeError(f"{target!r} has no method {method!r} to call")
            value = await getattr(handle.target, method)(*args)
        except Exception as exc:
            frame = _dump_answer(call, False, exc)
        else:
            frame = _dump_answer(call, True, value)
        if not writer.is_closing():
            writer.write(frame)
