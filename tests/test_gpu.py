"""The GPU pool on the CPU: real torch models, simulated per-device memory budgets.

No GPU is needed: ``Device("cpu:N", memory=...)`` gives the pool a budget on the host and
torch's ``"cpu"`` device runs the very code that ``cuda:N`` runs (only the pinning and
the stream synchronise are guarded by CUDA). Models are small, seeded and built here.
"""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
from _gpu_models import (
    MIB,
    FailingOnce,
    GatedService,
    SpyRuntime,
    inputs,
    reward_model,
    torch_service,
)
from conftest import wait_until

import tangram
from tangram import gpu
from tangram.gpu import Device, GpuOutOfMemoryError, GpuPool, TorchService

torch = pytest.importorskip("torch")  # the ``gpu`` extra; tests need no GPU, only torch


# -- topology ------------------------------------------------------------------------------


def test_nvlink_groups_from_a_fake_topology() -> None:
    links = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)]
    assert gpu.nvlink_groups(range(9), links) == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]
    assert gpu.nvlink_groups([0, 1], []) == [(0,), (1,)]


def test_place_prefers_aligned_chunks_inside_one_group() -> None:
    groups = [(0, 1, 2, 3), (4, 5, 6, 7)]
    free = {i: 10.0 for i in range(8)}
    assert gpu.place(groups, free, 4) in {(0, 1, 2, 3), (4, 5, 6, 7)}
    # 1 and 2 are free in group 0, but (1, 2) straddles the 2-chunks: the aligned 4-5 wins.
    assert gpu.place(groups, {1: 50.0, 2: 50.0, 4: 1.0, 5: 1.0}, 2) == (4, 5)
    # No aligned chunk anywhere: any two of one group, the freest.
    assert gpu.place(groups, {1: 5.0, 2: 9.0, 3: 7.0, 4: 100.0}, 2) == (2, 3)
    # Nothing inside one group: across groups, as a last resort.
    assert gpu.place(groups, {3: 1.0, 4: 1.0}, 2) == (3, 4)
    assert gpu.place(groups, {3: 1.0}, 2) is None
    assert gpu.place(groups, free, 1) is not None
    with pytest.raises(ValueError, match="count"):
        gpu.place(groups, free, 0)


def test_nvml_is_guarded_without_a_gpu() -> None:
    assert gpu.nvml_nvlink_pairs() == [] or torch.cuda.is_available()
    assert isinstance(gpu.discover_devices(), list)


