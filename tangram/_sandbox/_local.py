"""The embedded local sandbox backend: subprocesses in per-trajectory work dirs.

The default when Docker is absent, and what tests and laptops use. It is **not a security
boundary**: commands run on the host kernel with the host's file system and network. What
it does contain:

- cores: the process tree is pinned to the granted cores with CPU affinity, set in the
  child before ``exec`` and changed on every pid and thread of the tree on a resize;
- run time: a timeout kills the whole process group, and a CPU-time limit backs it up;
- memory, processes, file size: ``setrlimit`` in the child (``RLIMIT_AS``,
  ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, no core dumps);
- output: at most ``output_limit`` bytes of stdout and of stderr are kept, the rest read
  and dropped so a flood cannot fill memory or block the child;
- leftovers: after every action every process of its session, and every process that
  still carries the action's marker in its environment, is killed;
- a dead owner: on Linux a command gets SIGKILL when the process that started it dies
  (killed, OOM), so a crashed rollout worker leaves no command running; its own children
  are reaped by the per-action clean-up only while the owner lives;
- files: when started as root, commands run as an unprivileged user (``nobody``) who owns
  only the work dir, so writes elsewhere fail where file permissions forbid them.

What it does **not** contain: network access (use the Docker backend, which has no network
by default), reads of world-readable host files, writes to world-writable places such as
``/tmp``, and a process that both leaves the session and scrubs its environment.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import os
import pwd
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc

from .._core._units import parse_size
from ..errors import SandboxBrokenError
from ._backend import ExecRequest, ExecResult, Host, SandboxBackend, SandboxHandle
from ._cores import numa_nodes

__all__ = ["LocalBackend"]

_MARKER = "TANGRAM_SANDBOX_MARK"
_READ_CHUNK = 1 << 16
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

# prctl(PR_SET_PDEATHSIG) signals the child when the *thread* that forked it ends, not
# the process. anyio's worker threads end when idle, which would kill long commands, so
# every command is forked from this one thread, which lives as long as the process.
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tangram-spawn")


class LocalBackend(SandboxBackend):
    """Sandboxes as work dirs on this machine; each action a subprocess pinned to its cores.

    :param cores: core ids the pool may lend (default: those this process may use).
    :param root: where work dirs are made (default: the system temp dir).
    :param memory: address-space limit per process (``"4GiB"``), ``None`` for none.
    :param processes: ``RLIMIT_NPROC`` for the sandbox user; applied only when commands
        run as a dedicated user (``user``), because the limit counts every process of the
        user, the caller's own included.
    :param file_size: largest file a command may write.
    :param user: run commands as this user (name or uid). Default: ``"nobody"`` when
        this process is root, else the current user.
    :param python: interpreter for ``sbx.run(code=...)`` (default: this one).
    """

    def __init__(
        self,
        *,
        cores: Sequence[int] | None = None,
        root: str | os.PathLike[str] | None = None,
        memory: str | int | None = "4GiB",
        processes: int = 256,
        file_size: str | int = "1GiB",
        user: str | int | None = None,
        python: str | None = None,
    ) -> None:
        self._cores = tuple(sorted(cores if cores is not None else os.sched_getaffinity(0)))
        if not self._cores:
            raise ValueError("`cores` must name at least one core")
        self._root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.memory = _bytes(memory) if memory is not None else None
        self.processes = processes
        self.file_size = _bytes(file_size)
        self._uid: int | None = None
        self._gid: int | None = None
        if user is None and os.geteuid() == 0:
            user = "nobody"
        if user is not None:
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
            if entry.pw_uid != os.geteuid():
                self._uid, self._gid = entry.pw_uid, entry.pw_gid
        # Another user often cannot reach this interpreter (a virtualenv under /root), so
        # it then gets the system one.
        system = shutil.which("python3", path=_SYSTEM_PATH)
        default = sys.executable if self._uid is None or system is None else system
        self.python = python or default
        self._host = Host("local", self._cores, numa_nodes(self._cores), "cpu")

    def __repr__(self) -> str:
        return f"<tangram.LocalBackend cores={len(self._cores)} root={str(self._root)!r}>"

    async def start(self) -> Sequence[Host]:
        return (self._host,)

    async def create(self, host: Host) -> SandboxHandle:
        workdir = await anyio.to_thread.run_sync(self._make_workdir)
        return _LocalHandle(self, host, workdir)

    def _make_workdir(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix="tangram-sbx-", dir=self._root))
        if self._uid is not None and self._gid is not None:
            os.chown(path, self._uid, self._gid)
        path.chmod(0o700)
        return path


def _bytes(value: str | int) -> int:
    return int(parse_size(value)) if isinstance(value, str) else int(value)


class _LocalHandle(SandboxHandle):
    def __init__(self, backend: LocalBackend, host: Host, workdir: Path) -> None:
        self.host = host
        self._backend = backend
        self.workdir = workdir
        self._cores: tuple[int, ...] = ()
        self._session: int | None = None
        self._marker = ""
        self._destroyed = False

    def __repr__(self) -> str:
        return f"<tangram local sandbox {str(self.workdir)!r}>"

    async def apply(self, cores: tuple[int, ...], quota: float) -> None:
        # Affinity has no fractional share: a rigid ``cpu=0.5`` gets one whole core here.
        self._cores = cores
        if self._session is not None:
            await anyio.to_thread.run_sync(_pin_tree, self._session, self._marker, cores)

    async def park(self) -> None:
        # Nothing of the action survives it (leftovers were killed), so there is no
        # process to take cores from; the next action is pinned before it execs.
        self._cores = ()

    async def put_file(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._put, path, data)

    def _put(self, path: str, data: bytes) -> None:
        target = self._inside(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if self._backend._uid is not None and self._backend._gid is not None:
            for part in [target, *target.parents]:
                if part == self.workdir:
                    break
                os.chown(part, self._backend._uid, self._backend._gid)

    async def get_file(self, path: str) -> bytes:
        return await anyio.to_thread.run_sync(self._get, path)

    def _get(self, path: str) -> bytes:
        return self._inside(path).read_bytes()

    def _inside(self, path: str) -> Path:
        # Resolving follows symlinks the sandbox made, so a link to /etc/passwd fails here.
        target = (self.workdir / path).resolve()
        if not target.is_relative_to(self.workdir.resolve()):
            raise PermissionError(f"{path!r} leads outside the sandbox work dir")
        return target

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await anyio.to_thread.run_sync(shutil.rmtree, self.workdir, True)

    async def execute(self, request: ExecRequest) -> ExecResult:
        if self._destroyed or not self.workdir.is_dir():
            raise SandboxBrokenError(f"the work dir {self.workdir} is gone")
        marker = secrets.token_hex(8)
        env = {
            "PATH": _SYSTEM_PATH,
            "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir),
            "LANG": "C.UTF-8",
            **request.env,
            _MARKER: marker,
        }
        cores = self._cores or request.cores
        usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        backend = self._backend
        try:
            spawn = _SPAWNER.submit(
                subprocess.Popen,
                request.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                user=backend._uid,
                group=backend._gid,
                extra_groups=[] if backend._uid is not None else None,
                preexec_fn=_limits(backend, cores, request),
            )
            process = await anyio.to_thread.run_sync(spawn.result)
        except OSError as exc:
            # A command that does not exist is the command's failure, like a shell's 127.
            code = 127 if exc.errno == errno.ENOENT else 126
            return ExecResult(code, b"", f"{exc}\n".encode())
        self._session, self._marker = process.pid, marker
        try:
            if self._cores and self._cores != cores:  # resized while it was starting
                await anyio.to_thread.run_sync(_pin_tree, process.pid, marker, self._cores)
            return await _communicate(process, request, marker, usage_before)
        finally:
            self._session = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_kill_tree, process.pid, marker)
                await anyio.to_thread.run_sync(process.wait)
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()


def _limits(
    backend: LocalBackend, cores: tuple[int, ...], request: ExecRequest
) -> Callable[[], None]:
    """The child's set-up between fork and exec: only async-signal-safe-ish syscalls."""
    cpu_seconds = max(1, int(request.timeout * max(1, len(cores)) * 2) + 1)
    limits: list[tuple[int, int]] = [
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_FSIZE, backend.file_size),
        (resource.RLIMIT_CORE, 0),
    ]
    if backend.memory is not None:
        limits.append((resource.RLIMIT_AS, backend.memory))
    if backend._uid is not None:
        limits.append((resource.RLIMIT_NPROC, backend.processes))

    owner = os.getpid()

    def setup() -> None:
        if _LIBC is not None:  # after the change of user, which would clear it
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != owner:  # the owner died before the signal was armed
                os._exit(1)
        if cores:
            os.sched_setaffinity(0, cores)
        for which, value in limits:
            resource.setrlimit(which, (value, value))

    return setup


