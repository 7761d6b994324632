"""Soak: memory does not grow with the number of completed actions.

A rollout service runs for days; anything the runtime keeps per action (a stats sample,
an estimator observation, a lease, a cached demand) must be bounded or it is a leak. The
test runs a warm-up of N actions (enough to fill every bounded window: the stats keep the
last 2048 samples per kind), measures the traced memory, runs 10N more and measures
again: the growth, scaled to 100k actions, must stay under a bound far below what one
retained object per action would cost (a lease alone is a few hundred bytes, so keeping
one per action would add tens of MiB per 100k).

The workload mixes kinds, elastic and rigid demands, failures, cancellations and wait
timeouts, on asyncio with zero-length bodies (the clock does not matter to memory).
``TANGRAM_LONG=1`` makes it a 10-minute soak: it repeats the measured phase until then,
checking after each phase.
"""

from __future__ import annotations

import gc
import os
import random
import time
import tracemalloc

import anyio
import anyio.lowlevel
import pytest

import tangram
from tangram.errors import WaitTimeoutError
from tangram.testing import check_idle

LONG = os.environ.get("TANGRAM_LONG") == "1"
WARMUP = 2_500
MEASURED = 10 * WARMUP
SOAK_SECONDS = 600.0 if LONG else 0.0
MAX_GROWTH_KIB_PER_100K = 1024.0
KINDS = ("run_tests",)
"""One kind, so that the warm-up fills its stats window (2048 samples); more kinds only
take longer to fill, and each is bounded the same way."""


async def soak_workload(runtime: tangram.Runtime, actions: int, seed: int) -> None:
    r = random.Random(seed)
    budget = [actions]

    async def worker() -> None:
        while budget[0] > 0:
            budget[0] -= 1
            demand: dict[str, object] = r.choice(
                [
                    {"cpu": 1},
                    {"cpu": tangram.Elastic(1, 4)},
                    {"cpu": tangram.Elastic(1, 8, resizable=True), "mem": "1GiB"},
                    {"cpu": 2, "mem": "2GiB"},
                ]
            )
            fate = r.random()
            try:
                with anyio.move_on_after(0 if fate < 0.05 else float("inf")):
                    async with runtime.acquire(
                        demand,
                        kind=r.choice(KINDS),
                        trajectory=f"t{r.randrange(10**9)}",
                        wait_timeout=0 if fate > 0.97 else None,
                    ):
                        await anyio.lowlevel.checkpoint()
                        if fate < 0.15:
                            raise ValueError("the tool failed")
            except (ValueError, WaitTimeoutError):
                pass

    async with anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(worker)


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def measure_growth(warmup: int, measured: int, soak_seconds: float = 0.0) -> list[float]:
    """Growth in KiB per 100k actions since the warm-up, after each measured phase."""
    runtime = tangram.Runtime({"cpu": 16, "mem": "64GiB"})
    growths: list[float] = []
    async with runtime:
        await soak_workload(runtime, warmup, seed=0)
        # Traced from here on: what the measured phases allocate and keep. (Tracing the
        # warm-up too would only make the test slower: tracemalloc costs ~5x per action.)
        # The full windows hold samples allocated before tracing started, which count
        # nothing; each is replaced by a traced one as the window turns over. So twice
        # the warm-up runs under tracing before the baseline, turning every window over
        # (a window takes only the actions that ran): without it the first phase shows
        # the windows' own ~200 KiB as growth.
        tracemalloc.start()
        await soak_workload(runtime, 2 * warmup, seed=-1)
        before = traced()
        deadline = time.monotonic() + soak_seconds
        phase = 0
        while True:
            phase += 1
            await soak_workload(runtime, measured, seed=phase)
            after = traced()
            growths.append((after - before) / 1024 / (measured * phase) * 100_000)
            if time.monotonic() >= deadline:
                break
        check_idle(runtime)
    tracemalloc.stop()
    return growths


@pytest.mark.timeout(900 if LONG else 120)
def test_memory_does_not_grow_with_completed_actions() -> None:
    try:
        growths = anyio.run(measure_growth, WARMUP, MEASURED, SOAK_SECONDS, backend="asyncio")
    finally:
        tracemalloc.stop()
    print(f"growth KiB per 100k actions, per phase: {[round(g, 1) for g in growths]}")
    assert max(growths) < MAX_GROWTH_KIB_PER_100K, growths
