"""The sandbox pool on the embedded local backend: grants, state, containment, failures.

These run real subprocesses. Coordination between a running command and the test goes
through a file the command writes (``ready``), polled with a deadline; nothing waits a
fixed time for something to happen.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _venvs import make_venv

import tangram
from tangram._sandbox._backend import RunResult
from tangram._sandbox._cores import CoreSet, format_cpu_list, parse_cpu_list
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._local._isolate import reachable_by_others
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import SandboxBrokenError, SandboxClosedError

pytestmark = pytest.mark.anyio

ROOT = os.geteuid() == 0
CORES = tuple(sorted(os.sched_getaffinity(0)))


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def workdir(sbx: Sandbox) -> Path:
    path = sbx._handle.workdir  # type: ignore[attr-defined]
    assert isinstance(path, Path)
    return path


async def wait_for_file(path: Path, seconds: float = 20.0) -> None:
    """Poll for a file a command writes to say it reached a point (with a deadline).

    The command is another process: no event of ours can tell us, so this polls.
    """
    target = anyio.Path(path)
    with anyio.fail_after(seconds):
        while not await target.exists():  # noqa: ASYNC110
            await anyio.sleep(0.005)


def running(command: str) -> list[int]:
    """Host pids of live processes whose argv is exactly ``command`` split on spaces.

    Commands run in their own pid namespace, so the pid a command reports (``$$``,
    ``$!``) is not the host's: tests find processes by a unique argv instead.
    """
    wanted = [part.encode() for part in command.split()]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            except OSError:
                continue
            if argv == wanted and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state != b"Z"


async def test_run_reports_output_exit_code_and_grant() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run("echo out; echo err >&2; exit 3", cpu=1)
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
        assert not result.ok and not result.truncated and not result.timed_out
        assert result.units == 1 and len(result.cores) == 1
        probe = "import os; print(os.environ['TANGRAM_CPUS'], sorted(os.sched_getaffinity(0)))"
        result = await sbx.run(code=probe, cpu=len(CORES))
        assert result.ok
        assert result.stdout.decode().strip() == f"{len(CORES)} {sorted(CORES)}"
        assert result.cores == CORES
        result = await sbx.run(["cat"], stdin="fed", env={"X": "1"})
        assert result.stdout == b"fed"
        result = await sbx.run("echo $X", env={"X": "y"})
        assert result.stdout == b"y\n"
        missing = await sbx.run(["/no/such/program"])
        assert missing.exit_code == 127


FALLBACK = "not this process's interpreter"


async def test_an_interpreter_sandboxes_cannot_reach_is_lent_or_named_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A root trainer whose environment lies under a 0700 home (a virtualenv under
    ``/root``, as on this machine and CI): ``run(code=...)`` runs this interpreter, lent
    read-only (``tests/test_sandbox_lend.py``), or where lending fails the system
    ``python3``, without the trainer's packages, and the pool says so once at start
    instead of the model's ``import numpy`` failing unexplained (issue #18)."""
    from tangram._sandbox._local import _backend as _local

    backend = LocalBackend()
    mine = (sys.executable, sys.prefix, sys.base_prefix)
    out_of_reach = ROOT and not all(reachable_by_others(p) for p in mine)
    _local._WARNED.discard(backend.python)
    _local._WARNED.discard(shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "")
    with caplog.at_level(logging.WARNING, logger="tangram.sandbox"):
        async with (
            SandboxPool(backend) as pool,
            tangram.Runtime(capacity=pool.capacity()),
            pool.sandbox("t") as sbx,
        ):
            result = await sbx.run(code="import sys; print(sys.executable)")
    said = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    assert result.ok, result
    assert result.stdout.decode().strip() == backend.python == sbx.python
    if out_of_reach and backend._lend is None:
        assert backend.python != sys.executable
        assert len(said) == 1
        assert backend.python in said[0] and "[sandbox] python" in said[0]
    else:
        assert backend.python == sys.executable and not said


