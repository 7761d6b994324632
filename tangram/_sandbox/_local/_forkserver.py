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
the pid cannot be reused while the trainer kills what the command left behind. It dies
with the thread that started it (``PR_SET_PDEATHSIG``, SIGTERM here: it first kills each
command's session and cgroups, where what a command started outside bubblewrap would run
on), and each command dies with it (SIGKILL). It watches its commands by ``poll`` (the
trainer's descriptors may pass 1,024) and SIGCHLD, unblocked whatever mask it inherited,
and checks them every second besides, for a signal lost.

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
#: Milliseconds between checks of the commands' exits with no signal: a SIGCHLD lost.
_RECHECK_MS = 1000
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
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("1000")
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
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
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
        # Started and not yet reaped, with their cgroups' ``cgroup.procs`` files; those
        # whose exit is reported, and those the trainer gave up before it (reaped then).
        self.running: dict[int, list[str]] = {}
        self.reported: set[int] = set()
        self.abandoned: set[int] = set()
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
        head, ancillary, _, _ = self.sock.recvmsg(_HEAD.size, space, socket.MSG_CMSG_CLOEXEC)
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
            for fd in fds:
                os.close(fd)
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
        self.running[pid] = list(spec["procs"])
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
        for pid in [pid for pid in self.running if pid not in self.reported]:
            try:
                found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.running.pop(pid, None)
                continue
            if found is None:
                continue
            if pid in self.abandoned:
                self.reap(pid)
                continue
            self.reported.add(pid)
            code = found.si_status
            self.send(("exited", pid, code if found.si_code == os.CLD_EXITED else -code))

    def reap(self, pid: int) -> None:
        """The trainer is done with ``pid``: reaped now if it has ended, else when it does
        (waiting here would hold every other command's start)."""
        if pid not in self.running:
            return
        if (
            pid not in self.reported
            and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        ):
            self.abandoned.add(pid)
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        self.running.pop(pid, None)
        self.reported.discard(pid)
        self.abandoned.discard(pid)

    def kill_all(self, *_: object) -> None:
        """The trainer died: end every command and all it started, then this server.

        Each command dies of its own parent-death signal with this process, but what it
        started does not where no pid namespace holds it (no bubblewrap): so its session
        and its cgroups' processes are killed here first."""
        for pid, procs in self.running.items():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            for path in procs:
                try:
                    with open(path) as handle:
                        members = [int(line) for line in handle.read().split()]
                except (OSError, ValueError):
                    continue
                for member in members:
                    with contextlib.suppress(OSError):
                        os.kill(member, signal.SIGKILL)
        os._exit(0)

    def serve(self) -> None:
        # A trainer's signal mask is inherited, and SIGCHLD blocked would hide every
        # exit; the poll's timeout makes up for a signal lost all the same.
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self.kill_all)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD, signal.SIGTERM])
        poller = select.poll()  # not select: the socket's number may be past 1024
        poller.register(self.sock.fileno(), select.POLLIN)
        poller.register(wake_read, select.POLLIN)
        while True:
            ready = dict(poller.poll(_RECHECK_MS))
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 512):
                    pass
            self.report_exits()
            if self.sock.fileno() not in ready:
                continue
            got = self.receive()
            if got is None:
                return  # the trainer is gone: so are we, and our commands with us
            (what, *args), fds = got
            if what == "start":
                self.start(args[0], args[1], fds)
                self.report_exits()  # a command that ended at once
            elif what == "reap":
                self.reap(args[0])


def main(fd: int, parent: int) -> None:
    # SIGTERM, not SIGKILL, at the trainer's death: what its commands started goes first.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the trainer died before the signal was armed
            os._exit(1)
    _Server(socket.socket(fileno=fd)).serve()
    os._exit(0)
