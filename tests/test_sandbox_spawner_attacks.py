"""Attacks on the fork server (``_spawner``, ``_forkserver``) and on the harness's bootstrap.

What a hostile sandbox command or answer tries, and what tangram's own failures look like:
reaching the server (signals, ``ptrace``, ``/proc``), descriptors that leak either way,
statuses, set-up failures at every step, cancels at every point, fifty commands at once, the
server killed or stopped, signals meant for the trainer, a trainer with many descriptors or
SIGCHLD blocked, a forked trainer, the trainer's death, a pid reused before the last kill,
and the harness read from stdin. Each test asserts the safe behaviour, so a failure is a
hole. Real processes throughout; whatever is polled has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import tangram
from tangram._reward import _grade
from tangram._reward._grade import grade
from tangram._sandbox._backend import ExecRequest, ExecResult
from tangram._sandbox._local import _backend as local_backend
from tangram._sandbox._local import _spawner
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._local._proctree import Tree, kill_tree
from tangram._sandbox._pool import SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="local sandboxes are Linux's")

ROOT = os.geteuid() == 0
REPO = Path(tangram.__file__).resolve().parents[1]
PLAIN: dict[str, Any] = {"procs": [], "lend": None, "owner": None, "cores": (), "limits": []}
BWRAP = [pytest.param(None, id="bwrap"), pytest.param(False, id="no-bwrap")]
needs_root = pytest.mark.skipif(not ROOT, reason="a uid per sandbox needs root")


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


# -- helpers ------------------------------------------------------------------------------


def until(predicate: Callable[[], bool], seconds: float = 10.0, what: str = "") -> None:
    """Poll another process's state (nothing of ours can tell) until ``predicate`` holds."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def cmdline(pid: int | str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return state(pid) not in (None, "Z")


def running(*argv: str) -> list[int]:
    """Live host pids whose argv is exactly ``argv``."""
    wanted = b"".join(part.encode() + b"\0" for part in argv)
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and cmdline(entry) == wanted and alive(int(entry))
    ]


def children(pid: int) -> list[int]:
    """``pid``'s own children, zombies included (a zombie is a child until reaped)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.extend(int(kid) for kid in (task / "children").read_text().split())
    return found


def server_pid() -> int:
    server = _spawner._SERVER
    assert server is not None and server.alive
    return server.process.pid


def no_children_left() -> None:
    """Every command the server started was reaped: none of them is left as a zombie."""
    server = _spawner._SERVER
    if server is None or not server.alive:
        return
    pid = server.process.pid
    until(lambda: not children(pid), 10, f"the server's children {children(pid)} reaped")


def descriptors() -> dict[int, str]:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def no_new_descriptors(before: dict[int, str], settle: float = 5.0) -> None:
    """This process holds no more descriptors than ``before`` (a restarted server's socket
    replaces the dead one's); polled, as the reader thread closes a dead server's socket."""
    deadline = time.monotonic() + settle
    while True:
        after = descriptors()
        if len(after) <= len(before) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    new = {fd: what for fd, what in after.items() if before.get(fd) != what}
    assert len(after) <= len(before), f"descriptors left open: {new}"


def spawn(argv: list[str], cwd: str = "/", **spec: Any) -> _spawner.Child:
    """A command started the one way the backend starts it: through ``submit``."""
    return _spawner.submit(
        _spawner.spawn, argv, {"PATH": "/usr/bin:/bin"}, cwd, [], {**PLAIN, **spec}
    ).result()


@contextlib.asynccontextmanager
async def local_pool(**options: Any) -> Any:
    async with (
        SandboxPool(LocalBackend(**options)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        yield pool


def trainer(tmp_path: Path, source: str, **popen: Any) -> subprocess.Popen[bytes]:
    """Another trainer: ``source`` run by this interpreter in a directory of its own."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **popen,
    )


# -- a command against the server ----------------------------------------------------------

