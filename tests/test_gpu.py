"""The GPU pool on the CPU: real torch models, simulated per-device memory budgets.

No GPU is needed: ``Device("cpu:N", memory=...)`` gives the pool a budget on the host and
torch's ``"cpu"`` device runs the very code that ``cuda:N`` runs (only the pinning and
the stream synchronise are guarded by CUDA). Models are small, seeded and built here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
import trio.testing
from conftest import wait_until

import tangram
from tangram import gpu
from tangram.gpu import Device, GpuOutOfMemoryError, GpuPool, ModelService, TorchService

torch = pytest.importorskip("torch")  # the ``gpu`` extra; tests need no GPU, only torch

MIB = 2**20


def reward_model(seed: int, width: int = 64) -> torch.nn.Module:
    """A small reward head, seeded by its own generator.

    Not ``torch.manual_seed``: the pool loads services concurrently in worker threads, and
    the global generator shared between them would make the weights depend on timing.
    """
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.BatchNorm1d(width),  # buffers too, one of them int64
        torch.nn.LayerNorm(width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        norm = model[1]
        assert isinstance(norm, torch.nn.BatchNorm1d)
        assert norm.running_mean is not None and norm.running_var is not None
        norm.running_mean.copy_(torch.randn(width, generator=generator))
        norm.running_var.uniform_(0.5, 2.0, generator=generator)
    return model.eval()


def torch_service(name: str, seed: int, memory: str = "1MiB", **kw: Any) -> TorchService:
    return TorchService(name, lambda: reward_model(seed), memory=memory, **kw)


def inputs(seed: int, rows: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=generator)


class GatedService(ModelService):
    """A fake service whose runs wait on a gate: to hold actions open at will."""

    def __init__(self, name: str, memory: str = "1MiB", **kw: Any) -> None:
        super().__init__(name, memory=memory, **kw)
        self.gate = anyio.Event()
        self.runs: list[tuple[int, int]] = []  # (replica, batches merged)
        self.started = anyio.Event()

    async def load(self) -> None:
        pass

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        pass

    async def evict(self, replica: int) -> None:
        pass

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        self.runs.append((replica, len(batches)))
        self.started.set()
        await self.gate.wait()
        return [f"{self.name}:{b}" for b in batches]


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


class FailingOnce(TorchService):
    """Fails its first allocation as CUDA would when the device is full."""

    failures = 1

    def _allocate(self, target: torch.device, nbytes: int | None = None) -> torch.Tensor:
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return super()._allocate(target, nbytes)


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


class SpyRuntime(tangram.Runtime):
    """Records the estimate each memory grant was asked with."""

    estimates: list[float | None]

    def acquire(self, *args: Any, **kwargs: Any) -> tangram.AcquireContext:
        self.estimates.append(kwargs.get("estimate"))
        return super().acquire(*args, **kwargs)


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


# -- the scheduling bullets, each a test that fails when the behaviour goes ---------------


class SlowRestore(GatedService):
    """Restores take ``delay`` seconds: time the pool must count in the action's ACT."""

    def __init__(self, name: str, delay: float, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.delay = delay
        self.restored: list[tuple[str, ...]] = []

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        self.restored.append(tuple(d.name for d in devices))
        await anyio.sleep(self.delay)


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
    service = GatedService("judge", batching=batching, max_batch=max_batch)
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
            # The second action joined the first replica rather than start another.
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


# -- pipeline replicas: one TorchService across several devices ----------------------------


def deep_model(seed: int, width: int = 64) -> torch.nn.Sequential:
    """Seven layers, four with weights, seeded by its own generator (see reward_model)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 1),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


class TwoPart(torch.nn.Module):
    """Not a Sequential: a ``split`` function names its stages."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = deep_model(seed)[:5]
        self.head = deep_model(seed)[5:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.anyio
async def test_a_pipeline_replica_spans_devices_too_small_for_the_whole_model() -> None:
    whole = sum(t.numel() * t.element_size() for t in deep_model(1).state_dict().values())
    pipe = TorchService("pipe", lambda: deep_model(1), gpus=2)
    # Each device holds a little more than half the model: it only fits split in two.
    size = int(whole * 0.75)
    devices = [Device(f"cpu:{i}", size) for i in range(4)]
    # Four services rather than four replicas of one: a newcomer may queue on a busy
    # replica when its line is shorter than a restore, which would leave a device free.
    others = [TorchService(f"o{i}", lambda: reward_model(7), memory=size) for i in range(4)]
    x = inputs(0)
    expected = deep_model(1)(x).detach()
    pool = GpuPool([pipe, *others], devices=devices, links=[(0, 1), (2, 3)], warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        assert len(pipe.stage_bytes) == 2
        assert max(pipe.stage_bytes) < whole and sum(pipe.stage_bytes) >= whole
        assert pipe.memory is not None and pipe.memory <= size
        host = {k: v.data_ptr() for k, v in pipe.host_state().items()}
        assert set(host) == set(deep_model(1).state_dict())  # the module's own names
        for _round_trip in range(4):
            await wait_until(lambda: all(u["granted"] == 0 for u in pool.usage().values()))
            async with pool.use("pipe") as svc:
                names = tuple(d.name for d in svc.devices)
                assert names in {("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")}
                for name in names:
                    assert runtime.stats().resources[f"gpu_mem:{name}"].held == pipe.memory
                assert torch.equal(await svc(x), expected)
                state = pipe.replica_state(svc.replica)
                assert state.keys() == host.keys()
                assert all(state[k].data_ptr() != host[k] for k in state)
            # Four other services fill every device: the pipeline is evicted.
            await wait_until(lambda: pool.service_stats()["pipe"]["replicas_live"] == 0)
            async with anyio.create_task_group() as tg:
                for other in others:
                    tg.start_soon(use_once, pool, other.name)
            assert pool.residency()["pipe"] == []
            assert all(len(pool.residency()[other.name]) == 1 for other in others)
            # The pipeline was evicted once though two restores needed its room.
            assert all(u["resident"] == size for u in pool.usage().values())
        stats = pool.service_stats()["pipe"]
        assert stats["restores"] == 4 and stats["evictions"] == 4
        assert {k: v.data_ptr() for k, v in pipe.host_state().items()} == host
    with pytest.raises(GpuOutOfMemoryError, match="whole"):
        async with GpuPool([TorchService("whole", lambda: deep_model(1))], devices=devices):
            pass


async def use_once(pool: GpuPool, name: str) -> None:
    async with pool.use(name) as svc:
        await svc(inputs(1))


@pytest.mark.anyio
async def test_pipeline_residency_is_counted_on_every_device_of_the_replica() -> None:
    pipe = TorchService("pipe", lambda: deep_model(2), gpus=2, memory="1MiB")
    single = torch_service("single", 3)
    pool = GpuPool([pipe, single], devices=[Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")])
    x = inputs(4)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        async with pool.use("pipe") as svc:
            assert torch.equal(await svc(x), deep_model(2)(x).detach())
        assert [u["resident"] for u in pool.usage().values()] == [MIB, MIB]
        async with pool.use("single") as svc:  # evicts the pipeline from both devices
            await svc(x)
        assert sorted(u["resident"] for u in pool.usage().values()) == [0, MIB]
        assert pool.residency()["pipe"] == []
        async with pool.use("pipe") as svc:
            assert torch.equal(await svc(x), deep_model(2)(x).detach())
        assert pool.residency() == {"pipe": [("cpu:0", "cpu:1")], "single": []}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "split", [[1, 6], [6, 1], lambda m: [m[:3], m[3:]]], ids=["counts", "counts-late", "fn"]
)
async def test_a_pipeline_split_by_counts_or_function_is_exact(split: Any) -> None:
    pipe = TorchService("pipe", lambda: deep_model(5), gpus=2, split=split)
    pool = GpuPool([pipe], devices=[Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")])
    x = inputs(6, rows=5)
    first = 16 * 64 * 4 + 64 * 4  # the first Linear, weight and bias
    async with pool, tangram.Runtime(capacity=pool.capacity()), pool.use("pipe") as svc:
        assert torch.equal(await svc(x), deep_model(5)(x).detach())
        assert (pipe.stage_bytes[0] == first) is (split == [1, 6])


class Tied(torch.nn.Module):
    """Two layers sharing one weight: a split puts them on different devices."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(11)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def tied_stages(model: torch.nn.Module) -> list[torch.nn.Module]:
    assert isinstance(model, Tied)
    return [model.a, torch.nn.Sequential(torch.nn.Tanh(), model.b)]


@pytest.mark.anyio
async def test_a_split_function_cuts_any_module_and_tied_weights_are_copied_per_stage() -> None:
    two = TorchService("two", lambda: TwoPart(8), gpus=2, split=lambda m: [m.body, m.head])
    tied = TorchService("tied", lambda: Tied().eval(), gpus=2, split=tied_stages)
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    x = inputs(9)
    pool = GpuPool([two, tied], devices=devices)
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        for name, model in (("two", TwoPart(8)), ("tied", Tied())):
            for _ in range(2):
                async with pool.use(name) as svc:
                    assert torch.equal(await svc(x), model.eval()(x).detach())
        assert set(two.host_state()) == set(TwoPart(8).state_dict())
        # The shared weight is in both stages' regions: 16x16 floats twice, biases once.
        assert tied.stage_bytes == [16 * 16 * 4 + 16 * 4] * 2
        assert set(tied.host_state()) == {"a.weight", "a.bias", "b.bias"}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("service", "match"),
    [
        (lambda: TorchService("p", lambda: TwoPart(1), gpus=2), "nn.Sequential"),
        (lambda: TorchService("p", lambda: deep_model(1), gpus=2, split=[2, 2]), "covers 4"),
        (
            lambda: TorchService("p", lambda: deep_model(1), gpus=2, split=lambda m: [m]),
            "2 modules",
        ),
        (lambda: TorchService("p", lambda: deep_model(1)[:1], gpus=2), "1 layers for 2"),
        (
            lambda: TorchService("p", Tied, gpus=2, split=tied_stages, writeback=True),
            "share 'a.weight'",
        ),
    ],
    ids=["not-sequential", "bad-counts", "bad-function", "too-few-layers", "writeback-tied"],
)
async def test_a_bad_split_fails_clearly_when_the_pool_loads(
    service: Callable[[], TorchService], match: str
) -> None:
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    with pytest.raises(gpu.GpuServiceError, match=match):
        async with GpuPool([service()], devices=devices):
            pass


def test_split_arguments_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="split"):
        TorchService("p", lambda: deep_model(1), gpus=2, split=[7])
    with pytest.raises(ValueError, match="split"):
        TorchService("p", lambda: deep_model(1), gpus=2, split=[0, 7])
    with pytest.raises(ValueError, match="gpus"):
        TorchService("p", lambda: deep_model(1), gpus=0)


class FailsOnSecondStage(TorchService):
    """The second stage's allocation fails, as a full second GPU would."""

    failures = 1

    def _allocate(self, target: torch.device, nbytes: int | None = None) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        if self.failures and self.calls == 2:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")
        return super()._allocate(target, nbytes)


@pytest.mark.anyio
async def test_a_pipeline_restore_failing_on_one_stage_holds_nothing_on_any() -> None:
    pipe = FailsOnSecondStage("pipe", lambda: deep_model(3), gpus=2, memory="1MiB")
    devices = [Device("cpu:0", "1MiB"), Device("cpu:1", "1MiB")]
    pool = GpuPool([pipe], devices=devices, warm=False)
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        with pytest.raises(GpuOutOfMemoryError, match="cpu:0, cpu:1"):
            async with pool.use("pipe") as svc:
                await svc(inputs(0))
        assert pipe.replica_state(0) == {}
        assert all(u["resident"] == 0 and u["granted"] == 0 for u in pool.usage().values())
        assert all(runtime.stats().resources[d.kind].held == 0 for d in devices)
        async with pool.use("pipe") as svc:
            assert torch.equal(await svc(inputs(0)), deep_model(3)(inputs(0)).detach())


@pytest.mark.anyio
async def test_pipeline_replicas_scale_out_on_free_nvlink_pairs() -> None:
    pipe = TorchService("pipe", lambda: deep_model(4), gpus=2, max_replicas=2, memory="1MiB")
    devices = [Device(f"cpu:{i}", "1MiB") for i in range(4)]
    pool = GpuPool([pipe], devices=devices, links=[(0, 2), (1, 3)])
    x = inputs(2)
    expected = deep_model(4)(x).detach()
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        placed: list[tuple[str, ...]] = []
        both = anyio.Event()

        async def action() -> None:
            async with pool.use("pipe") as svc:
                placed.append(tuple(d.name for d in svc.devices))
                if len(placed) == 2:
                    both.set()
                await both.wait()  # both actions are in: two replicas live at once
                assert torch.equal(await svc(x), expected)

        async with anyio.create_task_group() as tg:
            tg.start_soon(action)
            tg.start_soon(action)
        assert sorted(placed) == [("cpu:0", "cpu:2"), ("cpu:1", "cpu:3")]
        assert sorted(pool.residency()["pipe"]) == sorted(placed)


class Bound(GatedService):
    """A gated service bound to one device, as a server started on its GPU is."""

    def __init__(self, name: str, device: str) -> None:
        super().__init__(name)
        self.device = device

    def slots(self) -> Sequence[tuple[str, ...]]:
        return [(self.device,)]


@pytest.mark.anyio
async def test_a_multi_gpu_replica_waits_for_one_nvlink_group_rather_than_straddle_two() -> None:
    x, y = Bound("x", "cpu:1"), Bound("y", "cpu:2")
    pipe = TorchService("pipe", lambda: deep_model(6), gpus=2, memory="1MiB")
    devices = [Device(f"cpu:{i}", "1MiB") for i in range(4)]
    # NVLink pairs 0-1 and 2-3; x and y run on 1 and 2, so only 0 and 3 have room now.
    pool = GpuPool([x, y, pipe], devices=devices, links=[(0, 1), (2, 3)])
    async with pool, tangram.Runtime(capacity=pool.capacity()):
        placed: list[tuple[str, ...]] = []

        async def action(name: str) -> None:
            async with pool.use(name) as svc:
                placed.append(tuple(d.name for d in svc.devices))
                if name == "pipe":
                    assert torch.equal(await svc(inputs(0)), deep_model(6)(inputs(0)).detach())
                else:
                    await svc(0)

        async with anyio.create_task_group() as tg:
            for service in (x, y):
                tg.start_soon(action, service.name)
                await service.started.wait()
            tg.start_soon(action, "pipe")
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            assert placed == [("cpu:1",), ("cpu:2",)]  # the pipeline waits
            x.gate.set()
            y.gate.set()
        assert placed[2] in {("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")}


def test_the_default_split_makes_the_largest_stage_as_small_as_it_can_be() -> None:
    from tangram._gpu._torch import _balance

    assert _balance([5, 1, 1, 1, 5], 3) == [1, 3, 1]
    assert max(sum(run) for run in _runs([5, 1, 1, 1, 5], _balance([5, 1, 1, 1, 5], 2))) == 7
    sizes = [0, 4, 0, 4, 0, 4, 0, 4]
    counts = _balance(sizes, 4)
    assert min(counts) >= 1 and [sum(run) for run in _runs(sizes, counts)] == [4, 4, 4, 4]
    assert _balance([9, 1, 1, 1], 4) == [1, 1, 1, 1]
    # A greedy cut at half the total (9 | 1 1 1 ... ) would leave 9 + 1 in one stage.
    assert _balance([1, 9, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [2, 8]


def _runs(sizes: list[int], counts: list[int]) -> list[list[int]]:
    runs, at = [], 0
    for count in counts:
        runs.append(sizes[at : at + count])
        at += count
    return runs


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
