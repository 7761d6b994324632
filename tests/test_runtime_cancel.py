"""Cancellation and failure at every stage of an action leave no unit held.

The stages: waiting in the queue, granted but not yet resumed, inside the body; the ways
out: cancellation, an exception, a BaseException that is not a cancellation, a wait
timeout. After each, the runtime holds nothing for the action, its ledger still matches
the live grants, and the actions behind it proceed.
"""

from __future__ import annotations

import random

import anyio
import anyio.abc
import pytest
from conftest import after_grant, assert_consistent, assert_idle, held, hold, wait_until

import tangram
from tangram.errors import TangramError, WaitTimeoutError

pytestmark = pytest.mark.anyio


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt: not an Exception, not a cancellation."""


async def test_cancel_while_waiting_leaves_the_queue_and_others_proceed() -> None:
    order: list[str] = []
    scopes: dict[str, anyio.CancelScope] = {}

    async def waiter(runtime: tangram.Runtime, name: str) -> None:
        with anyio.CancelScope() as scopes[name]:
            async with runtime.acquire(cpu=1, kind=name):
                order.append(name)

    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=1)
            for i, name in enumerate("abcd"):
                tg.start_soon(waiter, runtime, name)
                await wait_until(lambda i=i: runtime.stats().waiting == i + 1)
            scopes["b"].cancel()
            scopes["d"].cancel()
            await wait_until(lambda: runtime.stats().waiting == 2)
            assert_consistent(runtime)
            release.set()
        assert order == ["a", "c"]
        kinds = runtime.stats().kinds
        assert (kinds["b"].cancelled, kinds["b"].completed) == (1, 0)
        assert (kinds["c"].cancelled, kinds["c"].completed) == (0, 1)
        assert_idle(runtime)


async def test_cancelling_a_blocked_head_lets_the_ones_behind_it_start() -> None:
    """The head's reservation goes with it: a small action behind it starts at once."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=3)
            started = anyio.Event()
            head_scope = anyio.CancelScope()

            async def head() -> None:
                with head_scope:
                    async with runtime.acquire(cpu=4, kind="head"):
                        pytest.fail("the head ran")  # pragma: no cover

            async def small() -> None:
                async with runtime.acquire(cpu=1, kind="small", estimate=1000.0):
                    started.set()

            tg.start_soon(head)
            await wait_until(lambda: runtime.stats().waiting == 1)
            tg.start_soon(small)
            await wait_until(lambda: runtime.stats().waiting == 2)
            # The small action fits in the free unit, but it would run long past the
            # moment the head can start, so it waits behind the head.
            assert not started.is_set()
            head_scope.cancel()
            await started.wait()
            release.set()
        assert runtime.stats().kinds["head"].cancelled == 1
        assert runtime.stats().kinds["small"].completed == 1
        assert_idle(runtime)


async def test_granted_then_cancelled_before_resuming_releases() -> None:
    """The grant and the cancellation land in the same tick: the units come back."""
    ran: list[str] = []
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def waiter() -> None:
                with scope:
                    async with runtime.acquire(cpu=1, kind="raced"):
                        ran.append("body")
                        await anyio.sleep_forever()

            release = anyio.Event()
            admitted_and_cancelled = anyio.Event()

            async def holder() -> None:
                async with runtime.acquire(cpu=1, kind="holder"):
                    await release.wait()

            def cancel() -> None:
                # Inside the pass that granted the unit: the waiter has not run yet.
                assert runtime.stats().waiting == 0
                scope.cancel()
                admitted_and_cancelled.set()

            tg.start_soon(holder)
            await wait_until(lambda: held(runtime) == 1)
            tg.start_soon(waiter)
            await wait_until(lambda: runtime.stats().waiting == 1)
            after_grant(runtime, 1, cancel)
            release.set()
            await admitted_and_cancelled.wait()
        # Whether the body got to start depends on the backend; either way it did not
        # get past its first checkpoint and gave the unit back.
        assert ran in ([], ["body"])
        stats = runtime.stats()
        assert stats.kinds["raced"].cancelled == 1
        assert stats.kinds["raced"].completed == 0
        assert_idle(runtime)
        # The runtime is not wedged: the unit can be granted again at once.
        with anyio.fail_after(5):
            async with runtime.acquire(cpu=1):
                pass


async def test_cancel_inside_the_body_releases() -> None:
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        with anyio.CancelScope() as scope:
            async with runtime.acquire(cpu=2, kind="body") as lease:
                assert held(runtime) == 2
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert not lease.active
        assert runtime.stats().kinds["body"].cancelled == 1
        assert_idle(runtime)


async def test_exception_inside_the_body_releases_and_propagates() -> None:
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        with pytest.raises(ZeroDivisionError):
            async with runtime.acquire(cpu=tangram.Elastic(1, 2), kind="div"):
                assert held(runtime) == 2
                _ = 1 / 0
        kind = runtime.stats().kinds["div"]
        assert (kind.failed, kind.completed, kind.cancelled) == (1, 0, 0)
        assert_idle(runtime)


@pytest.mark.parametrize("error", [Interrupt, KeyboardInterrupt])
async def test_base_exception_inside_the_body_releases(error: type[BaseException]) -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        with pytest.raises(error):
            async with runtime.acquire(cpu=1, kind="interrupted"):
                raise error
        assert runtime.stats().kinds["interrupted"].cancelled == 1
        assert_idle(runtime)


