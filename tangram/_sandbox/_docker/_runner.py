"""The runner: one long-lived process per Docker sandbox that runs actions on request.

It is the container's main process (``python3 -c`` with this file's text, so an image
needs nothing installed but ``python3``) and reads length-prefixed frames on its attached
stdin, answering frames on stdout. An action therefore costs a frame each way instead of
a ``docker exec`` (an API round trip plus a runc start), while still running inside the
container's cgroup, so the grant applies and CPU is accounted per action from the
cgroup's own counters.

The channel is sealed from the commands it runs, which are hostile: the runner is root
inside the container (holding only the capabilities to switch users and to kill) and not
dumpable, while every command runs as the sandbox user with no capabilities and
``no_new_privs``, its own pipes for stdin, stdout and stderr, and no other descriptor. A
command can therefore neither trace the runner nor open ``/proc/1/fd``; and every reply
carries the request's id and a key the host sent as the first frame, which no command
ever sees, so a forged reply would be recognised even if one reached the channel.

As PID 1 of the container it also reaps orphans and, after each action, kills every other
process in the container: nothing an action starts outlives it. File moves run with the
sandbox user's effective ids and through directory descriptors that never follow a
symlink, so a ``get`` or ``put`` reaches nothing a command could not reach itself.

The SDK never runs it: ``RUNNER_SOURCE`` is its text, joined with :mod:`._runner_os`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import selectors
import signal
import stat
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._runner_os import (  # cut where the program is joined: see RUNNER_SOURCE
    F_SETPIPE_SZ,
    LIBC,
    PR_GET_DUMPABLE,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    REAPED,
    cpu_usage,
    drop_to,
    kill_others,
    refuse_xattrs,
    scrub,
)

WORK = "/work"
HEADER = struct.Struct(">IQ")
"""A frame: metadata length, data length, then the JSON metadata and the raw data."""
CHUNK = 1 << 20
"""Most data bytes in one frame of a file move or of stdin."""
META_LIMIT = 16 << 20
DATA_LIMIT = 2 * CHUNK
SETUP = "setup: "
"""Marks a prepared process's failure before the command was sent: never its result."""
MESSAGE_LIMIT = 2000
"""Characters of an error message sent back; a path can be long, a reply stays small."""


class Cancelled(Exception):
    """The host asked to stop a request before all of its data had come."""


