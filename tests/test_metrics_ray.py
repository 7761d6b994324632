"""tangram.metrics.StepMetrics on the shared scheduler of a real local Ray cluster.

A worker's remote runtime answers ``stats()`` with an await, so the step dict is read from
the scheduler actor: it sees what every process did, not only this one. With ``CI`` set
this never skips; without it, it skips where Ray is not installed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from ray_support import wait_for

import tangram
from tangram.metrics import Collector, StepMetrics

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

import tangram.ray as tray  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # a Ray call is awaited on an asyncio loop only


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",  # a cluster of its own, never one left running
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"tangram-metrics-{uuid.uuid4().hex[:8]}",
    )
    try:
        yield
    finally:
        ray.shutdown()


async def test_the_step_dict_reads_the_shared_scheduler(cluster: None) -> None:
    name = f"sched-{uuid.uuid4().hex[:8]}"
    async with tray.connect(name=name, capacity={"cpu": 4}, heartbeat=0.4) as remote:
        steps = StepMetrics(remote)
        assert (await steps.step())["tangram/actions"] == 0
        async with tangram.acquire(cpu=3, kind="run_tests"):
            during = await steps.step()
        for _ in range(2):
            async with tangram.acquire(cpu=1, kind="run_tests"):
                pass

        async def ended() -> bool:
            return (await remote.stats()).kinds["run_tests"].completed == 3

        await wait_for(ended, 10)  # releases reach the actor on the proxy's next send
        after = await steps.step()
        # A scrape cannot await the actor: the collector takes a local runtime only.
        with pytest.raises(TypeError, match=r"tangram\.Runtime"):
            Collector(remote)
    assert during["tangram/held/cpu"] == 3 and during["tangram/running"] == 1
    assert after["tangram/actions/run_tests"] == 3 == after["tangram/actions"]
    assert after["tangram/unit_s/cpu"] > 0