async def test_a_named_interpreter_is_used_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    system = shutil.which("python3", path="/usr/bin:/bin")
    assert system is not None
    with caplog.at_level(logging.WARNING, logger="tangram.sandbox"):
        async with (
            SandboxPool(LocalBackend(python=system)) as pool,
            tangram.Runtime(capacity=pool.capacity()),
            pool.sandbox("t") as sbx,
        ):
            result = await sbx.run(code="import sys; print(sys.executable)")
    assert result.stdout.decode().strip() == system
    assert not [r for r in caplog.records if FALLBACK in r.getMessage()]


@pytest.fixture
def trainer_env() -> Any:
    """A virtualenv where a training container keeps one (outside the system dirs), with
    a package of its own: what a user names with ``[sandbox] python``."""
    root = Path(tempfile.mkdtemp(prefix="trainer-env-", dir="/tmp"))
    shutil.rmtree(root)
    make_venv(root)
    yield root
    shutil.rmtree(root)


async def test_a_named_virtualenv_is_seen_with_its_packages(trainer_env: Path) -> None:
    """The interpreter the user names is a virtualenv's link to a base interpreter: the
    sandbox sees the venv itself (read-only) and imports its packages. Only the link's
    target used to be lent, and the command found no interpreter (exit 127)."""
    python = str(trainer_env / "bin" / "python")
    async with (
        SandboxPool(LocalBackend(python=python)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run(
            code="import sys, trainer_only; print(sys.prefix, trainer_only.VALUE)"
        )
        written = await sbx.run(code=f"open({str(trainer_env / 'pyvenv.cfg')!r}, 'a').write('x')")
    assert result.ok, result
    assert result.stdout.decode().split() == [str(trainer_env), "42"]
    assert not written.ok  # lent read-only: the model's code cannot change the trainer's env
    assert (trainer_env / "pyvenv.cfg").read_text().endswith("\n")


async def test_an_elastic_demand_that_is_not_resizable_runs_on_its_grant() -> None:
    # Its grant never changes, so nothing may wait for a resize of it (that wait raises).
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run("echo $TANGRAM_CPUS", cpu=tangram.Elastic(1, len(CORES)))
        assert result.ok, result
        assert 1 <= int(result.stdout) == result.units == len(result.cores) <= len(CORES)


async def test_state_persists_within_a_trajectory_and_never_leaks() -> None:
    async with (
        SandboxPool(LocalBackend(), warm=1) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("one") as one:
            await one.run("echo kept > state.txt")
            assert (await one.run("cat state.txt")).stdout == b"kept\n"
            await one.put("dir/data.bin", b"\x00\x01")
            assert await one.get("dir/data.bin") == b"\x00\x01"
            first = workdir(one)
            async with pool.sandbox("two") as two:
                assert workdir(two) != first
                result = await two.run("cat state.txt")
                assert result.exit_code != 0 and b"kept" not in result.stdout
                with pytest.raises(FileNotFoundError):
                    await two.get("dir/data.bin")
        assert not first.exists()
        with pytest.raises(SandboxClosedError):
            await one.run("true")


async def test_paths_cannot_leave_the_work_dir() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        for bad in ("../x", "/etc/passwd", "a/../../x", ""):
            with pytest.raises((ValueError, TypeError)):
                await sbx.get(bad)
        await sbx.run("ln -s /etc/passwd link")
        with pytest.raises(PermissionError):
            await sbx.get("link")


async def test_concurrent_actions_get_disjoint_cores_and_units_return() -> None:
    if len(CORES) < 2:
        pytest.skip("needs two cores")
    probe = (
        "import os, pathlib, time\n"
        "pathlib.Path('ready').write_text('')\n"
        "end = time.monotonic() + 20\n"
        "while not pathlib.Path('go').exists() and time.monotonic() < end: pass\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
    ):
        async with pool.sandbox("a") as a, pool.sandbox("b") as b:
            results: dict[str, RunResult] = {}

            async def run(name: str, sbx: Sandbox) -> None:
                results[name] = await sbx.run(code=probe, cpu=1, timeout=30)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "a", a)
                tg.start_soon(run, "b", b)
                await wait_for_file(workdir(a) / "ready")
                await wait_for_file(workdir(b) / "ready")
                assert runtime.stats().resources["cpu"].held == 2
                (workdir(a) / "go").write_text("")
                (workdir(b) / "go").write_text("")
            assert set(results["a"].cores).isdisjoint(results["b"].cores)
            for name in "ab":
                assert results[name].stdout.decode().strip() == str(list(results[name].cores))
        assert runtime.stats().resources["cpu"].held == 0
        assert not pool._hosts["local"].cores.free ^ set(CORES)


RESIZE_PROBE = r"""
import os, time, pathlib
seen = [len(os.sched_getaffinity(0))]
pathlib.Path("ready").write_text("")
end = time.monotonic() + 20
while time.monotonic() < end and len(seen) < 3:
    n = len(os.sched_getaffinity(0))
    if n != seen[-1]:
        seen.append(n)
print(seen)
"""


async def test_resize_is_visible_inside_the_running_action() -> None:
    if len(CORES) < 2:
        pytest.skip("needs two cores")
    backend = LocalBackend(cores=CORES[:2])
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
        pool.sandbox("a") as a,
        pool.sandbox("b") as b,
    ):
        results: dict[str, Any] = {}

        async def elastic() -> None:
            results["a"] = await a.run(
                code=RESIZE_PROBE, cpu=tangram.Elastic(1, 2, resizable=True), timeout=30
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(elastic)
            await wait_for_file(workdir(a) / "ready")
            # A rigid newcomer makes the scheduler shrink the elastic action, then give
            # the core back when it is done.
            results["b"] = await b.run("nproc", cpu=1)
        assert results["b"].stdout == b"1\n"
        assert results["a"].stdout == b"[2, 1, 2]\n"
        assert results["a"].resizes == 2 and results["a"].max_units == 2
        assert runtime.stats().resources["cpu"].held == 0


async def test_endless_loop_times_out_with_a_clear_result() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run("while :; do :; done", timeout=0.5)
        assert result.timed_out and result.exit_code is None and not result.ok
        assert result.exec_seconds < 5
        assert (await sbx.run("echo next")).stdout == b"next\n"


async def test_orphaned_background_processes_are_killed() -> None:
    backend = LocalBackend()
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        # One child stays in the session; one leaves it with setsid.
        result = await sbx.run(
            "sleep 300.0417 & setsid sleep 301.0417 & echo done",
        )
        assert result.ok and result.stdout == b"done\n"
        if not backend.protections.namespaced:
            # Under bubblewrap the kernel ends them with the sandbox's pid namespace as
            # the command exits, before anything can count them.
            assert result.leftovers_killed >= 1
        for token in ("sleep 300.0417", "sleep 301.0417"):
            assert not running(token), f"{token} survived the action"


async def test_output_flood_is_capped() -> None:
    async with (
        SandboxPool(LocalBackend(), output_limit=1000) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run("yes | head -c 50000000; yes >&2", timeout=3)
        assert len(result.stdout) == 1000 and result.stdout_truncated
        assert len(result.stderr) == 1000 and result.stderr_truncated
        assert result.timed_out and result.truncated


async def test_memory_bomb_fails_inside_its_limit() -> None:
    async with (
        SandboxPool(LocalBackend(memory="256MiB")) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
        result = await sbx.run(code=bomb, timeout=20)
        assert result.exit_code != 0 and not result.timed_out
        assert b"MemoryError" in result.stderr
        assert (await sbx.run("echo next")).ok


@pytest.mark.skipif(not ROOT, reason="RLIMIT_NPROC needs a dedicated user (run as root)")
async def test_fork_bomb_is_bounded() -> None:
    async with (
        SandboxPool(LocalBackend(processes=64)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run("b() { b | b & }; b; wait", timeout=2)
        # Forks fail at the process limit and the bomb dies out; the timeout would kill
        # the group otherwise. Either way it is bounded and the sandbox still works.
        assert result.exec_seconds < 10
        assert (await sbx.run("echo next")).stdout == b"next\n"


@pytest.mark.skipif(not ROOT, reason="commands run as `nobody` only when the caller is root")
async def test_writes_outside_the_work_dir_fail(tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        result = await sbx.run(f"echo x > {target}")
        assert result.exit_code != 0
        # Without namespaces the host's permissions refuse; with them the host's paths
        # are not there at all.
        refusals = (
            b"Permission denied",
            b"nonexistent directory",
            b"Directory nonexistent",
            b"No such file",
        )
        assert any(refusal in result.stderr for refusal in refusals), result.stderr
        # The checkout's directory may exist in the command's own /tmp (an interpreter
        # under it is bound there, read-only), so this may succeed in there: the host's
        # directory is what must not change.
        await sbx.run(f"touch {Path.cwd() / 'escaped'}")
        assert not target.exists() and not (Path.cwd() / "escaped").exists()
        assert (await sbx.run("echo inside > f; cat f")).stdout == b"inside\n"


async def test_cancelling_an_action_kills_it_and_returns_units() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
        pool.sandbox("t") as sbx,
    ):
        with anyio.move_on_after(20):
            async with anyio.create_task_group() as tg:

                async def victim() -> None:
                    await sbx.run("touch ready; sleep 300.0419", timeout=60)

                tg.start_soon(victim)
                await wait_for_file(workdir(sbx) / "ready")
                tg.cancel_scope.cancel()
        assert not running("sleep 300.0419")
        assert runtime.stats().resources["cpu"].held == 0
        assert (await sbx.run("echo next")).ok


async def test_a_fraction_of_a_core_holds_a_core_of_its_own() -> None:
    """An action is pinned to cores of its own, so ``cpu=0.5`` holds a whole core in the
    runtime's books: three at once on one core crashed the pool's core assignment with
    InvalidCapacityError (the runtime had granted two halves of one core), and two
    actions on a core break the memory reservation's one action per core (a review)."""
    async with (
        SandboxPool(LocalBackend(cores=[0])) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
    ):
        results: list[RunResult] = []

        async def half(name: str) -> None:
            async with pool.sandbox(name) as sbx:
                results.append(await sbx.run("sleep 0.2; nproc", cpu=0.5))

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(half, f"half-{i}")
        assert [(r.exit_code, r.stdout, r.units) for r in results] == [(0, b"1\n", 1)] * 3
        cpu = runtime.stats().resources["cpu"]
        assert cpu.peak == 1 and cpu.held == 0
        assert cpu.unit_seconds >= 0.6  # one after another, each holding the core


async def test_a_broken_sandbox_fails_clearly_and_is_replaced() -> None:
    async with (
        SandboxPool(LocalBackend(), warm=1) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
    ):
        async with pool.sandbox("t") as sbx:
            await sbx.run("true")
            shutil.rmtree(workdir(sbx))
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
            assert runtime.stats().resources["cpu"].held == 0
            assert pool.replaced == 1
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
        async with pool.sandbox("u") as fresh:
            assert (await fresh.run("echo ok")).ok


async def test_bad_arguments_fail_at_the_call() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        with pytest.raises(TypeError):
            await sbx.run()
        with pytest.raises(TypeError):
            await sbx.run("true", code="pass")
        with pytest.raises(ValueError):
            await sbx.run("true", timeout=0)
        with pytest.raises(TypeError):
            await sbx.run("true", cpu="two")  # type: ignore[arg-type]
        with pytest.raises(tangram.errors.CapacityExceededError):
            await sbx.run("true", cpu=len(CORES) + 1)
    pool = SandboxPool(LocalBackend())
    with pytest.raises(SandboxClosedError):
        pool.capacity()
    with pytest.raises(ValueError):
        SandboxPool(LocalBackend(), warm=-1)


async def test_warm_sandboxes_are_ready_ahead_of_demand() -> None:
    async with SandboxPool(LocalBackend(), warm=3) as pool:
        await pool.wait_warm()
        assert len(pool._warm) == 3
        async with pool.sandbox("t"):
            await pool.wait_warm()  # topped up again behind the checkout
            assert len(pool._warm) == 3
    assert not pool._live


def test_core_set_keeps_actions_together_and_never_lends_twice() -> None:
    cores = CoreSet([(0, 1, 2, 3), (4, 5, 6, 7)])
    a = cores.take(3)
    assert len({c // 4 for c in a}) == 1
    b = cores.take(2)
    assert set(a).isdisjoint(b) and len({c // 4 for c in b}) == 1
    grown = cores.resize(b, 4)
    assert grown[:2] == b and set(grown).isdisjoint(a)
    assert len({c // 4 for c in grown}) == 1
    shrunk = cores.resize(grown, 1)
    assert shrunk == b[:1]
    with pytest.raises(RuntimeError):
        cores.give(b[1:2])
    with pytest.raises(tangram.errors.InvalidCapacityError):
        cores.take(9)


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_signal_is_reported() -> None:
    async def main() -> RunResult:
        async with (
            SandboxPool(LocalBackend()) as pool,
            tangram.Runtime(capacity=pool.capacity()),
            pool.sandbox("t") as sbx,
        ):
            return await sbx.run("kill -TERM $$")

    result = anyio.run(main)
    assert result.signal == signal.SIGTERM and result.exit_code is None


_OWNER = """
import sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend

async def main():
    async with (
        tangram.SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        print(sbx._handle.workdir, flush=True)
        await sbx.run("echo started > cmd.pid; exec sleep 120.0421", timeout=300)

anyio.run(main)
"""


def test_a_command_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A rollout worker killed mid-action (OOM, a Ray node's agent killed): nothing of ours
    # runs to clean up, so the kernel's parent-death signal has to end the command.
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid_file = Path(owner.stdout.readline().strip()) / "cmd.pid"
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.01)
        while not running("sleep 120.0421"):
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.01)
        (command,) = running("sleep 120.0421")
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while pid_alive(command):
            assert time.monotonic() < deadline, "the command outlived its owner"
            time.sleep(0.01)
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


# -- memory reserved per sandbox (see tangram._sandbox._budget) ----------------------

_GIB = 1 << 30


@pytest.mark.parametrize("cap_gib", [0.5, 8, 32])
@pytest.mark.parametrize("cores", [1, 2, 8, 32])
@pytest.mark.parametrize("sandboxes", [1, 16, 256, 1024])
@pytest.mark.parametrize(("memory", "disk"), [(4 * _GIB, _GIB), (256 << 20, 8 << 20)])
def test_what_every_sandbox_may_hold_at_once_fits_under_the_cap(
    cap_gib: float, cores: int, sandboxes: int, memory: int, disk: int
) -> None:
    """One action per core at its leaf's limit and every live sandbox's work dir full
    (its bytes and its inodes) never add up past the cap, whatever was asked; so no
    sandbox reaches the shared limit, only its own."""
    from tangram._sandbox._budget import INODE_BYTES, inodes_for, plan_memory

    cap = int(cap_gib * _GIB)
    plan = plan_memory(
        cap=cap, cores=cores, memory=memory, disk=disk, sandboxes=sandboxes, files_in_memory=True
    )
    assert plan.memory is not None and plan.disk is not None and plan.sandboxes == sandboxes
    held = plan.disk + inodes_for(plan.disk) * INODE_BYTES
    assert cores * plan.memory + sandboxes * held <= cap, plan
    assert plan.memory <= memory and plan.disk <= disk
    if plan.problem is None:
        assert plan.lowered == (plan.memory < memory or plan.disk < disk)


def test_a_16_gib_pod_gets_these_defaults() -> None:
    """What docs/sandboxes.md promises for a 16 GiB pod lending 8 cores: half of its
    8 GiB cap for the actions (512 MiB each), half for 256 work dirs (14 MiB each)."""
    from tangram._sandbox._budget import plan_memory

    plan = plan_memory(
        cap=8 * _GIB, cores=8, memory=4 * _GIB, disk=_GIB, sandboxes=256, files_in_memory=True
    )
    assert plan.memory == 512 << 20 and plan.problem is None and plan.lowered
    assert 14 << 20 <= plan.disk < 15 << 20  # type: ignore[operator]
    # Without a tmpfs per work dir its files are page cache: the actions get it all.
    plan = plan_memory(
        cap=8 * _GIB, cores=8, memory=4 * _GIB, disk=_GIB, sandboxes=256, files_in_memory=False
    )
    assert plan.memory == _GIB and plan.sandboxes is None


def test_settings_the_cap_cannot_hold_are_refused() -> None:
    from tangram._sandbox._budget import plan_memory

    plan = plan_memory(
        cap=512 << 20, cores=64, memory=4 * _GIB, disk=_GIB, sandboxes=256, files_in_memory=True
    )
    assert plan.problem is not None and "lend fewer cores" in plan.problem


def two_places() -> LocalBackend:
    """A backend that reserves memory for two live sandboxes (skips where none is)."""
    backend = LocalBackend(sandboxes=2, memory="256MiB", disk="16MiB")
    if backend.protections.memory_per_sandbox and backend._places.limit is None:
        pytest.skip(f"work dirs are not memory here: {backend.protections.memory}")
    if backend._places.limit is None:
        pytest.skip(f"no cgroup memory controller here: {backend.protections.memory}")
    return backend


async def test_a_sandbox_past_the_reserved_count_is_refused() -> None:
    """Each live sandbox's work dir has memory reserved: one more would take a share of
    someone else's, so it is refused (typed), until one is destroyed."""
    backend = two_places()
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("a"), pool.sandbox("b") as b:
            with pytest.raises(tangram.errors.SandboxError, match="sandboxes=2"):
                async with pool.sandbox("c"):
                    pass
            assert (await b.run("echo ok")).ok
        async with pool.sandbox("c") as c:  # their reservations came back
            assert (await c.run("echo ok")).ok


async def test_a_broken_sandboxs_place_goes_to_the_next_at_the_reserved_count() -> None:
    """A broken sandbox is destroyed in the background; at exactly the reserved count the
    next trajectory's sandbox was refused while it went (a tangram failure in the step)."""
    backend = two_places()
    async with (
        SandboxPool(backend, warm=0) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("a") as a,
    ):
        async with pool.sandbox("t") as sbx:
            shutil.rmtree(workdir(sbx))
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
        async with pool.sandbox("u") as fresh:
            assert (await fresh.run("echo ok")).ok
        assert (await a.run("echo ok")).ok


async def test_an_actions_tmp_and_shm_go_with_it() -> None:
    """A parked sandbox is reserved only its work dir: its action's ``/tmp`` and
    ``/dev/shm`` (tmpfs pages no process owns) must not outlive the action."""
    backend = LocalBackend(memory="512MiB")
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        leaf = sbx._handle._leaf  # type: ignore[attr-defined]
        if leaf is None or leaf.memory is None or backend._bwrap is None:
            pytest.skip(f"no cgroup or no bubblewrap here: {backend.protections.missing}")
        result = await sbx.run(
            "head -c 64M /dev/zero > /tmp/f && head -c 64M /dev/zero > /dev/shm/f", timeout=30
        )
        assert result.ok, result
        stat = dict(line.split() for line in (leaf.memory / "memory.stat").read_text().splitlines())
        held = int(stat.get("total_shmem", stat.get("shmem", "0")))
        assert held < 8 << 20, f"{held >> 20} MiB of the action's files outlived it"
