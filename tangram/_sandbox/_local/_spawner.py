"""The trainer's side of the fork server (:mod:`._forkserver`): commands started there.

:func:`spawn` hands the server a command, its descriptors and its set-up, and returns a
:class:`Child` that reads as much like a ``subprocess.Popen`` as the backend needs: its
pid, its pipes, and ``wait`` for its status. The server keeps the ended command as a
zombie until :meth:`Child.close`, after the backend's last kill of what it left, so its
pid is not reused meanwhile. The server is started once per process, in its own session
(a Ctrl-C to the trainer's terminal is the trainer's to handle, not the server's), from
the one thread :func:`submit` runs calls on, which lives as long as the process (the
server dies with the thread that started it); one that died is started again at the
next command, and the commands it held end as the sandbox's failure, never as their own
exit. A forked trainer gets a thread and a server of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from ...errors import SandboxBrokenError
from . import _forkserver

__all__ = ["Child", "spawn", "submit"]

T = TypeVar("T")
_HEAD = struct.Struct("!I")
_SOURCE = Path(_forkserver.__file__).read_text(encoding="utf-8")
#: Seconds the server may take to report the exit of a command the kernel says ended:
#: past them it is stopped or stuck, and it is killed (its commands are the sandboxes'
#: failures) rather than hold the run past its timeout.
_REPORT_LIMIT = 3.0


def _new_thread() -> concurrent.futures.ThreadPoolExecutor:
    # The kernel's parent-death signal follows the *thread* that forked: anyio's worker
    # threads end when idle, which would kill the server and every command with it.
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tangram-spawn")


_THREAD = _new_thread()


def submit(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Run ``fn`` on the one thread that starts the fork server and hands it commands."""
    return _THREAD.submit(fn, *args)


class Child:
    """A command the fork server started: a ``Popen`` for what the backend reads of one."""

    def __init__(
        self,
        server: _Server,
        pid: int,
        pidfd: int | None,
        pipes: tuple[IO[bytes], IO[bytes], IO[bytes]],
    ) -> None:
        self.pid = pid
        #: Readable once the command has ended (``None`` where the kernel has none).
        self.pidfd = pidfd
        self.stdin, self.stdout, self.stderr = pipes
        self._server = server
        self._closed = False

    def wait(self) -> int:
        """Block until the command ends; its status as ``Popen.returncode`` gives it. It
        stays the server's zombie until :meth:`close`.

        :raises SandboxBrokenError: the fork server died first (and took the command), or
            did not report an exit the kernel had (stopped, or stuck).
        """
        future = self._server.exits(self.pid)
        if not future.done() and self.pidfd is not None:
            poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
            poll.poll()  # until the command has ended, as Popen.wait
            try:
                return future.result(timeout=_REPORT_LIMIT)
            except concurrent.futures.TimeoutError:
                self._server.kill()
        return future.result()

    def close(self) -> None:
        """Give the pid back (the server reaps it) and close the command's descriptors."""
        if self._closed:
            return
        self._closed = True
        self._server.reap(self.pid)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        for pipe in (self.stdin, self.stdout, self.stderr):
            pipe.close()


