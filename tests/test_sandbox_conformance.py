"""One contract, every backend: what a sandbox backend promises, through the public API.

Each test runs on the in-memory backend (:class:`tangram.testing.MemoryBackend`), the
embedded local backend and Docker, always through ``tangram.SandboxPool`` inside a
``tangram.Runtime``, so a backend is held to what rollout code sees, not to its own
internals. A new backend joins with a :class:`Subject` in the ``subject`` fixture and
passes these before its name goes into the registry (docs/sandboxes.md, "Adding a
backend").

The in-memory backend is a stand-in for tests: it runs no process. :func:`mini_shell`, its
handler, answers the few shell lines this suite runs (``echo``, ``cat``, ``touch``,
``sleep``, ``nproc``, ``exit``, ``>`` and ``>&2``) on the sandbox's dict of files the way
``sh`` would, sees the cores the pool applied, and stops a ``sleep`` at the action's
timeout, so the same assertions hold for it and mean the same thing.

What a test must do from outside a sandbox (see that a running command reached a point,
make a sandbox die as its real form dies, count the sandboxes that exist) differs per
backend and lives in its :class:`Subject`; the assertions are shared. Docker skips where
there is no daemon or test image, never on CI (``tests/sandbox_docker/docker_support.py``).
Everything runs on asyncio only: Docker's client needs it, and the contract is the
backend's, not the event loop's (``tests/test_sandbox_local.py`` covers trio).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

import tangram
from tangram._sandbox._backend import ExecRequest, ExecResult, RunResult, SandboxBackend
from tangram._sandbox._pool import Sandbox
from tangram.errors import SandboxBrokenError, SandboxClosedError
from tangram.testing import MemoryBackend, MemorySandbox, check_idle

pytestmark = pytest.mark.anyio

CORES = tuple(sorted(os.sched_getaffinity(0)))[:2]
"""What each backend lends: two cores, so two actions can run side by side."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the in-memory backend's shell ------------------------------------------------------


async def mini_shell(sandbox: MemorySandbox, request: ExecRequest) -> ExecResult:
    """``sh -c LINE`` (statements split on ``;``) or an argv, on ``sandbox.files``."""
    if request.argv[:2] == ("/bin/sh", "-c"):
        statements = [shlex.split(part) for part in request.argv[2].split(";")]
    else:
        statements = [list(request.argv)]
    out: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
    code: int | None = 0
    with anyio.move_on_after(request.timeout) as deadline:
        for words in statements:
            words = [request.env.get(w[1:], "") if w.startswith("$") else w for w in words]
            if not words:
                continue
            stream, path = 1, None
            if words[-1:] == [">&2"]:
                stream, words = 2, words[:-1]
            elif words[-2:-1] == [">"]:
                path, words = words[-1], words[:-2]
            if words[0] == "exit":
                code = int(words[1])
                break
            code, text, error = await _statement(sandbox, request, words)
            if path is not None:
                sandbox.files[path] = text
            else:
                out[stream] += text
            out[2] += error
    limit = request.output_limit
    return ExecResult(
        exit_code=None if deadline.cancelled_caught else code,
        stdout=bytes(out[1][:limit]),
        stderr=bytes(out[2][:limit]),
        stdout_truncated=len(out[1]) > limit,
        stderr_truncated=len(out[2]) > limit,
        timed_out=deadline.cancelled_caught,
        signal=9 if deadline.cancelled_caught else None,
    )


async def _statement(
    sandbox: MemorySandbox, request: ExecRequest, words: list[str]
) -> tuple[int, bytes, bytes]:
    """One command: its exit status, stdout and stderr."""
    command, *args = words
    if command == "echo":
        return 0, (" ".join(args) + "\n").encode(), b""
    if command == "cat" and not args:
        return 0, request.stdin, b""
    if command == "cat":
        if args[0] not in sandbox.files:
            return 1, b"", f"cat: {args[0]}: No such file or directory\n".encode()
        return 0, sandbox.files[args[0]], b""
    if command == "touch":
        sandbox.files.setdefault(args[0], b"")
        return 0, b"", b""
    if command == "sleep":
        await anyio.sleep(float(args[0]))
        return 0, b"", b""
    if command == "nproc":
        return 0, f"{len(sandbox.cores)}\n".encode(), b""
    if command == "true":
        return 0, b"", b""
    return 127, b"", f"sh: 1: {command}: not found\n".encode()


# -- the backends under test -------------------------------------------------------------


@attrs.frozen
class Subject:
    """One backend, and what the suite does to its sandboxes from outside."""

    make: Callable[[], SandboxBackend]
    #: whether the command running in the sandbox has created ``ready`` in its work dir.
    ready: Callable[[Sandbox], Awaitable[bool]]
    #: make the sandbox die as its real form dies (a container killed, a work dir gone).
    kill: Callable[[Sandbox], Awaitable[None]]
    #: how many of this subject's sandboxes exist now.
    live: Callable[[], Awaitable[int]]


