"""A task's own leases: a demand they make impossible fails at the acquire, not never.

A task that holds ``cpu=3`` of 4 and asks for ``cpu=3`` more cannot be served until it
releases, and it cannot release while it waits (issue 20: it waited forever). That is
certain from the task's own holdings and the capacity, so it is a
:class:`~tangram.errors.SelfDeadlockError` at the call. A wait that other tasks' releases
can end, but that holds units meanwhile, is only a risk: a
:class:`~tangram.errors.DeadlockRiskWarning` (pytest here turns warnings into errors, so
every test that expects none also checks that none is given).
"""

from __future__ import annotations

import warnings

import anyio
import pytest
from conftest import assert_idle, wait_until

import tangram
from tangram.errors import DeadlockRiskWarning, SelfDeadlockError

pytestmark = pytest.mark.anyio


async def test_holding_three_of_four_and_asking_three_more_fails_at_once() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with runtime.acquire(cpu=3) as outer:
            with pytest.raises(SelfDeadlockError) as info:
                async with runtime.acquire(cpu=3, kind="inner"):
                    pytest.fail("granted")
            assert isinstance(info.value, RuntimeError)
            message = str(info.value)
            assert "holds cpu=3 (in 1 lease)" in message
            assert "capacity cpu=4" in message
            assert "asks for cpu=3 more" in message
            assert "'inner'" in message
            # Nothing of the refused demand was queued; the outer grant is untouched.
            assert outer.active
            assert runtime.stats().waiting == 0
            assert runtime.stats().resources["cpu"].held == 3
        assert_idle(runtime)
        assert runtime._holders == {}


async def test_a_fixed_elastic_grant_counts_at_what_it_got() -> None:
    """``Elastic(1, 4)`` alone gets all 4 and never gives any back while it runs."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with runtime.acquire(cpu=tangram.Elastic(1, 4)) as outer:
            assert outer.units == 4
            with pytest.raises(SelfDeadlockError, match=r"holds cpu=4 .* asks for cpu=1"):
                async with runtime.acquire(cpu=1):
                    pytest.fail("granted")
        assert_idle(runtime)


async def test_a_resizable_grant_counts_at_its_minimum() -> None:
    """The policy shrinks a resizable grant to make room, so only its ``min`` is held."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        demand = tangram.Elastic(2, 4, resizable=True)
        async with runtime.acquire(cpu=demand, estimate=100.0) as outer:
            assert outer.units == 4
            with pytest.raises(SelfDeadlockError, match=r"holds cpu=2 "):
                async with runtime.acquire(cpu=3):
                    pytest.fail("granted")
            async with runtime.acquire(cpu=2) as inner:  # 2 + 2 fit: outer shrinks
                assert inner.active
                assert outer.units == 2
        assert_idle(runtime)


async def test_sizes_are_shown_in_their_units() -> None:
    async with tangram.Runtime(capacity={"cpu": 8, "mem": "16GiB"}) as runtime:
        async with runtime.acquire(cpu=1, mem="12GiB"):
            with pytest.raises(SelfDeadlockError) as info:
                async with runtime.acquire(cpu=1, mem="8GiB"):
                    pytest.fail("granted")
        message = str(info.value)
        assert "mem=12GiB" in message
        assert "mem=16GiB" in message
        assert "mem=8GiB" in message
        assert "e+" not in message
        assert_idle(runtime)


async def test_several_own_leases_add_up() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with runtime.acquire(cpu=1), runtime.acquire(cpu=2):
            async with runtime.acquire(cpu=1):  # 4 of 4: fits exactly
                pass
            with pytest.raises(SelfDeadlockError, match=r"holds cpu=3 \(in 2 leases\)"):
                async with runtime.acquire(cpu=2):
                    pytest.fail("granted")
        assert_idle(runtime)


async def test_after_release_the_task_holds_nothing() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        for _ in range(3):
            async with runtime.acquire(cpu=3):
                pass
        async with runtime.acquire(cpu=4):
            pass
        assert runtime._holders == {}
        assert_idle(runtime)