# Run as the sandbox's uid: everything it can learn of, or do to, its parent (the fork
# server, without bubblewrap) or any process whose source is the server's.
REACH = r"""
import ctypes, json, os, signal
out = {"fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}
mark = b"def report" + b"_exits("  # in the server's source, not in this one
def argv_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""
servers = [int(p) for p in os.listdir("/proc") if p.isdigit() and mark in argv_of(p)]
out["servers"] = servers
libc = ctypes.CDLL(None, use_errno=True)
got = {}
parent = os.getppid()  # 1 under bubblewrap: its own init, not the server
for pid in servers + ([parent] if parent > 1 and parent not in servers else []):
    for what in ("environ", "mem", "maps", "fd", "fd/0", "fd/3", "fd/4", "root/etc/hostname"):
        try:
            path = f"/proc/{pid}/{what}"
            if what == "fd":
                os.listdir(path)
            else:  # never blocks on a pipe, were it opened
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    os.read(fd, 1)
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
            got[f"{pid}/{what}"] = "read"
        except OSError:
            pass
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            got[f"{pid}/kill{int(sig)}"] = "sent"
        except OSError:
            pass
    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        got[f"{pid}/ptrace"] = "attached"
out["got"] = got
print(json.dumps(out))
"""


@needs_root
@pytest.mark.anyio
@pytest.mark.parametrize("bubblewrap", BWRAP)
async def test_a_command_cannot_reach_the_fork_server_nor_hold_its_descriptors(
    bubblewrap: bool | None,
) -> None:
    """Without bubblewrap the server is the command's parent and in its ``/proc``; with it,
    out of sight. Either way a command of the sandbox's uid can read nothing of it, signal
    or trace it, and holds its own three streams and nothing else."""
    async with local_pool(bubblewrap=bubblewrap) as pool, pool.sandbox("reach") as sbx:
        result = await sbx.run(code=REACH, timeout=30)
        server = server_pid()
    assert result.exit_code == 0, result
    seen = json.loads(result.stdout)
    assert seen["fds"] == [0, 1, 2, 3]  # 3: the listing's own
    assert seen["got"] == {}
    if bubblewrap is None:
        assert seen["servers"] == []  # another pid namespace
    else:
        assert seen["servers"] == [server]
    assert alive(server) and state(server) != "T"


def test_the_fork_server_holds_nothing_but_its_socket_and_its_wakeup_pipe() -> None:
    """Started with ``close_fds``: none of the trainer's descriptors, and none of a request's
    left behind after it (twenty commands, one of them failing its set-up)."""
    for n in range(20):
        try:
            child = spawn(["/bin/sh", "-c", f"exit {n % 3}"], cores=(4095,) if n == 7 else ())
        except subprocess.SubprocessError:
            assert n == 7
            continue
        assert child.wait() == n % 3
        child.close()
    pid = server_pid()
    no_children_left()
    held = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert sorted(held)[:3] == [0, 1, 2]
    assert held[0] == held[1] == os.devnull
    rest = sorted(held[fd].split(":")[0] for fd in held if fd > 2)
    assert rest == ["pipe", "pipe", "socket"], held


def test_what_the_trainer_receives_from_the_server_is_close_on_exec() -> None:
    """Every descriptor Python opens is non-inheritable (PEP 446), as the pidfd was when
    the trainer opened it itself: one received over ``SCM_RIGHTS`` without
    ``MSG_CMSG_CLOEXEC`` is inheritable, and reaches whatever the trainer starts with
    ``close_fds=False`` or ``os.system`` (a handle to signal a sandbox's command)."""
    child = spawn(["/bin/sleep", "30"])
    try:
        assert child.pidfd is not None
        for pipe in (child.stdin, child.stdout, child.stderr):
            assert not os.get_inheritable(pipe.fileno())
        assert not os.get_inheritable(child.pidfd), "the pidfd leaks into the trainer's children"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.close()


# -- statuses and failures ------------------------------------------------------------------

STATUSES = [
    ("exit 0", 0, None),
    ("exit 3", 3, None),
    ("exit 255", 255, None),
    ("kill -TERM $$", None, signal.SIGTERM),
    ("kill -KILL $$", None, signal.SIGKILL),
    ("kill -SEGV $$", None, signal.SIGSEGV),
]


@pytest.mark.anyio
@pytest.mark.parametrize("bubblewrap", BWRAP)
async def test_a_commands_status_is_its_own_whatever_it_was(bubblewrap: bool | None) -> None:
    async with local_pool(bubblewrap=bubblewrap) as pool, pool.sandbox("statuses") as sbx:
        for line, code, sig in STATUSES:
            result = await sbx.run(line, timeout=30)
            assert (result.exit_code, result.signal) == (code, sig), (line, result)
            assert not result.timed_out
        # Exec's own failures: the command's, as a shell says them.
        await sbx.put("plain", b"echo not executable\n")
        missing = await sbx.run(["/no/such/program"])
        directory = await sbx.run(["/usr"])
        unrunnable = await sbx.run(["./plain"])
    assert missing.exit_code == 127
    assert directory.exit_code == 126
    assert unrunnable.exit_code == 126
    no_children_left()


