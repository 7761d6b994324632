"""tangram.metrics: the Prometheus collector and the per-step dict, read from real parts.

Everything is real: prometheus-client's own registry, text exposition, parser and HTTP
server on loopback; sandboxes of the local backend; a torch model restored by the GPU pool
onto a CPU device (the one stand-in: a GPU, which this machine may lack); an HTTP API
server on loopback that answers 429 past its limit.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import AsyncExitStack

import anyio
import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import tangram
from tangram.errors import RuntimeClosedError, SettingTypeError
from tangram.gpu import Device, GpuPool, TorchService
from tangram.metrics import Collector, StepMetrics
from tangram.quota import ApiKey, Quota
from tangram.testing import Limit, QuotaServer

pytestmark = pytest.mark.anyio

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the sandbox pool's local backend and the quota client run there


def parse(text: bytes | str) -> Samples:
    """Every sample of an exposition, keyed by name and sorted labels."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry))


async def test_a_scrape_follows_the_actions_of_a_runtime_and_its_sandbox_pool() -> None:
    registry = CollectorRegistry()
    async with (
        tangram.SandboxPool(tangram.LocalBackend(cores=[0, 1])) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
        pool.sandbox("t") as sbx,
    ):
        registry.register(Collector(runtime, sandboxes=pool))
        before = scrape(registry)
        assert before[("tangram_resource_capacity", (("resource", "cpu"),))] == 2
        assert before[("tangram_resource_held", (("resource", "cpu"),))] == 0
        assert before[("tangram_sandbox_replaced_total", (("pool", "sandbox"),))] == 0
        assert not any(name == "tangram_actions_total" for name, _ in before)

        async with runtime.acquire(cpu=2, kind="hold"):
            during = scrape(registry)
        assert during[("tangram_resource_held", (("resource", "cpu"),))] == 2
        assert during[("tangram_actions_running", ())] == 1

        for _ in range(2):
            assert (await sbx.run("true", cpu=1, kind="run_tests")).ok
        after = scrape(registry)
    kind = (("kind", "run_tests"),)
    assert after[("tangram_actions_total", (*kind, ("outcome", "completed")))] == 2
    assert after[("tangram_actions_total", (*kind, ("outcome", "failed")))] == 0
    assert after[("tangram_actions_total", (("kind", "hold"), ("outcome", "completed")))] == 1
    assert after[("tangram_action_exec_seconds_count", kind)] == 2
    assert after[("tangram_action_exec_seconds_sum", kind)] > 0
    assert after[("tangram_action_queue_seconds_count", kind)] == 2
    assert after[("tangram_resource_held", (("resource", "cpu"),))] == 0
    assert after[("tangram_resource_unit_seconds_total", (("resource", "cpu"),))] > 0
    assert after[("tangram_actions_running", ())] == 0
    assert after[("tangram_decisions_total", ())] > before[("tangram_decisions_total", ())]


@pytest.fixture
def http_registry() -> Iterator[tuple[CollectorRegistry, str]]:
    registry = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield registry, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_prometheus_http_server_scrapes_from_its_thread_on_the_runtime_loop(
    http_registry: tuple[CollectorRegistry, str],
) -> None:
    """The scrape runs in prometheus-client's server thread; the figures are read on the
    runtime's loop, which stays free to answer (the client awaits on that loop)."""
    registry, url = http_registry
    async with (
        tangram.Runtime(capacity={"cpu": 4}) as runtime,
        httpx.AsyncClient() as client,
    ):
        registry.register(Collector(runtime))
        async with runtime.acquire(cpu=3, kind="held"):
            response = await client.get(url)
        assert response.status_code == 200
        samples = parse(response.text)
        assert samples[("tangram_resource_held", (("resource", "cpu"),))] == 3
        # From a worker thread too (anyio's), as a custom exporter would call it.
        samples = parse(await anyio.to_thread.run_sync(generate_latest, registry))
        assert samples[("tangram_actions_total", (("kind", "held"), ("outcome", "completed")))] == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_scrape_from_a_worker_thread_reads_on_the_loop_on_either_backend() -> None:
    registry = CollectorRegistry()
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:
        registry.register(Collector(runtime))
        async with runtime.acquire(cpu=2, kind="k"):
            samples = parse(await anyio.to_thread.run_sync(generate_latest, registry))
    assert samples[("tangram_resource_held", (("resource", "cpu"),))] == 2
    assert samples[("tangram_actions_running", ())] == 1


