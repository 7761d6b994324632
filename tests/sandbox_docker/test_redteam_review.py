"""Red-team review of the Docker runner, its channel and the code reward on Docker.

Each test is an attack a policy rewarded for any hole would try, written to assert the
safe behaviour: it fails while the hole is open. They run on the real daemon, like
``test_sandbox_docker_channel.py``.
"""

from __future__ import annotations

import platform

import anyio
import pytest
from _hacks import HIDE, SURVIVOR

from tangram._reward._grade import grade
from tangram.errors import SandboxBrokenError

from .docker_support import Setup, config, open_pool

pytestmark = pytest.mark.anyio

OTHERS = (
    "import os\n"
    "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()"
    " and int(p) not in (1, os.getpid())))\n"
)


async def test_a_thread_whose_leader_exited_does_not_outlive_its_action(setup: Setup) -> None:
    """Hole: the runner's kill scan skips state Z, which a live thread group shows."""
    async with setup.pool.sandbox("t") as sbx:
        first = await sbx.run(code=SURVIVOR.replace("BODY", "time.sleep(120)"), timeout=10)
        assert first.stdout == b"hidden\n", first
        after = await sbx.run(code=OTHERS)
        assert after.stdout == b"[]\n", (first, after)


# What a survivor does with it: it traces the next action's shell (same uid, dumpable
# after its exec, no Yama in the container) and rewrites the status of its `exit_group`.
# (Writing into the next command's stdout through /proc/<pid>/fd/1 is refused: the
# runner creates the pipes as root, so a pipe inode is 0600 root's.)
FLIP_EXIT = """seen = {os.getpid(), 1}
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    regs = (ctypes.c_ulong * 27)()  # x86_64 user_regs_struct: rdi 14, orig_rax 15
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for p in os.listdir('/proc'):
            if not p.isdigit() or int(p) in seen:
                continue
            pid = int(p)
            try:
                with open(f'/proc/{p}/stat', 'rb') as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index(b'(') + 1 : stat.rindex(b')')]
            ppid = int(stat.rpartition(b')')[2].split()[1])
            if comm != b'sh' or ppid != 1 or libc.ptrace(16, pid, None, None) != 0:
                continue
            seen.add(pid)
            os.waitpid(pid, 0x40000000)
            libc.ptrace(0x4200, pid, None, 1)  # PTRACE_O_TRACESYSGOOD
            give = 0
            while True:
                libc.ptrace(24, pid, None, give)  # PTRACE_SYSCALL
                _, status = os.waitpid(pid, 0x40000000)
                if not os.WIFSTOPPED(status):
                    break
                sig = os.WSTOPSIG(status)
                give = 0 if sig in (0x85, 19) else sig
                if sig != 0x85:
                    continue
                libc.ptrace(12, pid, None, ctypes.byref(regs))  # GETREGS
                if regs[15] in (60, 231):  # exit, exit_group
                    regs[14] = 0
                    libc.ptrace(13, pid, None, ctypes.byref(regs))  # SETREGS
                    libc.ptrace(17, pid, None, None)  # DETACH
                    break
        time.sleep(0.002)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 register layout")
async def test_a_survivor_cannot_forge_the_next_actions_exit_code(setup: Setup) -> None:
    """Impact of the hole above: a later action's (a reward test's) exit 1 comes back 0."""
    async with setup.pool.sandbox("t") as sbx:
        first = await sbx.run(code=SURVIVOR.replace("BODY", FLIP_EXIT), timeout=10)
        assert first.stdout == b"hidden\n", first
        with anyio.fail_after(30):
            second = await sbx.run("sleep 0.5; echo 'FAILED (failures=3)'; exit 1", timeout=10)
        assert second.exit_code == 1, second


async def test_a_command_whose_leader_exited_is_a_timeout_not_a_hang(docker: None) -> None:
    """Hole: the leader is never reapable while its thread lives, and the runner's last
    ``proc.wait()`` has no deadline: the host sees no answer until its outer limit, then
    the sandbox is destroyed (SandboxBrokenError) instead of a timed-out result."""
    code = HIDE + "hide(lambda: time.sleep(3600))\n"
    async with open_pool(config=config(io_timeout=3.0)) as setup:
        async with setup.pool.sandbox("t") as sbx:
            with anyio.fail_after(40):
                result = await sbx.run(code=code, timeout=2)
            assert result.timed_out, result
            assert (await sbx.run("echo alive")).stdout == b"alive\n"
        assert setup.pool.replaced == 0


# Memory that belongs to no process (a memfd written through `write`, not mapped) is
# charged to the container but not to any process's RSS; the writer is `head` (~1 MiB).
UNOWNED_MEMORY = (
    "import os\n"
    "fd = os.memfd_create('hog', 0)\n"
    "os.dup2(fd, 3)\n"
    "os.execv('/bin/sh', ['sh', '-c', 'exec head -c 4000000000 /dev/zero >&3'])\n"
)


async def test_memory_held_by_no_process_kills_the_command_not_the_runner(docker: None) -> None:
    """Hole: the OOM killer picks the biggest process, the runner (a Python process),
    over a 1 MiB `head` whose memory is in a memfd: the container dies, and a command
    out of memory becomes SandboxBrokenError (an infrastructure failure), not a result."""
    async with open_pool(config=config(memory="256MiB")) as setup:
        async with setup.pool.sandbox("t") as sbx:
            with anyio.fail_after(60):
                result = await sbx.run(code=UNOWNED_MEMORY, timeout=30)
            assert not result.ok and not result.timed_out, result
            assert (await sbx.run("echo alive")).stdout == b"alive\n"
        assert setup.pool.replaced == 0


async def test_get_of_a_sparse_file_over_the_cap_is_refused_without_reading_it(
    docker: None,
) -> None:
    """Hole: the runner never checks the size; the host buffers `work_size` bytes of
    zeros, then destroys the sandbox (the local backend raises EFBIG and keeps it)."""
    async with open_pool(config=config(work_size="16MiB")) as setup:
        async with setup.pool.sandbox("t") as sbx:
            made = await sbx.run(code="open('big', 'wb').truncate(1 << 40)\nprint('ok')")
            assert made.stdout == b"ok\n", made
            with anyio.fail_after(30):
                try:
                    await sbx.get("big")
                except SandboxBrokenError as exc:
                    pytest.fail(f"a sparse file broke the sandbox: {exc}")
                except OSError:
                    pass
                else:
                    pytest.fail("a file over work_size was returned")
            assert (await sbx.run("echo alive")).stdout == b"alive\n"
        assert setup.pool.replaced == 0


async def test_commands_cannot_signal_or_limit_the_runner(setup: Setup) -> None:
    probe = (
        "import os, resource, signal\n"
        "seen = []\n"
        "for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL, signal.SIGINT):\n"
        "    try:\n"
        "        os.kill(1, sig); seen.append('signalled')\n"
        "    except OSError as exc:\n"
        "        seen.append(exc.errno)\n"
        "try:\n"
        "    resource.prlimit(1, resource.RLIMIT_NOFILE, (3, 3)); seen.append('limited')\n"
        "except OSError as exc:\n"
        "    seen.append(exc.errno)\n"
        "print(seen)\n"
    )
    async with setup.pool.sandbox("t") as sbx:
        result = await sbx.run(code=probe)
        assert b"signalled" not in result.stdout and b"limited" not in result.stdout, result
        assert (await sbx.run("echo alive")).stdout == b"alive\n"
    assert setup.pool.replaced == 0


# -- the code reward on a Docker sandbox ---------------------------------------------------

WRONG = "def add(a, b):\n    return 0\n"
# The answer's top level lowers its judge's open-file limit: `prlimit` needs only the
# same uid, and being non-dumpable does not stop it. The harness then imports a stdlib
# module the tests name freely, after the answer started, catching only ImportError.
LIMIT_THE_JUDGE = (
    "import os, resource\n"
    "try:\n"
    "    resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (1, 1))\n"
    "except OSError:\n"
    "    pass\n" + WRONG
)
FREE_STDLIB_TESTS = (
    "assert add(2, 3) == fractions.Fraction(5)\nassert add(-1, 4) == fractions.Fraction(3)\n"
)


async def test_a_wrong_answer_cannot_make_grading_an_infrastructure_failure(
    setup: Setup,
) -> None:
    async with setup.pool.sandbox("reward") as sbx:
        with anyio.fail_after(60):
            try:
                verdict = await grade(sbx, LIMIT_THE_JUDGE, FREE_STDLIB_TESTS, timeout=20)
            except SandboxBrokenError as exc:
                pytest.fail(f"a wrong answer turned its 0 into an infrastructure failure: {exc}")
        assert verdict.score() == 0.0, verdict
    async with setup.pool.sandbox("reward-right") as sbx:
        right = "def add(a, b):\n    return a + b\n"
        assert (await grade(sbx, right, FREE_STDLIB_TESTS, timeout=20)).score() == 1.0
