"""Entering and leaving a Runtime: the current runtime, closing, and ``Runtime.run``."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from conftest import assert_idle, wait_until

import tangram
from tangram.errors import NoCurrentRuntimeError, RuntimeClosedError

pytestmark = pytest.mark.anyio


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt: not an Exception, not a cancellation."""


async def test_runtime_is_current_in_body_and_child_tasks() -> None:
    seen: list[tangram.Lease] = []
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        assert tangram.current_runtime() is runtime

        async def child() -> None:
            assert tangram.current_runtime() is runtime
            async with tangram.acquire(cpu=1) as lease:
                seen.append(lease)
                assert lease.active

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
            tg.start_soon(child)
        assert len(seen) == 2
        assert_idle(runtime)
    with pytest.raises(NoCurrentRuntimeError):
        tangram.current_runtime()


def test_acquire_outside_any_runtime_fails_at_the_call() -> None:
    with pytest.raises(NoCurrentRuntimeError, match=r"async with tangram\.Runtime"):
        tangram.acquire(cpu=1)
    with pytest.raises(NoCurrentRuntimeError):
        tangram.current_runtime()


async def test_acquire_in_a_loop_but_outside_the_runtime_fails() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    with pytest.raises(NoCurrentRuntimeError):
        tangram.acquire(cpu=1)
    async with runtime:
        pass
    with pytest.raises(NoCurrentRuntimeError):
        tangram.acquire(cpu=1)


async def test_tasks_started_before_the_runtime_do_not_see_it() -> None:
    """The current runtime is a context variable: only tasks started inside inherit it."""
    go = anyio.Event()
    outcome: list[str] = []

    async def early() -> None:
        await go.wait()
        try:
            tangram.acquire(cpu=1)
        except NoCurrentRuntimeError:
            outcome.append("none")

    async with anyio.create_task_group() as tg:
        tg.start_soon(early)
        async with tangram.Runtime(capacity={"cpu": 1}):
            go.set()
            await wait_until(lambda: bool(outcome))
    assert outcome == ["none"]


async def test_nested_runtimes_restore_the_outer_one() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as outer:
        async with tangram.Runtime(capacity={"gpu": 1}) as inner:
            assert tangram.current_runtime() is inner
            async with tangram.acquire(gpu=1):
                assert inner.stats().resources["gpu"].held == 1
        assert tangram.current_runtime() is outer
        async with tangram.acquire(cpu=1):
            assert outer.stats().resources["cpu"].held == 1


async def test_entering_twice_raises_runtime_closed() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    async with runtime:
        with pytest.raises(RuntimeClosedError, match="entered once"):
            async with runtime:
                pytest.fail("entered a running runtime again")  # pragma: no cover
        # The failed second entry did not disturb the first.
        assert tangram.current_runtime() is runtime
        async with runtime.acquire(cpu=1):
            pass
    with pytest.raises(RuntimeClosedError):
        async with runtime:
            pytest.fail("reopened a closed runtime")  # pragma: no cover


async def test_acquire_before_entering_and_after_closing_raises() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    context = runtime.acquire(cpu=1)  # building the request needs no running runtime
    with pytest.raises(RuntimeClosedError, match="new"):
        async with context:
            pytest.fail("granted by a runtime that never ran")  # pragma: no cover
    async with runtime:
        pass
    with pytest.raises(RuntimeClosedError, match="closed"):
        async with runtime.acquire(cpu=1):
            pytest.fail("granted by a closed runtime")  # pragma: no cover
    with pytest.raises(RuntimeClosedError):
        await runtime.run({"cpu": 1}, anyio.sleep, 0)
    assert_idle(runtime)


async def test_waiters_at_close_get_runtime_closed_and_holders_keep_units() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    events: list[str] = []
    holding = anyio.Event()
    finish = anyio.Event()

    async def holder() -> None:
        async with runtime.acquire(cpu=1, kind="holder") as lease:
            holding.set()
            await finish.wait()
            events.append(f"holder active={lease.active}")

    async def waiter(name: str) -> None:
        try:
            async with runtime.acquire(cpu=1, kind="waiter"):
                events.append(f"{name} ran")  # pragma: no cover
        except RuntimeClosedError:
            events.append(f"{name} closed")

    # The task group outlives the runtime, so its tasks are still there when it closes.
    async with anyio.create_task_group() as tg:
        async with runtime:
            tg.start_soon(holder)
            await holding.wait()
            tg.start_soon(waiter, "a")
            tg.start_soon(waiter, "b")
            await wait_until(lambda: runtime.stats().waiting == 2)
        await wait_until(lambda: len(events) == 2)
        assert sorted(events) == ["a closed", "b closed"]
        stats = runtime.stats()
        assert stats.waiting == 0
        assert stats.resources["cpu"].held == 1  # a running action keeps its units
        assert stats.kinds["waiter"].cancelled == 2
        finish.set()
    assert events[-1] == "holder active=True"
    assert_idle(runtime)
    assert runtime.stats().kinds["holder"].completed == 1