async def _communicate(
    process: subprocess.Popen[bytes],
    request: ExecRequest,
    marker: str,
    usage_before: resource.struct_rusage,
) -> ExecResult:
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    outputs: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
    dropped = {1: False, 2: False}
    timed_out = False
    open_pipes = [2]
    done = anyio.Event()

    async def feed() -> None:
        assert process.stdin is not None
        fd = process.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(request.stdin)
        try:
            while view:
                await anyio.wait_writable(fd)
                try:
                    written = os.write(fd, view[:_READ_CHUNK])
                except BlockingIOError:
                    continue
                view = view[written:]
        except (BrokenPipeError, OSError):
            pass  # the command did not read its input: its business
        finally:
            process.stdin.close()

    async def drain(stream: int) -> None:
        pipe = process.stdout if stream == 1 else process.stderr
        assert pipe is not None
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        buffer = outputs[stream]
        while True:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                open_pipes[0] -= 1
                if not open_pipes[0]:
                    done.set()
                return
            room = request.output_limit - len(buffer)
            if room > 0:
                buffer.extend(chunk[:room])
            if len(chunk) > room:
                dropped[stream] = True

    async def wait_exit() -> None:
        try:
            pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            await anyio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
            return
        try:
            await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)

    async with anyio.create_task_group() as io:
        io.start_soon(feed)
        io.start_soon(drain, 1)
        io.start_soon(drain, 2)
        with anyio.move_on_after(request.timeout) as scope:
            await wait_exit()
        timed_out = scope.cancelled_caught
        # The command is done (or out of time): whatever it left running goes now, which
        # also closes the pipes those leftovers held, so the readers reach end of file.
        leftovers = await anyio.to_thread.run_sync(_kill_tree, process.pid, marker)
        with anyio.move_on_after(5.0):
            await done.wait()
        io.cancel_scope.cancel()
    for pipe in (process.stdout, process.stderr):
        pipe.close()
    status = await anyio.to_thread.run_sync(process.wait)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime)
    return ExecResult(
        exit_code=None if timed_out or status < 0 else status,
        stdout=bytes(outputs[1]),
        stderr=bytes(outputs[2]),
        stdout_truncated=dropped[1],
        stderr_truncated=dropped[2],
        timed_out=timed_out,
        signal=-status if status < 0 else None,
        # Children's usage of this whole process: exact when one action runs at a time,
        # a mix of concurrent actions otherwise, so it is reported only as a hint.
        cpu_seconds=cpu,
        leftovers_killed=leftovers,
    )


def _kill_group(session: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(session, signal.SIGKILL)


def _tree(session: int, marker: str) -> list[int]:
    """Pids of the action's session, plus any process still carrying its marker."""
    needle = f"{_MARKER}={marker}".encode()
    found: list[int] = []
    own = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == own:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rpartition(b")")[2].split()[0] == b"Z":
                    continue  # already dead, waiting to be reaped
            if os.getsid(pid) == session:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _pin_tree(session: int, marker: str, cores: tuple[int, ...]) -> None:
    """Set the affinity of every thread of every process of the action's tree."""
    for pid in _tree(session, marker):
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cores)


def _kill_tree(session: int, marker: str) -> int:
    """Kill the action's whole tree, orphans included; return how many were left behind.

    Repeats until nothing is found, because a process forking while we scan can add a
    pid after the scan passed it; a forking process that has a kill pending cannot.
    """
    killed = 0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        # Scan before killing: a process killed first may be gone before the scan counts it.
        pids = [pid for pid in _tree(session, marker) if pid != session]
        _kill_group(session)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            break
        killed = max(killed, len(pids))
        time.sleep(0.005)
    return killed
