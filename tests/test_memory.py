"""The in-memory executors behind ``tangram.testing``: real pools, no processes or models."""

from __future__ import annotations

import anyio
import pytest
from conftest import wait_until

import tangram
from tangram.abc import ExecResult
from tangram.errors import GpuOutOfMemoryError, SandboxBrokenError
from tangram.gpu import Device, GpuPool
from tangram.testing import (
    MemoryBackend,
    MemoryModelService,
    MemorySandbox,
    check_idle,
    memory_sandboxes,
)

pytestmark = pytest.mark.anyio


async def test_grants_reach_the_sandbox_and_files_persist_per_trajectory() -> None:
    def count_files(sandbox: MemorySandbox, request: tangram.abc.ExecRequest) -> ExecResult:
        names = ",".join(sorted(sandbox.files)).encode()
        return ExecResult(exit_code=0, stdout=names, stderr=b"")

    async with memory_sandboxes(count_files, cores=4) as pool:
        async with pool.sandbox("a") as a:
            await a.put("solution.py", "print(1)")
            result = await a.run("ls", cpu=tangram.Elastic(1, 4))
            assert result.stdout == b"solution.py"
            assert result.units == 4 and len(result.cores) == 4
            assert await a.get("solution.py") == b"print(1)"
        async with pool.sandbox("b") as b:
            assert (await b.run("ls", cpu=1)).stdout == b""
        backend = pool.backend
        assert isinstance(backend, MemoryBackend)
        first = backend.sandboxes[0]
        # Applied for the action, parked after it: the pool's allocate-on-execution.
        grants = [applied.cores for applied in first.applied]
        assert grants[-2] == result.cores and grants[-1] == ()
        assert [r.argv[-1] for r in first.requests] == ["ls"]


async def test_a_broken_sandbox_fails_typed_and_returns_its_units() -> None:
    async with memory_sandboxes(cores=2) as pool, pool.sandbox("t") as sbx:
        backend = pool.backend
        assert isinstance(backend, MemoryBackend)
        for sandbox in backend.sandboxes:
            sandbox.broken = True
        with pytest.raises(SandboxBrokenError):
            await sbx.run("true", cpu=2)
        assert tangram.current_runtime().stats().resources["cpu"].held == 0


async def test_an_async_handler_models_a_duration() -> None:
    async def slow(sandbox: MemorySandbox, request: tangram.abc.ExecRequest) -> ExecResult:
        await anyio.sleep(0.01)
        return ExecResult(exit_code=3, stdout=b"", stderr=b"failed")

    async with memory_sandboxes(slow) as pool, pool.sandbox("t") as sbx:
        result = await sbx.run("pytest", cpu=1)
        assert result.exit_code == 3 and not result.ok
        assert result.exec_seconds >= 0.01


async def test_a_handler_returning_something_else_is_a_type_error() -> None:
    async with memory_sandboxes(lambda sandbox, request: "ok") as pool:  # type: ignore[arg-type,return-value]
        async with pool.sandbox("t") as sbx:
            with pytest.raises(TypeError, match="ExecResult"):
                await sbx.run("true")
        check_idle(tangram.current_runtime())


def test_bad_arguments_are_typed() -> None:
    with pytest.raises(ValueError, match="cores"):
        MemoryBackend(cores=0)
    with pytest.raises(TypeError, match="handler"):
        MemoryBackend("not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn"):
        MemoryModelService("judge", 3)  # type: ignore[arg-type]


async def test_model_services_are_restored_and_evicted_least_recently_used() -> None:
    judge = MemoryModelService("judge", lambda batch: [x * 2 for x in batch], memory="1GiB")
    teacher = MemoryModelService("teacher", len, memory="1GiB")
    pool = GpuPool([judge, teacher], devices=[Device("cpu:0", memory="1GiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        async with pool.use("judge") as svc:
            assert await svc([1, 2]) == [2, 4]
        async with pool.use("teacher") as svc:
            assert await svc([1, 2, 3]) == 3
        async with pool.use("judge") as svc:
            assert await svc([5]) == [10]
        # The replica's task gives its grant back once it sees the last user left.
        await wait_until(lambda: not runtime.stats().running)
        check_idle(runtime)
    kinds = [event[0] for event in judge.events]
    assert kinds[:3] == ["load", "restore", "run"]
    assert kinds.count("evict") >= 1 and kinds.count("restore") == 2
    assert ("restore", 0, ("cpu:0",)) in teacher.events


async def test_an_injected_restore_failure_is_typed_and_holds_nothing() -> None:
    judge = MemoryModelService("judge", memory="1GiB")
    judge.fail_restores = 1
    pool = GpuPool([judge], devices=[Device("cpu:0", memory="2GiB")], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        with pytest.raises(GpuOutOfMemoryError, match="injected"):
            async with pool.use("judge") as svc:
                await svc("x")
        assert runtime.stats().resources["gpu_mem:cpu:0"].held == 0
        async with pool.use("judge") as svc:
            assert await svc("x") == "x"
