"""Pipeline replicas: one ``TorchService`` across several devices, its stages split.

CPU devices stand in for GPUs (see ``tests/test_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
from _gpu_models import MIB, GatedService, inputs, reward_model, seeded, torch_service
from conftest import wait_until

import tangram
from tangram import gpu
from tangram.gpu import Device, GpuOutOfMemoryError, GpuPool, TorchService

torch = pytest.importorskip("torch")  # the ``gpu`` extra; tests need no GPU, only torch


# -- pipeline replicas: one TorchService across several devices ----------------------------


def deep_model(seed: int, width: int = 64) -> torch.nn.Sequential:
    """Seven layers, four with weights, seeded by its own generator (see ``seeded``)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 1),
    )
    seeded(model, seed)
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
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        seeded(self, 11)
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
