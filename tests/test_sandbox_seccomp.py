"""Local sandboxes, red team round 3: the sandbox's own init, the kernel keyring, and
what one sandbox can see of another's file accesses.

Each test performs the attack as a policy rewarded for any hole would, and asserts the
safe behaviour, so it fails while the hole is open. Closed by the system-call filter
(``tangram/_sandbox/_local/_seccomp.py``) and by running each command as its sandbox's pid 1.
"""

from __future__ import annotations

import errno
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from _xattrs import SET_XATTRS, expected

import tangram
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._local._seccomp import DENIED, NO_XATTRS, syscall_filter
from tangram._sandbox._pool import Sandbox, SandboxPool

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="local sandboxes isolate on Linux"),
]

PYTHON = "/usr/bin/python3"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    backend = LocalBackend()
    async with (
        SandboxPool(backend, warm=2) as sandboxes,
        tangram.Runtime(capacity=sandboxes.capacity()),
    ):
        if not os.environ.get("CI") and not backend.protections.namespaced:
            pytest.skip("bubblewrap cannot make sandboxes here; CI never skips")
        yield sandboxes


async def test_the_filter_is_on_wherever_sandboxes_are_namespaced(pool: SandboxPool) -> None:
    protections = pool.backend.protections  # type: ignore[attr-defined]
    assert protections.syscalls_filtered, protections.syscalls
    assert "syscalls" not in " ".join(protections.missing)


# -- 5: the sandbox's init, traced to forge the command's exit status ----------------------

# A helper forked by the command attaches to pid 1 and, when pid 1 exits with the
# command's status, rewrites the exit code it passes to the kernel to 0.
_FORGE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
NAMES = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags "
         "rsp ss fs_base gs_base ds es fs gs").split()

class Regs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_ulonglong) for name in NAMES]

r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    if os.getpid() == 1 or libc.ptrace(16, 1, None, None) != 0:  # PTRACE_ATTACH
        os.write(w, b"N")
        os._exit(0)
    os.waitpid(1, 0x40000000)  # __WALL
    os.write(w, b"Y")
    regs = Regs()
    for _ in range(100000):
        libc.ptrace(24, 1, None, None)  # PTRACE_SYSCALL
        _, status = os.waitpid(1, 0x40000000)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            break
        libc.ptrace(12, 1, None, ctypes.byref(regs))  # PTRACE_GETREGS
        if regs.rax != 2**64 - 38:  # not a system call's entry (-ENOSYS)
            continue
        if regs.orig_rax in (60, 231) and regs.rdi != 0:  # exit, exit_group
            regs.rdi = 0
            libc.ptrace(13, 1, None, ctypes.byref(regs))  # PTRACE_SETREGS
        elif regs.orig_rax == 1 and regs.rdx == 8:  # the status, status + 1 on an eventfd
            libc.ptrace(5, 1, ctypes.c_void_p(regs.rsi), ctypes.c_void_p(1))  # POKEDATA
    os._exit(0)
os.close(w)
print("attached" if os.read(r, 1) == b"Y" else "refused", flush=True)
os._exit(3)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the forging helper is x86-64 code")
async def test_a_command_cannot_forge_its_exit_status_through_the_sandboxs_init(
    pool: SandboxPool,
) -> None:
    """bubblewrap's init (pid 1 of the sandbox) ran dumpable under the sandbox's uid: a
    command traced it and rewrote the status it exits with, so a failing test run read
    ``exit_code=0, ok=True``; writing into its stdout could cut a grading's verdict."""
    async with pool.sandbox("forge") as sandbox:
        result = await sandbox.run([PYTHON, "-c", _FORGE], timeout=20)
    assert result.stdout.decode().strip() == "refused", result
    assert result.exit_code == 3, result


async def test_the_sandboxs_init_shows_nothing_in_proc(pool: SandboxPool) -> None:
    """Its memory, descriptors and environment stay out of reach without ``ptrace``."""
    code = (
        "import os\n"
        "print(os.listdir('/proc/1'))\n"
        "for name in ('mem', 'fd/1', 'environ'):\n"
        "    try:\n"
        "        open(f'/proc/1/{name}', 'rb').close()\n"
        "        print('opened', name)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    async with pool.sandbox("init") as sandbox:
        result = await sandbox.run([PYTHON, "-c", code], timeout=20)
    assert result.stdout.decode().split("\n")[:2] == ["[]", ""], result


async def test_a_command_can_still_end_itself_with_a_signal(pool: SandboxPool) -> None:
    """The command is not the sandbox's pid 1, which no signal without a handler from
    inside the sandbox can end: ``kill -TERM $$`` ends it as it would on the host."""
    async with pool.sandbox("signal") as sandbox:
        result = await sandbox.run("kill -TERM $$; echo survived", timeout=20)
    assert result.signal == 15 and result.stdout == b"", result


# -- 6: the trainer's session keyring -------------------------------------------------------

_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}