async def test_wait_timeout_raises_and_leaves_nothing_behind() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=1)
            with pytest.raises(WaitTimeoutError) as info:
                async with runtime.acquire(cpu=1, kind="impatient", wait_timeout=0.05):
                    pytest.fail("granted while held")  # pragma: no cover
            assert isinstance(info.value, TimeoutError)
            assert isinstance(info.value, TangramError)
            assert "0.05" in str(info.value)
            stats = runtime.stats()
            assert stats.waiting == 0
            assert stats.kinds["impatient"].cancelled == 1
            assert held(runtime) == 1
            # The timed-out action does not linger: the next one gets the unit.
            done = anyio.Event()

            async def patient() -> None:
                async with runtime.acquire(cpu=1, kind="patient", wait_timeout=60):
                    done.set()

            tg.start_soon(patient)
            await wait_until(lambda: runtime.stats().waiting == 1)
            release.set()
            await done.wait()
        assert_idle(runtime)


async def test_zero_wait_timeout_means_only_if_free_now() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with runtime.acquire(cpu=1, wait_timeout=0) as lease:
            assert lease.active
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=1)
            with pytest.raises(WaitTimeoutError):
                async with runtime.acquire(cpu=1, wait_timeout=0):
                    pytest.fail("granted while held")  # pragma: no cover
            release.set()
        assert_idle(runtime)


async def test_zero_wait_timeout_is_granted_where_the_decision_would_wait_for_a_pass() -> None:
    """A demand the runtime decides in one pass at the end of the loop iteration (an
    elastic one that is not resizable, or any while others wait) was refused with every
    unit it asked for free: the zero wait ran out before that pass."""
    async with tangram.Runtime(capacity={"cpu": 4, "gpu": 1}) as runtime:
        async with runtime.acquire(cpu=tangram.Elastic(1, 2), wait_timeout=0) as lease:
            assert lease.units == 2
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, gpu=1)
            tg.start_soon(_acquire_gpu, runtime)
            await wait_until(lambda: runtime.stats().waiting == 1)
            async with runtime.acquire(cpu=1, wait_timeout=0) as lease:
                assert lease.active
            release.set()
        assert_idle(runtime)


async def _acquire_gpu(runtime: tangram.Runtime) -> None:
    async with runtime.acquire(gpu=1):
        pass


async def test_zero_wait_timeout_while_holding_it_oneself_is_a_plain_no() -> None:
    """ "Only if free now" is a fair question while holding: the answer is no, as a
    WaitTimeoutError (its cause says why), not the SelfDeadlockError of a wait without
    a timeout."""
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with runtime.acquire(cpu=1):
            with pytest.raises(WaitTimeoutError) as info:
                async with runtime.acquire(cpu=1, wait_timeout=0):
                    pytest.fail("granted while held")  # pragma: no cover
            assert isinstance(info.value.__cause__, tangram.errors.SelfDeadlockError)
        assert_idle(runtime)


async def test_outer_timeout_while_waiting_is_not_a_wait_timeout() -> None:
    """``fail_after`` around acquire raises its own TimeoutError, not WaitTimeoutError."""
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, cpu=1)
            with pytest.raises(TimeoutError) as info:
                with anyio.fail_after(0.02):
                    async with runtime.acquire(cpu=1, wait_timeout=60):
                        pytest.fail("granted while held")  # pragma: no cover
            assert not isinstance(info.value, WaitTimeoutError)
            assert runtime.stats().waiting == 0
            release.set()
        assert_idle(runtime)


async def test_cancellation_storm() -> None:
    """Hundreds of actions, a third cancelled at random while waiting or running."""
    rng = random.Random(1234)
    capacity = 6
    count = 240
    outcomes: dict[str, int] = {"done": 0, "cancelled": 0}
    overcommitted: list[float] = []
    async with tangram.Runtime(capacity={"cpu": capacity}) as runtime:
        scopes: list[anyio.CancelScope] = []
        gate = anyio.Event()

        async def action(i: int, scope: anyio.CancelScope) -> None:
            demand: object = tangram.Elastic(1, 3, resizable=True) if i % 2 else 1 + i % 3
            with scope:
                async with runtime.acquire(cpu=demand, kind="storm", estimate=0.01 * (i % 7 + 1)):
                    now_held = held(runtime)
                    if now_held > capacity + 1e-9:
                        overcommitted.append(now_held)
                    await gate.wait()
                    for _ in range(i % 4):
                        await anyio.lowlevel.checkpoint()
                outcomes["done"] += 1
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1

        async with anyio.create_task_group() as tg:
            for i in range(count):
                scope = anyio.CancelScope()
                scopes.append(scope)
                tg.start_soon(action, i, scope)
            await wait_until(lambda: runtime.stats().waiting + runtime.stats().running == count)
            victims = rng.sample(range(count), count // 3)
            for n, victim in enumerate(victims):
                scopes[victim].cancel()
                if n == len(victims) // 2:
                    gate.set()  # the rest are cancelled while others finish and start
                if n % 5 == 0:
                    await anyio.lowlevel.checkpoint()
                    assert_consistent(runtime)
        assert outcomes["done"] + outcomes["cancelled"] == count
        assert outcomes["cancelled"] >= 1
        assert overcommitted == []
        kind = runtime.stats().kinds["storm"]
        assert kind.completed + kind.cancelled == count
        assert kind.completed == outcomes["done"]
        assert_idle(runtime)
