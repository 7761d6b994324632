"""The GPU pool's scheduling rules, each a test that fails when its behaviour goes.

CPU devices stand in for GPUs (see ``tests/test_gpu.py``).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _gpu_models import MIB, GatedService, SlowRestore, SpyRuntime, inputs, torch_service
from conftest import wait_until

import tangram
from tangram import gpu
from tangram.gpu import Device, GpuPool

# -- the scheduling bullets, each a test that fails when the behaviour goes ---------------


@pytest.mark.anyio
async def test_an_action_goes_where_its_service_is_resident_not_where_memory_is_freest() -> None:
    big = GatedService("big", memory="4MiB")
    judge = GatedService("judge")
    judge.gate.set()
    devices = [Device("cpu:0", "4MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([big, judge], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        async with anyio.create_task_group() as tg:

            async def hold_big() -> None:
                async with pool.use("big") as svc:
                    await svc(0)

            tg.start_soon(hold_big)
            await big.started.wait()
            async with pool.use("judge") as svc:  # cpu:0 is granted to big: only cpu:1 fits
                assert svc.devices[0].name == "cpu:1"
                await svc(1)
            big.gate.set()
        await wait_until(lambda: pool.usage()["cpu:0"]["granted"] == 0)
        # cpu:0 is now 4 MiB free, cpu:1 1 MiB: the most free memory says cpu:0, but the
        # judge is resident on cpu:1, and running there costs no restore.
        async with pool.use("judge") as svc:
            assert svc.devices[0].name == "cpu:1"
            await svc(2)
        stats = pool.service_stats()["judge"]
        assert (stats["restores"], stats["hits"]) == (1, 1)
        assert pool.residency() == {"big": [("cpu:0",)], "judge": [("cpu:1",)]}


@pytest.mark.anyio
async def test_an_evicted_service_is_estimated_at_its_learnt_restore_plus_run() -> None:
    services = [torch_service("judge", 1), torch_service("other", 2)]
    pool = GpuPool(services, devices=[Device("cpu:0", "1MiB")], warm=False)
    async with pool:
        runtime = SpyRuntime(capacity=pool.capacity())
        runtime.estimates = []
        async with runtime:
            for name in ("judge", "other", "judge"):  # other evicts judge in between
                async with pool.use(name) as svc:
                    await svc(inputs(0))
                await wait_until(
                    lambda: all(s["replicas_live"] == 0 for s in pool.service_stats().values())
                )
                if name == "other":
                    learnt = pool.service_stats()["judge"]
        assert pool.service_stats()["judge"]["restores"] == 2
    restore, run = learnt["restore_seconds"], learnt["run_seconds"]
    assert isinstance(restore, float) and isinstance(run, float)
    assert runtime.estimates[2] == pytest.approx(restore + run)
    assert runtime.estimates[2] != pytest.approx(MIB / gpu.DEFAULT_RESTORE_BANDWIDTH + run)


@pytest.mark.anyio
async def test_restore_time_is_the_lease_overhead_in_the_runtime_stats() -> None:
    slow = SlowRestore("slow", 0.05)
    slow.gate.set()
    pool = GpuPool([slow], devices=[Device("cpu:0", "1MiB")], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        for _ in range(2):  # a restore, then a resident hit
            async with pool.use("slow") as svc:
                await svc(0)
            await wait_until(lambda: pool.service_stats()["slow"]["replicas_live"] == 0)
        kind = runtime.stats().kinds["gpu:slow"]
    assert len(slow.restored) == 1
    assert kind.completed == 2
    # Two grants: one waited 50 ms for its restore, the resident hit for nothing.
    assert kind.overhead.count == 2
    assert kind.overhead.mean * 2 >= 0.05


@pytest.mark.anyio
async def test_eviction_skips_a_replica_with_a_running_action_even_when_it_is_the_lru() -> None:
    a, b, c = GatedService("a"), GatedService("b"), GatedService("c")
    b.gate.set()
    c.gate.set()
    pool = GpuPool([a, b, c], devices=[Device("cpu:0", "2MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        async with anyio.create_task_group() as tg:

            async def hold_a() -> None:
                async with pool.use("a") as svc:
                    assert await svc(1) == "a:1"

            tg.start_soon(hold_a)  # a is used first, so least recently, and keeps running
            await a.started.wait()
            async with pool.use("c") as svc:
                await svc(2)
            await wait_until(lambda: pool.usage()["cpu:0"]["granted"] == MIB)
            # b's grant fits beside a's; making room evicts c, the idle one, not a.
            async with pool.use("b") as svc:
                assert await svc(3) == "b:3"
                assert pool.residency() == {"a": [("cpu:0",)], "b": [("cpu:0",)], "c": []}
            a.gate.set()
        assert pool.service_stats()["a"]["evictions"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("batching", "max_batch", "runs"),
    [(True, None, [1, 5]), (False, None, [1] * 6), (True, 2, [1, 2, 2, 1])],
)
async def test_waiting_actions_of_one_service_run_batched_as_the_service_allows(
    batching: bool, max_batch: int | None, runs: list[int]
) -> None:
    """Six actions wait while the first runs; the next ones merge as far as the service
    allows. With ``max_batch=2`` the replica seats four (the run and the next forming
    behind it) and two wait in line: their seats are handed over as actions end, and
    they call while the run before theirs still takes its time, as a real run does."""
    service = GatedService("judge", batching=batching, max_batch=max_batch, seconds=0.05)
    pool = GpuPool([service], devices=[Device("cpu:0", "4MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        results: list[str] = []

        async def action(k: int) -> None:
            async with pool.use("judge") as svc:
                results.append(await svc(k))

        async with anyio.create_task_group() as tg:
            tg.start_soon(action, 0)
            await service.started.wait()
            for k in range(1, 6):
                tg.start_soon(action, k)
            await wait_until(lambda: pool.service_stats()["judge"]["replicas_live"] == 1)
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            service.gate.set()
        assert sorted(results) == [f"judge:{k}" for k in range(6)]
        assert [n for _, n in service.runs] == runs


@pytest.mark.anyio
@pytest.mark.parametrize("why", ["max_replicas", "no_room_now"])
async def test_no_elastic_replica_past_max_replicas_or_without_room_now(why: str) -> None:
    judge = GatedService("judge", max_replicas=1 if why == "max_replicas" else 2)
    other = GatedService("other")
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([judge, other], devices=devices)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        seen: list[str] = []

        async def action(name: str) -> None:
            async with pool.use(name) as svc:
                seen.append(f"{name}@{svc.devices[0].name}")
                await svc(0)

        async with anyio.create_task_group() as tg:
            if why == "no_room_now":
                tg.start_soon(action, "other")
                await other.started.wait()
            tg.start_soon(action, "judge")
            await judge.started.wait()
            tg.start_soon(action, "judge")
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            # The second action waits for the first replica's seat rather than start another.
            assert pool.service_stats()["judge"]["replicas_live"] == 1
            judge.gate.set()
            other.gate.set()
        judges = [s for s in seen if s.startswith("judge")]
        assert len(judges) == 2 and len(set(judges)) == 1


@pytest.mark.anyio
async def test_an_action_joining_a_withdrawn_replica_is_served() -> None:
    """The last waiter leaves (its request is withdrawn) and, before the replica's task
    sees that, a new action joins it: the task asks again instead of failing the action."""
    a, b = GatedService("a"), GatedService("b")
    b.gate.set()
    pool = GpuPool([a, b], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        async with anyio.create_task_group() as tg:

            async def hold_a() -> None:
                async with pool.use("a") as svc:
                    await svc(1)

            async def release_a() -> None:
                await anyio.sleep(0.05)
                a.gate.set()

            tg.start_soon(hold_a)
            await a.started.wait()
            with anyio.move_on_after(0.02):
                async with pool.use("b"):
                    pytest.fail("b cannot fit while a runs")
            tg.start_soon(release_a)
            async with pool.use("b") as svc:  # entered with no checkpoint since the leave
                assert await svc(2) == "b:2"
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)


# -- one line per service -------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_action_that_finds_no_seat_waits_in_its_service_line_not_on_a_replica() -> None:
    """A replica that runs one call at a time seats one action: the next ones wait in the
    service's line and enter their blocks in the order they came, each when a seat frees.
    Bound to the replica at arrival (as before the line), all three would have entered at
    once, and a replica drained meanwhile would have served all of them."""
    judge = GatedService("judge", batching=False, max_replicas=1)
    pool = GpuPool([judge], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        entered: list[int] = []

        async def action(k: int) -> None:
            async with pool.use("judge") as svc:
                entered.append(k)
                await svc(k)

        async with anyio.create_task_group() as tg:
            tg.start_soon(action, 0)
            await judge.started.wait()
            for k in (1, 2):
                tg.start_soon(action, k)
                await wait_until(lambda k=k: len(pool._services["judge"].line) == k)
            assert entered == [0]
            judge.gate.set()
        assert entered == [0, 1, 2]
        assert not pool._services["judge"].line


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["in_line", "handed_a_seat"])
async def test_an_action_cancelled_in_line_or_as_its_seat_comes_passes_the_seat_on(
    when: str,
) -> None:
    """Cancelled while it waits in line, an action leaves the line; cancelled in the same
    instant a seat is handed to it (before it wakes), it hands the seat to the next in
    line. Either way the third action runs and every byte is given back."""
    judge = GatedService("judge", batching=False, max_replicas=1)
    pool = GpuPool([judge], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        entered: list[str] = []
        second = anyio.CancelScope()

        async def first() -> None:
            async with pool.use("judge") as svc:
                entered.append("first")
                await svc(0)
                if when == "handed_a_seat":
                    second.cancel()  # delivered after the block's end hands it the seat

        async def cancelled() -> None:
            with second:
                async with pool.use("judge"):
                    entered.append("second")

        async def third() -> None:
            async with pool.use("judge") as svc:
                entered.append("third")
                await svc(2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await judge.started.wait()
            tg.start_soon(cancelled)
            await wait_until(lambda: len(pool._services["judge"].line) == 1)
            tg.start_soon(third)
            await wait_until(lambda: len(pool._services["judge"].line) == 2)
            if when == "in_line":
                second.cancel()
                await wait_until(lambda: len(pool._services["judge"].line) == 1)
            judge.gate.set()
        assert entered == ["first", "third"]
        [replica] = pool._services["judge"].replicas
        assert replica.users == 0
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)


@pytest.mark.anyio
async def test_closing_the_pool_fails_the_actions_in_line() -> None:
    judge = GatedService("judge", batching=False, max_replicas=1)
    pool = GpuPool([judge], devices=[Device("cpu:0", "1MiB")])
    errors: list[BaseException] = []

    async def action() -> None:
        try:
            async with pool.use("judge") as svc:
                await svc(0)
        except gpu.GpuPoolClosedError as exc:
            errors.append(exc)

    runtime = tangram.Runtime(capacity=pool.capacity())
    async with runtime:
        async with anyio.create_task_group() as tg, pool:
            tg.start_soon(action)
            await judge.started.wait()
            tg.start_soon(action)
            await wait_until(lambda: len(pool._services["judge"].line) == 1)
        assert len(errors) == 2
        assert any("waited for a seat" in str(e) for e in errors)
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["same_task", "child_tasks"])
async def test_a_block_inside_a_block_of_its_service_shares_the_replica_not_the_line(
    where: str,
) -> None:
    """In line, the inner block would wait for the seat its own action holds, for ever:
    from the same task, or from tasks started inside the block."""
    judge = GatedService("judge", batching=False, max_replicas=1)
    judge.gate.set()
    pool = GpuPool([judge], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        results: list[str] = []

        async def inner(k: int, outer: int) -> None:
            async with pool.use("judge") as svc:
                assert svc.replica == outer
                results.append(await svc(k))

        with anyio.fail_after(5):
            async with pool.use("judge") as outer:
                if where == "same_task":
                    await inner(1, outer.replica)
                else:
                    async with anyio.create_task_group() as tg:
                        for k in (1, 2):
                            tg.start_soon(inner, k, outer.replica)
                results.append(await outer(0))
        assert sorted(results) == ["judge:0", "judge:1"] + (
            ["judge:2"] if where != "same_task" else []
        )
        [replica] = pool._services["judge"].replicas
        assert replica.users == 0


@pytest.mark.anyio
async def test_two_actions_nesting_two_services_in_opposite_orders_both_run() -> None:
    """Each holds the one seat of one service and asks for the other's: in line, each
    would wait for the other's seat."""
    s, t = GatedService("s", batching=False), GatedService("t", batching=False)
    s.gate.set()
    t.gate.set()
    pool = GpuPool([s, t], devices=[Device("cpu:0", "4MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        both = anyio.Event()
        holding: list[str] = []
        ran: list[str] = []

        async def action(first: str, then: str) -> None:
            async with pool.use(first) as outer:
                await outer(0)
                holding.append(first)
                if len(holding) == 2:
                    both.set()
                await both.wait()
                async with pool.use(then) as inner:
                    ran.append(await inner(1))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(action, "s", "t")
                tg.start_soon(action, "t", "s")
        assert sorted(ran) == ["s:1", "t:1"]


class _FailsFirstRestore(GatedService):
    failures = 1

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await anyio.sleep(0.01)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("restore failed")


@pytest.mark.anyio
async def test_a_failed_restore_reaches_its_action_though_the_line_starts_another() -> None:
    """The replica stops with an action seated on it and one in line; the line starts a
    replica at once. That must be a new one: restarting the failed one would clear its
    error before its seated action saw it."""
    judge = _FailsFirstRestore("judge", batching=False, max_replicas=1)
    judge.gate.set()
    pool = GpuPool([judge], devices=[Device("cpu:0", "1MiB")], warm=False)
    outcome: dict[int, str] = {}
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:

        async def action(k: int) -> None:
            try:
                async with pool.use("judge") as svc:
                    outcome[k] = await svc(k)
            except gpu.GpuServiceError:
                outcome[k] = "failed"

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(action, 1)
                await wait_until(lambda: pool.service_stats()["judge"]["replicas_live"] == 1)
                tg.start_soon(action, 2)
        assert outcome == {1: "failed", 2: "judge:2"}
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)


@pytest.mark.anyio
async def test_a_waiting_replica_stays_on_a_device_whose_last_action_is_leaving() -> None:
    """b waits for cpu:0, held by a; c runs on cpu:1. When a's action ends its replica
    still holds the grant for a moment: b must not move to cpu:1 (and drain c) for it."""
    a, b, c = GatedService("a"), GatedService("b"), GatedService("c")
    b.gate.set()
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([a, b, c], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        served = anyio.Event()

        async def action(name: str) -> None:
            async with pool.use(name) as svc:
                await svc(0)
            if name == "b":
                served.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(action, "a")
            await a.started.wait()
            tg.start_soon(action, "c")
            await c.started.wait()
            tg.start_soon(action, "b")
            await wait_until(lambda: pool.service_stats()["b"]["replicas_live"] == 1)
            [waiting] = pool._services["b"].replicas
            assert waiting.devices[0].name == "cpu:0"
            a.gate.set()
            with anyio.fail_after(5):
                await served.wait()
            assert waiting.devices[0].name == "cpu:0"
            assert not pool._services["c"].replicas[0].draining
            c.gate.set()


@pytest.mark.anyio
async def test_a_task_that_outlives_its_block_waits_in_line_as_any_action() -> None:
    """A worker started inside an A block into a task group outside it inherits the
    block's context. Once the block ends it must not count as nested: joining A's
    replica past its drain, it would keep A's grant for ever and starve B."""
    a = GatedService("A", batching=False, max_replicas=1, seconds=0.01)
    b = GatedService("B", batching=False, max_replicas=1, seconds=0.01)
    a.gate.set()
    b.gate.set()
    pool = GpuPool([a, b], devices=[Device("cpu:0", "1MiB")], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        stop = anyio.Event()

        async def worker() -> None:
            while not stop.is_set():
                async with pool.use("A") as svc:
                    await svc(0)

        async with anyio.create_task_group() as tg:
            async with pool.use("A") as svc:
                await svc(1)
                tg.start_soon(worker)  # outlives this block
            await anyio.sleep(0.1)
            with anyio.fail_after(3):
                async with pool.use("B") as svc:
                    assert await svc(2) == "B:2"
            stop.set()


class _Bound(GatedService):
    def __init__(self, name: str, slots: list[tuple[str, ...]], **kw: Any) -> None:
        super().__init__(name, **kw)
        self._slots = slots

    def slots(self) -> list[tuple[str, ...]]:
        return self._slots


@pytest.mark.anyio
async def test_a_nested_block_does_not_join_a_replica_waiting_for_its_own_device() -> None:
    """X holds A on cpu:0; Z's B replica waits for cpu:0; cpu:1 is free. X's nested B
    block must start a replica on cpu:1, not join Z's, whose grant needs X's seat."""
    a = _Bound("A", [("cpu:0",)], batching=False)
    c = _Bound("C", [("cpu:1",)], batching=False)
    b = _Bound("B", [("cpu:0",), ("cpu:1",)], batching=False, max_replicas=2)
    for service in (a, b, c):
        service.gate.set()
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([a, b, c], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        release_c, nest, a_in, c_in = anyio.Event(), anyio.Event(), anyio.Event(), anyio.Event()
        nested_on: list[str] = []

        async def x() -> None:
            async with pool.use("A") as svc:
                await svc(0)
                a_in.set()
                await nest.wait()
                async with pool.use("B") as inner:
                    nested_on.append(inner.devices[0].name)

        async def y() -> None:
            async with pool.use("C") as svc:
                await svc(0)
                c_in.set()
                await release_c.wait()

        async def z() -> None:
            async with pool.use("B"):
                pass

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x)
                await a_in.wait()
                tg.start_soon(y)
                await c_in.wait()
                tg.start_soon(z)
                await wait_until(lambda: pool.service_stats()["B"]["replicas_live"] == 1)
                assert pool._services["B"].replicas[0].devices[0].name == "cpu:0"
                release_c.set()
                await wait_until(lambda: pool.usage()["cpu:1"]["granted"] == 0)
                nest.set()
        assert nested_on == ["cpu:1"]


@pytest.mark.anyio
async def test_a_batching_replica_started_for_a_newcomer_seats_the_line_too() -> None:
    """S batches two per run (four seats); its replica on cpu:0 is full and W1, W2 wait
    in line. A newcomer starts a replica on cpu:1 once C leaves it: its other seats go
    to W1 and W2 at once, not to whoever comes next."""
    s = GatedService("S", batching=True, max_batch=2, max_replicas=2)
    c = _Bound("C", [("cpu:1",)], batching=False)
    c.gate.set()
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([s, c], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        release_c, c_in, done = anyio.Event(), anyio.Event(), anyio.Event()
        entered: list[tuple[str, str]] = []

        async def hold_c() -> None:
            async with pool.use("C") as svc:
                await svc(0)
                c_in.set()
                await release_c.wait()

        async def action(tag: str) -> None:
            async with pool.use("S") as svc:
                entered.append((tag, svc.devices[0].name))
                if tag.startswith("R1"):
                    await svc(tag)  # gated: keeps the first replica full
                else:
                    await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_c)
            await c_in.wait()
            for i in range(4):
                tg.start_soon(action, f"R1.{i}")
            await wait_until(lambda: len(entered) == 4)
            for tag in ("W1", "W2"):
                tg.start_soon(action, tag)
                await wait_until(lambda tag=tag: len(pool._services["S"].line) == int(tag[1]))
            release_c.set()
            await wait_until(lambda: pool.usage()["cpu:1"]["granted"] == 0)
            tg.start_soon(action, "N")
            with anyio.fail_after(5):
                await wait_until(lambda: len(entered) == 7)
            assert not pool._services["S"].line
            assert sorted(tag for tag, where in entered if where == "cpu:1") == ["N", "W1", "W2"]
            done.set()
            s.gate.set()
