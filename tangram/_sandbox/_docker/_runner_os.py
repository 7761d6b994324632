"""The runner's dealings with the kernel: users, processes, scratch files, seccomp.

Part of the runner's program (:mod:`._runner`), which is sent to the container as text:
this file's text comes first in it, so it imports nothing but the standard library, and
the runner's import of it is cut when the two are joined (:data:`._runner.RUNNER_SOURCE`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import signal
import struct
import time
from pathlib import Path

SCRATCH = ("/tmp", "/dev/shm")
SCRUB_SECONDS = 30.0  # scratch files' inodes are bounded (4,096 a mount): well under 1 s

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
PR_SET_NO_NEW_PRIVS = 38
F_SETPIPE_SZ = 1031
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
XATTR_SETTERS = {
    # ``uname -m``: per audit architecture, the numbers of setxattr, lsetxattr, fsetxattr
    # and setxattrat (x32's are x86_64's with bit 30 set; the 32-bit ABIs' are their own).
    "x86_64": (
        (0xC000003E, (188, 189, 190, 463, *(0x40000000 | n for n in (188, 189, 190, 463)))),
        (0x40000003, (226, 227, 228, 463)),
    ),
    "aarch64": ((0xC00000B7, (5, 6, 7, 463)), (0x40000028, (226, 227, 228, 463))),
}
"""Extended attributes no command may set (``EOPNOTSUPP``): a POSIX ACL on a tmpfs inode
is up to 64 KiB of kernel memory that neither the mount's size nor the container's limit
counts (1,311 files of a parked work dir held 302 MiB of the host's)."""

LIBC = ctypes.CDLL(None, use_errno=True)


def cpu_usage() -> float:
    """CPU seconds the container's cgroup has used (v2 ``cpu.stat``, v1 ``cpuacct``)."""
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    for path in (
        "/sys/fs/cgroup/cpuacct/cpuacct.usage",
        "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage",
    ):
        try:
            return int(Path(path).read_text()) / 1e9
        except OSError:
            continue
    return float("nan")


REAPED: dict[int, int] = {}
"""Wait statuses of children reaped while killing leftovers, for the command's own wait."""


def reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        REAPED[pid] = status


def others() -> list[int]:
    """Every other live process: a zombie counts while any thread of its group still runs.

    A process whose main thread ended with the ``exit`` system call (not ``exit_group``)
    shows ``Z`` while its other threads go on, and its parent cannot reap it: skipping
    state ``Z`` let such a process outlive its action and trace the next one.
    """
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                state = Path(f"/proc/{name}/stat").read_bytes().rpartition(b")")[2].split()[0]
                alive = state != b"Z" or len(os.listdir(f"/proc/{name}/task")) > 1
            except OSError:
                continue
            if alive:
                found.append(int(name))
    return found


def kill_others() -> int:
    """Kill every process but this one, until none is left; return how many were found."""
    most = 0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        reap()
        pids = others()
        if not pids:
            break
        most = max(most, len(pids))
        # As the container's PID 1, -1 reaches every other process of it, whole thread
        # groups included, whatever a scan of /proc could see.
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    reap()
    return most


def xattr_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """BPF refusing :data:`XATTR_SETTERS`, a block per architecture (others jump over)."""
    load, jump_eq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.EOPNOTSUPP  # SECCOMP_RET_*
    program = [(load, 0, 0, 4)]  # seccomp_data.arch
    for arch, numbers in XATTR_SETTERS.get(machine, ()):
        count = len(numbers)
        program += [(jump_eq, 0, count + 3, arch), (load, 0, 0, 0)]  # then .nr
        program += [(jump_eq, count - i, 0, n) for i, n in enumerate(numbers)]
        program += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]
    return [*program, (ret, 0, 0, allow)]


def refuse_xattrs() -> None:
    """Load :func:`xattr_filter` for this process and what it execs (after no_new_privs)."""
    program = xattr_filter(os.uname().machine)
    if len(program) > 2:  # an architecture with a table
        code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))
        fprog = struct.pack("HP", len(program), ctypes.addressof(code))  # struct sock_fprog
        if LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def drop_to(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def scrub(uid: int, gid: int) -> None:
    """Empty ``/tmp`` and ``/dev/shm`` after an action, before its reply, as the sandbox
    user, who owns every file a command made (the runner has no capability over files).

    What an action left there is not the next action's, and a parked sandbox holding it
    held memory its host's reservation does not count (only ``/work`` is kept).
    """
    if not any(os.path.isdir(top) and os.listdir(top) for top in SCRATCH):
        return  # nothing to remove: no fork
    pid = os.fork()
    if pid == 0:
        try:
            with contextlib.suppress(OSError):  # never the runner, were memory short now
                Path("/proc/self/oom_score_adj").write_text("1000")
            drop_to(uid, gid)
            for top in SCRATCH:
                with contextlib.suppress(OSError):
                    empty(top)
        finally:
            os._exit(0)
    deadline = time.monotonic() + SCRUB_SECONDS
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)


def empty(top: str) -> None:
    """Remove everything below ``top`` without recursion, long paths or a full listing.

    A command may nest directories past the stack and ``PATH_MAX``, put thousands of names
    in one, and take every permission off its own directories: each directory met below
    the top is moved up to it under an unguessable name (so at most two are open at once),
    and entries are removed as they are read, reading again until a pass removes nothing.
    """
    top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    token, moved = secrets.token_hex(8), 0
    queue: list[str | None] = [None]
    queued: set[str] = set()
    try:
        while queue:
            name = queue.pop()
            try:
                if name is not None:
                    os.chmod(name, 0o700, dir_fd=top_fd)
                fd = os.open(
                    name or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top_fd
                )
            except OSError:
                continue
            progress = True
            while progress:
                progress = False
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if name is None and entry.name in queued:
                            continue
                        with contextlib.suppress(OSError):
                            if not entry.is_dir(follow_symlinks=False):
                                os.unlink(entry.name, dir_fd=fd)
                            elif name is None:  # the top's own directories, in place
                                queued.add(entry.name)
                                queue.append(entry.name)
                            else:  # moving a directory rewrites its "..": made writable
                                os.chmod(entry.name, 0o700, dir_fd=fd)
                                moved += 1
                                new = f".{token}-{moved}"
                                os.rename(entry.name, new, src_dir_fd=fd, dst_dir_fd=top_fd)
                                queue.append(new)
                            progress = True
            os.close(fd)
            if name is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=top_fd)
    finally:
        os.close(top_fd)