@needs_root
@pytest.mark.parametrize(
    "step",
    ["cwd", "procs", "lend", "cores", "limits"],
)
def test_a_set_up_that_fails_at_any_step_is_tangrams_and_leaves_nothing(
    step: str, tmp_path: Path
) -> None:
    """Never the command's 127: ``SubprocessError`` (the backend's ``SandboxBrokenError``),
    the half-set-up child reaped, no descriptor left, and the server serves on."""
    warm = spawn(["/bin/true"])
    warm.wait()
    warm.close()
    before = descriptors()
    steps: dict[str, dict[str, Any]] = {
        "cwd": {"cwd": str(tmp_path / "gone")},
        "procs": {"procs": [str(tmp_path / "no-cgroup" / "cgroup.procs")]},
        "lend": {"lend": ((str(tmp_path / "top"),), (str(tmp_path / "missing"),))},
        "cores": {"cores": (4095,)},
        "limits": {"limits": [(resource.RLIMIT_NOFILE, 1 << 40)]},
    }
    broken = steps[step]
    with pytest.raises(subprocess.SubprocessError, match="set-up"):
        spawn(["/bin/true"], **broken)
    no_children_left()
    no_new_descriptors(before)
    child = spawn(["/bin/sh", "-c", "exit 4"])
    assert child.wait() == 4
    child.close()


@needs_root
@pytest.mark.anyio
@pytest.mark.parametrize("bubblewrap", BWRAP)
async def test_a_sandbox_whose_cgroup_vanished_is_broken_not_a_missing_command(
    bubblewrap: bool | None,
) -> None:
    async with local_pool(bubblewrap=bubblewrap) as pool, pool.sandbox("vanish") as sbx:
        leaf = sbx._handle._leaf
        if leaf is None:
            pytest.skip("no cgroup here")
        assert (await sbx.run("true")).exit_code == 0
        leaf.remove()
        with pytest.raises(SandboxBrokenError):
            await sbx.run("true")
    no_children_left()


# -- cancels and load -------------------------------------------------------------------------


@needs_root
@pytest.mark.anyio
async def test_a_run_cancelled_at_any_point_leaves_no_process_zombie_or_descriptor() -> None:
    async with local_pool() as pool:
        async with pool.sandbox("warm") as sbx:
            await sbx.run("true")
        before = descriptors()
        for delay in (0.0, 0.001, 0.003, 0.006, 0.01, 0.02, 0.04, 0.08, 0.15):
            async with pool.sandbox("cancelled") as sbx:
                uid = sbx._handle._claim.uid
                with anyio.move_on_after(delay):
                    await sbx.run("sleep 31.4159; echo never", timeout=60)
                assert not running("sleep", "31.4159")
                assert not [
                    p for p in os.listdir("/proc") if p.isdigit() and _uid(int(p)) == uid
                ], "a process of the sandbox's uid outlived the cancelled run"
        async with pool.sandbox("after") as sbx:
            assert (await sbx.run("echo fine")).stdout == b"fine\n"
    no_children_left()
    no_new_descriptors(before)


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:") and state(pid) != "Z":
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@needs_root
@pytest.mark.anyio
async def test_fifty_commands_at_once_across_fifty_sandboxes() -> None:
    """Fifty handles run at once (past the pool's grants): a wait per command in worker
    threads, the spawner thread and the reader thread must not block one another; every
    status and output is the command's own, every zombie reaped, no descriptor left."""
    backend = LocalBackend(sandboxes=64)
    (host,) = await backend.start()
    handles = [await backend.create(host) for _ in range(50)]
    before = descriptors()
    results: list[ExecResult | None] = [None] * 50

    async def one(i: int) -> None:
        timeout = 1.0 if i % 10 == 0 else 30.0
        line = "sleep 30" if i % 10 == 0 else f"echo {i}; cat; exit {i % 7}"
        request = ExecRequest(
            ("/bin/sh", "-c", line), f"in{i}".encode(), {}, timeout, 1 << 20, (0,), 1.0
        )
        results[i] = await handles[i].execute(request)

    try:
        with anyio.fail_after(40):
            async with anyio.create_task_group() as tasks:
                for i in range(50):
                    tasks.start_soon(one, i)
    finally:
        for handle in handles:
            await handle.destroy()
        await backend.aclose()
    for i, result in enumerate(results):
        assert result is not None
        if i % 10 == 0:
            assert result.timed_out, (i, result)
        else:
            assert (result.exit_code, result.stdout) == (i % 7, f"{i}\nin{i}".encode()), (i, result)
    no_children_left()
    no_new_descriptors(before)