async def test_body_exception_propagates_unwrapped() -> None:
    """An error raised in the body is not turned into an ExceptionGroup by the runtime."""
    with pytest.raises(ValueError, match="boom") as info:
        async with tangram.Runtime(capacity={"cpu": 1}) as runtime, runtime.acquire(cpu=1):
            raise ValueError("boom")
    assert type(info.value) is ValueError
    assert_idle(runtime)
    with pytest.raises(Interrupt):
        async with tangram.Runtime(capacity={"cpu": 1}):
            raise Interrupt


async def test_outer_cancellation_closes_the_runtime() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    with anyio.CancelScope() as scope:
        async with runtime, runtime.acquire(cpu=1):
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert_idle(runtime)
    assert runtime.stats().kinds["action"].cancelled == 1
    assert "closed" in repr(runtime)


async def test_repr_names_state_and_capacity() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 2, "mem": "1KiB"})
    assert repr(runtime) == "<tangram.Runtime new capacity={'cpu': 2.0, 'mem': 1024.0}>"
    async with runtime:
        assert repr(runtime).startswith("<tangram.Runtime running ")
    assert repr(runtime).startswith("<tangram.Runtime closed ")


async def test_run_returns_the_result_and_releases() -> None:
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:

        async def work(a: int, b: int) -> int:
            assert runtime.stats().resources["cpu"].held == 2
            await anyio.lowlevel.checkpoint()
            return a + b

        assert await runtime.run({"cpu": 2}, work, 2, 3, kind="add") == 5
        assert_idle(runtime)

        async def broken() -> None:
            raise KeyError("nope")

        with pytest.raises(KeyError):
            await runtime.run({"cpu": 1}, broken, kind="broken")
        assert_idle(runtime)
        kinds = runtime.stats().kinds
        assert (kinds["add"].completed, kinds["add"].failed) == (1, 0)
        assert (kinds["broken"].completed, kinds["broken"].failed) == (0, 1)
        with pytest.raises(TypeError, match="fn"):
            await runtime.run({"cpu": 1}, "not callable")  # type: ignore[arg-type]


async def test_acquire_context_is_entered_once() -> None:
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        context = runtime.acquire(cpu=1, kind="tool", trajectory="t1")
        assert context.action.kind == "tool"
        assert context.action.trajectory == "t1"
        assert dict(context.action.demand.minimum) == {"cpu": 1.0}
        async with context:
            pass
        with pytest.raises(RuntimeError, match="once"):
            async with context:
                pytest.fail("entered twice")  # pragma: no cover
        assert_idle(runtime)


async def test_fcfs_on_every_backend() -> None:
    """Rigid equal demands on one unit are granted in arrival order."""
    order: list[int] = []
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            gate = anyio.Event()

            async def first() -> None:
                async with runtime.acquire(cpu=1):
                    await gate.wait()

            async def action(i: int) -> None:
                async with runtime.acquire(cpu=1):
                    order.append(i)
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(first)
            await wait_until(lambda: runtime.stats().running == 1)
            for i in range(10):
                tg.start_soon(action, i)
                await wait_until(lambda i=i: runtime.stats().waiting == i + 1)
            gate.set()
        assert order == list(range(10))
        assert_idle(runtime)


async def test_capacity_set_before_entering_is_used() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    runtime.set_capacity(cpu=3)
    async with runtime, runtime.acquire(cpu=3) as lease:
        assert dict(lease.grant) == {"cpu": 3.0}
    assert_idle(runtime)


@pytest.mark.slow
async def test_rate_paces_calls_in_real_time() -> None:
    """The timer wakes waiters as a rate refills, on a real clock (wide margins)."""
    async with tangram.Runtime(capacity={"api": tangram.Rate(20, burst=1)}) as runtime:
        start = anyio.current_time()
        with anyio.fail_after(30):
            for _ in range(5):
                async with runtime.acquire(api=1):
                    pass
        elapsed = anyio.current_time() - start
    # Four refills of 1/20 s after the first call: at least 0.2 s, and never a hang.
    assert 0.19 <= elapsed < 10
