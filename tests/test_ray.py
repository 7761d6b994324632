"""The shared scheduler on a real local Ray cluster: separate worker processes, one actor.

Workers are Ray actors, so each is its own process with its own proxy; they meet only
through the scheduler actor. One small cluster (4 CPUs, no dashboard) serves the whole
module. With ``CI`` set these never skip; without it they skip where Ray is not installed.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from ray_support import held, wait_for, work_dir_holding

import tangram
from tangram.errors import (
    AcquireReusedError,
    AsyncioRequiredError,
    CapacityExceededError,
    DemandTypeError,
    GpuError,
    GpuServiceError,
    InvalidCapacityError,
    InvalidDemandError,
    UnknownResourceError,
    WaitTimeoutError,
)

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

import tangram.ray as tray  # noqa: E402
from tangram.gpu import ModelService  # noqa: E402

# Worker actors are defined here, in a module Ray's workers cannot import: ship them by value.
importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.anyio
HEARTBEAT = 0.4
LEASE_TIMEOUT = 2.0


@pytest.fixture
def anyio_backend() -> str:
    # A Ray call is awaited on an asyncio loop only.
    return "asyncio"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",  # a cluster of its own, never one left running
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"tangram-test-{uuid.uuid4().hex[:8]}",
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def workers(cluster: None) -> list[Any]:
    """Four workers, plus a fifth the kill test ends (processes start in parallel here)."""
    pool = [Worker.remote() for _ in range(5)]  # type: ignore[attr-defined]
    ray.get([w.pid.remote() for w in pool])
    return pool


def _name() -> str:
    return f"sched-{uuid.uuid4().hex[:8]}"


def _connect(name: str, *, lease_timeout: float = LEASE_TIMEOUT, **kwargs: Any) -> Any:
    return tray.connect(name=name, heartbeat=HEARTBEAT, lease_timeout=lease_timeout, **kwargs)


@ray.remote(num_cpus=0)
class Worker:
    """A rollout process: its own event loop, its own proxy, actions through tangram.acquire."""

    async def pid(self) -> int:
        return os.getpid()

    async def act(
        self, name: str, actions: int, seconds: float, tasks: int, cpu: int
    ) -> list[tuple[float, float, float]]:
        intervals: list[tuple[float, float, float]] = []

        async def one() -> None:
            for _ in range(actions):
                async with tangram.acquire(cpu=cpu, kind="work") as lease:
                    started = time.time()
                    await anyio.sleep(seconds)
                    intervals.append((started, time.time(), lease.grant["cpu"]))

        async with (
            tray.connect(name=name, create=False, heartbeat=HEARTBEAT),
            anyio.create_task_group() as tg,
        ):
            for _ in range(tasks):
                tg.start_soon(one)
        return intervals

    async def hang(self, name: str, cpu: int) -> None:
        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT) as remote:
            await remote.run({"cpu": cpu}, anyio.sleep_forever, kind="hang")

    async def stall(self, name: str, cpu: int, seconds: float) -> dict[str, Any]:
        outcome: dict[str, Any] = {}

        async def waiter(remote: tray.RemoteRuntime) -> None:
            try:
                async with remote.acquire(cpu=1, kind="waiter"):
                    outcome["waiter"] = "granted"
            except tray.SchedulerUnavailableError:
                outcome["waiter"] = "dropped"

        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT) as remote:
            async with (
                remote.acquire(cpu=cpu, kind="stall") as lease,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(waiter, remote)
                # Its request waits at the actor before the stall: one sent after it would
                # be a new request from a live process, and wait for cores like any other.
                with anyio.fail_after(30):
                    while (await remote.stats()).waiting < 1:  # noqa: ASYNC110 - remote state
                        await anyio.sleep(0.05)
                time.sleep(seconds)  # noqa: ASYNC251 - a stalled process: no heartbeats
                await anyio.sleep(HEARTBEAT * 2)  # the poll that reports what was lost
            outcome["reclaimed"] = lease.reclaimed
        return outcome

    async def bad_inputs(self, name: str) -> list[str]:
        async with tray.connect(name=name, create=False, heartbeat=HEARTBEAT):
            return _bad_input_errors()


def _bad_input_errors() -> list[str]:
    """The error type each bad call raises at the call, in the runtime this task sees."""
    calls = [
        lambda: tangram.acquire(cpu="four"),
        lambda: tangram.acquire(cpu=True),
        lambda: tangram.acquire(gpu=1),
        lambda: tangram.acquire(cpu=100),
        lambda: tangram.acquire(cpu=-1),
        lambda: tangram.acquire({"cpu": 1}, cpu=1),
        lambda: tangram.acquire(cpu=1, kind=3),
        lambda: tangram.acquire(cpu=1, wait_timeout=-1),
        lambda: tangram.acquire(cpu=1, estimate=float("inf")),
        lambda: tangram.acquire(cpu=1, trajectory=7),
        lambda: tangram.acquire(cpu=tangram.Elastic(8, 16)),
    ]
    names = []
    for call in calls:
        try:
            call()
        except Exception as exc:
            names.append(type(exc).__qualname__)
        else:
            names.append("no error")
    return names


def _max_overlap(intervals: list[tuple[float, float, float]]) -> float:
    """The most units held at once, from (start, end, units) intervals."""
    points = sorted(
        [(start, units) for start, _, units in intervals]
        + [(end, -units) for _, end, units in intervals],
        key=lambda p: (p[0], p[1]),  # at equal times a release counts before a grant
    )
    level = peak = 0.0
    for _, change in points:
        level += change
        peak = max(peak, level)
    return peak


def test_importing_tangram_does_not_import_ray() -> None:
    code = "import sys, tangram; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_tangram_ray_does_not_import_torch() -> None:
    # GPU agents are optional: torch loads only in an agent that loads a torch service.
    code = "import sys, tangram.ray; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_replicas_share_of_devices_never_exceeds_what_its_memory_allows() -> None:
    from tangram._shared._agent import _NodeGpuLedger

    ledger = _NodeGpuLedger(None, "gpu@h", {"gpu_mem:a": 3, "gpu_mem:b": 4})
    thirds = [ledger.share({"gpu_mem:a": 1}) for _ in range(3)]
    assert 0 < thirds[0] < 1 / 3 and sum(thirds) <= 1  # a full device is at most one
    assert ledger.share({"gpu_mem:a": 3, "gpu_mem:b": 4}) == 2  # a replica on two devices
    assert ledger.share({"gpu_mem:b": 2}) == 0.5


def test_trio_is_refused_with_a_clear_error() -> None:
    import trio

    async def main() -> None:
        async with tray.connect():
            pass

    with pytest.raises(AsyncioRequiredError, match="asyncio"):
        trio.run(main)
    assert issubclass(AsyncioRequiredError, RuntimeError)


async def test_bad_settings_fail_before_anything_starts() -> None:
    with pytest.raises(InvalidCapacityError, match="twice"):
        async with tray.connect(heartbeat=1.0, lease_timeout=1.5):
            pass
    with pytest.raises(InvalidCapacityError):
        async with tray.connect(heartbeat=-1.0):
            pass
    with pytest.raises(InvalidCapacityError):
        async with tray.connect(capacity={"cpu": -4}):
            pass


async def test_workers_never_exceed_the_global_capacity(workers: list[Any]) -> None:
    name = _name()
    # A long lease timeout: on a loaded 2-core machine seven processes can stall one
    # worker's heartbeats past the short one, and a reclaim is not what this test is about.
    async with _connect(name, capacity={"cpu": 3}, lease_timeout=60.0) as remote:
        runs = [
            w.act.remote(name, 6, 0.02, 2, 1 + i % 2)  # two tasks each; 1 or 2 cores per action
            for i, w in enumerate(workers[:4])
        ]
        results = await _gather(runs)
        intervals = [i for result in results for i in result]
        assert len(intervals) == 4 * 2 * 6
        # Each worker alone may hold 4 cores (two tasks x 2); together they stay at 3.
        assert _max_overlap(intervals) <= 3
        stats = await remote.stats()
        assert stats.resources["cpu"].peak <= 3
        assert stats.resources["cpu"].peak >= 2  # they did run side by side
        assert stats.kinds["work"].completed == 48
        assert stats.resources["cpu"].held == 0
        assert stats.waiting == 0 and stats.running == 0
        counters = await remote.actor.counters.remote()
        assert counters["leases"] == 0 and counters["reclaimed"] == 0


async def _gather(refs: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(refs)

    async def one(index: int) -> None:
        results[index] = await refs[index]

    async with anyio.create_task_group() as tg:
        for index in range(len(refs)):
            tg.start_soon(one, index)
    return results


async def test_a_killed_worker_returns_its_units_and_others_keep_going(
    workers: list[Any],
) -> None:
    name = _name()
    victim = workers[4]
    async with _connect(name, capacity={"cpu": 3}) as remote:
        victim.hang.remote(name, 2)
        await wait_for(lambda: _equals(held(remote), 2.0), 30)
        # One core is left: a worker using one core at a time keeps going meanwhile.
        steady = workers[0].act.remote(name, 20, 0.05, 1, 1)
        blocked = workers[1].act.remote(name, 1, 0.01, 1, 2)  # needs the victim's cores
        await anyio.sleep(0.3)
        killed_at = time.monotonic()
        ray.kill(victim)
        with anyio.fail_after(LEASE_TIMEOUT + 10):
            await blocked
        returned_after = time.monotonic() - killed_at
        assert returned_after <= LEASE_TIMEOUT + 3 * HEARTBEAT + 2.0
        assert len(await steady) == 20
        counters = await remote.actor.counters.remote()
        assert counters["reclaimed"] == 1
        assert await held(remote) == 0
        stats = await remote.stats()
        assert stats.resources["cpu"].peak <= 3


async def _equals(value: Any, expected: float) -> bool:
    return bool(await value == expected)


async def _waiting_or_reclaimed(remote: Any) -> bool:
    if (await remote.stats()).waiting >= 1:
        return True
    return bool((await remote.actor.counters.remote())["reclaimed"] >= 1)


async def test_a_late_release_of_a_reclaimed_lease_is_harmless(workers: list[Any]) -> None:
    name = _name()
    async with _connect(name, capacity={"cpu": 2}) as remote:
        # Twice the timeout: the actor drops the silent process (and so its waiting
        # request) only once its last call is a timeout old, and on a loaded machine that
        # call may reach the actor well after it was sent.
        stalled = workers[2].stall.remote(name, 2, 2 * LEASE_TIMEOUT + HEARTBEAT)
        await wait_for(lambda: _equals(held(remote), 2.0), 30)
        # Asked only once the worker's own request waits (or was already dropped with the
        # silent worker): the worker counts waiting requests to know that its request has
        # reached the actor, so this one must not be among them.
        await wait_for(lambda: _waiting_or_reclaimed(remote), 30)
        # The stalled worker sends no heartbeat; its lease is reclaimed and granted here.
        # The bound only keeps a bug from hanging the suite: the stall alone is ~5 s, and
        # a loaded 2-core machine takes seconds more to start and stop the worker's client.
        with anyio.fail_after(LEASE_TIMEOUT + 30):
            async with remote.acquire(cpu=2, kind="next") as lease:
                assert lease.grant["cpu"] == 2
                report = await stalled  # its block ends now: the late release arrives
                assert report == {"reclaimed": True, "waiter": "dropped"}
                await anyio.sleep(HEARTBEAT)
                # No double credit: this lease still holds both cores, nothing else fits.
                assert await held(remote) == 2
                with pytest.raises(WaitTimeoutError):
                    async with remote.acquire(cpu=1, wait_timeout=0.3):
                        pass
                counters = await remote.actor.counters.remote()
                assert counters["ignored_releases"] == 1  # it did arrive, and was ignored
        await wait_for(lambda: _equals(held(remote), 0.0), 5)
        counters = await remote.actor.counters.remote()
        assert counters["reclaimed"] == 1 and counters["leases"] == 0
        stats = await remote.stats()
        assert stats.resources["cpu"].peak == 2


async def test_bad_input_raises_the_local_runtimes_errors_at_the_call(
    workers: list[Any],
) -> None:
    capacity = {"cpu": 4, "mem": "8GiB"}
    async with tangram.Runtime(capacity=capacity):
        local = _bad_input_errors()
    assert "no error" not in local
    name = _name()
    async with _connect(name, capacity=capacity) as remote:
        assert await workers[3].bad_inputs.remote(name) == local
        assert _bad_input_errors() == local  # the driver's proxy too
        with pytest.raises(DemandTypeError):
            remote.acquire(cpu="four")
        with pytest.raises(UnknownResourceError):
            remote.acquire(gpu=1)
        with pytest.raises(CapacityExceededError):
            remote.acquire(cpu=5)
        with pytest.raises(InvalidDemandError):
            remote.acquire(mem="-1GiB")
        with pytest.raises(TypeError):
            await remote.run({"cpu": 1}, "not callable")  # type: ignore[arg-type]
        assert await held(remote) == 0


async def test_a_resizable_grant_follows_the_shared_scheduler(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 4}) as remote:
        elastic = tangram.Elastic(1, 4, resizable=True)
        async with tangram.acquire(cpu=elastic, estimate=10.0, kind="grow") as lease:
            assert isinstance(lease, tray.RemoteLease)
            assert lease.units == 4 and lease.grant == {"cpu": 4.0}
            got: list[float] = []

            async def other() -> None:
                async with remote.acquire(cpu=2, estimate=0.1, kind="small") as small:
                    got.append(small.grant["cpu"])

            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
                with anyio.fail_after(10):
                    assert await lease.wait_resized() == 2
                assert lease.grant == {"cpu": 2.0} and lease.resizes == 1
            assert got == [2.0]
        # Releases travel in the background, on the proxy's next send.
        await wait_for(lambda: _equals(held(remote), 0.0), 5)
        stats = await remote.stats()
        assert stats.resources["cpu"].peak == 4 and stats.resizes >= 1


async def test_an_acquire_context_is_entered_once(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 2}) as remote:
        context = remote.acquire(cpu=1)
        async with context as lease:
            with pytest.raises(AcquireReusedError, match="only once"):
                await context.__aenter__()
            assert lease.active and await held(remote) == 1
        await wait_for(lambda: _equals(held(remote), 0.0), 5)


async def test_an_existing_scheduler_with_other_limits_is_refused(cluster: None) -> None:
    name = _name()
    async with _connect(name, capacity={"cpu": 2}):
        with pytest.raises(InvalidCapacityError, match="already exists"):
            async with _connect(name, capacity={"cpu": 8}):
                pass
        async with _connect(name, capacity={"cpu": 2}) as same:
            async with same.acquire(cpu=1) as lease:
                assert lease.grant == {"cpu": 1.0}
            with pytest.raises(tray.SchedulerUnavailableError, match="no host agent"):
                async with same.sandbox("traj-0"):
                    pass
            with pytest.raises(InvalidCapacityError):
                await same.set_capacity(cpu="lots")
            await same.set_capacity(cpu=3)
            assert same.capacity["cpu"].total == 3
            async with same.acquire(cpu=3) as lease:  # checked against the new capacity
                assert lease.grant == {"cpu": 3.0}
    with pytest.raises(tray.SchedulerUnavailableError):
        async with tray.connect(name=name, create=False, lookup_timeout=0.5):
            pass


async def test_a_dead_scheduler_fails_waiting_and_new_acquires(cluster: None) -> None:
    async with _connect(_name(), capacity={"cpu": 1}) as remote:
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await remote.run({"cpu": 1}, anyio.sleep, 0)
            except tray.SchedulerUnavailableError as exc:
                errors.append(exc)

        async with remote.acquire(cpu=1) as running:
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.2)  # queued behind the held core
                ray.kill(remote.actor)
            assert len(errors) == 1
            assert isinstance(errors[0].__cause__, ray.exceptions.RayError)
            assert running.grant == {"cpu": 1.0}  # a running block finishes
        with pytest.raises(tray.SchedulerUnavailableError):
            async with remote.acquire(cpu=1):
                pass


async def test_actions_placed_on_host_agents_run_in_their_sandboxes(cluster: None) -> None:
    roots = [tempfile.mkdtemp(prefix="tangram-agent-") for _ in range(2)]
    for root in roots:
        os.chmod(root, 0o755)  # the sandbox user (nobody, as root) walks through it
    agents: list[tray.HostAgent] = []
    try:
        async with _connect(_name(), capacity={"cpu": 1}) as remote:
            for index, root in enumerate(roots):
                backend = functools.partial(tangram.LocalBackend, cores=[index % 2], root=root)
                agents.append(await tray.start_agent(remote, name=f"host{index}", backend=backend))
            assert remote.capacity["cpu@host0"].total == 1
            # The driver that created the scheduler is not homed to an agent it starts on
            # its own node: the scheduler places its sandboxes, least loaded first.
            await anyio.sleep(3 * HEARTBEAT)
            assert remote._local is None
            root_of = {agent.name: root for agent, root in zip(agents, roots, strict=True)}

            async def trajectory(index: int) -> tuple[str, str]:
                async with remote.sandbox(f"traj-{index}") as sbx:
                    first = await sbx.run(f"echo traj-{index} > mine.txt")
                    second = await sbx.run(["cat", "mine.txt"])
                    assert first.ok and second.ok, (first, second)
                    # Run by that agent's backend, in a work dir under that agent's root.
                    cwd = work_dir_holding(root_of[sbx.host], f"traj-{index}")
                    # The second action ran where the first left its file.
                    assert second.stdout.decode().strip() == f"traj-{index}"
                    assert first.units == 1
                    # Bad input is refused by the agent with the local sandbox's error.
                    with pytest.raises(TypeError, match="command"):
                        await sbx.run(42)  # type: ignore[arg-type]
                    return sbx.host, cwd

            results: list[tuple[str, str]] = [("", "")] * 4

            async def record(index: int) -> None:
                results[index] = await trajectory(index)

            async with anyio.create_task_group() as tg:
                for index in range(4):
                    tg.start_soon(record, index)
            hosts = [host for host, _ in results]
            assert sorted(hosts) == ["host0", "host0", "host1", "host1"]
            stats = await remote.stats()
            for agent in agents:
                assert stats.resources[agent.resource].peak == 1
                assert stats.resources[agent.resource].held == 0
            assert stats.kinds["sandbox"].completed == 8
            for _, cwd in results:
                assert not await anyio.Path(cwd).exists()  # each sandbox went with its block
    finally:
        for agent in agents:
            await agent.aclose()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


class _Unloadable(ModelService):
    """A model service whose cold load fails (its weights are missing)."""

    async def load(self) -> None:
        raise RuntimeError("weights not found")

    async def restore(self, replica: int, devices: Any) -> None:
        raise AssertionError("never loaded")

    async def evict(self, replica: int) -> None:
        raise AssertionError("never loaded")

    async def run(self, replica: int, batches: Any) -> list[Any]:
        raise AssertionError("never loaded")


async def test_an_agent_whose_gpu_services_cannot_start_fails_at_start_agent(
    cluster: None,
) -> None:
    async with _connect(_name(), capacity={"cpu": 1}) as remote:
        with pytest.raises(TypeError, match="services"):
            await tray.start_agent(remote, name="bad", services="judge")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Device"):
            await tray.start_agent(
                remote,
                name="bad",
                services=[_Unloadable("judge")],
                devices=["cpu:0"],  # type: ignore[list-item]
            )
        # A CPU-only node: discovery finds no device there (on a GPU node the service's
        # load fails instead), and the agent's error is raised here, as itself. The
        # service is a callable that builds it on the node.
        backend = functools.partial(tangram.LocalBackend, cores=[0])
        with pytest.raises(GpuError) as caught:
            await tray.start_agent(
                remote,
                name="gpuless",
                backend=backend,
                services=[functools.partial(_Unloadable, "judge")],
            )
        if isinstance(caught.value, GpuServiceError):
            assert "weights not found" in str(caught.value)
        else:
            assert "no CUDA device" in str(caught.value)
        # Nothing was registered.
        assert await remote.actor.hosts.remote() == {}
        assert sorted(remote.capacity) == ["cpu"]