class _Server:
    """One fork server process and the thread that reads its answers."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        python = sys.executable or "python3"
        program = f"{_SOURCE}\nmain({theirs.fileno()}, {os.getpid()})\n"
        try:
            with theirs:
                self.process = subprocess.Popen(
                    [python, "-I", "-c", program],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    close_fds=True,
                    start_new_session=True,
                )
        except BaseException:
            ours.close()
            raise
        self._sock = ours
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[tuple[int, int | None]]] = {}
        self._exits: dict[int, concurrent.futures.Future[int]] = {}
        self._ids = itertools.count(1)
        self.alive = True
        threading.Thread(target=self._read, name="tangram-forkserver", daemon=True).start()

    def start(self, spec: dict[str, Any], fds: list[int]) -> tuple[int, int | None]:
        call = next(self._ids)
        future: concurrent.futures.Future[tuple[int, int | None]] = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise SandboxBrokenError("the sandboxes' fork server is gone")
            self._calls[call] = future
        self._send(("start", call, spec), fds)
        return future.result()

    def exits(self, pid: int) -> concurrent.futures.Future[int]:
        with self._lock:
            return self._exits[pid]

    def reap(self, pid: int) -> None:
        with self._lock:
            self._exits.pop(pid, None)
        with contextlib.suppress(OSError):
            self._send(("reap", pid), [])

    def kill(self) -> None:
        """End a server that stopped answering: its commands fail as the sandboxes'."""
        with contextlib.suppress(OSError):
            self.process.send_signal(signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader ends, failing what waits

    def _send(self, message: object, fds: list[int]) -> None:
        body = pickle.dumps(message)
        data = _HEAD.pack(len(body)) + body
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        with self._send_lock:
            sent = self._sock.sendmsg([data], rights if fds else [])
            if sent < len(data):
                self._sock.sendall(data[sent:])

    def _read(self) -> None:
        try:
            while True:
                got = _receive(self._sock)
                if got is None:
                    return
                message, fds = got
                self._dispatch(message, fds)
        except OSError:
            return
        finally:
            self._die()

    def _dispatch(self, message: tuple[Any, ...], fds: list[int]) -> None:
        what = message[0]
        with self._lock:
            if what == "started":
                _, call, pid = message
                self._exits[pid] = concurrent.futures.Future()
                self._calls.pop(call).set_result((pid, fds[0] if fds else None))
            elif what == "failed":
                _, call, stage, code, text, program = message
                self._calls.pop(call).set_exception(_failure(stage, code, text, program))
            elif what == "exited":
                _, pid, status = message
                future = self._exits.get(pid)
                if future is not None:
                    future.set_result(status)

    def _die(self) -> None:
        with self._lock:
            self.alive = False
            lost = SandboxBrokenError("the sandboxes' fork server died, and its commands")
            futures: list[concurrent.futures.Future[Any]] = [*self._calls.values()]
            for future in [*futures, *self._exits.values()]:
                if not future.done():
                    future.set_exception(lost)
            self._calls.clear()
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            self.process.wait()


def _receive(sock: socket.socket) -> tuple[tuple[Any, ...], list[int]] | None:
    # Close-on-exec: a pidfd must not reach what the trainer starts itself.
    head, ancillary, _, _ = sock.recvmsg(_HEAD.size, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
    while head and len(head) < _HEAD.size:
        more = sock.recv(_HEAD.size - len(head))
        if not more:
            return None
        head += more
    if not head:
        return None
    (size,) = _HEAD.unpack(head)
    body = bytearray()
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            return None
        body += more
    return pickle.loads(body), fds


def _failure(stage: str, code: int, text: str, program: str) -> Exception:
    """What ``subprocess`` raises for the same failure: ``exec``'s and ``fork``'s error as
    an ``OSError`` (the program's name on ``exec``'s), the set-up's as its own error."""
    if stage == "exec" and code:
        return OSError(code, os.strerror(code), program)
    if stage == "fork" and code:
        return OSError(code, os.strerror(code))
    return subprocess.SubprocessError(f"the command's set-up failed: {text}")


_SERVER: _Server | None = None


def _forked() -> None:
    """In a forked trainer: the parent's thread is not here, nor its server to use."""
    global _THREAD, _SERVER
    _THREAD = _new_thread()
    _SERVER = None


os.register_at_fork(after_in_child=_forked)


def spawn(
    argv: list[str], env: dict[str, str], cwd: str, fds: list[int], spec: dict[str, Any]
) -> Child:
    """Start ``argv`` in the fork server; ``fds`` become its 3, 4 ... in order.

    Its standard streams are new pipes, whose ends the :class:`Child` holds. Call through
    :func:`submit` only: the server dies with the thread that started it. ``spec`` is the
    set-up (``._forkserver._set_up``).
    """
    global _SERVER
    server = _SERVER
    if server is None or not server.alive:
        server = _SERVER = _Server()
    ends = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]
    theirs = [ends[0][0], ends[1][1], ends[2][1]]
    try:
        pid, pidfd = server.start({**spec, "argv": argv, "env": env, "cwd": cwd}, theirs + fds)
    except BaseException:
        for fd in (ends[0][1], ends[1][0], ends[2][0]):
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            with contextlib.suppress(OSError):
                os.close(fd)
    pipes = (
        open(ends[0][1], "wb", buffering=0),  # noqa: SIM115 - the Child closes them
        open(ends[1][0], "rb", buffering=0),  # noqa: SIM115
        open(ends[2][0], "rb", buffering=0),  # noqa: SIM115
    )
    return Child(server, pid, pidfd, pipes)
