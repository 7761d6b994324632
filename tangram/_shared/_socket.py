"""The actors' transport without Ray: objects served by one process on a Unix socket.

Ray gives the shared scheduler a process, a name and remote calls; a job that runs
without Ray (torchrun, multiprocessing, a shell loop of workers) has none of them. Here a
server process holds the same actor objects and answers their calls on a Unix socket,
and a worker's :class:`SocketHandle` mirrors a Ray actor handle: ``handle.method.remote(
*args)`` sends at once and returns an awaitable. The proxy, the host handles and the
agent then run unchanged on either transport. Inside the server, objects reach each other
through a :class:`LocalHandle` of the same shape.

A frame is a 4-byte length and a pickle of ``(call, target, method, args)`` one way and
``(call, outcome, value)`` the other, where ``args`` and ``value`` are pickles of their
own: one that cannot be loaded (a class the other process lacks) fails that call alone,
never the connection. A handle inside arguments or answers travels as its object's name
and arrives as a handle on the other side (the scheduler hands a worker its host agent
this way). As with Ray, an awaiter cancelled while it waits does not cancel the call,
and a call's awaitable may be awaited again.

Only processes of the server's own user are answered: the socket's directory is theirs
alone, and each peer's uid is checked, because the server runs what a pickle from the
socket says.
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

__all__ = ["Call", "Connection", "LocalHandle", "Server", "SocketHandle"]

_LENGTH = struct.Struct("!I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_FRAME = 1 << 30
"""The largest frame either side accepts: a sandbox file read travels by value."""


# An answer's outcome: the value, what the method raised, or the call cancelled in the
# server (its sandbox closed under it), which the caller sees as a lost call.
_OK, _RAISED, _CANCELLED = 0, 1, 2


class Call:
    """A call in flight, like Ray's ``ObjectRef``: awaited any number of times, and an
    awaiter's cancellation leaves the call itself running."""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self._future = future

    def __await__(self) -> Any:
        return asyncio.shield(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()


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

    def _start(self, method: str, args: tuple[Any, ...]) -> Call:
        task = asyncio.get_running_loop().create_task(self._run(method, args))
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._done)
        return Call(task)

    async def _run(self, method: str, args: tuple[Any, ...]) -> Any:
        try:
            return await getattr(self.target, method)(*args)
        except Exception as exc:
            raise ActorTaskError(exc) from exc
        except asyncio.CancelledError:
            # The method's own work was cancelled (its sandbox closed): its caller hears
            # of a lost call, as Ray's TaskCancelledError, not a cancellation of its own.
            raise ActorLostError(f"{self.name}.{method} was cancelled") from None

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
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a frame of {len(payload)} bytes is over the limit of {MAX_FRAME}")
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

    def call(self, target: str, method: str, args: tuple[Any, ...]) -> Call:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
            return Call(future)
        try:
            frame = _frame(pickle.dumps((self._next + 1, target, method, self._dumps(args))))
        except Exception as exc:  # arguments that cannot travel fail this call, here
            future.set_exception(ActorTaskError(exc))
            return Call(future)
        self._next += 1
        self._calls[self._next] = future
        self._writer.write(frame)
        return Call(future)

    def _dumps(self, value: Any) -> bytes:
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(value)
        return buffer.getvalue()

    async def _receive(self) -> None:
        try:
            while True:
                frame = await _read_frame(self._reader)
                call, outcome, payload = pickle.loads(frame)
                future = self._calls.pop(call, None)
                if future is None or future.done():
                    continue
                try:
                    value = _Unpickler(io.BytesIO(payload), self).load()
                except Exception as exc:  # a class this process lacks: this call fails
                    future.set_exception(
                        ActorTaskError(RuntimeError(f"the answer could not be loaded: {exc!r}"))
                    )
                    continue
                if outcome == _OK:
                    future.set_result(value)
                elif outcome == _RAISED:
                    future.set_exception(ActorTaskError(value))
                else:
                    future.set_exception(ActorLostError(value))
        except asyncio.CancelledError:
            self._lose(ActorLostError("the connection to the node's scheduler was closed"))
            raise
        except Exception as exc:  # the connection or its framing is broken: every call fails
            self._lose(ActorLostError(f"the node's scheduler process closed the connection: {exc}"))

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


def _dump_answer(call: int, outcome: int, value: Any) -> bytes:
    try:
        buffer = io.BytesIO()
        _ServerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        if outcome == _RAISED:
            pickle.loads(buffer.getvalue())  # an error that cannot be loaded back fails too
        return _frame(pickle.dumps((call, outcome, buffer.getvalue())))
    except Exception as exc:  # an answer or an error that cannot travel: say so instead
        error = RuntimeError(
            f"the answer ({type(value).__name__}) could not be sent: {type(exc).__name__}: {exc}"
        )
        return _frame(pickle.dumps((call, _RAISED, pickle.dumps(error))))


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
                try:
                    call, target, method, payload = pickle.loads(frame)
                except Exception:
                    return  # not this protocol's frame: the peer is broken
                task = asyncio.get_running_loop().create_task(
                    self._answer(writer, call, target, method, payload, speakers)
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
        payload: bytes,
        speakers: set[str],
    ) -> None:
        handle = self.objects.get(target)
        try:
            if handle is None or not isinstance(method, str) or method.startswith("_"):
                raise AttributeError(f"{target!r} has no method {method!r} to call")
            args = _ServerUnpickler(io.BytesIO(payload), self.objects).load()
            if method in self._tracked and args and isinstance(args[0], str):
                speakers.add(args[0])
            value = await getattr(handle.target, method)(*args)
        except Exception as exc:
            frame = _dump_answer(call, _RAISED, exc)
        except asyncio.CancelledError:
            if writer.is_closing():
                raise  # the connection is going: this task was cancelled with it
            # The method's own work was cancelled (its sandbox closed under it).
            frame = _dump_answer(call, _CANCELLED, f"{target}.{method} was cancelled")
        else:
            frame = _dump_answer(call, _OK, value)
        if not writer.is_closing():
            writer.write(frame)
