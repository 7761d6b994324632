"""tangram.testing: the invariant checker and the pytest plugin catch real violations.

Each violation is made on purpose (a corrupted ledger, a policy that over-grants or
grants outside the elastic range, a lease whose task ended without releasing it) and the
checker must name it; a correct run, including one with a capacity cut below what is
held, must pass clean.
"""

from __future__ import annotations

import textwrap
from typing import Any

import anyio
import pytest

import tangram
from tangram._core._ledger import Ledger
from tangram._core._policy import Plan
from tangram.testing import (
    InvariantChecker,
    InvariantViolation,
    check_idle,
    checked_runtime,
    checker_of,
)

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.anyio


class GreedyPolicy:
    """Admits every waiting action at once, capacity or not, with ``units`` units.

    The ledger refuses such plans (``PolicyError``); the tests that use it to show what
    the checker catches take that check out, standing for a bug that lets one through.
    """

    def __init__(self, units: int = 1) -> None:
        self.units = units

    def plan(self, state: Any) -> Plan:
        return Plan(admits=[(entry, self.units) for entry in state.waiting()])


async def test_a_correct_run_is_clean() -> None:
    async with tangram.Runtime({"cpu": 4, "mem": "1GiB", "api": "100/s"}) as runtime:
        checker = InvariantChecker(runtime, raise_immediately=True)
        async with anyio.create_task_group() as tg:
            for i in range(20):

                async def one(i: int = i) -> None:
                    cpu = tangram.Elastic(1, 4, resizable=True) if i % 2 else 1
                    async with runtime.acquire(cpu=cpu, mem="10MiB", api=1):
                        await anyio.sleep(0.001)

                tg.start_soon(one)
        check_idle(runtime)
        checker.check()
    assert checker.checks > 20 and checker.submitted == 20 == checker.released
    assert checker.accounted() == 20


async def test_a_corrupted_ledger_is_detected() -> None:
    async with tangram.Runtime({"cpu": 4}) as runtime:
        checker = InvariantChecker(runtime)
        async with runtime.acquire(cpu=1):
            runtime._ledger.held["cpu"] += 1  # units held no longer match the grants
            async with runtime.acquire(cpu=1):
                pass
        assert checker.violations
        assert "sum of live grants" in checker.violations[0]
        with pytest.raises(InvariantViolation, match="sum of live grants"):
            checker.verify()
        with pytest.raises(InvariantViolation, match="still holds"):
            check_idle(runtime)
        runtime._ledger.held["cpu"] -= 1


async def test_raise_immediately_points_at_the_call() -> None:
    async with tangram.Runtime({"cpu": 4}) as runtime:
        InvariantChecker(runtime, raise_immediately=True)
        runtime._ledger.held["cpu"] = -1.0
        with pytest.raises(InvariantViolation, match="sum of live grants"):
            runtime.set_capacity(cpu=5)
        runtime._ledger.held["cpu"] = 0.0


