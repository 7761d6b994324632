"""Models and fake services shared by the GPU pool's tests (``tests/test_gpu*.py``).

Real torch modules, small and seeded, and fakes of ``ModelService`` that hold actions
open or time restores: no GPU is needed (see ``tests/test_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

import tangram
from tangram.gpu import Device, ModelService, TorchService

torch = pytest.importorskip("torch")  # the ``gpu`` extra; tests need no GPU, only torch

MIB = 2**20


def reward_model(seed: int, width: int = 64) -> torch.nn.Module:
    """A small reward head, seeded by its own generator (see ``seeded``)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.BatchNorm1d(width),  # buffers too, one of them int64
        torch.nn.LayerNorm(width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )
    generator = seeded(model, seed)
    with torch.no_grad():
        norm = model[1]
        assert isinstance(norm, torch.nn.BatchNorm1d)
        assert norm.running_mean is not None and norm.running_var is not None
        norm.running_mean.copy_(torch.randn(width, generator=generator))
        norm.running_var.uniform_(0.5, 2.0, generator=generator)
    return model.eval()


def seeded(model: torch.nn.Module, seed: int) -> torch.Generator:
    """Set ``model``'s weights from a generator of its own, seeded, and return it for what
    else the caller draws. Not ``torch.manual_seed``: the pool loads services
    concurrently in worker threads, and the global generator shared between them would
    make the weights depend on timing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return generator


def torch_service(name: str, seed: int, memory: str = "1MiB", **kw: Any) -> TorchService:
    return TorchService(name, lambda: reward_model(seed), memory=memory, **kw)


def inputs(seed: int, rows: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=generator)


class GatedService(ModelService):
    """A fake service whose runs wait on a gate: to hold actions open at will."""

    def __init__(self, name: str, memory: str = "1MiB", seconds: float = 0.0, **kw: Any) -> None:
        super().__init__(name, memory=memory, **kw)
        self.seconds = seconds  # each run's time once the gate is open
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
        await anyio.sleep(self.seconds)
        return [f"{self.name}:{b}" for b in batches]


class FailingOnce(TorchService):
    """Fails its first allocation as CUDA would when the device is full."""

    failures = 1

    def _allocate(self, target: torch.device, nbytes: int | None = None) -> torch.Tensor:
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return super()._allocate(target, nbytes)


class SpyRuntime(tangram.Runtime):
    """Records the estimate each memory grant was asked with."""

    estimates: list[float | None]

    def acquire(self, *args: Any, **kwargs: Any) -> tangram.AcquireContext:
        self.estimates.append(kwargs.get("estimate"))
        return super().acquire(*args, **kwargs)


class SlowRestore(GatedService):
    """Restores take ``delay`` seconds: time the pool must count in the action's ACT."""

    def __init__(self, name: str, delay: float, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.delay = delay
        self.restored: list[tuple[str, ...]] = []

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        self.restored.append(tuple(d.name for d in devices))
        await anyio.sleep(self.delay)