# In the sandbox: read the trainer's key, then leave one for another trajectory.
_KEYS = r"""
import ctypes, sys
ADD, REQUEST, KEYCTL = map(int, sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
key = libc.syscall(L(REQUEST), b"user", b"tangram-secret", None, L(0))
buf = ctypes.create_string_buffer(64)
n = libc.syscall(L(KEYCTL), L(11), L(key), buf, L(64)) if key >= 0 else -1  # KEYCTL_READ
print("read", buf.raw[:n].decode() if n > 0 else "nothing")
added = libc.syscall(L(ADD), b"user", b"left-by-a-sandbox", b"x", L(1), L(-3))
print("added", "yes" if added >= 0 else "no")
"""

# The trainer: a session keyring of its own (as runc gives every container process) with
# a secret in it, then a sandbox that attacks it.
_TRAINER = r"""
import ctypes, sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import Sandbox, SandboxPool
ADD, REQUEST, KEYCTL = map(int, sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
assert libc.syscall(L(KEYCTL), L(1), b"tangram-trainer") >= 0, ctypes.get_errno()
assert libc.syscall(L(ADD), b"user", b"tangram-secret", b"s3cr3t", L(6), L(-3)) >= 0

async def main():
    async with SandboxPool(LocalBackend(), warm=1) as pool, \
            tangram.Runtime(capacity=pool.capacity()):
        async with pool.sandbox("keys") as sandbox:
            result = await sandbox.run(
                ["/usr/bin/python3", "-c", sys.argv[4], *sys.argv[1:4]], timeout=20
            )
    print(result.stdout.decode(), end="")

anyio.run(main)
"""


@pytest.mark.skipif(platform.machine() not in _SYSCALLS, reason="syscall numbers known")
def test_a_sandbox_cannot_read_or_write_the_trainers_keyring(tmp_path: Path) -> None:
    """A trainer with a session keyring (every process in a runc container has one) passed
    it to its sandboxes: they read its keys, and left keys for other trajectories."""
    numbers = [str(n) for n in _SYSCALLS[platform.machine()]]
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER, *numbers, _KEYS],
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split("\n")[:2] == ["read nothing", "added no"], done.stdout


# -- 7: watching what another sandbox opens --------------------------------------------------

# Sandbox A watches a file of the shared, read-only /usr; B imports the module.
_WATCH = r"""
import ctypes, os, select, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
if fd < 0:
    print("no inotify", ctypes.get_errno()); sys.exit(0)
libc.inotify_add_watch(fd, sys.argv[1].encode(), 0x20)  # IN_OPEN
print("watching", flush=True)
ready, _, _ = select.select([fd], [], [], 8)
print("saw an open" if ready else "saw nothing")
"""


async def test_a_sandbox_cannot_watch_what_another_opens(pool: SandboxPool) -> None:
    """``inotify`` on the read-only ``/usr`` both sandboxes see reported each file the
    other opened: which modules it imports, and a channel between trajectories."""
    found = await anyio.run_process([PYTHON, "-c", "import json; print(json.__file__)"])
    target = str(Path(found.stdout.decode().strip()).parent / "__pycache__")
    seen: list[str] = []
    async with (
        pool.sandbox("watcher") as watcher,
        pool.sandbox("watched") as watched,
        anyio.create_task_group() as tg,
    ):

        async def watch() -> None:
            result = await watcher.run([PYTHON, "-c", _WATCH, target], timeout=20)
            seen.append(result.stdout.decode())

        tg.start_soon(watch)
        await anyio.sleep(1.5)
        for _ in range(3):
            await watched.run([PYTHON, "-c", "import json"], timeout=20)
    assert "saw an open" not in seen[0], seen[0]
    assert "no inotify" in seen[0], seen[0]


# -- the filter, call by call ------------------------------------------------------------------

_CALL = r"""
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
bad = []
for pair in sys.argv[1:]:
    name, number = pair.split("=")
    # Arguments that make every call harmless: null pointers and invalid descriptors.
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(int(number)), *[ctypes.c_long(-1)] * 6)
    if not (rc == -1 and ctypes.get_errno() == errno.EPERM):
        bad.append(f"{name}:{rc}:{ctypes.get_errno()}")
print("bad", *bad)
"""


async def test_every_denied_call_is_refused_with_eperm(pool: SandboxPool) -> None:
    """Each call the filter names, made in a sandbox with arguments that would otherwise
    fail differently (EBADF, EFAULT, EINVAL), answers EPERM: the filter, not the call."""
    numbers = {k: v for k, v in syscall_filter().numbers.items() if k in DENIED}
    assert numbers, "the filter names no call on this architecture"
    pairs = [f"{name}={number}" for name, number in sorted(numbers.items())]
    async with pool.sandbox("calls") as sandbox:
        result = await sandbox.run([PYTHON, "-c", _CALL, *pairs], timeout=20)
    assert result.stdout.decode().split() == ["bad"], result
    # The rest are the extended attributes' setters, refused EOPNOTSUPP (tested below).
    assert set(syscall_filter().numbers) <= set(DENIED) | set(NO_XATTRS)


