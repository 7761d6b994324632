"""Warm start, the line-length rule and the targeted drain, as the simulator models them.

CPU devices stand in for GPUs (see ``tests/test_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
import trio.testing
from _gpu_models import (
    MIB,
    FailingOnce,
    GatedService,
    SlowRestore,
    SpyRuntime,
    inputs,
    reward_model,
    torch_service,
)
from conftest import wait_until

import tangram
from tangram import gpu
from tangram.gpu import Device, GpuPool

torch = pytest.importorskip("torch")  # the ``gpu`` extra; tests need no GPU, only torch


# -- warm start, the line-length test, the targeted drain (as the simulator models them) --
#
# CPU devices stand in for GPUs throughout: ``cpu:N`` budgets are books the pool keeps,
# exactly as it keeps them for ``cuda:N``.


@pytest.mark.anyio
async def test_entering_the_pool_fills_idle_devices_so_first_actions_pay_no_restore() -> None:
    """Real torch modules on CPU devices that stand in for two GPUs of 2 MiB.

    One replica of each service in declared order, then a second of each while there is
    room: ``a`` gets its second on cpu:1, never two on cpu:0 (cpu:0 keeps 1 MiB free),
    ``b`` stops at ``max_replicas=1``, ``c`` (2 MiB) fits nowhere without evicting.
    """
    a = torch_service("a", 1, max_replicas=2)
    b = torch_service("b", 2)
    c = torch_service("c", 3, memory="2MiB")
    devices = [Device("cpu:0", "2MiB"), Device("cpu:1", "2MiB")]
    async with GpuPool([a, b, c], devices=devices, links=[]) as pool:
        assert pool.residency() == {"a": [("cpu:0",), ("cpu:1",)], "b": [("cpu:1",)], "c": []}
        assert [u["resident"] for u in pool.usage().values()] == [MIB, 2 * MIB]
        assert [u["granted"] for u in pool.usage().values()] == [0, 0]
        runtime = SpyRuntime(capacity=pool.capacity())
        runtime.estimates = []
        async with runtime:
            # Warm replicas hold no grant: the runtime sees every byte free.
            assert all(runtime.stats().resources[d.kind].held == 0 for d in devices)
            for name, seed in (("a", 1), ("b", 2)):
                async with pool.use(name) as svc:
                    x = inputs(seed)
                    assert torch.equal(await svc(x), reward_model(seed)(x).detach())
            assert runtime.estimates == [None, None]  # no restore in either estimate
            await wait_until(lambda: all(u["granted"] == 0 for u in pool.usage().values()))
            # Idle and evictable like any replica: c evicts a's replica on cpu:0.
            async with pool.use("c") as svc:
                assert torch.equal(await svc(inputs(3)), reward_model(3)(inputs(3)).detach())
        assert pool.residency() == {"a": [("cpu:1",)], "b": [("cpu:1",)], "c": [("cpu:0",)]}
        stats = pool.service_stats()
        assert [(stats[n]["warmed"], stats[n]["restores"], stats[n]["hits"]) for n in "abc"] == [
            (2, 0, 1),
            (1, 0, 1),
            (0, 1, 0),
        ]
        assert stats["a"]["evictions"] == 1
    async with GpuPool([torch_service("a", 1)], devices=devices, warm=False) as cold:
        assert cold.residency() == {"a": []}
    with pytest.raises(TypeError, match="warm"):
        GpuPool([a], warm="yes")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_failed_or_cancelled_warm_restore_leaves_nothing_held() -> None:
    """CPU devices stand in for GPUs; the first allocation fails as a full GPU's would."""
    flaky = FailingOnce("flaky", lambda: reward_model(5), memory="1MiB")
    pool = GpuPool([flaky, torch_service("ok", 6)], devices=[Device("cpu:0", memory="2MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        # Start-up went on: the flaky service stays evicted, the other one is warm.
        assert pool.residency() == {"flaky": [], "ok": [("cpu:0",)]}
        assert pool.usage()["cpu:0"]["resident"] == MIB
        assert flaky.replica_state(0) == {}
        async with pool.use("flaky") as svc:
            assert torch.equal(await svc(inputs(0)), reward_model(5)(inputs(0)).detach())
        assert pool.service_stats()["flaky"]["restores"] == 1
    # Cancelled while warming: what was restored is evicted and the pool is closed.
    fast, slow = SlowRestore("fast", 0.0), SlowRestore("slow", 60.0)
    pool = GpuPool([fast, slow], devices=[Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_mid_warm() -> None:
                await wait_until(lambda: bool(pool.residency()["fast"] and slow.restored))
                scope.cancel()

            tg.start_soon(cancel_mid_warm)
            await pool.__aenter__()
            pytest.fail("slow's restore takes a minute: entering was cancelled first")
    assert (fast.restored, slow.restored) == ([("cpu:0",)], [("cpu:1",)])
    assert pool.residency() == {"fast": [], "slow": []}
    assert all(u["resident"] == 0 for u in pool.usage().values())
    with pytest.raises(gpu.GpuPoolClosedError):
        async with pool:
            pass


class Paced(GatedService):
    """Restores take ``restore`` and runs ``run`` seconds of virtual time, then the gate.

    Each finished call is logged as ``name:batch`` in ``log``, shared between services.
    """

    def __init__(self, name: str, log: list[str], restore: float, run: float, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.log = log
        self.restore_s = restore
        self.run_s = run

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await anyio.sleep(self.restore_s)

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        await anyio.sleep(self.run_s)
        results = await super().run(replica, batches)
        self.log.extend(results)
        return results


def run_virtual(test: Callable[[], Any]) -> None:
    """Run ``test`` on trio under a clock that jumps to the next deadline: exact times."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    anyio.run(test, backend="trio", backend_options={"clock": clock})


def test_a_newcomer_queues_on_a_full_replica_unless_its_line_is_longer_than_a_restore() -> None:
    """CPU devices stand in for two GPUs; time is virtual (trio's MockClock).

    Restores take 1 s and runs 0.4 s, one action per replica at a time. Four actions
    arrive together on a replica that is resident on cpu:0: the 2nd and 3rd are 1st and
    2nd in line (0.4 s, 0.8 s < 1 s) and wait there; the 4th would wait 1.2 s, longer than
    a restore, so a second replica is restored on cpu:1 for it.
    """

    async def main() -> None:
        log: list[str] = []
        judge = Paced("judge", log, restore=1.0, run=0.4, max_replicas=2, batching=False)
        judge.gate.set()
        devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
        pool = GpuPool([judge], devices=devices, links=[], warm=False)
        async with pool, tangram.Runtime(capacity=pool.capacity()):
            async with pool.use("judge") as svc:  # learns both times, stays on cpu:0
                await svc(0)
            stats = pool.service_stats()["judge"]
            assert (stats["restore_seconds"], stats["run_seconds"]) == pytest.approx((1.0, 0.4))
            await wait_until(lambda: pool.service_stats()["judge"]["replicas_live"] == 0)
            seen: list[str] = []

            async def action(k: int) -> None:
                async with pool.use("judge") as svc:
                    seen.append(svc.devices[0].name)
                    await svc(k)

            async with anyio.create_task_group() as tg:
                for k in range(1, 5):
                    tg.start_soon(action, k)
            assert sorted(seen) == ["cpu:0", "cpu:0", "cpu:0", "cpu:1"]
            assert pool.service_stats()["judge"]["restores"] == 2

    run_virtual(main)


def test_a_waiting_service_drains_only_the_least_loaded_replica_past_its_tenure() -> None:
    """CPU devices stand in for one GPU of 2 MiB; time is virtual (trio's MockClock).

    ``a`` (three actions) and ``c`` (one) are granted cpu:0 at t=0 and restored by t=2
    (1 s each, one after the other). ``b`` asks for cpu:0 at t=1.5: nothing waits in
    ``c``'s line, so ``b``'s line has the share of ``c``'s replica, but ``c`` has held
    its grant less than two restores, so it keeps it for now (an ``a`` newcomer at t=1.6
    looks); a ``c`` newcomer at t=1.7 joins it. At t=3 both have held it long enough;
    ``b``'s line has waited longer than ``c``'s (and its restore, assumed from its 1 MiB
    until one is measured, costs next to nothing), so ``c``, above its share and the
    less loaded, stops taking newcomers and hands its memory to ``b`` once its actions
    end, while ``a``, whose line waited longest, keeps serving its newcomer. Without
    the drain ``c``, joined continuously, would hold cpu:0 and ``b`` would wait behind
    every ``c`` action.
    """

    async def main() -> None:
        log: list[str] = []
        a, b, c = (Paced(n, log, restore=1.0, run=0.0) for n in "abc")
        b.gate.set()
        pool = GpuPool([a, c, b], devices=[Device("cpu:0", "2MiB")], warm=False)
        async with pool, tangram.Runtime(capacity=pool.capacity()):
            entered: list[str] = []

            async def action(name: str, k: int) -> None:
                async with pool.use(name) as svc:
                    entered.append(f"{name}:{k}")
                    await svc(k)

            async with anyio.create_task_group() as tg:
                for k in range(3):
                    tg.start_soon(action, "a", k)
                tg.start_soon(action, "c", 0)
                await anyio.sleep(1.5)
                tg.start_soon(action, "b", 0)
                await wait_until(lambda: pool.service_stats()["b"]["replicas_live"] == 1)
                await anyio.sleep(0.1)
                tg.start_soon(action, "a", 3)  # before c's tenure: nothing drains
                await anyio.sleep(0.1)
                assert pool.service_stats()["c"]["replicas_live"] == 1
                tg.start_soon(action, "c", 1)  # joins c's replica
                await anyio.sleep(1.3)
                tg.start_soon(action, "a", 4)  # a keeps serving newcomers
                tg.start_soon(action, "c", 2)  # c drains: this one waits for b
                await wait_until(lambda: "a:4" in entered)
                assert "c:2" not in entered
                c.gate.set()
                await anyio.sleep(10)  # b is restored and served, then c again
                assert "c:2" in log and not any(e.startswith("a:") for e in log)
                a.gate.set()
            assert log.index("c:1") < log.index("b:0") < log.index("c:2")
            assert log.index("b:0") < log.index("a:4")
            stats = pool.service_stats()
            assert (stats["a"]["restores"], stats["c"]["restores"]) == (1, 2)

    run_virtual(main)
