"""The program that starts every local sandbox command: a small process that forks them.

A command's child needs set-up between ``fork`` and ``exec`` that ``subprocess`` can only
run as a Python ``preexec_fn`` (join the sandbox's cgroup, lend the interpreter, become
the sandbox's uid, arm the parent-death signal, pin the cores, set the limits), and with
one ``subprocess`` forks the whole process, not ``vfork``s it. Forking a trainer is
slow in proportion to its memory, and the fork holds the GIL: with 2 GiB resident, each
command took 119 ms to start, all of them in turn on one thread, and stalled the
trainer's event loop for up to 63 ms each (236 MiB, torch imported and nothing else: 14
ms). So the trainer starts this program once (``python -I -c``, its source sent whole: it
imports nothing but the standard library, and holds some 10 MiB), without a
``preexec_fn``, and asks it for each command over a Unix socket; the fork here costs
the same whatever the trainer holds.

It also keeps each command as its child until told to reap it: it reports the exit
status when the command ends (``waitid`` with ``WNOWAIT``, which leaves the zombie), so
the pid cannot be reused while the trainer kills what the command left behind, as with a
``Popen`` the trainer waits on last. It dies with the thread that started it
(``PR_SET_PDEATHSIG``), and its commands die with it.

The protocol: each message is a 4-byte length and a pickle, the request's descriptors on
its first byte (``SCM_RIGHTS``). The trainer's only peer is this process, started by it
as root, and no command holds the socket (every descriptor but its own is closed in the
child).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pickle
import resource
import select
import signal
import socket
import stat
import struct
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["lend", "main"]

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 32, 4096
_MS_REC, _MS_SLAVE = 16384, 1 << 19
_HEAD = struct.Struct("!I")
#: Descriptors one request carries at most: stdin, stdout, stderr and a few more.
_MOST_FDS = 8
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _call(result: int, what: object) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{os.strerror(errno)} ({what})")


def lend(tops: Sequence[str], dirs: Sequence[str]) -> None:
    """Lay a mount namespace of this process's own over the host: an empty tmpfs on each
    of ``tops`` and ``dirs`` bound back in place (see ``._lend``), as root.

    The directories are opened inside the new namespace (a bind's source must be a
    mount of the caller's own namespace), before the tmpfs hides their path; the
    descriptors are closed after, so nothing of the host's tree reaches the command.
    """
    assert _LIBC is not None
    _call(_LIBC.unshare(_CLONE_NEWNS), "unshare")
    _call(_LIBC.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "/")
    fds = [os.open(d, os.O_PATH | os.O_CLOEXEC) for d in dirs]
    for top in tops:
        flags = _MS_NOSUID | _MS_NODEV
        _call(_LIBC.mount(b"tmpfs", top.encode(), b"tmpfs", flags, b"mode=0755"), top)
    for directory, fd in zip(dirs, fds, strict=True):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(directory, mode=0o755, exist_ok=True)
        else:  # the interpreter's own path, a file: a file to mount it on
            os.makedirs(os.path.dirname(directory), mode=0o755, exist_ok=True)
            os.close(os.open(directory, os.O_CREAT | os.O_WRONLY, 0o755))
        source = f"/proc/self/fd/{fd}".encode()
        _call(_LIBC.mount(source, directory.encode(), None, _MS_BIND | _MS_REC, None), fd)
        remount = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
        _call(_LIBC.mount(None, directory.encode(), None, remount, None), directory)
    for fd in fds:
        os.close(fd)


def _set_up(spec: dict[str, Any], server: int) -> None:
    """The command's own set-up, in its child, in this order (each step needs the last)."""
    for path in spec["procs"]:  # join the sandbox's cgroup before anything can fork
        with open(path, "w") as handle:
            handle.write("0")
    # A host out of memory kills a sandbox's process before the trainer's.
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
    except OSError:
        pass
    if spec["lend"] is not None:  # while still root: see ._lend
        lend(*spec["lend"])
    owner = spec["owner"]
    if owner is not None:
        os.setgroups([])
        os.setresgid(owner[1], owner[1], owner[1])
        os.setresuid(owner[0], owner[0], owner[0])
    if _LIBC is not None:  # after the change of user, which would clear it
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:  # this server died before the signal was armed
            os._exit(1)
    if spec["cores"]:
        os.sched_setaffinity(0, spec["cores"])
    for which, value in spec["limits"]:
        resource.setrlimit(which, (value, value))


def _child(spec: dict[str, Any], fds: list[int], report: int, server: int) -> None:
    """In the forked child: descriptors in place, set-up, ``exec``; never returns."""
    stage = "set-up"
    try:
        # This server's own signal handling is not the command's.
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # the last two as subprocess restores them
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        # Every descriptor to its number in the command (0, 1, 2, then the request's),
        # through numbers above them all so that none overwrites another still needed.
        wanted = len(fds)
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, wanted) for fd in fds]
        report = fcntl.fcntl(report, fcntl.F_DUPFD_CLOEXEC, wanted + len(moved))
        for target, fd in enumerate(moved):
            os.dup2(fd, target)  # dup2 clears close-on-exec
        os.closerange(wanted, report)
        os.closerange(report + 1, 1 << 20)
        os.setsid()
        os.chdir(spec["cwd"])
        _set_up(spec, server)
        stage = "exec"
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # reported, whatever it was
        code = exc.errno if isinstance(exc, OSError) and exc.errno else 0
        try:
            os.write(report, pickle.dumps((stage, code, f"{type(exc).__name__}: {exc}")))
        finally:
            os._exit(127)


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.running: set[int] = set()  # started, exit not yet reported
        self.pid = os.getpid()

    def send(self, message: object, fds: Sequence[int] = ()) -> None:
        body = pickle.dumps(message)
        data = _HEAD.pack(len(body)) + body
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        sent = self.sock.sendmsg([data], ancillary if fds else [])
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def receive(self) -> tuple[Any, list[int]] | None:
        space = socket.CMSG_SPACE(_MOST_FDS * 4)
        head, ancillary, _, _ = self.sock.recvmsg(_HEAD.size, space)
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
        if not head:
            return None
        while len(head) < _HEAD.size:
            more = self.sock.recv(_HEAD.size - len(head))
            if not more:
                return None
            head += more
        (size,) = _HEAD.unpack(head)
        body = bytearray()
        while len(body) < size:
            more = self.sock.recv(min(size - len(body), 1 << 20))
            if not more:
                return None
            body += more
        return pickle.loads(body), fds

    def start(self, call: int, spec: dict[str, Any], fds: list[int]) -> None:
        read, write = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(read)
            os.close(write)
            self.send(("failed", call, "fork", exc.errno or 0, str(exc), spec["argv"][0]))
            return
        if pid == 0:
            os.close(read)
            _child(spec, fds, write, self.pid)
        os.close(write)
        for fd in fds:
            os.close(fd)
        with os.fdopen(read, "rb") as handle:
            failure = handle.read()  # nothing: the command was exec'd
        if failure:
            os.waitpid(pid, 0)
            stage, code, text = pickle.loads(failure)
            self.send(("failed", call, stage, code, text, spec["argv"][0]))
            return
        self.running.add(pid)
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.send(("started", call, pid))
        else:
            try:
                self.send(("started", call, pid), [pidfd])
            finally:
                os.close(pidfd)

    def report_exits(self) -> None:
        for pid in list(self.running):
            try:
                found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                found = None
                self.running.discard(pid)
            if found is None:
                continue
            self.running.discard(pid)
            code = found.si_status
            status = code if found.si_code == os.CLD_EXITED else -code
            self.send(("exited", pid, status))

    def serve(self) -> None:
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            ready, _, _ = select.select([self.sock.fileno(), wake_read], [], [])
            if wake_read in ready:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
                self.report_exits()
            if self.sock.fileno() in ready:
                got = self.receive()
                if got is None:
                    return  # the trainer is gone: so are we, and our commands with us
                (what, *args), fds = got
                if what == "start":
                    self.start(args[0], args[1], fds)
                    self.report_exits()  # a command that ended at once
                elif what == "reap":
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(args[0], 0)
                    self.running.discard(args[0])


def main(fd: int, parent: int) -> None:
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the trainer died before the signal was armed
            os._exit(1)
    _Server(socket.socket(fileno=fd)).serve()
    os._exit(0)
