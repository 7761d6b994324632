"""The GPU pool given what users really hand it: factories that seed torch's global
generator, a malformed batch among good ones, a declared ``memory`` smaller than the
model, a handle kept past its block, and bad arguments (issue #20).

Real torch modules on ``Device("cpu:N", memory=...)`` budgets; no GPU is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from conftest import assert_idle, wait_until

import tangram
from tangram.errors import TangramError
from tangram.gpu import (
    Device,
    GpuOutOfMemoryError,
    GpuPool,
    GpuPoolClosedError,
    GpuServiceError,
    TorchService,
    VllmService,
)

torch = pytest.importorskip("torch")

MIB = 2**20


def seeded_model(seed: int) -> torch.nn.Module:
    """A factory as users write them: seed the global generator, then build.

    Every layer's default initialisation draws from that generator, so two of these
    running at once in the pool's loader threads would mix their draws.
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(48, 48) for _ in range(6)))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the race is in threads, not the loop
async def test_factories_that_seed_build_what_a_serial_build_does() -> None:
    seeds = range(12)
    expected = {seed: seeded_model(seed).state_dict() for seed in seeds}
    # Before factories were run one at a time, 35 pools of 40 got mixed weights here.
    for _ in range(6):
        services = [TorchService(f"m{s}", functools.partial(seeded_model, s)) for s in seeds]
        async with GpuPool(services, devices=[Device("cpu:0", "64MiB")], warm=False):
            for seed, service in zip(seeds, services, strict=True):
                host = service.host_state()
                for name, tensor in expected[seed].items():
                    assert torch.equal(host[name], tensor), (seed, name)


