"""GPU model services under evict-on-execution: restore bandwidth, shared-GPU ACT, overhead.

One script for a lent GPU (``python benchmarks/gpu_services.py``); without CUDA it runs on
the host (``cpu:N`` devices with simulated budgets, use ``--quick``), says so in its
figures, and labels its targets as measured on the CPU. The last stdout line is one JSON
object: ``{"bench": "gpu_services", "figures": {...}, "targets": {...}}``.

- restore bandwidth: bytes restored per second by :class:`TorchService` (pinned host
  buffers, non-blocking copies) against a plain pinned host-to-device copy of the same
  bytes. Goal >= 0.8.
- ACT: N services sharing K devices against N dedicated devices, same actions.
- overhead share: restore seconds over total ACT in the shared run. Goal <= 0.1.
- pipeline restore (a figure, no goal): a ``gpus=2`` service restored onto two devices
  (two GPUs when there are two, else two slices of one) against plain copies of its two
  regions.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import anyio
import torch

import tangram
from tangram.gpu import Device, GpuPool, TorchService


def model(seed: int, width: int, layers: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    net = torch.nn.Sequential(*mods, torch.nn.Linear(width, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return net


class Timed(TorchService):
    """Counts the seconds spent restoring and evicting: the EOE overhead of an action."""

    overhead = 0.0

    def _restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        started = time.perf_counter()
        try:
            super()._restore(replica, devices)
        finally:
            Timed.overhead += time.perf_counter() - started

    def _evict(self, replica: int) -> None:
        started = time.perf_counter()
        try:
            super()._evict(replica)
        finally:
            Timed.overhead += time.perf_counter() - started


def devices(count: int, memory: int, cuda: bool) -> list[Device]:
    """``count`` devices: real GPUs while there are enough, else slices of the ones there
    are (``cuda:0/3``), each with its own budget; on the host, ``cpu:N`` budgets."""
    if not cuda:
        return [Device(f"cpu:{i}", memory, i) for i in range(count)]
    n = torch.cuda.device_count()
    if count <= n:
        return [Device(f"cuda:{i}", memory, i) for i in range(count)]
    return [Device(f"cuda:{i % n}/{i // n}", memory, i) for i in range(count)]


def plain_copy_seconds(src: torch.Tensor, target: str) -> float:
    """One plain host-to-device copy of ``src`` into fresh device memory."""
    started = time.perf_counter()
    dst = torch.empty_like(src, device=target)
    dst.copy_(src, non_blocking=True)
    if target.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


async def bandwidths(
    width: int, layers: int, target: str, repeats: int, pinned: bool
) -> tuple[float, float, int]:
    """Best restore and best plain copy of the same bytes, measured alternately.

    Alternating keeps both under the same cache, allocator and clock state; the plain
    copy's source is pinned exactly when the service's host buffer is.
    """
    service = TorchService("m", lambda: model(0, width, layers), empty_cache=False)
    await service.load()
    dev = Device(target if target.startswith("cuda") else "cpu:0", 2**40)
    src = torch.empty(service.nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    restore = copy = float("inf")
    for _ in range(repeats):
        copy = min(copy, plain_copy_seconds(src, target))
        started = time.perf_counter()
        await service.restore(0, (dev,))
        restore = min(restore, time.perf_counter() - started)
        await service.evict(0)
    return service.nbytes / restore, service.nbytes / copy, service.nbytes


async def pipeline_bandwidths(
    width: int, layers: int, cuda: bool, repeats: int
) -> tuple[float, float, int]:
    """A two-stage pipeline replica's restore against plain copies of its two regions.

    On two GPUs the stages fill both devices at once; on one GPU (two slices of it) and on
    the host they share one bus, and the figure shows what splitting costs there.
    """
    service = TorchService("pipe", lambda: model(0, width, layers), gpus=2, empty_cache=False)
    await service.load()
    pair = tuple(devices(2, 2**40, cuda))
    sources = []
    for size in service.stage_bytes:
        src = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        src.fill_(1)
        sources.append(src)
    nbytes = sum(service.stage_bytes)
    restore = copy = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        copies = []
        for src, device in zip(sources, pair, strict=True):
            dst = torch.empty_like(src, device=device.torch_device)
            dst.copy_(src, non_blocking=True)
            copies.append(dst)
        if cuda:
            for device in pair:
                torch.cuda.synchronize(device.torch_device)
        copy = min(copy, time.perf_counter() - started)
        del copies
        started = time.perf_counter()
        await service.restore(0, pair)
        restore = min(restore, time.perf_counter() - started)
        await service.evict(0)
    return nbytes / restore, nbytes / copy, nbytes


async def act(
    n: int, k: int, actions: int, width: int, layers: int, rows: int, cuda: bool
) -> dict[str, Any]:
    """Mean ACT of ``actions`` arriving every 2 ms on random services of ``n``, ``k`` devices.

    Same seed, same arrivals for shared and dedicated, so the ratio is the price of
    sharing: restores and queueing for memory.
    """
    # Only in-process services share the devices here: keep freed blocks in torch's cache.
    services = [
        Timed(f"s{i}", lambda i=i: model(i, width, layers), empty_cache=False) for i in range(n)
    ]
    probe = TorchService("p", lambda: model(0, width, layers))
    await probe.load()
    assert probe.memory is not None
    # Room for two services per device when shared, one each when dedicated.
    per_device = probe.memory * (2 if k < n else 1) + 1
    pool = GpuPool(services, devices=devices(k, per_device, cuda), links=[])
    x = torch.randn(rows, width)
    rng = random.Random(0)
    acts: list[float] = []
    Timed.overhead = 0.0
    async with pool, tangram.Runtime(capacity=pool.capacity()):

        async def one(i: int) -> None:
            started = time.perf_counter()
            async with pool.use(f"s{i}") as svc:
                await svc(x)
            acts.append(time.perf_counter() - started)

        async with anyio.create_task_group() as tg:
            for _ in range(actions):
                tg.start_soon(one, rng.randrange(n))
                await anyio.sleep(0.002)
    total = sum(acts)
    return {
        "mean_act_s": total / len(acts),
        "restore_evict_s": Timed.overhead,
        "overhead_share": Timed.overhead / total if total else 0.0,
    }


async def main_async(quick: bool) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    target = "cuda:0" if cuda else "cpu"
    width, layers = (1024, 8) if quick else (4096, 16)
    repeats = 5 if quick else 20
    restore_bw, copy_bw, nbytes = await bandwidths(width, layers, target, repeats, cuda)
    pipe_bw, pipe_copy_bw, pipe_bytes = await pipeline_bandwidths(width, layers, cuda, repeats)
    n, k = (4, 2) if quick else (8, 2)
    actions = 40 if quick else 400
    rows = 32 if quick or not cuda else 1024
    shared = await act(n, k, actions, width, layers, rows, cuda)
    dedicated = await act(n, n, actions, width, layers, rows, cuda)
    ratio = restore_bw / copy_bw
    overhead = shared["overhead_share"]
    on = "" if cuda else " (measured on CPU: no GPU present)"
    figures = {
        "gpu_present": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (no GPU present)",
        "restore_bytes": nbytes,
        "restore_gbps": round(restore_bw / 1e9, 3),
        "pinned_copy_gbps": round(copy_bw / 1e9, 3),
        "copy_source_pinned": cuda,
        "physical_gpus": torch.cuda.device_count() if cuda else 0,
        "pipeline_restore_bytes": pipe_bytes,
        "pipeline_restore_gbps": round(pipe_bw / 1e9, 3),
        "pipeline_copy_gbps": round(pipe_copy_bw / 1e9, 3),
        "pipeline_restore_vs_copy": round(pipe_bw / pipe_copy_bw, 3),
        "services": n,
        "rows_per_action": rows,
        "shared_devices": k,
        "shared": shared,
        "dedicated": dedicated,
        "act_shared_over_dedicated": round(shared["mean_act_s"] / dedicated["mean_act_s"], 3),
        "torch": torch.__version__,
    }
    targets = {
        "restore_vs_pinned_copy": {
            "value": round(ratio, 3),
            "goal": ">= 0.8" + on,
            "met": ratio >= 0.8,
        },
        "overhead_share_of_act": {
            "value": round(overhead, 3),
            "goal": "<= 0.1" + on,
            "met": overhead <= 0.1,
        },
    }
    return {"bench": "gpu_services", "figures": figures, "targets": targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few actions")
    args = parser.parse_args()
    result = anyio.run(main_async, args.quick)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