def test_without_libseccomp_the_pool_says_the_filter_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host without ``libseccomp.so.2``: sandboxes still run, and the start-up warning
    and ``tangram doctor`` name what is then open."""
    from tangram._sandbox._local import _backend as _local

    def unavailable() -> None:
        raise OSError(errno.ENOENT, "libseccomp is not usable here (removed by the test)")

    monkeypatch.setattr(_local, "syscall_filter", unavailable)
    backend = LocalBackend()
    try:
        protections = backend.protections
    finally:
        anyio.run(backend.aclose)
    if not protections.namespaced:
        assert not os.environ.get("CI"), protections.namespaces
        pytest.skip("bubblewrap cannot make sandboxes here")
    assert not protections.syscalls_filtered
    off = [line for line in protections.missing if line.startswith("syscalls: ")]
    assert off and "keyring" in off[0], protections.missing


# -- what stays open: locks on files every sandbox shares ------------------------------------

# One sandbox holds a lock on a file of the shared, read-only /etc for each 1 bit of a
# slot; the other tries the lock halfway through each slot. Both start at an agreed time
# on the machine's monotonic clock, which the sandboxes share.
_LOCKS = r"""
import fcntl, os, sys, time
role, start, slot, bits = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
fd = os.open("/etc/passwd", os.O_RDONLY)
def until(t):
    while time.monotonic() < t:
        pass
got = []
for i, bit in enumerate(bits):
    if role == "send":
        until(start + i * slot)
        fcntl.flock(fd, fcntl.LOCK_EX if bit == "1" else fcntl.LOCK_UN)
    else:
        until(start + (i + 0.5) * slot)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            got.append("0")
        except BlockingIOError:
            got.append("1")
print("".join(got))
"""


async def test_a_lock_on_a_shared_file_still_carries_bits_between_sandboxes(
    pool: SandboxPool,
) -> None:
    """The residual channel ``docs/threat-model.md`` states: ``flock`` and ``fcntl`` locks on
    files every sandbox sees (``/usr``, ``/etc``, ``/dev/null``) cross sandboxes. Refusing
    them would break programs that lock their own files (SQLite), so the channel stays,
    measured: 256 bits in 5 ms slots arrive with fewer than 10% wrong, 200 bit/s. If this
    fails, the channel closed and the threat model must say so."""
    bits = "".join(random.choice("01") for _ in range(256))
    slot = 0.005
    async with pool.sandbox("sender") as sender, pool.sandbox("receiver") as receiver:
        start = str(time.monotonic() + 2.0)
        results: dict[str, str] = {}

        async def run(name: str, sandbox: Sandbox) -> None:
            argv = [PYTHON, "-c", _LOCKS, name, start, str(slot), bits]
            results[name] = (await sandbox.run(argv, timeout=30)).stdout.decode().strip()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "send", sender)
            tg.start_soon(run, "receive", receiver)
    wrong = sum(a != b for a, b in zip(bits, results["receive"], strict=True))
    print(f"lock channel: {len(bits) / (len(bits) * slot):.0f} bit/s, {wrong} of {len(bits)} wrong")
    assert wrong < len(bits) // 10, (bits, results)


async def test_a_sandbox_cannot_ask_which_pages_of_a_shared_file_are_cached(
    pool: SandboxPool,
) -> None:
    """``preadv2(RWF_NOWAIT)`` answers only from the page cache: one sandbox read chosen
    pages of a cold file under ``/usr`` and a later sandbox decoded them, a channel that
    needs no overlap in time. Refused with that flag; plain reads work."""
    code = (
        "import os\n"
        "fd = os.open('/etc/passwd', os.O_RDONLY)\n"
        "print(os.preadv(fd, [bytearray(1)], 0))\n"
        "try:\n"
        "    os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)\n"
        "    print('answered')\n"
        "except PermissionError:\n"
        "    print('refused')\n"
    )
    async with pool.sandbox("cache") as sandbox:
        result = await sandbox.run([PYTHON, "-c", code], timeout=20)
    assert result.stdout.decode().split() == ["1", "refused"], result


async def test_no_command_can_set_an_extended_attribute(pool: SandboxPool) -> None:
    """Every setter, by number, in the work dir and ``/tmp`` (both tmpfs): ``EOPNOTSUPP``."""
    async with pool.sandbox("t") as sbx:
        code = SET_XATTRS.replace("WHERE", repr((".", "/tmp")))
        result = await sbx.run([PYTHON, "-c", code], timeout=30)
    assert result.stdout == expected(".", "/tmp"), result