class Channel:
    """Frames on fds 0 and 1. Frames read ahead (a cancel during a run) wait in ``pending``."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.pending: deque[tuple[dict[str, Any], bytes]] = deque()
        self.closed = False
        self.key = ""
        with contextlib.suppress(OSError):
            fcntl.fcntl(0, F_SETPIPE_SZ, CHUNK)

    def fill(self) -> bool:
        """Read what the host sent so far; False once it hung up."""
        chunk = os.read(0, CHUNK + HEADER.size)
        if not chunk:
            self.closed = True
        self.buffer += chunk
        return bool(chunk)

    def parse(self) -> None:
        """Move every complete frame in the buffer to ``pending``."""
        while len(self.buffer) >= HEADER.size:
            meta_len, data_len = HEADER.unpack_from(self.buffer)
            if meta_len > META_LIMIT or data_len > DATA_LIMIT:
                raise SystemExit("a frame larger than the channel allows")
            end = HEADER.size + meta_len + data_len
            if len(self.buffer) < end:
                return
            meta = json.loads(bytes(self.buffer[HEADER.size : HEADER.size + meta_len]))
            data = bytes(self.buffer[HEADER.size + meta_len : end])
            del self.buffer[:end]
            self.pending.append((meta, data))

    def next(self) -> tuple[dict[str, Any], bytes] | None:
        """The next frame, waiting for it; None once the host hung up."""
        while not self.pending:
            if self.closed or not self.fill():
                return None
            self.parse()
        return self.pending.popleft()

    def data(self, size: int) -> Iterator[bytes]:
        """The ``size`` bytes of a request's data frames, as they come.

        :raises Cancelled: another frame (a cancel) came first; it stays pending.
        """
        left = size
        while left > 0:
            frame = self.next()
            if frame is None:
                raise Cancelled
            meta, data = frame
            if meta.get("op") != "data" or len(data) > left:
                self.pending.appendleft(frame)
                raise Cancelled
            left -= len(data)
            yield data

    def send(self, meta: dict[str, Any], data: bytes = b"") -> None:
        meta["key"] = self.key
        body = json.dumps(meta).encode()
        view = memoryview(HEADER.pack(len(body), len(data)) + body + data)
        while view:
            view = view[os.write(1, view) :]


class Spare:
    """A child forked ahead of the next action, already the sandbox user, waiting to exec.

    A child that switches users cannot be started with ``vfork``, and a full ``fork`` of
    the runner on the action's path cost about 2 ms of its start here (12.6 against 10.7
    ms median for ``true``). Forked after the reply, while the sandbox idles, an action
    pays only the ``exec``. It is forked after the last action's leftovers were
    killed, so no command ever runs beside it before it becomes the next command itself.
    Its stdin, stdout and stderr are pipes the runner holds the other ends of; everything
    else it has is close-on-exec, so the command inherits nothing of the channel.
    """

    def __init__(self, uid: int, gid: int) -> None:
        self.returncode: int | None = None
        order_r, self.order = os.pipe()
        self.failure, failure_w = os.pipe()
        in_r, self.stdin = os.pipe()
        self.stdout, out_w = os.pipe()
        self.stderr, err_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (self.order, self.failure, self.stdin, self.stdout, self.stderr):
                os.close(fd)  # the runner's ends: held here, the order would never end
            self.become(uid, gid, order_r, failure_w, (in_r, out_w, err_w))
        for fd in (order_r, failure_w, in_r, out_w, err_w):
            os.close(fd)

    @staticmethod
    def become(uid: int, gid: int, order: int, failure: int, std: tuple[int, int, int]) -> None:
        """In the child: drop to the sandbox user now, exec the command when it comes."""
        try:
            # The OOM killer's first choice, before the runner: memory no process owns (a
            # memfd, tmpfs pages) otherwise made it pick the runner, the biggest process.
            with contextlib.suppress(OSError):
                Path("/proc/self/oom_score_adj").write_text("1000")
            os.setsid()
            drop_to(uid, gid)
            if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
            refuse_xattrs()
            for target, fd in enumerate(std):
                os.dup2(fd, target)  # the runner's channel on 0-2 is gone from here on
            for number in (signal.SIGPIPE, signal.SIGXFSZ):
                # Python ignores these, and an ignored signal stays ignored across exec.
                signal.signal(number, signal.SIG_DFL)
        except BaseException as exc:
            # Not the command's doing (it has not been sent yet): the runner's to handle.
            with contextlib.suppress(BaseException):
                os.write(failure, f"{SETUP}{type(exc).__name__}: {exc}"[:MESSAGE_LIMIT].encode())
            os._exit(127)
        try:
            chunks = []
            while chunk := os.read(order, CHUNK):
                chunks.append(chunk)
            if not chunks:
                os._exit(0)  # the runner stopped without using it
            request = json.loads(b"".join(chunks))
            with contextlib.suppress(OSError):
                # The last command may have taken its permissions off its own work dir:
                # every later command then failed to start. Its owner puts them back.
                os.chmod(WORK, 0o700)
            os.chdir(WORK)
            os.write(failure, b"\0")  # about to exec: an EOF without it is a death before
            os.execvpe(request["argv"][0], request["argv"], request["env"])
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                os.write(failure, f"{type(exc).__name__}: {exc}"[:MESSAGE_LIMIT].encode())
        finally:
            os._exit(127)

    def start(self, argv: list[str], env: dict[str, str]) -> str | None:
        """Exec ``argv``; why it could not be (the child has exited then), or None."""
        try:
            view = memoryview(json.dumps({"argv": argv, "env": env}).encode())
            while view:
                view = view[os.write(self.order, view) :]
        except OSError as exc:
            return f"{SETUP}the prepared process is gone: {exc}"
        finally:
            os.close(self.order)
        chunks = []
        while chunk := os.read(self.failure, 65536):  # EOF: the exec closed it
            chunks.append(chunk)
        os.close(self.failure)
        if not chunks:  # killed with the order in its pipe (the OOM killer picks it first)
            return f"{SETUP}the prepared process died before the command started"
        return b"".join(chunks).lstrip(b"\0").decode(errors="replace") or None

    def poll(self) -> int | None:
        if self.returncode is None:
            status = REAPED.pop(self.pid, None)
            if status is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    pid, status = self.pid, REAPED.pop(self.pid, 0)
                if pid == 0:
                    return None
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
            time.sleep(0.001)
        return code

    def close_stdin(self) -> None:
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def close(self) -> None:
        self.close_stdin()
        os.close(self.stdout)
        os.close(self.stderr)


class SandboxSetupError(Exception):
    """The runner could not prepare a process for the command: tangram's failure."""