# -- the server's death, stop, and signals meant for the trainer -------------------------------


def _sleeping(argument: str) -> Callable[[], bool]:
    return lambda: bool(running("sleep", argument))


@pytest.mark.anyio
@pytest.mark.parametrize("bubblewrap", BWRAP)
async def test_a_server_killed_under_a_command_leaves_no_descriptor(
    bubblewrap: bool | None,
) -> None:
    """The command ends as the sandbox's failure; every descriptor of it is closed."""
    async with local_pool(bubblewrap=bubblewrap) as pool:
        async with pool.sandbox("warm") as sbx:
            await sbx.run("true")
        before = descriptors()
        async with pool.sandbox("killed") as sbx:
            server = _spawner._SERVER
            assert server is not None

            async def kill_when_started() -> None:
                await anyio.to_thread.run_sync(until, _sleeping("43.21"))
                server.process.kill()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(kill_when_started)
                with pytest.raises(SandboxBrokenError, match="fork server"):
                    await sbx.run("sleep 43.21", timeout=60)
        async with pool.sandbox("again") as sbx:  # a new server
            assert (await sbx.run("echo again")).stdout == b"again\n"
    no_new_descriptors(before, settle=2.0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the server's part: one loop is enough
async def test_a_stopped_server_does_not_hold_a_run_past_its_timeout() -> None:
    """A run of ``timeout=1`` whose server is stopped (SIGSTOP) ends in seconds, as a
    timeout or the sandbox's failure. It had waited, shielded and uncancellable, on an
    exit status only the stopped server could send; a server that has not reported an
    exit the kernel has within a few seconds is now killed. Resumed after 6 s, should
    it still be there, so the test ends."""
    async with local_pool() as pool, pool.sandbox("stopped") as sbx:
        await sbx.run("true")
        pid = server_pid()

        async def stop_when_started() -> None:
            await anyio.to_thread.run_sync(until, _sleeping("44.32"))
            os.kill(pid, signal.SIGSTOP)

        resume = threading.Timer(6.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        start = time.monotonic()
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(stop_when_started)
                with contextlib.suppress(SandboxBrokenError):
                    await sbx.run("sleep 44.32", timeout=1)
        finally:
            resume.cancel()
            with contextlib.suppress(ProcessLookupError):  # killed as stuck, as it should
                os.kill(pid, signal.SIGCONT)
        took = time.monotonic() - start
    assert took < 5.0, f"the run of timeout=1 took {took:.1f} s: it waited for the stopped server"


TRAINER_SIGNALLED = """
    import signal, anyio, tangram
    from tangram._sandbox._local._backend import LocalBackend
    from tangram._sandbox._pool import SandboxPool
    # A trainer that finishes its rollouts on Ctrl-C or a preemption notice.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: print("TRAINER carries on", flush=True))
    async def main():
        async with SandboxPool(LocalBackend()) as pool, \\
                tangram.Runtime(capacity=pool.capacity()), pool.sandbox("x") as sbx:
            result = await sbx.run("sleep 2.718; echo done", timeout=60)
            print("RESULT", result.exit_code, result.stdout, flush=True)
    try:
        anyio.run(main)
    except BaseException as exc:
        print("RAISED", type(exc).__name__, exc, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_trainers_process_group_spares_its_running_commands(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """Ctrl-C in a terminal, or a batch system's preemption notice, reaches every process
    of the trainer's group. A trainer that handles it finishes its rollouts; its commands
    (sessions of their own) never see it. The fork server was of the trainer's group and
    died of it, and every command with it; it now has a session of its own."""
    process = trainer(tmp_path, TRAINER_SIGNALLED, start_new_session=True)
    try:
        until(_sleeping("2.718"), 30, "the trainer's command started")
        os.killpg(process.pid, sig)
        output = process.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "TRAINER carries on" in output
    assert "RESULT 0 b'done\\n'" in output, output[-1500:]


TRAINER_FORKS = """
    import faulthandler, os, anyio, tangram
    from tangram._sandbox._local._backend import LocalBackend
    from tangram._sandbox._pool import SandboxPool
    async def once(who):
        async with SandboxPool(LocalBackend()) as pool, \\
                tangram.Runtime(capacity=pool.capacity()), pool.sandbox("x") as sbx:
            result = await sbx.run("echo hi", timeout=30)
            print(who, result.exit_code, result.stdout, flush=True)
    anyio.run(once, "PARENT")
    pid = os.fork()  # a data loader's worker, multiprocessing's fork
    if pid == 0:
        faulthandler.dump_traceback_later(6, exit=True)  # a hang: its stacks, exit 1
        anyio.run(once, "CHILD")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("CHILD EXIT", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_trainer_runs_commands(tmp_path: Path) -> None:
    """A copy of a trainer that used sandboxes starts a server of its own, through a
    spawner thread of its own: the parent's executor, copied, believes it has its worker,
    and the copy had waited for it forever."""
    process = trainer(tmp_path, TRAINER_FORKS)
    try:
        output = process.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "PARENT 0 b'hi\\n'" in output, output[-1500:]
    assert "CHILD 0 b'hi\\n'" in output and "CHILD EXIT 0" in output, output[-3000:]


TRAINER_AS_IT_IS = """
    import faulthandler, os, resource, signal, anyio, tangram
    from tangram._sandbox._local._backend import LocalBackend
    from tangram._sandbox._pool import SandboxPool
    faulthandler.dump_traceback_later(8, exit=True)  # a hang: its stacks, exit 1
    {setting}
    async def main():
        async with SandboxPool(LocalBackend()) as pool, \\
                tangram.Runtime(capacity=pool.capacity()), pool.sandbox("x") as sbx:
            result = await sbx.run("sleep 0.2; echo hi", timeout=5)
            print("RESULT", result.exit_code, result.stdout, flush=True)
    try:
        anyio.run(main)
    except BaseException as exc:
        print("RAISED", type(exc).__name__, exc, flush=True)
"""

SETTINGS = {
    # A large trainer's files, sockets, CUDA and NCCL handles, past select()'s 1024: the
    # server's socket keeps the number it had in the trainer.
    "holds 1100 descriptors": (
        "resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))\n"
        "    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]"
    ),
    # A trainer that takes SIGCHLD through sigwait or a signalfd blocks it in its main
    # thread: every thread it starts, and what they start, inherit the mask.
    "blocks SIGCHLD": "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])",
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_trainer_runs_commands_however_its_process_is_set(setting: str, tmp_path: Path) -> None:
    """The server is started from the trainer and inherits its process: as ``Popen`` did
    before it, a command must run whatever descriptors or signal mask the trainer has."""
    process = trainer(tmp_path, TRAINER_AS_IT_IS.format(setting=SETTINGS[setting]))
    try:
        output = process.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "RESULT 0 b'hi\\n'" in output, output[-2500:]


TRAINER_DIES = """
    import anyio, tangram
    from tangram._sandbox._local import _spawner
    from tangram._sandbox._local._backend import LocalBackend
    from tangram._sandbox._pool import SandboxPool
    async def main():
        async with SandboxPool(LocalBackend(bubblewrap={bwrap})) as pool, \\
                tangram.Runtime(capacity=pool.capacity()), pool.sandbox("x") as sbx:
            await sbx.run("true")
            print("SERVER", _spawner._SERVER.process.pid, flush=True)
            await sbx.run({command!r}, timeout=120)
    anyio.run(main)
"""


def _kill_the_trainer(tmp_path: Path, bubblewrap: bool | None, command: str) -> None:
    """Start a trainer whose command runs ``sleep 97.31``, SIGKILL the trainer, and wait
    for its server and that sleep to end."""
    process = trainer(tmp_path, TRAINER_DIES.format(bwrap=bubblewrap, command=command))
    assert process.stdout is not None
    try:
        until(_sleeping("97.31"), 30, "the trainer's command started")
        line = process.stdout.readline().decode()
        while not line.startswith("SERVER"):
            assert line, "the trainer said no server"
            line = process.stdout.readline().decode()
        server = int(line.split()[1])
        process.kill()
        process.wait()
        until(lambda: not alive(server), 5, "the server died with the trainer")
        until(lambda: not running("sleep", "97.31"), 5, "the command died with the trainer")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        for pid in running("sleep", "97.31"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("bubblewrap", BWRAP)
def test_the_trainers_death_takes_the_server_and_its_command(
    bubblewrap: bool | None, tmp_path: Path
) -> None:
    """Trainer (its spawner thread), server, command: each dies with the one before."""
    _kill_the_trainer(tmp_path, bubblewrap, "exec sleep 97.31")


@pytest.mark.parametrize("bubblewrap", BWRAP)
def test_the_trainers_death_takes_what_its_command_started(
    bubblewrap: bool | None, tmp_path: Path
) -> None:
    """The parent-death signal reaches the server's child alone (``sh``); bubblewrap's
    ``--die-with-parent`` ends its whole pid namespace, but without bubblewrap what the
    command forked (``sleep``, here) was re-parented to init and ran on, no trainer left
    to kill its tree (before the fork server too). The server's own parent-death signal
    is now SIGTERM, on which it kills each command's session and cgroups first."""
    _kill_the_trainer(tmp_path, bubblewrap, "sleep 97.31; true")


# -- a pid reused before the last kill ---------------------------------------------------------


def _take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A new session leader with exactly ``pid`` (root: the kernel's next pid, set)."""
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        victim = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
        if victim.pid == pid:
            return victim
        victim.kill()
        victim.wait()
    return None


@needs_root
@pytest.mark.anyio
async def test_the_last_kill_of_a_commands_tree_never_reaches_a_reused_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server keeps an ended command as its zombie until the trainer is done with it,
    so the pid cannot be reused while the trainer kills what the command left behind.
    The trainer had the server reap it at its wait in ``communicate``, and ``execute``
    then killed the tree once more, by that pid and its process group; it is now reaped
    at ``close``, after that kill. Here a new session tries to take the pid once the
    wait is done (another sandbox's command would: each is a session leader); the kill
    is observed, not changed."""
    real = kill_tree
    victims: list[subprocess.Popen[bytes]] = []
    reaped_first: list[bool] = []

    def observed(tree: Tree) -> int:
        if tree.session > 0:
            deadline = time.monotonic() + 2.0
            while state(tree.session) is not None and time.monotonic() < deadline:
                time.sleep(0.001)
            gone = state(tree.session) is None
            reaped_first.append(gone)
            if gone:
                victim = _take_pid(tree.session)
                if victim is not None:
                    victims.append(victim)
        return real(tree)

    monkeypatch.setattr(local_backend, "kill_tree", observed)
    try:
        async with local_pool() as pool, pool.sandbox("reuse") as sbx:
            assert (await sbx.run("exit 0")).exit_code == 0
        for victim in victims:
            assert victim.poll() is None, (
                f"a session that took the reaped pid {victim.pid} was killed by the "
                f"command's last kill_tree (status {victim.poll()})"
            )
        assert reaped_first == [False], "the command's pid was reaped before its last kill"
    finally:
        for victim in victims:
            if victim.poll() is None:
                victim.kill()
            victim.wait()


# -- the harness, read from stdin --------------------------------------------------------------


# The answer that searches every memory and stdin it can open for the tests is
# tests/test_grade.py's, with its control.


@pytest.mark.anyio
async def test_a_harness_cut_short_ends_at_once_never_hangs() -> None:
    """The bootstrap reads exact counts: a stream that ends early (in the head, the
    bytecode, the source) ends the interpreter with ``EOFError``, well before its timeout."""
    program = _grade._program(_grade._harness_source())
    boot = _grade._BOOT % _grade._HEAD
    async with local_pool() as pool, pool.sandbox("cut") as sbx:
        for cut in (b"", program[:10], program[: len(program) // 2], program[:-1]):
            start = time.monotonic()
            result = await sbx.run([sbx.python, "-I", "-c", boot], stdin=cut, timeout=30)
            assert not result.timed_out and time.monotonic() - start < 10
            assert result.exit_code == 1 and b"EOFError" in result.stderr, result
            assert result.stdout == b""


@pytest.mark.anyio
async def test_foreign_bytecode_is_never_loaded_only_the_source_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the magic differs, the bytes sent as bytecode are skipped, whatever they are
    (here not bytecode at all), and the source is compiled and judges as ever."""
    program = _grade._program(_grade._harness_source())
    head = program[: _grade._HEAD]
    magic, code_size, _ = head.split()
    garbage = b"\xff" * int(code_size)
    rest = program[_grade._HEAD + int(code_size) :]
    other = b"0" * len(magic) + head[len(magic) :] + garbage + rest
    assert len(other) == len(program)
    monkeypatch.setattr(_grade, "_program", lambda source: other)
    async with local_pool() as pool, pool.sandbox("foreign") as sbx:
        right = await grade(sbx, "def f(x):\n    return x + 1\n", "assert f(1) == 2\n")
        wrong = await grade(sbx, "def f(x):\n    return x\n", "assert f(1) == 2\n")
    assert right.score() == 1.0 and wrong.score() == 0.0