async def test_a_refused_inner_acquire_leaves_the_outer_one_countable() -> None:
    """The refusal changes nothing: the same task can still ask for what does fit."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with runtime.acquire(cpu=3):
            with pytest.raises(SelfDeadlockError):
                async with runtime.acquire(cpu=2):
                    pytest.fail("granted")
            async with runtime.acquire(cpu=1):
                pass
            with pytest.raises(SelfDeadlockError):
                await runtime.run({"cpu": 2}, anyio.lowlevel.checkpoint)
        assert_idle(runtime)


async def test_a_child_task_is_another_task() -> None:
    """The parent holds 3 of 4 and its child asks for 3: not certain (the parent may
    release before it waits for the child), so the child waits and is served."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        served: list[float] = []

        async def child() -> None:
            async with runtime.acquire(cpu=3) as lease:
                served.append(lease.grant["cpu"])

        async with anyio.create_task_group() as tg, runtime.acquire(cpu=3):
            tg.start_soon(child)
            await wait_until(lambda: runtime.stats().waiting == 1)
        assert served == [3.0]
        assert_idle(runtime)


async def test_leases_of_another_runtime_do_not_count() -> None:
    async with (
        tangram.Runtime(capacity={"cpu": 4}) as first,
        tangram.Runtime(capacity={"cpu": 4}) as second,
    ):
        async with first.acquire(cpu=3), second.acquire(cpu=3) as lease:
            assert lease.active
            with pytest.raises(SelfDeadlockError):
                async with second.acquire(cpu=2):
                    pytest.fail("granted")
        assert_idle(first)
        assert_idle(second)


async def test_rate_budgets_are_not_held() -> None:
    """A rate's units are taken, not held: a second take waits for the refill only."""
    capacity = {"cpu": 4, "search": tangram.Rate(per_second=1000, burst=1)}
    async with tangram.Runtime(capacity=capacity) as runtime:
        async with runtime.acquire(cpu=1, search=1), runtime.acquire(search=1) as lease:
            assert lease.active
        assert_idle(runtime)


async def test_a_wait_that_others_can_end_warns_and_is_served() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        other_holds = anyio.Event()
        release_other = anyio.Event()

        async def other() -> None:
            async with runtime.acquire(cpu=2):
                other_holds.set()
                await release_other.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await other_holds.wait()
            async with runtime.acquire(cpu=1):
                # 1 held + 2 asked fit the capacity, not what is free now (1).
                tg.start_soon(_set_when_waiting, runtime, release_other)
                with pytest.warns(DeadlockRiskWarning, match=r"holds cpu=1 .* waits for cpu=2"):
                    async with runtime.acquire(cpu=2) as inner:
                        assert inner.active
        assert_idle(runtime)


async def _set_when_waiting(runtime: tangram.Runtime, event: anyio.Event) -> None:
    await wait_until(lambda: runtime.stats().waiting == 1)
    event.set()


async def test_no_warning_when_the_demand_fits_now() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        async with runtime.acquire(cpu=1):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                async with runtime.acquire(cpu=3):
                    pass
        assert_idle(runtime)


async def test_the_warning_points_at_the_callers_line() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        holding = anyio.Event()
        done = anyio.Event()

        async def other() -> None:
            async with runtime.acquire(cpu=3):
                holding.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await holding.wait()
            async with runtime.acquire(cpu=1):
                with pytest.warns(DeadlockRiskWarning) as caught:
                    with anyio.move_on_after(0.01):
                        async with runtime.acquire(cpu=1):
                            pytest.fail("granted")
            done.set()
        assert caught[0].filename == __file__
        assert_idle(runtime)