def _memory() -> Subject:
    made: list[MemoryBackend] = []

    def make() -> MemoryBackend:
        made.append(MemoryBackend(mini_shell, cores=2))
        return made[-1]

    def handle(sbx: Sandbox) -> MemorySandbox:
        found = sbx._handle
        assert isinstance(found, MemorySandbox)
        return found

    async def ready(sbx: Sandbox) -> bool:
        return "ready" in handle(sbx).files

    async def kill(sbx: Sandbox) -> None:
        handle(sbx).broken = True

    async def live() -> int:
        return sum(not s.destroyed for backend in made for s in backend.sandboxes)

    return Subject(make, ready, kill, live)


def _local_root() -> Path:
    """Where the local backend makes its work dirs: a directory of the test's own, so what
    it leaves there can be counted."""
    root = Path(tempfile.mkdtemp(prefix="tangram-conformance-"))
    root.chmod(0o755)  # sandbox commands run as users of their own when we are root
    return root


def _local(root: Path) -> Subject:
    def workdir(sbx: Sandbox) -> Path:
        path = sbx._handle.workdir  # type: ignore[attr-defined]
        assert isinstance(path, Path)
        return path

    async def ready(sbx: Sandbox) -> bool:
        return await anyio.Path(workdir(sbx) / "ready").exists()

    async def kill(sbx: Sandbox) -> None:
        shutil.rmtree(workdir(sbx))

    async def live() -> int:
        return len([box async for box in anyio.Path(root).glob("tangram-sbx-*")])

    return Subject(lambda: tangram.LocalBackend(cores=CORES, root=root), ready, kill, live)


async def _docker() -> Subject:
    from sandbox_docker.docker_support import aiodocker, config, ensure_docker

    from tangram._sandbox._docker._reaper import PID

    await ensure_docker()

    def container(sbx: Sandbox) -> Any:
        return sbx._handle.container  # type: ignore[attr-defined]

    async def ready(sbx: Sandbox) -> bool:
        try:
            probe = await container(sbx).exec(["sh", "-c", "test -e /work/ready"], user="65534")
            async with probe.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass
            info = await probe.inspect()
        except Exception:  # the container is busy starting the command: look again
            return False
        return bool(info.get("ExitCode") == 0)

    async def kill(sbx: Sandbox) -> None:
        await container(sbx).kill()

    async def live() -> int:
        client = aiodocker.Docker()
        try:
            mine = {"label": [f"{PID}={os.getpid()}"]}
            return len(await client.containers.list(all=True, filters=mine))
        finally:
            await client.close()

    url = os.environ.get("DOCKER_HOST", "")
    return Subject(
        lambda: tangram.DockerBackend(config=config(), cores={url: CORES}), ready, kill, live
    )