class Runner:
    @staticmethod
    def discard(proc: Spare) -> None:
        proc.wait()
        proc.close()
        kill_others()
        REAPED.clear()

    def __init__(self, channel: Channel, uid: int, gid: int) -> None:
        self.channel = channel
        self.uid = uid
        self.gid = gid
        self.spare: Spare | None = None

    def prepare(self) -> None:
        """Fork the next action's process, after the reply: never on an action's path."""
        if self.spare is None:
            self.spare = Spare(self.uid, self.gid)

    def run(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        size = int(request["stdin"])
        data = bytearray(size)
        got = 0
        try:
            for chunk in self.channel.data(size):
                data[got : got + len(chunk)] = chunk
                got += len(chunk)
        except Cancelled:
            return {"ok": True, "cancelled": True, "exit_code": None, "stdout_len": 0}, b""
        limit = int(request["output_limit"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK}
        env.update(request["env"])
        before = cpu_usage()
        proc = self.spare or Spare(self.uid, self.gid)
        self.spare = None
        failure = proc.start(list(request["argv"]), env)
        if failure is not None and failure.startswith(SETUP):
            # The prepared process died before the command was sent (the kernel's OOM
            # killer picks it first when memory runs short outside it): one fresh try,
            # and never the command's result, since the command never ran.
            self.discard(proc)
            proc = Spare(self.uid, self.gid)
            failure = proc.start(list(request["argv"]), env)
            if failure is not None and failure.startswith(SETUP):
                self.discard(proc)
                raise SandboxSetupError(failure[len(SETUP) :])
        if failure is not None:
            self.discard(proc)
            scrub(self.uid, self.gid)
            missing = failure.startswith(("FileNotFoundError", "NotADirectoryError"))
            return {"ok": True, "exit_code": 127 if missing else 126, "stdout_len": 0}, (
                f"{failure}\n".encode()
            )
        view = memoryview(data)
        out_fd, err_fd, in_fd = proc.stdout, proc.stderr, proc.stdin
        out = {out_fd: bytearray(), err_fd: bytearray()}
        dropped = dict.fromkeys(out, False)
        sel = selectors.DefaultSelector()
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if view:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.close_stdin()
        deadline = time.monotonic() + float(request["timeout"])
        timed_out = False
        exited_at: float | None = None
        first_kill = 0
        if not self.channel.closed:
            sel.register(0, selectors.EVENT_READ)  # a cancel can come while it runs
        cancelled = False
        while out_fd in sel.get_map() or err_fd in sel.get_map():
            now = time.monotonic()
            if exited_at is None and (self.channel.pending or self.channel.closed):
                cancelled = True
                exited_at = now
                first_kill = kill_others()
            if exited_at is None and proc.poll() is not None:
                # The command is done: leftovers holding its pipes go now, so reads end.
                exited_at = now
                first_kill = kill_others()
            if now >= deadline and exited_at is None:
                timed_out = True
                exited_at = now
                first_kill = kill_others()
            if exited_at is not None and now - exited_at > 2.0:
                break
            for key, _ in sel.select(timeout=0.05):
                fd = key.fd
                if fd == 0:
                    if not self.channel.fill():
                        sel.unregister(0)
                    self.channel.parse()
                    continue
                if fd == in_fd:
                    try:
                        view = view[os.write(fd, view[:CHUNK]) :]
                    except BlockingIOError:
                        continue
                    except OSError:
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        proc.close_stdin()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = limit - len(out[fd])
                if room > 0:
                    out[fd] += chunk[:room]
                if len(chunk) > room:
                    dropped[fd] = True
        if exited_at is None:
            # Both pipes closed first: the command may still be working (or just exiting).
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                timed_out = True
        sel.close()
        leftovers = kill_others() + first_kill
        try:
            status = proc.wait(timeout=5.0)
        except TimeoutError:  # nothing should outlive kill_others; never hang the channel
            timed_out = True
            status = -signal.SIGKILL
        REAPED.clear()  # the leftovers' statuses: nobody waits for them
        proc.close()
        scrub(self.uid, self.gid)
        stdout, stderr = bytes(out[out_fd]), bytes(out[err_fd])
        reply = {
            "ok": True,
            "exit_code": None if timed_out or cancelled or status < 0 else status,
            "cancelled": cancelled,
            "signal": -status if status < 0 else None,
            "timed_out": timed_out,
            "stdout_len": len(stdout),
            "stdout_truncated": dropped[out_fd],
            "stderr_truncated": dropped[err_fd],
            "cpu_seconds": cpu_usage() - before,
            "leftovers": leftovers,
        }
        return reply, stdout + stderr

    @contextlib.contextmanager
    def as_sandbox_user(self) -> Iterator[None]:
        """File moves with the sandbox user's rights: they reach what a command can, no more."""
        os.setegid(self.gid)
        os.seteuid(self.uid)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)

    def walk(self, path: str, create: bool) -> tuple[int, str]:
        """A descriptor of ``path``'s parent, reached without following a symlink; its name."""
        parts = path.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise PermissionError(f"{path!r} leads outside the work dir")
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(WORK, flags)
        try:
            for part in parts[:-1]:
                try:
                    inner = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise FileNotFoundError(f"no such file in the sandbox: {path!r}") from None
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    inner = self.open_dir(part, fd, path)
                except OSError as exc:
                    raise refusal(path, exc) from None
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def open_dir(self, name: str, parent: int, path: str) -> int:
        try:
            return os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
            )
        except OSError as exc:
            raise refusal(path, exc) from None

    def put(self, request: dict[str, Any]) -> dict[str, Any]:
        path, size = str(request["path"]), int(request["size"])
        chunks = self.channel.data(size)
        try:
            with self.as_sandbox_user():
                self.write(path, chunks)
        except Cancelled:
            raise
        except Exception:
            for _ in chunks:  # the rest of its data is still on the channel
                pass
            raise
        return {"ok": True}

    def write(self, path: str, chunks: Iterator[bytes]) -> None:
        parent, name = self.walk(path, create=True)
        temp = f".tangram-put-{secrets.token_hex(8)}"
        try:
            fd = os.open(
                temp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=parent,
            )
            try:
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            # A rename replaces whatever had the name (a FIFO, a symlink) without opening
            # it, so nothing is ever written through it.
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)
            raise
        finally:
            os.close(parent)

    def get(self, request: dict[str, Any]) -> dict[str, Any]:
        path, limit = str(request["path"]), int(request["limit"])
        with self.as_sandbox_user():
            parent, name = self.walk(path, create=False)
            try:
                fd = os.open(
                    name,
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                    dir_fd=parent,
                )
            except FileNotFoundError:
                raise FileNotFoundError(f"no such file in the sandbox: {path!r}") from None
            except OSError as exc:
                raise refusal(path, exc) from None
            finally:
                os.close(parent)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(f"{path!r} is a directory")
            if not stat.S_ISREG(mode):
                raise PermissionError(f"{path!r} is not a regular file (a FIFO or device)")
            said = os.fstat(fd).st_size
            if said > limit:
                # Refused before a byte is read: a sparse file costs nothing to make.
                raise OSError(errno.EFBIG, f"{path!r} has {said} bytes, over the {limit} of a get")
            size = 0
            while chunk := os.read(fd, CHUNK):
                size += len(chunk)
                self.channel.send({"id": request["id"], "more": True}, chunk)
        finally:
            os.close(fd)
        return {"ok": True, "size": size}

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        op = request.get("op")
        if op == "run":
            return self.run(request)
        if op == "put":
            return self.put(request), b""
        if op == "get":
            return self.get(request), b""
        if op == "cancel":
            return {"ok": True, "cancelled": False}, b""  # nothing of it is running now
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}, b""
        raise ValueError(f"unknown op {op!r}")