def test_core_import_does_not_import_torch() -> None:
    code = (
        "import sys, tangram; assert 'torch' not in sys.modules; assert 'pynvml' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpu_import_does_not_import_torch_nor_nvml() -> None:
    # torch comes with the first service that loads, NVML with the first device query.
    code = (
        "import sys, tangram.gpu; "
        "assert 'torch' not in sys.modules; assert 'pynvml' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_device_parses_sizes_and_rejects_nonsense() -> None:
    assert Device("cpu:0", memory="64MiB").memory == 64 * MIB
    assert Device("cuda:1", memory=10).kind == "gpu_mem:cuda:1"
    assert Device("cpu:3", memory=1).torch_device == "cpu"
    with pytest.raises(ValueError, match="memory"):
        Device("cpu:0", memory=0)
    with pytest.raises(TypeError, match="memory"):
        Device("cpu:0", memory=[1])  # type: ignore[arg-type]


# -- torch services ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_round_trips_are_bitwise_identical() -> None:
    # One device with room for one service: every switch evicts the other one (not warmed
    # at entry, so the count of restores is the actions').
    services = [torch_service("judge", 1), torch_service("teacher", 2)]
    pool = GpuPool(services, devices=[Device("cpu:0", memory="1.5MiB")], warm=False)
    x = inputs(0)
    expected = {"judge": reward_model(1)(x).detach(), "teacher": reward_model(2)(x).detach()}
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        assert runtime.capacity["gpu_mem:cpu:0"].total == 1.5 * MIB
        host = {name: services[i].host_state() for i, name in enumerate(expected)}
        for _ in range(5):
            for name in expected:
                async with pool.use(name) as svc:
                    assert torch.equal(await svc(x), expected[name])
                    assert pool.residency()[name] == [("cpu:0",)]
        stats = pool.service_stats()
        assert stats["judge"]["restores"] == 5 and stats["judge"]["evictions"] >= 4
        # The host buffers are the ones allocated at load, never re-made per eviction.
        for i, name in enumerate(expected):
            now = services[i].host_state()
            assert all(now[k].data_ptr() == host[name][k].data_ptr() for k in now)
        assert services[0].pinned is torch.cuda.is_available()


@pytest.mark.anyio
async def test_lru_idle_service_is_evicted_first() -> None:
    services = [torch_service(n, i) for i, n in enumerate("abc")]
    pool = GpuPool(services, devices=[Device("cpu:0", memory="2MiB")], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        for name in "ab":
            async with pool.use(name) as svc:
                await svc(inputs(1))
        async with pool.use("a") as svc:  # a is now the most recently used
            await svc(inputs(1))
        async with pool.use("c") as svc:
            await svc(inputs(1))
        assert pool.residency() == {"a": [("cpu:0",)], "b": [], "c": [("cpu:0",)]}
        assert pool.service_stats()["a"]["hits"] == 1


@pytest.mark.anyio
async def test_concurrent_actions_never_exceed_any_device_budget() -> None:
    services = [torch_service(f"s{i}", i) for i in range(5)]
    devices = [Device("cpu:0", memory="2MiB"), Device("cpu:1", memory="2MiB")]
    pool = GpuPool(services, devices=devices)
    x = inputs(3)
    expected = [reward_model(i)(x).detach() for i in range(5)]
    async with pool, tangram.Runtime(capacity=pool.capacity()):

        async def action(k: int) -> None:
            i = (k * 7) % 5
            async with pool.use(f"s{i}") as svc:
                out = await svc(x)
                assert torch.equal(out, expected[i])
                for device, use in pool.usage().items():
                    assert use["resident"] is not None and use["capacity"] is not None
                    assert use["resident"] <= use["capacity"], device

        async with anyio.create_task_group() as tg:
            for k in range(30):
                tg.start_soon(action, k)
        # The last holders let go of their grants once they next run.
        await wait_until(lambda: all(u["granted"] == 0 for u in pool.usage().values()))
        for use in pool.usage().values():
            assert use["peak"] is not None and use["capacity"] is not None
            assert 0 < use["peak"] <= use["capacity"]


@pytest.mark.anyio
async def test_a_service_with_a_running_action_is_never_evicted() -> None:
    a, b = GatedService("a"), GatedService("b")
    pool = GpuPool([a, b], devices=[Device("cpu:0", memory="1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        result: list[str] = []

        async def hold_a() -> None:
            async with pool.use("a") as svc:
                result.append(await svc(1))

        async def then_b() -> None:
            async with pool.use("b") as svc:
                result.append(await svc(2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_a)
            await a.started.wait()
            tg.start_soon(then_b)
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            # b waits in the runtime queue: a's memory is granted while its action runs.
            assert pool.residency()["a"] == [("cpu:0",)]
            assert b.runs == []
            b.gate.set()
            a.gate.set()
        assert result == ["a:1", "b:2"]
        assert pool.residency() == {"a": [], "b": [("cpu:0",)]}


@pytest.mark.anyio
async def test_failed_restore_is_typed_and_leaves_the_pool_consistent() -> None:
    flaky = FailingOnce("flaky", lambda: reward_model(5), memory="1MiB")
    devices = [Device("cpu:0", memory="2MiB")]
    pool = GpuPool([flaky, torch_service("ok", 6)], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        # The message gives the replica's size in human units, as every GPU error does.
        with pytest.raises(GpuOutOfMemoryError, match=r"\([\d.]+KiB per device\).*out of"):
            async with pool.use("flaky") as svc:
                await svc(inputs(0))
        assert pool.usage()["cpu:0"]["resident"] == 0
        assert pool.usage()["cpu:0"]["granted"] == 0
        assert runtime.stats().resources["gpu_mem:cpu:0"].held == 0
        assert pool.residency()["flaky"] == []
        # The next action restores it normally.
        async with pool.use("flaky") as svc:
            assert torch.equal(await svc(inputs(0)), reward_model(5)(inputs(0)).detach())
        async with pool.use("ok") as svc:
            await svc(inputs(0))


@pytest.mark.anyio
async def test_a_service_too_big_for_every_device_fails_at_entry() -> None:
    pool = GpuPool([torch_service("big", 1, memory="8MiB")], devices=[Device("cpu:0", "4MiB")])
    with pytest.raises(GpuOutOfMemoryError, match="big"):
        async with pool:
            pass
    assert issubclass(GpuOutOfMemoryError, tangram.errors.TangramError)
    assert issubclass(GpuOutOfMemoryError, MemoryError)


@pytest.mark.anyio
async def test_memory_defaults_to_the_module_size() -> None:
    service = TorchService("m", lambda: reward_model(1, width=256))
    async with GpuPool([service], devices=[Device("cpu:0", "64MiB")]):
        assert service.nbytes > 0
        # The tensors plus a quarter for activations (and 64-byte alignment per tensor).
        assert (
            int(service.nbytes * 1.25) <= service.memory <= int((service.nbytes + 64 * 16) * 1.25)
        )


@pytest.mark.anyio
async def test_torch_batches_merge_and_split_back() -> None:
    pool = GpuPool([torch_service("judge", 1)], devices=[Device("cpu:0", "4MiB")])
    model = reward_model(1)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        outs: dict[int, torch.Tensor] = {}

        async def action(k: int) -> None:
            async with pool.use("judge") as svc:
                outs[k] = await svc(inputs(k, rows=k + 1))

        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(action, k)
        for k, out in outs.items():
            assert out.shape == (k + 1, 1)
            torch.testing.assert_close(out, model(inputs(k, rows=k + 1)).detach())


@pytest.mark.anyio
async def test_elastic_replica_starts_on_a_free_device() -> None:
    service = GatedService("judge", max_replicas=2, batching=False)
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([service], devices=devices)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        seen: list[str] = []

        async def action() -> None:
            async with pool.use("judge") as svc:
                seen.append(svc.devices[0].name)
                await svc(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(action)
            await service.started.wait()
            tg.start_soon(action)
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            assert sorted(seen) == ["cpu:0", "cpu:1"]
            assert pool.service_stats()["judge"]["replicas_live"] == 2
            service.gate.set()
        assert sorted(r for r, _ in service.runs) == [0, 1]


@pytest.mark.anyio
async def test_use_outside_the_pool_and_unknown_names_fail_clearly() -> None:
    pool = GpuPool([GatedService("a")], devices=[Device("cpu:0", "1MiB")])
    with pytest.raises(gpu.GpuPoolClosedError):
        async with pool.use("a"):
            pass
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        with pytest.raises(LookupError, match="nope"):
            async with pool.use("nope"):
                pass
    with pytest.raises(ValueError, match="names must be unique"):
        GpuPool([GatedService("a"), GatedService("a")])


@pytest.mark.anyio
async def test_restore_time_is_counted_in_the_estimate() -> None:
    pool = GpuPool([torch_service("judge", 1)], devices=[Device("cpu:0", "4MiB")], warm=False)
    async with pool:
        runtime = SpyRuntime(capacity=pool.capacity())
        runtime.estimates = []
        async with runtime:
            learnt = []
            for _ in range(2):
                async with pool.use("judge") as svc:
                    await svc(inputs(0))
                await wait_until(lambda: pool.service_stats()["judge"]["replicas_live"] == 0)
                learnt.append(pool.service_stats()["judge"]["run_seconds"])
            assert "gpu:judge" in runtime.stats().kinds
        first, second = runtime.estimates
        assert first == pytest.approx(MIB / gpu.DEFAULT_RESTORE_BANDWIDTH)  # evicted, never run
        assert second == pytest.approx(learnt[0])  # resident: the learnt run time only


@pytest.mark.anyio
async def test_an_action_cancelled_while_waiting_leaves_nothing_held() -> None:
    a, b = GatedService("a"), GatedService("b")
    pool = GpuPool([a, b], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        async with anyio.create_task_group() as tg:

            async def hold_a() -> None:
                async with pool.use("a") as svc:
                    await svc(1)

            tg.start_soon(hold_a)
            await a.started.wait()
            with anyio.move_on_after(0.05):
                async with pool.use("b"):
                    pytest.fail("b cannot fit while a runs")
            await wait_until(lambda: runtime.stats().waiting == 0)  # b's request withdrawn
            a.gate.set()
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)
        b.gate.set()
        async with pool.use("b") as svc:
            assert await svc(2) == "b:2"
        assert pool.residency() == {"a": [], "b": [("cpu:0",)]}


@pytest.mark.anyio
async def test_a_handle_outlives_its_action_only_as_an_error() -> None:
    service = GatedService("a")
    service.gate.set()
    pool = GpuPool([service], devices=[Device("cpu:0", "1MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        async with pool.use("a") as svc:
            assert await svc(1) == "a:1"
        await wait_until(lambda: pool.service_stats()["a"]["replicas_live"] == 0)
        with pytest.raises(gpu.GpuPoolClosedError, match="inside"):
            await svc(2)


class Counter(torch.nn.Module):
    """Counts its calls in a buffer: state that changes while serving."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.calls.expand(len(x)).clone()


@pytest.mark.anyio
@pytest.mark.parametrize("writeback", [False, True])
async def test_writeback_keeps_state_changed_while_serving(writeback: bool) -> None:
    counter = TorchService("counter", Counter, memory="1KiB", writeback=writeback)
    other = GatedService("other", memory="1KiB")
    other.gate.set()
    pool = GpuPool([counter, other], devices=[Device("cpu:0", "1KiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        seen = []
        for _ in range(3):
            async with pool.use("counter") as svc:
                seen.append(int((await svc(torch.zeros(1)))[0]))
            async with pool.use("other") as svc:  # evicts the counter
                await svc(0)
        assert seen == ([1, 2, 3] if writeback else [1, 1, 1])
        assert int(counter.host_state()["calls"]) == (3 if writeback else 0)


@pytest.mark.anyio
async def test_a_multi_gpu_replica_lands_on_one_nvlink_group() -> None:
    service = GatedService("tp2", gpus=2)
    service.gate.set()
    devices = [Device(f"cpu:{i}", "1MiB") for i in range(4)]
    # NVLink pairs 0-3 and 1-2: numbering alone would pick (0, 1), which talks over PCIe.
    pool = GpuPool([service], devices=devices, links=[(0, 3), (1, 2)])
    runtime = tangram.Runtime(capacity=pool.capacity())
    async with pool, runtime, pool.use("tp2") as svc:
        names = tuple(d.name for d in svc.devices)
        assert names in {("cpu:0", "cpu:3"), ("cpu:1", "cpu:2")}
        for name in names:
            assert runtime.stats().resources[f"gpu_mem:{name}"].held == MIB
        assert await svc(1) == "tp2:1"