def _unchecked(init: Any) -> Any:
    def unchecked(self: Ledger, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._check = None

    return unchecked


@pytest.fixture
def unchecked_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans applied unchecked: a ledger whose own check has a hole."""
    monkeypatch.setattr(Ledger, "__init__", _unchecked(Ledger.__init__))


@pytest.mark.usefixtures("unchecked_plans")
async def test_a_grant_over_capacity_is_detected() -> None:
    async with tangram.Runtime({"cpu": 2}, policy=GreedyPolicy()) as runtime:
        checker = InvariantChecker(runtime)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(runtime.run, {"cpu": 1}, anyio.sleep, 0.001)
        assert any("> capacity 2" in v for v in checker.violations), checker.violations


@pytest.mark.usefixtures("unchecked_plans")
async def test_an_elastic_grant_outside_its_range_is_detected() -> None:
    async with tangram.Runtime({"cpu": 8}, policy=GreedyPolicy(units=5)) as runtime:
        checker = InvariantChecker(runtime)
        async with runtime.acquire(cpu=tangram.Elastic(1, 3)):
            pass
        assert any("outside [1, 3]" in v for v in checker.violations), checker.violations


@pytest.mark.usefixtures("unchecked_plans")
async def test_a_capacity_cut_may_leave_holdings_above_it_but_not_grow_them() -> None:
    async with tangram.Runtime({"cpu": 4}) as runtime:
        checker = InvariantChecker(runtime, raise_immediately=True)
        async with runtime.acquire(cpu=3):
            runtime.set_capacity(cpu=1)  # 3 held > 1: allowed, it drains
            async with anyio.create_task_group() as tg:
                tg.start_soon(runtime.run, {"cpu": 1}, anyio.sleep, 0)
                await anyio.sleep(0.01)
                assert runtime.stats().waiting == 1  # nothing admitted into the cut
                tg.cancel_scope.cancel()
        checker.check()
    # Growing into a cut is caught: force it through the ledger's own admission.
    async with tangram.Runtime({"cpu": 4}, policy=GreedyPolicy()) as runtime:
        checker = InvariantChecker(runtime)
        async with runtime.acquire(cpu=3):
            runtime.set_capacity(cpu=1)
            # From another task: in this one, holding 3 of 1, it is a SelfDeadlockError.
            async with anyio.create_task_group() as tg:
                tg.start_soon(runtime.run, {"cpu": 1}, anyio.sleep, 0)
        assert any("grew to 4" in v for v in checker.violations), checker.violations


async def test_a_lease_that_outlives_its_task_is_detected() -> None:
    async with tangram.Runtime({"cpu": 4}) as runtime:
        checker = InvariantChecker(runtime)
        context = runtime.acquire(cpu=1)

        async def leaker() -> None:
            await context.__aenter__()  # and never __aexit__: the task ends holding it

        async with anyio.create_task_group() as tg:
            tg.start_soon(leaker)
        async with runtime.acquire(cpu=1):  # the next decision sees the orphan
            pass
        with pytest.raises(InvariantViolation, match="outlived the task"):
            checker.check()
        with pytest.raises(InvariantViolation, match="1 leases still registered"):
            check_idle(runtime)
        await context.__aexit__(None, None, None)
        check_idle(runtime)


async def test_detach_restores_the_runtime() -> None:
    async with tangram.Runtime({"cpu": 4}) as runtime:
        checker = InvariantChecker(runtime)
        checker.detach()
        checker.detach()  # twice is harmless
        with pytest.raises(KeyError):
            runtime.remove_instrument(checker)  # no longer attached
        async with runtime.acquire(cpu=1):
            pass
        assert checker.checks == checker.submitted == checker.released == 0


async def test_checked_runtime_checks_idle_at_the_end() -> None:
    async with checked_runtime({"cpu": 2}) as runtime:
        async with runtime.acquire(cpu=1):
            pass
        assert checker_of(runtime).checks > 0
    with pytest.raises(InvariantViolation, match="not idle"):
        async with checked_runtime({"cpu": 2}) as runtime:
            context = runtime.acquire(cpu=1)
            await context.__aenter__()
    with pytest.raises(LookupError):
        checker_of(tangram.Runtime({"cpu": 1}))


def test_the_checker_needs_a_runtime() -> None:
    with pytest.raises(TypeError):
        InvariantChecker(object())  # type: ignore[arg-type]


def test_the_kit_refuses_what_is_not_a_runtime_with_a_tangram_error() -> None:
    """Without the check, ``check_idle(3)`` failed on a missing attribute, naming nothing."""
    from tangram import errors

    for call in (InvariantChecker, checker_of, check_idle):
        with pytest.raises(errors.SettingTypeError, match=r"tangram\.Runtime \(got 3\)"):
            call(3)  # type: ignore[arg-type]
    with pytest.raises(errors.InstrumentNotAttachedError, match="checked_runtime"):
        checker_of(tangram.Runtime({"cpu": 1}))


def test_the_pytest_plugin_gives_checked_runtimes(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest('pytest_plugins = ["tangram.testing"]')
    pytester.makepyfile(
        textwrap.dedent(
            """
            import pytest

            pytestmark = pytest.mark.anyio

            @pytest.fixture
            def anyio_backend():
                return "asyncio"

            async def test_clean(tangram_runtime):
                async with tangram_runtime(capacity={"cpu": 2}) as rt:
                    async with rt.acquire(cpu=1):
                        pass

            async def test_leaves_a_lease(tangram_runtime):
                async with tangram_runtime(capacity={"cpu": 2}) as rt:
                    await rt.acquire(cpu=1).__aenter__()

            async def test_sandboxes_in_memory(tangram_sandboxes):
                import tangram
                async with tangram_sandboxes(cores=2) as pool:
                    async with pool.sandbox("t") as sbx:
                        result = await sbx.run("pytest", cpu=tangram.Elastic(1, 2))
                    assert result.ok and result.units == 2
                    assert pool.backend.sandboxes[0].requests[0].cores == result.cores

            async def test_corrupts(tangram_invariants):
                import tangram
                async with tangram.Runtime({"cpu": 2}) as rt:
                    tangram_invariants(rt)
                    rt._ledger.held["cpu"] = 7.0
                    rt.set_capacity(cpu=3)
                    rt._ledger.held["cpu"] = 0.0
            """
        )
    )
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    output = result.stdout.str()
    assert "runtime not idle: 'cpu' still holds 1 units" in output
    assert "ERROR at teardown of test_corrupts" in output and "sum of live grants" in output