def refusal(path: str, exc: OSError) -> OSError:
    """What a symlink or a non-directory on the way becomes: a refusal, never a follow."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return exc
    return PermissionError(f"{path!r} goes through a symlink or a non-directory: refused")


def seal() -> str | None:
    """Make this process untraceable; why it could not be, or None."""
    if LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or LIBC.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0):
        return f"prctl(PR_SET_DUMPABLE) failed: errno {ctypes.get_errno()}"
    try:
        os.setgroups([])
    except OSError as exc:
        return f"cannot drop supplementary groups: {exc}"
    return None


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uid, gid = int(sys.argv[1]), int(sys.argv[2])
    channel = Channel()
    hello = channel.next()
    if hello is None or hello[0].get("op") != "hello":
        return
    channel.key = str(hello[0]["key"])
    problem = seal()
    if problem is None and (os.getuid() == uid or uid == 0):
        problem = f"the runner's uid {os.getuid()} must differ from the sandbox user's {uid}"
    if problem is not None:
        channel.send({"id": 0, "ok": False, "error": "SealError", "message": problem})
        return
    channel.send({"id": 0, "ok": True, "ready": True, "pid": os.getpid()})
    runner = Runner(channel, uid, gid)
    runner.prepare()
    while (request := channel.next()) is not None:
        meta, _ = request
        try:
            reply, data = runner.handle(meta)
        except Cancelled:
            reply, data = {"ok": False, "error": "Cancelled", "message": "cancelled"}, b""
        except Exception as exc:
            message = str(exc)[:MESSAGE_LIMIT]
            reply, data = {"ok": False, "error": type(exc).__name__, "message": message}, b""
            if isinstance(exc, OSError) and exc.errno is not None:
                reply["errno"] = exc.errno
        reply["id"] = meta.get("id")
        channel.send(reply, data)
        runner.prepare()


def _joined() -> str:
    """The program sent to the container: :mod:`._runner_os`'s text, then this module's
    without its ``__future__`` import (which must come first) or its import of the other."""
    kernel = (Path(__file__).parent / "_runner_os.py").read_text()
    here = Path(__file__).read_text()
    cut = here.index("from ._runner_os import (")
    here = here[:cut] + here[here.index(")\n", cut) + 2 :]
    return kernel + here.replace("from __future__ import annotations\n", "", 1)


if __name__ == "__main__":  # in the container, as ``python3 -c RUNNER_SOURCE``
    main()
else:
    RUNNER_SOURCE = _joined()