@pytest.fixture(params=["memory", "local", "docker"])
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    if request.param == "memory":
        yield _memory()
    elif request.param == "docker":
        yield await _docker()
    else:
        root = _local_root()
        try:
            yield _local(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def pool_of(
    subject: Subject, **options: Any
) -> AsyncIterator[tuple[tangram.SandboxPool, tangram.Runtime]]:
    """A pool on a fresh backend, a runtime of its cores around it; nothing left after."""
    async with (
        tangram.SandboxPool(subject.make(), **options) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
    ):
        yield pool, runtime
        check_idle(runtime)
    assert await subject.live() == 0


def record_grants(sbx: Sandbox) -> list[tuple[tuple[int, ...], float]]:
    """Every grant the pool applies to ``sbx`` from now on, and ``((), 0.0)`` per park."""
    handle = sbx._handle
    seen: list[tuple[tuple[int, ...], float]] = []
    apply, park = handle.apply, handle.park

    async def recorded_apply(cores: tuple[int, ...], quota: float) -> None:
        seen.append((tuple(cores), quota))
        await apply(cores, quota)

    async def recorded_park() -> None:
        seen.append(((), 0.0))
        await park()

    handle.apply = recorded_apply  # type: ignore[method-assign]
    handle.park = recorded_park  # type: ignore[method-assign]
    return seen


async def until_ready(subject: Subject, sbx: Sandbox) -> None:
    """Wait for the running command to create ``ready``, seen from outside the sandbox.

    The command runs elsewhere (a process, a container): there is no event to wait on.
    """
    with anyio.fail_after(20):
        while not await subject.ready(sbx):  # noqa: ASYNC110
            await anyio.sleep(0.01)


# -- the contract --------------------------------------------------------------------------


async def test_a_commands_output_and_exit_status_come_back(subject: Subject) -> None:
    async with pool_of(subject) as (pool, _), pool.sandbox("t") as sbx:
        result = await sbx.run("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
        assert not result.ok and not result.timed_out and not result.truncated
        assert (await sbx.run("true")).ok
        assert (await sbx.run(["cat"], stdin="fed")).stdout == b"fed"
        assert (await sbx.run("echo $X", env={"X": "y"})).stdout == b"y\n"
        assert (await sbx.run(["/no/such/program"])).exit_code == 127


async def test_output_is_capped_at_the_pools_limit(subject: Subject) -> None:
    async with pool_of(subject, output_limit=8) as (pool, _), pool.sandbox("t") as sbx:
        result = await sbx.run("echo 0123456789; echo abcdefghij >&2")
        assert (result.stdout, result.stderr) == (b"01234567", b"abcdefgh")
        assert result.stdout_truncated and result.stderr_truncated and result.ok


async def test_files_put_are_read_back_and_a_missing_one_raises(subject: Subject) -> None:
    async with pool_of(subject) as (pool, _), pool.sandbox("t") as sbx:
        await sbx.put("dir/data.bin", b"\x00\xff")
        assert await sbx.get("dir/data.bin") == b"\x00\xff"
        await sbx.put("note.txt", "text")
        assert (await sbx.run("cat note.txt")).stdout == b"text"
        await sbx.run("echo made > made.txt")
        assert await sbx.get("made.txt") == b"made\n"
        await sbx.put("made.txt", b"replaced")
        assert await sbx.get("made.txt") == b"replaced"
        with pytest.raises(FileNotFoundError):
            await sbx.get("missing.txt")
        missing = await sbx.run("cat missing.txt")
        assert missing.exit_code != 0 and b"missing.txt" in missing.stderr
        assert (await sbx.run("echo still")).stdout == b"still\n"


async def test_state_persists_in_a_sandbox_and_never_reaches_another(subject: Subject) -> None:
    async with pool_of(subject) as (pool, _), pool.sandbox("one") as one:
        await one.run("echo kept > state.txt")
        await one.put("put.txt", b"mine")
        async with pool.sandbox("two") as two:
            assert (await two.run("cat state.txt")).exit_code != 0
            with pytest.raises(FileNotFoundError):
                await two.get("put.txt")
            await two.run("echo other > state.txt")
            assert (await two.run("cat state.txt")).stdout == b"other\n"
        assert (await one.run("cat state.txt")).stdout == b"kept\n"
        assert await one.get("put.txt") == b"mine"


async def test_a_timeout_kills_the_command_and_is_a_result(subject: Subject) -> None:
    async with pool_of(subject) as (pool, runtime), pool.sandbox("t") as sbx:
        result = await sbx.run("echo started; sleep 1; touch late", timeout=0.3)
        assert result.timed_out and result.exit_code is None and not result.ok
        assert result.exec_seconds < 5
        check_idle(runtime)
        await anyio.sleep(1.2)  # past the point the command would have reached
        with pytest.raises(FileNotFoundError):
            await sbx.get("late")
        assert (await sbx.run("echo next")).stdout == b"next\n"


async def test_the_cores_granted_are_the_cores_applied(subject: Subject) -> None:
    async with pool_of(subject) as (pool, _), pool.sandbox("t") as sbx:
        host = set(sbx.host.cores)
        for cpu in (len(CORES), 1):
            grants = record_grants(sbx)
            result = await sbx.run("echo $TANGRAM_CPUS; nproc", cpu=cpu)
            assert result.stdout == f"{cpu}\n{cpu}\n".encode(), result
            assert result.units == len(result.cores) == len(set(result.cores)) == cpu
            assert set(result.cores) <= host
            # Applied for the action, parked after it: allocate-on-execution.
            assert grants == [(result.cores, float(cpu)), ((), 0.0)]


async def test_an_elastic_grant_is_resized_while_the_command_runs(subject: Subject) -> None:
    if len(CORES) < 2:
        pytest.skip("needs two cores")
    async with (
        pool_of(subject) as (pool, _),
        pool.sandbox("a") as a,
        pool.sandbox("b") as b,
    ):
        grants = record_grants(a)
        results: dict[str, RunResult] = {}

        async def elastic() -> None:
            cpu = tangram.Elastic(1, 2, resizable=True)
            results["a"] = await a.run("touch ready; sleep 2", cpu=cpu, timeout=30)

        async with anyio.create_task_group() as tg:
            tg.start_soon(elastic)
            await until_ready(subject, a)
            # A rigid newcomer makes the scheduler shrink the elastic action, then give
            # the core back when it is done.
            results["b"] = await b.run("nproc", cpu=1)
        assert results["b"].stdout == b"1\n"
        assert results["a"].ok and results["a"].resizes == 2 and results["a"].max_units == 2
        cores = [applied for applied, _ in grants]
        assert [len(c) for c in cores] == [2, 1, 2, 0], grants
        assert set(cores[1]).isdisjoint(results["b"].cores)


async def test_cancelling_an_action_returns_its_units(subject: Subject) -> None:
    async with pool_of(subject) as (pool, runtime), pool.sandbox("t") as sbx:
        async with anyio.create_task_group() as tg:

            async def victim() -> None:
                await sbx.run("touch ready; sleep 300", timeout=60)

            tg.start_soon(victim)
            await until_ready(subject, sbx)
            tg.cancel_scope.cancel()
        check_idle(runtime)
        assert (await sbx.run("echo next")).stdout == b"next\n"
        assert pool.replaced == 0


async def test_a_sandbox_is_destroyed_when_its_block_ends(subject: Subject) -> None:
    async with pool_of(subject) as (pool, _):
        async with pool.sandbox("t") as sbx:
            await sbx.run("echo kept > state.txt")
            assert await subject.live() == 1
        assert await subject.live() == 0
        with pytest.raises(SandboxClosedError):
            await sbx.run("true")
        with pytest.raises(RuntimeError, match="rollout code failed"):
            async with pool.sandbox("u"):
                raise RuntimeError("rollout code failed")
        assert await subject.live() == 0
    # and a pool's warm sandboxes go with it (checked by pool_of on the way out)
    async with pool_of(subject, warm=1) as (pool, _):
        await pool.wait_warm()
        assert await subject.live() == 1


@pytest.mark.parametrize("found_by", ["run", "get"])
async def test_a_sandbox_that_breaks_is_not_reused(subject: Subject, found_by: str) -> None:
    async with pool_of(subject, warm=1) as (pool, runtime):
        async with pool.sandbox("t") as sbx:
            assert (await sbx.run("echo ok")).ok
            broken = sbx._handle
            await subject.kill(sbx)
            with pytest.raises(SandboxBrokenError):
                if found_by == "run":
                    await sbx.run("true")
                else:
                    await sbx.get("anything")
            check_idle(runtime)
            assert pool.replaced == 1
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
            with pytest.raises(SandboxBrokenError):
                await sbx.put("f", b"")
            with pytest.raises(SandboxBrokenError):
                await sbx.get("f")
        async with pool.sandbox("next") as fresh:
            assert fresh._handle is not broken
            assert (await fresh.run("echo fine")).stdout == b"fine\n"


async def test_a_broken_sandbox_is_gone_when_its_block_ends(subject: Subject) -> None:
    """The pool destroys a broken sandbox in the background as soon as it is found; its
    block still ends only once it is gone, as every sandbox's does."""
    async with pool_of(subject) as (pool, _):
        async with pool.sandbox("t") as sbx:
            assert (await sbx.run("echo ok")).ok
            await subject.kill(sbx)
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
        assert await subject.live() == 0


async def test_a_pool_closed_while_a_broken_sandbox_goes_leaves_nothing(subject: Subject) -> None:
    """The pool's close cancels its background work; a broken sandbox's removal is part of
    it and must finish anyway, or its container is left for a later run's reaper. (The
    pool is entered by hand so that it closes while the sandbox's block is still open.)"""
    async with tangram.Runtime(capacity={"cpu": len(CORES)}) as runtime:
        pool = tangram.SandboxPool(subject.make(), runtime=runtime)
        await pool.__aenter__()
        block = pool.sandbox("t")
        try:
            assert pool.capacity() == {"cpu": len(CORES)}
            sbx = await block.__aenter__()
            handle, remove = sbx._handle, sbx._handle.destroy

            async def slow_remove() -> None:
                await anyio.sleep(0.5)  # a daemon slow to delete: the close comes meanwhile
                await remove()

            handle.destroy = slow_remove  # type: ignore[method-assign]
            await subject.kill(sbx)
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
        finally:
            await pool.aclose()
        await block.__aexit__(None, None, None)
        check_idle(runtime)
    assert await subject.live() == 0


async def test_a_path_with_a_nul_byte_is_the_callers_error(subject: Subject) -> None:
    """A NUL byte in a path (the model's, through a file tool or a SandboxFusion request)
    is a bad argument, typed: the OS's own ``ValueError`` was read as tangram's failure."""
    async with pool_of(subject) as (pool, _), pool.sandbox("t") as sbx:
        for call in (sbx.put("a\0b", b"x"), sbx.get("a\0b")):
            with pytest.raises(tangram.errors.InvalidSettingError, match="NUL"):
                await call
