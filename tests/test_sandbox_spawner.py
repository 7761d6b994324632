"""Local sandbox commands started by the fork server (``_spawner``, ``_forkserver``).

The trainer never forks for a command: a fork of a process holding 2 GiB took 119 ms
and held the GIL through it (``benchmarks/local_spawn.py`` measures what it costs now).
These check what the server must keep of ``subprocess``: descriptors, errors, statuses,
the zombie until the trainer waits, its death as the sandbox's failure, and a forked
trainer's own server. Real processes throughout.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

import tangram
from tangram._sandbox._local import _spawner
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._pool import SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="local sandboxes are Linux's")

PLAIN = {"procs": [], "lend": None, "owner": None, "cores": (), "limits": []}
PYTHON = sys.executable


def run(argv: list[str], fds: tuple[int, ...] = (), **spec: object) -> _spawner.Child:
    return _spawner.spawn(argv, {"PATH": "/usr/bin:/bin"}, "/", list(fds), {**PLAIN, **spec})


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_a_command_gets_its_streams_and_the_descriptors_passed_and_nothing_else() -> None:
    read, write = os.pipe()
    code = (
        "import os, sys; os.write(3, b'through 3'); "
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd'))); "
        "print(sys.stdin.read(), file=sys.stderr)"
    )
    child = run([PYTHON, "-I", "-c", code], (write,))
    os.close(write)
    try:
        child.stdin.write(b"fed")
        child.stdin.close()
        out, err = child.stdout.read(), child.stderr.read()
        assert child.wait() == 0
    finally:
        child.close()
    # 0-2, the one passed as 3, and the listing's own: not the server's socket, nor
    # any other descriptor of the trainer's or the server's.
    assert out.strip() == b"[0, 1, 2, 3, 4]"
    assert err.strip() == b"fed"
    assert os.read(read, 100) == b"through 3"
    os.close(read)


def test_the_command_is_the_fork_servers_child_not_the_trainers() -> None:
    child = run(["/bin/sleep", "30"])
    try:
        parent = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines()
                if line.startswith("PPid:")
            )
        )
        assert parent != os.getpid()
        assert _spawner._SERVER is not None and parent == _spawner._SERVER.process.pid
    finally:
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        child.close()


def test_an_ended_command_stays_a_zombie_until_the_trainer_is_done_with_it() -> None:
    """Its pid cannot be reused while the trainer still kills by it: the server reaps it
    only once the trainer closes it, after its last kill of what the command left."""
    child = run(["/bin/sh", "-c", "exit 3"])
    try:
        assert child.pidfd is not None
        select.select([child.pidfd], [], [], 20)
        deadline = time.monotonic() + 20
        while state(child.pid) != "Z":
            assert time.monotonic() < deadline, state(child.pid)
            time.sleep(0.005)
        assert child.wait() == 3
        assert state(child.pid) == "Z"  # waited, but not yet given back
    finally:
        child.close()
    while state(child.pid) is not None:
        assert time.monotonic() < deadline, "never reaped"
        time.sleep(0.005)


def test_failures_read_as_subprocess_says_them() -> None:
    with pytest.raises(FileNotFoundError) as missing:
        run(["/no/such/program"])
    assert missing.value.filename == "/no/such/program"
    with pytest.raises(subprocess.SubprocessError, match="set-up"):
        run(["/bin/true"], procs=["/no/such/cgroup/cgroup.procs"])
    child = run(["/bin/true"])  # and the server goes on
    assert child.wait() == 0
    child.close()


def test_a_forked_trainer_starts_a_server_of_its_own() -> None:
    first = run(["/bin/true"])
    first.wait()
    first.close()
    assert _spawner._SERVER is not None
    theirs = _spawner._SERVER.process.pid
    pid = os.fork()
    if pid == 0:  # the copy: the parent's server is not its child, nor its to use
        try:
            child = run(["/bin/sh", "-c", "exit 5"])
            mine = _spawner._SERVER.process.pid if _spawner._SERVER else theirs
            os._exit(0 if child.wait() == 5 and mine != theirs else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.anyio
async def test_the_fork_servers_death_is_the_sandboxs_failure_not_the_commands(
    tmp_path: Path,
) -> None:
    """A command whose server died was killed with it: never the command's own exit."""
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("first") as sbx:
            assert (await sbx.run("true")).exit_code == 0
            server = _spawner._SERVER
            assert server is not None

            async def kill_when_started() -> None:
                with anyio.fail_after(20):
                    # Another process's state: nothing of ours can tell, so polled.
                    while not _started(server.process.pid):  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                server.process.kill()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(kill_when_started)
                with pytest.raises(SandboxBrokenError, match="fork server"):
                    await sbx.run("sleep 42.0421", timeout=60)
        async with pool.sandbox("second") as sbx:  # a new server for the next command
            assert (await sbx.run("echo again")).stdout == b"again\n"
        assert _spawner._SERVER is not server


def _children(pid: int) -> list[int]:
    """``pid``'s descendants, from ``/proc``."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def _started(server: int) -> bool:
    return any(b"42.0421" in _cmdline(p) for p in _children(server))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