class GatedTorch(TorchService):
    """A real torch service whose first run waits on a gate, so later calls queue up
    and are merged into one run; records how many batches each run merged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = anyio.Event()
        self.started = anyio.Event()
        self.merged: list[int] = []

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        self.merged.append(len(batches))
        if len(self.merged) == 1:
            self.started.set()
            await self.gate.wait()
        return await super().run(replica, batches)


def small_model() -> torch.nn.Module:
    generator = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval()


def rows(seed: int, count: int = 4, width: int = 16) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.anyio
async def test_a_malformed_batch_fails_only_its_own_caller() -> None:
    service = GatedTorch("judge", small_model, memory="1MiB")
    pool = GpuPool([service], devices=[Device("cpu:0", "4MiB")])
    good = {k: rows(k) for k in range(4)}
    expected = {k: small_model()(x).detach() for k, x in good.items()}
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    async def action(k: int, batch: torch.Tensor) -> None:
        async with pool.use("judge") as svc:
            try:
                results[k] = await svc(batch)
            except GpuServiceError as exc:
                errors[k] = exc

    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        async with anyio.create_task_group() as tg:
            tg.start_soon(action, 0, good[0])
            await service.started.wait()
            for k in (1, 2, 3):
                tg.start_soon(action, k, good[k])
            tg.start_soon(action, 9, rows(9, width=7))  # the wrong width for the first layer
            replica = pool._services["judge"].replicas[0]
            await wait_until(lambda: len(replica.pending) == 4)
            service.gate.set()
        assert service.merged[:2] == [1, 4]  # the four were merged into one run
        assert sorted(results) == [0, 1, 2, 3]
        for k, out in results.items():
            assert torch.equal(out, expected[k])
        assert list(errors) == [9]
        assert "judge" in str(errors[9])
        await wait_until(lambda: pool.service_stats()["judge"]["replicas_live"] == 0)
        assert_idle(runtime)


@pytest.mark.anyio
async def test_a_call_in_a_run_when_the_pool_closes_fails_as_closed() -> None:
    service = GatedTorch("judge", small_model, memory="1MiB")
    pool = GpuPool([service], devices=[Device("cpu:0", "4MiB")])
    caught: list[BaseException] = []

    async def action() -> None:
        async with pool.use("judge") as svc:
            try:
                await svc(rows(0))
            except GpuPoolClosedError as exc:
                caught.append(exc)

    runtime = tangram.Runtime(capacity=pool.capacity())
    async with runtime:
        async with anyio.create_task_group() as tg, pool:
            tg.start_soon(action)
            await service.started.wait()  # the call is in a run, out of the queue
        assert len(caught) == 1
        await wait_until(lambda: runtime.stats().resources["gpu_mem:cpu:0"].held == 0)
        assert_idle(runtime)


@pytest.mark.anyio
async def test_a_service_larger_than_every_device_is_refused_in_human_units() -> None:
    pool = GpuPool(
        [TorchService("big", small_model, memory="8MiB")], devices=[Device("cpu:0", "4MiB")]
    )
    with pytest.raises(GpuOutOfMemoryError) as caught:
        async with pool:
            pytest.fail("a service no device can hold must not start")
    message = str(caught.value)
    assert "8MiB" in message and "4MiB" in message, message
    assert str(8 * MIB) not in message


@pytest.mark.anyio
async def test_a_declared_memory_smaller_than_the_model_is_refused_with_both_sizes() -> None:
    # 5 MB of float32 weights declared as 1 KiB: a restore would overrun its grant.
    service = TorchService("big", lambda: torch.nn.Linear(1120, 1120), memory="1KiB")
    pool = GpuPool([service], devices=[Device("cpu:0", "64MiB")])
    with pytest.raises(GpuOutOfMemoryError) as caught:
        async with pool:
            pytest.fail("a model larger than its declared memory must not load")
    message = str(caught.value)
    assert "big" in message and "1KiB" in message and "4.79MiB" in message, message
    assert "bytes" not in message
    assert pool.usage()["cpu:0"]["resident"] == 0
    # A declared size that holds the tensors is accepted as it is.
    fits = TorchService("fits", lambda: torch.nn.Linear(1120, 1120), memory="6MiB")
    async with GpuPool([fits], devices=[Device("cpu:0", "64MiB")]) as pool:
        assert fits.memory == 6 * MIB
        async with tangram.Runtime(capacity=pool.capacity()), pool.use("fits") as svc:
            assert (await svc(torch.zeros(2, 1120))).shape == (2, 1120)


@pytest.mark.anyio
async def test_a_handle_used_after_its_block_raises_while_the_replica_still_serves() -> None:
    service = GatedTorch("judge", small_model, memory="1MiB")
    service.gate.set()
    pool = GpuPool([service], devices=[Device("cpu:0", "4MiB")])
    async with pool, tangram.Runtime(capacity=pool.capacity()), pool.use("judge") as other:
        async with pool.use("judge") as svc:
            await svc(rows(0))
        runs = len(service.merged)
        # The replica is still live (another action is on it); the handle is not.
        with pytest.raises(GpuPoolClosedError, match="inside"):
            await svc(rows(1))
        assert len(service.merged) == runs
        await other(rows(2))


def test_device_arguments_fail_as_tangram_errors_with_the_value() -> None:
    for memory in (-1, 0, float("nan")):
        with pytest.raises(ValueError, match=r"memory.*got") as caught:
            Device("cpu:0", memory=memory)
        assert isinstance(caught.value, TangramError)
    for memory in ([1], None, True):
        with pytest.raises(TypeError, match=r"memory.*got") as caught:
            Device("cpu:0", memory=memory)  # type: ignore[arg-type]
        assert isinstance(caught.value, TangramError)
    with pytest.raises(ValueError, match="not a size") as caught:
        Device("cpu:0", memory="lots")
    assert isinstance(caught.value, TangramError)
    for name in ("", 3):
        with pytest.raises(TypeError, match="name") as caught:
            Device(name, memory=1)  # type: ignore[arg-type]
        assert isinstance(caught.value, TangramError)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"factory": 3}, TypeError, "factory"),
        ({"memory": -5}, ValueError, "memory"),
        ({"memory": [1]}, TypeError, "memory"),
        ({"headroom": -0.5}, ValueError, "headroom"),
        ({"max_replicas": 0}, ValueError, "max_replicas"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"gpus": 0}, ValueError, "gpus"),
        ({"batching": "yes"}, TypeError, "batching"),
        ({"writeback": True, "max_replicas": 2}, ValueError, "writeback"),
        ({"split": [0]}, ValueError, "split"),
        ({"name": ""}, TypeError, "name"),
    ],
)
def test_torch_service_arguments_fail_as_tangram_errors(
    kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    arguments: dict[str, Any] = {"name": "m", "factory": small_model, **kwargs}
    with pytest.raises(error, match=words) as caught:
        TorchService(arguments.pop("name"), arguments.pop("factory"), **arguments)
    assert isinstance(caught.value, TangramError)
    assert "got" in str(caught.value)


def test_pool_arguments_fail_as_tangram_errors() -> None:
    service = TorchService("m", small_model)
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"services": [service, TorchService("m", small_model)]}, ValueError),
        ({"services": ["m"]}, TypeError),
        ({"devices": []}, TypeError),
        ({"devices": ["cpu:0"]}, TypeError),
        ({"devices": [Device("cpu:0", 1), Device("cpu:0", 2)]}, ValueError),
        ({"warm": "no"}, TypeError),
        ({"runtime": "current"}, TypeError),
        ({"links": [(0, "1")]}, TypeError),
        ({"links": [(0, 1, 2)]}, TypeError),
    ]
    for kwargs, error in cases:
        arguments: dict[str, Any] = {"services": [service], **kwargs}
        with pytest.raises(error) as caught:
            GpuPool(arguments.pop("services"), **arguments)
        assert isinstance(caught.value, TangramError), kwargs
        assert "got" in str(caught.value), kwargs


def test_http_service_arguments_fail_as_tangram_errors() -> None:
    cases: list[tuple[Any, dict[str, Any], type[Exception]]] = [
        ({}, {"memory": "1GiB"}, ValueError),
        ({"http://a": ["cuda:0"], "http://b": ["cuda:1", "cuda:2"]}, {"memory": 1}, ValueError),
        ({"http://a": []}, {"memory": 1}, ValueError),
        ({"http://a": ["cuda:0"]}, {"memory": -1}, ValueError),
        ({"http://a": ["cuda:0"]}, {"memory": 1, "timeout": 0}, ValueError),
        ({"http://a": ["cuda:0"]}, {"memory": 1, "request": "post"}, TypeError),
        (["http://a"], {"memory": 1}, TypeError),
        ({"http://a": "cuda:0"}, {"memory": 1}, TypeError),
    ]
    for servers, kwargs, error in cases:
        with pytest.raises(error) as caught:
            VllmService("llm", servers, **kwargs)
        assert isinstance(caught.value, TangramError), (servers, kwargs)
        assert "got" in str(caught.value), (servers, kwargs)
