"""The group gate: a prompt's samples reach the scheduler together, and nothing hangs.

The gate is what the group (GRPO) reward of issue #18 is: verl's reward manager holds
each sample there just before its grant. These tests drive it on a real runtime.
"""

from __future__ import annotations

import contextlib
import random

import anyio
import anyio.lowlevel
import pytest

import tangram
from tangram._runtime._group import Gate
from tangram.errors import InvalidSettingError, SettingTypeError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Plans(tangram.Instrument):
    """Which group each admission was for, and in which loop iteration, in pass order."""

    def __init__(self) -> None:
        self.admitted: list[tuple[str, int]] = []
        self.iteration = 0

    async def tick(self) -> None:
        while True:
            await anyio.lowlevel.checkpoint()
            self.iteration += 1

    def after_plan(self, plan: tangram.abc.Plan, now: float) -> None:
        for entry, _ in plan.admits:
            self.admitted.append((entry.action.trajectory or "", self.iteration))


async def _score_batch(gate: Gate | None, groups: int, size: int, seed: int) -> _Plans:
    """A batch of ``groups`` prompts of ``size`` samples, all handed over at once (verl's
    ``compute_score_batch``), each taking 0-50 ms to get ready (decoding, a sandbox) and
    then holding one core for 20 ms, with a core for every sample."""
    plans = _Plans()
    rng = random.Random(seed)
    ready = [rng.uniform(0.0, 0.05) for _ in range(groups * size)]
    async with tangram.Runtime(capacity={"cpu": groups * size}) as runtime:
        runtime.add_instrument(plans)

        async def one(group: int, delay: float) -> None:
            key = f"g{group}"
            async with contextlib.AsyncExitStack() as stack:
                arrive = None
                if gate is not None:
                    arrive = await stack.enter_async_context(gate.sample(key))
                await anyio.sleep(delay)
                if arrive is not None:
                    await arrive()
                async with runtime.acquire(cpu=1, trajectory=key):
                    await anyio.sleep(0.02)

        async with anyio.create_task_group() as ticking:
            ticking.start_soon(plans.tick)
            async with anyio.create_task_group() as tg:
                for n, delay in enumerate(ready):
                    tg.start_soon(one, n // size, delay)
            ticking.cancel_scope.cancel()
    return plans


def _runs(plans: _Plans) -> int:
    """Stretches of one group in the order of admission."""
    order = [group for group, _ in plans.admitted]
    return sum(1 for n, group in enumerate(order) if n == 0 or order[n - 1] != group)


def _instants(plans: _Plans) -> dict[str, int]:
    """Per group, in how many loop iterations some of its samples were admitted."""
    times: dict[str, set[int]] = {}
    for group, now in plans.admitted:
        times.setdefault(group, set()).add(now)
    return {group: len(seen) for group, seen in times.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_each_group_is_admitted_at_once_and_side_by_side(seed: int) -> None:
    """The runtime admits an uncontended demand in a pass of its own, at once, so "one
    decision" is here: the group's samples admitted in one iteration, none between them."""
    gate = Gate(wait=5.0)
    plans = await _score_batch(gate, groups=4, size=4, seed=seed)
    assert len(plans.admitted) == 16
    assert _runs(plans) == 4
    assert _instants(plans) == {"g0": 1, "g1": 1, "g2": 1, "g3": 1}
    assert (gate.stats.groups, gate.stats.samples, gate.stats.timed_out) == (4, 16, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_without_the_gate_groups_are_admitted_piecemeal(seed: int) -> None:
    """The control: the same batch without the gate."""
    plans = await _score_batch(None, groups=4, size=4, seed=seed)
    assert _runs(plans) > 4
    assert max(_instants(plans).values()) > 1


async def test_a_sample_alone_goes_at_once() -> None:
    """Samples handed over one at a time (verl's agent loop scoring each trajectory as it
    ends, to any reward worker) find no group-mate in the gate and do not wait."""
    gate = Gate(wait=30.0)
    went: list[float] = []

    async def one(delay: float) -> None:
        await anyio.sleep(delay)
        async with gate.sample("g") as arrive:
            await anyio.sleep(0.05)
            await arrive()
            went.append(anyio.current_time())

    start = anyio.current_time()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0.0)
            tg.start_soon(one, 0.2)
    assert len(went) == 2 and went[0] - start < 0.2 and went[1] - start < 0.5
    assert (gate.stats.groups, gate.stats.samples, gate.stats.timed_out) == (2, 2, 0)


async def test_samples_of_one_group_wait_for_each_other() -> None:
    gate = Gate(wait=30.0)
    went: list[float] = []

    async def one(delay: float) -> None:
        async with gate.sample("g") as arrive:
            await anyio.sleep(delay)
            await arrive()
            went.append(anyio.current_time())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0.0)
            tg.start_soon(one, 0.3)
    assert len(went) == 2 and went[1] - went[0] < 0.01
    assert (gate.stats.groups, gate.stats.samples) == (1, 2)


async def test_a_sample_that_fails_before_arriving_lets_its_group_go() -> None:
    gate = Gate(wait=30.0)
    went: list[float] = []
    failed: list[BaseException] = []

    async def arrives() -> None:
        async with gate.sample("g") as arrive:
            await arrive()
            went.append(anyio.current_time())

    async def fails() -> None:
        try:
            async with gate.sample("g"):
                await anyio.sleep(0.1)
                raise ValueError("no test in the label")
        except ValueError as exc:
            failed.append(exc)

    start = anyio.current_time()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fails)
            tg.start_soon(arrives)
    assert len(failed) == 1 and len(went) == 1
    assert 0.08 <= went[0] - start < 1.0  # waited for it, and went when it left
    assert gate.stats.timed_out == 0


async def test_no_sample_waits_past_group_wait() -> None:
    """A sample still on its way (a slow decode) holds its group at most ``wait``."""
    gate = Gate(wait=0.2)
    went: list[float] = []

    async def arrives() -> None:
        async with gate.sample("g") as arrive:
            await arrive()
            went.append(anyio.current_time())

    async def slow() -> None:
        async with gate.sample("g"):
            await anyio.sleep(2.0)

    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow)
        tg.start_soon(arrives)
    assert len(went) == 1 and 0.15 <= went[0] - start < 1.5
    assert gate.stats.timed_out == 1


async def test_cancelled_while_waiting_leaves_the_gate_consistent() -> None:
    gate = Gate(wait=30.0)
    went: list[str] = []

    async def waits() -> None:
        async with gate.sample("g") as arrive:
            await arrive()
            went.append("waited")

    async def slow() -> None:
        async with gate.sample("g") as arrive:
            await anyio.sleep(10)
            await arrive()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            tg.start_soon(waits)
            await anyio.sleep(0.05)
            # Both cancelled, one waiting at the gate and one on its way.
            tg.cancel_scope.cancel()
    assert went == []
    assert gate._open == {}
    # The next batch's group of that key is not held by what the cancelled one left.
    with anyio.fail_after(2):
        async with gate.sample("g") as arrive:
            await arrive()


def test_a_bad_wait_fails_at_the_call() -> None:
    with pytest.raises(InvalidSettingError):
        Gate(wait=-1)
    with pytest.raises(SettingTypeError):
        Gate(wait="2")  # type: ignore[arg-type]