def test_built_before_the_loop_registers_without_reading_and_fails_clearly_after_it() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 2})
    collector = Collector(runtime)
    registry = CollectorRegistry()
    registry.register(collector)  # describe(): reads nothing, needs no loop

    async def main() -> Samples:
        async with runtime:
            async with runtime.acquire(cpu=1, kind="k"):
                pass
            # Off the loop before any scrape on it: the collector was built before the
            # loop existed and cannot know it yet.
            with pytest.raises(RuntimeClosedError, match="not running"):
                await anyio.to_thread.run_sync(generate_latest, registry)
            return scrape(registry)  # on the loop: found, and remembered

    samples = anyio.run(main)
    assert samples[("tangram_actions_total", (("kind", "k"), ("outcome", "completed")))] == 1
    with pytest.raises(RuntimeClosedError, match=r"not running|gone"):
        generate_latest(registry)  # that loop has ended: nothing can read it safely


def _judge() -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval()


async def test_gpu_restores_and_api_429s_reach_the_scrape_and_the_step_dict() -> None:
    services = [TorchService(name, _judge, memory="64KiB") for name in ("judge", "teacher")]
    # Room for one model: every switch restores.
    gpu = GpuPool(services, devices=[Device("cpu:0", memory="100KiB")], warm=False)
    # Configured at 100/s; the server allows 4 at once then 5/s: it answers 429s.
    quota = Quota([ApiKey(name="k", requests=100)], name="judge_api")
    registry = CollectorRegistry()
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(QuotaServer(Limit(requests=5, requests_burst=4)))
        await stack.enter_async_context(gpu)
        runtime = await stack.enter_async_context(
            tangram.Runtime(capacity={**gpu.capacity(), **quota.capacity()})
        )
        client = await stack.enter_async_context(quota.client(base_url=server.url))
        registry.register(Collector(runtime, gpu=gpu, quotas=[quota]))
        steps = StepMetrics(runtime, gpu=gpu, quotas=quota)
        first = await steps.step()
        assert first["tangram/restores"] == 0 and first["tangram/limited"] == 0

        for name in ("judge", "teacher", "judge"):
            async with gpu.use(name) as svc:
                await svc(torch.ones(1, 4))
        codes = []

        async def call() -> None:
            codes.append((await client.get("/v1")).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(call)
        second = await steps.step()
        samples = scrape(registry)
        third = await steps.step()

    assert codes == [200] * 12  # the 429s were retried
    limited = samples[
        (
            "tangram_quota_responses_total",
            (("key", "k"), ("quota", "judge_api"), ("result", "limited")),
        )
    ]
    assert limited == len(server.rejected) > 0
    assert second["tangram/limited/judge_api/k"] == second["tangram/limited"] == limited
    assert samples[("tangram_quota_sent_total", (("key", "k"), ("quota", "judge_api")))] >= 12
    assert samples[("tangram_gpu_restores_total", (("service", "judge"),))] == 2
    assert samples[("tangram_gpu_restores_total", (("service", "teacher"),))] == 1
    assert ("tangram_gpu_memory_bytes", (("device", "cpu:0"), ("state", "capacity"))) in samples
    assert second["tangram/restores/judge"] == 2 and second["tangram/restores"] == 3
    assert second["tangram/restore_s"] > 0
    # Nothing happened since: every change is 0, and every key is still there.
    assert set(third) == set(second)
    assert third["tangram/restores"] == third["tangram/limited"] == 0


async def test_the_step_dict_gives_the_change_since_the_last_call() -> None:
    async with tangram.Runtime(capacity={"cpu": 4}) as runtime:
        steps = StepMetrics(runtime)
        assert (await steps.step())["tangram/actions"] == 0
        for _ in range(3):
            async with runtime.acquire(cpu=1, kind="run_tests"):
                await anyio.sleep(0.01)
        first = await steps.step()
        async with runtime.acquire(cpu=2, kind="reward"):
            during = await steps.step()
        after = await steps.step()
    assert first["tangram/actions/run_tests"] == first["tangram/actions"] == 3
    assert first["tangram/exec_s/run_tests"] >= 0.03
    assert first["tangram/exec_s"] == first["tangram/exec_s/run_tests"]
    assert first["tangram/unit_s/cpu"] >= 0.03
    # The held units are a level now, not a change; the times changed by nothing.
    assert during["tangram/held/cpu"] == 2 and during["tangram/running"] == 1
    assert during["tangram/actions/run_tests"] == 0 and during["tangram/exec_s/run_tests"] == 0
    assert "tangram/actions/reward" not in during  # it has not ended yet
    assert after["tangram/actions/reward"] == 1 and after["tangram/held/cpu"] == 0
    assert after["tangram/actions/run_tests"] == 0  # seen once, kept at 0


async def test_the_changes_add_up_to_the_total_when_zeros_are_added() -> None:
    """An action admitted at once queues exactly 0 s: the total stays while the count
    grows, and ``mean * count`` came out a step lower about one time in ten, which the
    change took for a restart and reported the whole run's queue time again (a review:
    14x the real total over 200 steps)."""
    async with tangram.Runtime(capacity={"s": 1}) as runtime:
        steps = StepMetrics(runtime)

        async def hold() -> None:
            async with runtime.acquire({"s": 1}, kind="k"):
                await anyio.sleep(0.013)

        async with anyio.create_task_group() as tg:  # some real queueing first
            for _ in range(3):
                tg.start_soon(hold)
        reported = (await steps.step())["tangram/queue_s/k"]
        for _ in range(200):
            async with runtime.acquire({"s": 1}, kind="k"):
                pass
            reported += (await steps.step())["tangram/queue_s/k"]
        queue = runtime.stats().kinds["k"].queue
    assert queue.total > 0.01
    assert reported == pytest.approx(queue.total, rel=1e-9)
    assert queue.total == pytest.approx(queue.mean * queue.count, rel=1e-9)


async def test_fixed_keys_are_exactly_the_keys_of_every_dict() -> None:
    keys = ["tangram/actions/a", "tangram/held/cpu", "tangram/restores"]
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        steps = StepMetrics(runtime, keys=keys)
        assert await steps.step() == dict.fromkeys(keys, 0.0)
        async with runtime.acquire(cpu=1, kind="b"):
            pass
        async with runtime.acquire(cpu=1, kind="a"):
            assert await steps.step() == {**dict.fromkeys(keys, 0.0), "tangram/held/cpu": 1.0}
        assert (await steps.step())["tangram/actions/a"] == 1


def test_wrong_arguments_fail_where_they_are_given() -> None:
    runtime = tangram.Runtime(capacity={"cpu": 1})
    with pytest.raises(SettingTypeError, match=r"`runtime` must be a tangram\.Runtime"):
        Collector(object())  # type: ignore[arg-type]
    with pytest.raises(SettingTypeError, match=r"`sandboxes` must be a tangram\.SandboxPool"):
        Collector(runtime, sandboxes=[runtime])  # type: ignore[list-item]
    with pytest.raises(SettingTypeError, match=r"`gpu` must be a tangram\.gpu\.GpuPool"):
        StepMetrics(runtime, gpu=runtime)  # type: ignore[arg-type]
    with pytest.raises(SettingTypeError, match=r"`quotas` must be a tangram\.quota\.Quota .*3"):
        StepMetrics(runtime, quotas=3)  # type: ignore[arg-type]
    with pytest.raises(SettingTypeError, match="`keys` must be a collection of strings"):
        StepMetrics(runtime, keys="tangram/actions")


def test_without_prometheus_client_the_collector_says_which_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(ImportError, match=r"pip install 'tangram\[metrics\]'"):
        Collector(tangram.Runtime(capacity={"cpu": 1}))


def test_import_tangram_and_its_metrics_module_import_no_prometheus_client() -> None:
    code = (
        "import sys, tangram, tangram.metrics; "
        "assert 'prometheus_client' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