async def test_lowering_the_capacity_fails_a_wait_it_makes_endless() -> None:
    """Cap 8; another task holds 4; this one holds 3 and waits for 3. At a capacity of 5,
    3 + 3 can never fit while it waits: the waiting acquire fails; others wait on."""
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        other_holds = anyio.Event()
        release_other = anyio.Event()
        outcomes: list[str] = []

        async def other() -> None:
            async with runtime.acquire(cpu=4):
                other_holds.set()
                await release_other.wait()

        async def bystander() -> None:
            async with runtime.acquire(cpu=2):  # holds nothing else: only waits
                outcomes.append("bystander served")

        async def nested() -> None:
            async with runtime.acquire(cpu=3):
                try:
                    with pytest.warns(DeadlockRiskWarning):
                        async with runtime.acquire(cpu=3):
                            outcomes.append("nested served")
                except SelfDeadlockError as exc:
                    outcomes.append(str(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await other_holds.wait()
            tg.start_soon(nested)
            await wait_until(lambda: runtime.stats().waiting == 1)
            tg.start_soon(bystander)
            await wait_until(lambda: runtime.stats().waiting == 2)
            runtime.set_capacity(cpu=5)
            await wait_until(lambda: bool(outcomes))
            assert "capacity cpu=5" in outcomes[0]
            assert runtime.stats().waiting == 1  # the bystander still waits
            release_other.set()
        assert outcomes[1:] == ["bystander served"]
        assert_idle(runtime)


async def test_lowering_the_capacity_checks_the_acquire_not_yet_entered() -> None:
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=3):
            context = runtime.acquire(cpu=3)  # built while 3 + 3 <= 8
            runtime.set_capacity(cpu=5)
            with pytest.raises(SelfDeadlockError, match="capacity cpu=5"):
                async with context:
                    pytest.fail("granted")
        assert_idle(runtime)


async def test_a_lease_leaked_by_a_finished_task_counts_for_no_other_task() -> None:
    """Tasks are told apart by the task object, not ``id(task)``, which a later task
    may reuse: a leaked lease's dead task must not make a newcomer's wait "its own"."""
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        context = runtime.acquire(cpu=3)

        async def leaker() -> None:
            await context.__aenter__()  # and never __aexit__

        causes: list[BaseException | None] = []

        async def asker() -> None:
            with pytest.raises(tangram.errors.WaitTimeoutError) as info:
                async with runtime.acquire(cpu=2, wait_timeout=0):
                    pytest.fail("granted")
            causes.append(info.value.__cause__)

        async with anyio.create_task_group() as tg:
            tg.start_soon(leaker)
        for _ in range(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(asker)
        assert len(causes) == 20
        assert not any(isinstance(cause, SelfDeadlockError) for cause in causes)
        await context.__aexit__(None, None, None)
        assert_idle(runtime)


@pytest.mark.parametrize("order", ["size", "arrival"])
@pytest.mark.parametrize("starved", [True, False], ids=["starved", "head"])
async def test_a_nested_acquire_of_free_units_is_not_held_for_the_one_waiting_on_its_caller(
    order: str, starved: bool
) -> None:
    """T holds ``b`` and asks, inside, for a free ``a`` to finish; X waits for ``a`` and
    ``b``. Kept for X (its reservation as the blocked head, or everything it needs once
    starved past the bound), that ``a`` was never T's: T never gave ``b`` back, X never
    started, with ``a`` idle and no warning, as ``a`` was free (a hostile review).
    An acquire made while holding units is held back by no reservation for another."""
    policy = tangram.ElasticPolicy(order=order, starvation_bound=0.2 if starved else 30.0)  # type: ignore[arg-type]
    # Starved, X's guard is the whole of ``a``; as the head, the one ``a`` is its.
    capacity = {"a": 2 if starved else 1, "b": 1}
    got: list[str] = []
    async with tangram.Runtime(capacity, policy=policy) as runtime:

        async def t() -> None:
            async with runtime.acquire(b=1, kind="outer", estimate=0.01):
                await wait_until(lambda: runtime.stats().waiting == 1)
                await anyio.sleep(0.5 if starved else 0.0)
                async with runtime.acquire(a=1, kind="inner", estimate=10.0):
                    got.append("inner")

        async def x() -> None:
            async with runtime.acquire(a=1, b=1, kind="x"):
                got.append("x")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t)
                await wait_until(lambda: runtime.stats().running == 1)
                tg.start_soon(x)
        assert got == ["inner", "x"]
        assert_idle(runtime)
