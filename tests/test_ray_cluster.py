"""Host agents on a real multi-node Ray cluster: separate raylets, sandboxes and GPU services.

``ray.cluster_utils.Cluster`` starts a head and two worker nodes as separate raylets on
this machine; each host agent is pinned to its own node, and removing a node kills its
raylet and every process on it, as losing a machine would. One cluster, one scheduler and
two agents serve the whole module (node start-up is the slow part); the tests run in file
order and the last one removes a node.

No GPU exists here: the agents' "GPUs" are ``Device("cpu:N")`` stand-ins, which run the
very same GpuPool and TorchService code on torch's cpu device (see docs/gpu.md), with a
real small torch module. With ``CI`` set these never skip; without it they skip where Ray
or torch is not installed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from ray_support import held, two_node_cluster, wait_for, work_dir_holding

import tangram
from tangram.errors import (
    GpuServiceError,
    InvalidDemandError,
    InvalidSettingError,
    SandboxBrokenError,
    SettingTypeError,
    UnknownResourceError,
)

if os.environ.get("CI"):
    import ray
    import torch
else:
    ray = pytest.importorskip("ray")
    torch = pytest.importorskip("torch")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import tangram.ray as tray
from tangram.gpu import Device, TorchService

# Factories and actors are defined here, in a module Ray's workers cannot import.
importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.anyio
HEARTBEAT = 0.5
# Wider than test_ray's: three raylets, two agents and torch share two cores here.
LEASE_TIMEOUT = 3.0
SLOW_SECONDS = 10.0


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # Module scope: the scheduler proxy and the agents live for the whole module.
    return "asyncio"


class Tagged(torch.nn.Module):
    """A linear layer whose output also carries the pid of the process that built it."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("pid", torch.tensor([float(os.getpid())]))
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)  # a long action, for the node to be removed under it
        tag = self.pid.expand(x.shape[0], 1)
        return torch.cat([self.linear(x), tag], dim=1)


def build_tagged(delay: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every node and in the reference copy
    return Tagged(delay)


def _services(*names: str) -> list[Any]:
    # Specs, not live modules: each agent builds its module on its own node. "slow" is a
    # callable building the service there, the other way start_agent takes one.
    specs: list[Any] = []
    for name in names:
        if name == "slow":
            specs.append(
                functools.partial(
                    TorchService, "slow", functools.partial(build_tagged, SLOW_SECONDS)
                )
            )
        else:
            specs.append(TorchService(name, build_tagged))
    return specs


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    with two_node_cluster("tangram-cluster") as nodes:
        yield nodes


@pytest.fixture(scope="module")
async def deployment(cluster: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The driver's scheduler and one agent per worker node, started in parallel."""
    roots = {host: tempfile.mkdtemp(prefix=f"tangram-{host}-") for host in ("a", "b")}
    for root in roots.values():
        os.chmod(root, 0o755)  # the sandbox user (nobody, as root) walks through it
    services = {"a": _services("lin"), "b": _services("lin", "only_b", "slow")}
    agents: dict[str, tray.HostAgent] = {}
    name = f"sched-{uuid.uuid4().hex[:8]}"
    try:
        async with tray.connect(
            name=name,
            capacity={"cpu": 1},
            heartbeat=HEARTBEAT,
            lease_timeout=LEASE_TIMEOUT,
        ) as remote:

            async def start(host: str) -> None:
                backend = functools.partial(tangram.LocalBackend, cores=[0], root=roots[host])
                agents[host] = await tray.start_agent(
                    remote,
                    name=host,
                    node_id=cluster["nodes"][host].node_id,
                    backend=backend,
                    services=services[host],
                    devices=[Device("cpu:0", memory="1MiB")],
                )

            async with anyio.create_task_group() as tg:
                for host in ("a", "b"):
                    tg.start_soon(start, host)
            try:
                yield {"remote": remote, "name": name, "agents": agents, "roots": roots, **cluster}
            finally:
                for agent in agents.values():
                    await agent.aclose()
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


def _reference(batch: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return build_tagged().linear(batch)


async def test_agents_run_on_their_own_nodes_and_register_cores_and_devices(
    deployment: dict[str, Any],
) -> None:
    remote: tray.RemoteRuntime = deployment["remote"]
    agents: dict[str, tray.HostAgent] = deployment["agents"]
    for host, node in deployment["nodes"].items():
        assert agents[host].node_id == node.node_id
    assert len({agent.node_id for agent in agents.values()} | {deployment["head"]}) == 3
    assert agents["a"].pid != agents["b"].pid
    assert (agents["a"].gpu_resource, agents["a"].gpus) == ("gpu@a", 1)
    assert agents["b"].services == ("lin", "only_b", "slow")
    assert remote.capacity.totals() == {
        "cpu": 1,
        "cpu@a": 1,
        "gpu@a": 1,
        "cpu@b": 1,
        "gpu@b": 1,
    }
    # The scheduler stays on the driver's node, so losing a worker node cannot take it.
    info = await remote.actor.info.remote()
    assert info["node_id"] == deployment["head"]
    # Refused with tangram's errors, still the ValueError and TypeError they were.
    with pytest.raises(InvalidSettingError, match="named 'a' is already registered"):
        await tray.start_agent(remote, name="a", services=_services("lin"))
    with pytest.raises(InvalidSettingError, match="without `services`"):
        await tray.start_agent(remote, name="c", devices=[Device("cpu:0", memory="1MiB")])
    with pytest.raises(SettingTypeError, match="ModelService") as caught:
        await tray.start_agent(remote, name="c", services=[object()])
    assert isinstance(caught.value, TypeError)


async def test_a_trajectorys_sandbox_actions_stay_on_its_host(
    deployment: dict[str, Any],
) -> None:
    remote: tray.RemoteRuntime = deployment["remote"]

    async def trajectory(index: int, hosts: list[str]) -> None:
        async with remote.sandbox(f"traj-{index}") as sbx:
            first = await sbx.run(f"echo traj-{index} > mine.txt")
            second = await sbx.run(["cat", "mine.txt"])
            assert first.ok and second.ok, (first, second)
            # Run by the agent on that host's node, under that agent's root, and the
            # second action found the first one's file.
            work_dir_holding(deployment["roots"][sbx.host], f"traj-{index}")
            assert second.stdout.decode().strip() == f"traj-{index}"
            hosts.append(sbx.host)

    hosts: list[str] = []
    async with anyio.create_task_group() as tg:
        for index in range(4):
            tg.start_soon(trajectory, index, hosts)
    assert sorted(hosts) == ["a", "a", "b", "b"]
    stats = await remote.stats()
    for host in ("a", "b"):
        assert stats.resources[f"cpu@{host}"].peak == 1
        assert stats.resources[f"cpu@{host}"].held == 0


async def test_a_nodes_cores_are_decided_on_the_node(deployment: dict[str, Any]) -> None:
    """Issue 30: a sandbox action's grant and release stay on its node. The job's actor
    hears of them in the node's reports, so its stats still count every action."""
    remote: tray.RemoteRuntime = deployment["remote"]
    runs = 40
    async with remote.sandbox("decided-here") as sbx:
        await sbx.run("true")  # placed and warm: what is left is the runs themselves
        kind = (await remote.stats()).kinds["sandbox"]
        before = await remote.actor.counters.remote()
        for _ in range(runs):
            assert (await sbx.run("true")).ok
        after = await remote.actor.counters.remote()
    # Besides heartbeats (by the clock, so more on a slow machine: 22 in a CI run where
    # 40 runs took over 5 s) only the node's reports reach the job's actor while the runs
    # go on; deciding centrally took at least a batch per run.
    messages = after["messages"] - before["messages"]
    beats = after["heartbeats"] - before["heartbeats"]
    assert messages - beats < runs / 4, (messages, beats)
    stats = await remote.stats()
    assert stats.kinds["sandbox"].completed == kind.completed + runs
    assert stats.resources[f"cpu@{sbx.host}"].held == 0
    assert stats.resources[f"cpu@{sbx.host}"].peak == 1
    # The job's scheduler never lends a node's cores itself, or two books would lend them.
    for kind in (f"cpu@{sbx.host}", f"gpu@{sbx.host}"):
        with pytest.raises(InvalidDemandError, match="lent by its host"):
            async with remote.acquire({kind: 1}):
                pass


async def test_a_workers_sandbox_opens_on_its_own_node_without_the_jobs_actor(
    deployment: dict[str, Any],
) -> None:
    """Issue 30: while its node has a core per open sandbox, a worker's sandbox opens on
    its own node's agent and the job's actor never hears of it; past that, it spills to
    the job's actor, which places it on the least loaded host, counting what the full
    node said it holds."""
    remote: tray.RemoteRuntime = deployment["remote"]
    agent_a = deployment["agents"]["a"].actor
    async with tray.connect(
        name=deployment["name"], create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
    ) as worker:
        await worker._home("a", agent_a)  # what `open_shared(agent=True)` does on node a
        before = await remote.actor.counters.remote()
        async with worker.sandbox("own-node") as first:
            assert first.host == "a"
            assert (await first.run("echo own-node > mine.txt")).ok
            work_dir_holding(deployment["roots"]["a"], "own-node")
            assert (await remote.actor.counters.remote())["placements"] == before["placements"]
            # Node a has one core and one sandbox open: the next goes to the job's actor.
            async with worker.sandbox("spilled") as second:
                assert second.host == "b"
                assert (await second.run("true")).ok
                assert (await remote.actor.hosts.remote())["a"]["sandboxes"] == 1
        after = await remote.actor.counters.remote()
    assert after["placements"] == before["placements"] + 2  # the spill's place and unplace
    # Both closed: node a takes a sandbox of its own again.
    python, count = await agent_a.open_here.remote("probe", "test")
    assert python is not None and count == 1
    await agent_a.close.remote("probe")


async def test_an_idle_worker_beats_through_its_nodes_agent(deployment: dict[str, Any]) -> None:
    """Issue 30: a worker with nothing waiting or held at the job's actor beats to its
    node's agent, which passes it on in its own poll: the worker sends the job's actor
    nothing, and is not dropped for it. A request takes it back to the job's actor."""
    remote: tray.RemoteRuntime = deployment["remote"]
    agent_a = deployment["agents"]["a"].actor
    async with tray.connect(
        name=deployment["name"], create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
    ) as worker:
        await anyio.sleep(HEARTBEAT)  # its first poll has reached the job's actor
        clients = (await remote.actor.counters.remote())["clients"]
        await worker._home("a", agent_a)
        await anyio.sleep(2 * HEARTBEAT)  # the poll in flight returns
        calls = worker.calls
        await anyio.sleep(2 * LEASE_TIMEOUT)
        assert worker.calls == calls  # not one message to the job's actor while idle
        assert (await remote.actor.counters.remote())["clients"] == clients  # still alive
        with anyio.fail_after(5 * HEARTBEAT):  # woken at once, not at the next beat
            async with worker.acquire({"cpu": 1}):
                assert worker.calls > calls
        # Released: the beats go back to the agent within a heartbeat or so.
        await anyio.sleep(3 * HEARTBEAT)
        calls = worker.calls
        await anyio.sleep(4 * HEARTBEAT)
        assert worker.calls == calls
        assert (await remote.actor.counters.remote())["clients"] == clients


@ray.remote(num_cpus=0)
class Connector:
    """A rollout process that only connects (``tray.connect``) and opens one sandbox."""

    async def open(self, scheduler: str, trajectory: str) -> tuple[str, bool]:
        async with (
            tray.connect(
                name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
            ) as remote,
            remote.sandbox(trajectory) as sbx,
        ):
            assert (await sbx.run("true")).ok
            return sbx.host, remote._local is not None


async def test_a_worker_connecting_on_an_agents_node_is_at_home_there(
    deployment: dict[str, Any],
) -> None:
    """Issue 30: ``tray.connect`` on a node whose agent decides its cores finds that
    agent, as a worker that started it does: its sandbox opens there without a placement
    by the job's actor (the one message is its home), and idle it beats through it. On
    a node without an agent (the head) a worker's sandbox is placed as before."""
    remote: tray.RemoteRuntime = deployment["remote"]
    worker = Connector.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            deployment["nodes"]["a"].node_id, soft=False
        )
    ).remote()
    before = await remote.actor.counters.remote()
    assert await worker.open.remote(deployment["name"], "connected-on-a") == ("a", True)
    after = await remote.actor.counters.remote()
    assert after["placements"] == before["placements"] + 1  # its home, no place or unplace
    elsewhere = Connector.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(deployment["head"], soft=False)
    ).remote()
    host, at_home = await elsewhere.open.remote(deployment["name"], "connected-on-head")
    assert host in ("a", "b") and not at_home
    placed = await remote.actor.counters.remote()
    assert placed["placements"] == after["placements"] + 2  # placed, and unplaced


@ray.remote(num_cpus=0)
class Holder:
    """A rollout process on node a holding a sandbox it placed there itself, until killed."""

    def __init__(self) -> None:
        self.host: str | None = None

    async def hold(self, scheduler: str, agent: Any) -> None:
        async with tray.connect(
            name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as remote:
            await remote._home("a", agent)
            async with remote.sandbox("held-by-the-dead") as sbx:
                self.host = sbx.host
                await anyio.sleep_forever()

    async def where(self) -> str | None:
        """Where its sandbox opened, once it has."""
        return self.host


async def test_a_dead_workers_own_node_sandbox_is_closed(deployment: dict[str, Any]) -> None:
    """The job's actor never placed it, so its book cannot hand it back: the worker's
    death reaches the agents, which close what that worker opened there themselves."""
    agent_a = deployment["agents"]["a"].actor
    holder = Holder.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            deployment["nodes"]["a"].node_id, soft=False
        )
    ).remote()
    holder.hold.remote(deployment["name"], agent_a)

    async def full() -> bool:
        python, _ = await agent_a.open_here.remote("probe", "test")
        if python is not None:
            await agent_a.close.remote("probe")
        return python is None

    async def opened() -> bool:
        # Asked of the holder, not probed on the agent: a probe takes node a's one core
        # for a moment, and a holder opening then found the node full and went to b.
        return bool(await holder.where.remote() == "a")

    await wait_for(opened, 60.0)
    assert await full()
    ray.kill(holder)

    async def free() -> bool:
        return not await full()

    # Dropped a lease timeout after its last heartbeat; a margin for two loaded cores.
    await wait_for(free, 6 * LEASE_TIMEOUT)


@ray.remote(num_cpus=0)
class Worker:
    """A rollout process on the head node calling a GPU service through the scheduler."""

    async def call(self, scheduler: str, service: str) -> tuple[str, list[float]]:
        async with (
            tray.connect(name=scheduler, create=False, heartbeat=HEARTBEAT) as remote,
            remote.service(service) as svc,
        ):
            out = await svc(torch.ones(2, 4))
            return svc.host, out[:, 3].tolist()


async def test_a_service_call_runs_on_a_node_that_serves_it(
    deployment: dict[str, Any],
) -> None:
    remote: tray.RemoteRuntime = deployment["remote"]
    agents: dict[str, tray.HostAgent] = deployment["agents"]
    batch = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    async def call(name: str) -> str:
        async with remote.service(name) as svc:
            out = await svc(batch)
            assert torch.equal(out[:, :3], _reference(batch))
            # The module was built, and ran, in that host's agent process.
            assert out[:, 3].tolist() == [float(agents[svc.host].pid)] * 3
            return svc.host

    # Resident nowhere yet: the first host by name; then where it is resident.
    assert [await call("lin"), await call("lin")] == ["a", "a"]
    # Two blocks at once: "a" has one device and one open block, so the next goes to "b".
    both = anyio.Event()
    entered: list[str] = []

    async def concurrent() -> None:
        async with remote.service("lin") as svc:
            entered.append(svc.host)
            if len(entered) == 2:
                both.set()
            await both.wait()
            out = await svc(batch)
            assert out[0, 3].item() == float(agents[svc.host].pid)

    async with anyio.create_task_group() as tg:
        tg.start_soon(concurrent)
        tg.start_soon(concurrent)
    assert sorted(entered) == ["a", "b"]
    # Three runs on "a" on the copy made resident at start: the placement followed it.
    stats_a = (await agents["a"].service_stats())["lin"]
    assert (stats_a["warmed"], stats_a["restores"], stats_a["runs"]) == (1, 0, 3)
    stats_b = (await agents["b"].service_stats())["lin"]
    assert (stats_b["warmed"], stats_b["restores"]) == (1, 0)
    # Only "b" serves "only_b"; from another process (a worker actor on the head node).
    worker = Worker.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=deployment["head"], soft=False)
    ).remote()
    host, tags = await worker.call.remote(deployment["name"], "only_b")
    assert host == "b" and tags == [float(agents["b"].pid)] * 2
    ray.kill(worker)
    with pytest.raises(UnknownResourceError, match="no host agent serves 'missing'"):
        async with remote.service("missing"):
            pass
    # Each replica's grant was mirrored centrally as its share of a device, and returned.
    stats = await remote.stats()
    for host in ("a", "b"):
        assert 0 < stats.resources[f"gpu@{host}"].peak <= 1
        assert stats.resources[f"gpu@{host}"].held == 0
    assert stats.kinds["gpu:lin"].completed >= 3


async def test_removing_a_node_mid_action_returns_its_units_and_others_keep_serving(
    deployment: dict[str, Any],
) -> None:
    remote: tray.RemoteRuntime = deployment["remote"]
    # The second trajectory opened goes to "b" (least loaded, ties by name).
    errors: dict[str, BaseException] = {}
    opened = anyio.Event()

    async def sandbox_action() -> None:
        async with remote.sandbox("traj-a") as on_a:
            assert on_a.host == "a"
            # A second block of the same trajectory is refused and leaves the first open.
            with pytest.raises(InvalidSettingError, match="already has an open sandbox"):
                async with remote.sandbox("traj-a"):
                    pass
            assert (await on_a.run("echo still")).stdout == b"still\n"
            async with remote.sandbox("traj-b") as sbx:
                assert sbx.host == "b"
                opened.set()
                try:
                    await sbx.run(f"sleep {SLOW_SECONDS}")
                except SandboxBrokenError as exc:
                    errors["sandbox"] = exc

    async def service_action() -> None:
        async with remote.service("slow") as svc:
            assert svc.host == "b"
            try:
                await svc(torch.ones(1, 4))
            except GpuServiceError as exc:
                errors["service"] = exc

    async def busy() -> bool:
        return await held(remote, "cpu@b") == 1 and await held(remote, "gpu@b") > 0

    async with anyio.create_task_group() as tg:
        tg.start_soon(sandbox_action)
        tg.start_soon(service_action)
        await opened.wait()
        await wait_for(busy, 30)
        removed_at = time.monotonic()
        deployment["cluster"].remove_node(deployment["nodes"]["b"])

        async def returned() -> bool:
            stats = await remote.stats()
            return all(
                stats.resources[kind].held == 0 and stats.resources[kind].total == 0
                for kind in ("cpu@b", "gpu@b")
            )

        await wait_for(returned, LEASE_TIMEOUT + 15)
        returned_after = time.monotonic() - removed_at
    # Within the lease timeout (plus a heartbeat and the watchdog's half beat of lag).
    assert returned_after <= LEASE_TIMEOUT + 2 * HEARTBEAT + 2.0, returned_after
    assert set(errors) == {"sandbox", "service"}
    assert isinstance(errors["service"].__cause__, ray.exceptions.RayError)
    # "a" keeps serving: new trajectories and service calls land there and run.
    async with remote.sandbox("traj-after") as sbx:
        assert sbx.host == "a"
        assert (await sbx.run("echo ok")).stdout == b"ok\n"
    async with remote.service("lin") as svc:
        assert svc.host == "a"
        assert (await svc(torch.ones(1, 4))).shape == (1, 4)
    with pytest.raises(UnknownResourceError, match="'slow'"):
        async with remote.service("slow"):
            pass
    hosts = await remote.actor.hosts.remote()
    assert sorted(hosts) == ["a"]


@ray.remote(num_cpus=0)
class Survivor:
    """A rollout process on node a whose job's scheduler actor is killed mid-rollout."""

    async def run_through(
        self, scheduler: str, agent: Any, seconds: float
    ) -> tuple[list[tuple[float, bool]], str]:
        runs: list[tuple[float, bool]] = []
        async with tray.connect(
            name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as remote:
            await remote._home("x", agent)
            async with remote.sandbox("survives") as sbx:
                deadline = time.time() + seconds
                while time.time() < deadline:
                    result = await sbx.run("echo ok")
                    runs.append((time.time(), result.stdout == b"ok\n"))
                    await anyio.sleep(0.2)
            try:
                with anyio.fail_after(5 * HEARTBEAT):
                    async with remote.acquire({"cpu": 1}):
                        pass
            except Exception as exc:
                return runs, type(exc).__name__
        return runs, "granted"


async def test_the_jobs_actor_dying_stops_only_what_it_lent(cluster: dict[str, Any]) -> None:
    """Issue 30, faults at scale: the job's scheduler actor dies. What it lent (here a
    shared `cpu`) fails loudly with a typed error, never hangs; a worker's sandbox on its
    own node keeps running, its cores lent by the node's agent, for longer than any lease
    timeout; and the agent, detached, ends by itself once its node's workers are gone."""
    from tangram._shared._agent import HostAgentActor

    name = f"doomed-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="tangram-doomed-")
    os.chmod(root, 0o755)
    node_a = cluster["nodes"]["a"].node_id
    try:
        async with tray.connect(
            name=name, capacity={"cpu": 1}, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as job:
            backend = functools.partial(tangram.LocalBackend, cores=[0], root=root)
            agent = (
                ray.remote(HostAgentActor)
                .options(
                    num_cpus=0,
                    max_concurrency=1_000,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_a, soft=False),
                )
                .remote("x", job.actor, backend, 0, [], None, None, True)
            )
            await agent.start.remote()
            survivor = Survivor.options(  # type: ignore[attr-defined]
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_a, soft=False)
            ).remote()
            seconds = 2 * LEASE_TIMEOUT + 4.0
            outcome = survivor.run_through.remote(name, agent, seconds)
            await anyio.sleep(3.0)  # the sandbox is open and its runs go on
            killed_at = time.time()
            ray.kill(job.actor)
            runs, error = await outcome
        after = [ok for at, ok in runs if at > killed_at + 1.0]
        assert len(after) >= 10 and all(after), runs
        assert runs[-1][0] > killed_at + 2 * LEASE_TIMEOUT  # past any lease's timeout
        assert error == "SchedulerUnavailableError"

        async def gone() -> bool:
            try:
                await agent.service_stats.remote()
            except ray.exceptions.RayError:
                return True
            return False

        # Its workers gone, the agent ends within IDLE lease timeouts, and a little.
        await wait_for(gone, 2 * LEASE_TIMEOUT + 15)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@ray.remote(num_cpus=0)
class Resident:
    """A rollout process connected for a whole test, from before its node has an agent."""

    def __init__(self) -> None:
        self._remote: tray.RemoteRuntime | None = None
        self._leave = anyio.Event()
        self._left = anyio.Event()

    async def join(self, scheduler: str) -> None:
        joined = anyio.Event()

        async def stay() -> None:
            try:
                async with tray.connect(
                    name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
                ) as remote:
                    self._remote = remote
                    joined.set()
                    await self._leave.wait()
            finally:
                self._left.set()

        import asyncio

        self._stay = asyncio.get_running_loop().create_task(stay())
        await joined.wait()

    async def home(self) -> str | None:
        """The actor id of the agent this worker beats through and opens sandboxes on."""
        assert self._remote is not None
        local = self._remote._local
        return None if local is None else local[1]._actor_id.hex()

    async def open(self, trajectory: str) -> str:
        assert self._remote is not None
        async with self._remote.sandbox(trajectory) as sbx:
            assert (await sbx.run("true")).ok
            return sbx.host

    async def leave(self) -> None:
        self._leave.set()
        await self._left.wait()


async def test_a_nodes_workers_follow_its_agent_as_it_starts_dies_and_is_replaced(
    cluster: dict[str, Any],
) -> None:
    """Issue 30. A worker that connected before its node had an agent is homed there
    when one starts: its sandbox opens on its own node with no placement by the job's
    actor. That agent killed, the job's actor drops it at once (its lease timeout here
    is 30 s), so its name is free for a replacement, which the worker follows too."""
    name = f"rehome-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="tangram-rehome-")
    os.chmod(root, 0o755)
    node_a = cluster["nodes"]["a"].node_id
    backend = functools.partial(tangram.LocalBackend, cores=[0], root=root)
    resident = Resident.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_a, soft=False)
    ).remote()
    agents: list[Any] = []
    try:
        async with tray.connect(
            name=name, capacity={"cpu": 1}, heartbeat=HEARTBEAT, lease_timeout=30.0
        ) as job:
            await resident.join.remote(name)
            assert await resident.home.remote() is None
            try:
                for attempt in ("first", "second"):
                    agent = await tray.start_agent(job, name="r", node_id=node_a, backend=backend)
                    agents.append(agent.actor)
                    ident = agent.actor._actor_id.hex()

                    async def homed(ident: str = ident) -> bool:
                        return bool(await resident.home.remote() == ident)

                    await wait_for(homed, 10 * HEARTBEAT)
                    before = (await job.actor.counters.remote())["placements"]
                    assert await resident.open.remote(f"{attempt}-trajectory") == "r"
                    assert (await job.actor.counters.remote())["placements"] == before
                    if attempt == "first":
                        ray.kill(agent.actor)

                        async def dropped() -> bool:
                            return "r" not in await job.actor.hosts.remote()

                        assert await wait_for(dropped, 10.0) < 10.0
            finally:
                await resident.leave.remote()
                for actor in agents:
                    with contextlib.suppress(ray.exceptions.RayError):
                        await actor.stop.remote()
                    ray.kill(actor)
    finally:
        ray.kill(resident)
        shutil.rmtree(root, ignore_errors=True)


STALL_SECONDS = 3 * 2.0  # three of the next test's lease timeouts


class _Stalling(tangram.LocalBackend):
    """A backend whose first sandbox blocks its agent's event loop, as a long garbage
    collection or a blocking call in a backend does: the process lives, its proxy is
    silent past the lease timeout."""

    stalled = False

    async def create(self, host: Any) -> Any:
        if not _Stalling.stalled:
            _Stalling.stalled = True
            time.sleep(STALL_SECONDS)  # noqa: ASYNC251 - the agent's stall under test
        return await super().create(host)


async def test_an_agent_whose_own_loop_stalls_past_the_lease_timeout_comes_back(
    cluster: dict[str, Any],
) -> None:
    """Issue 30, F5, on a real cluster. The agent's loop blocks three lease timeouts
    while it opens a sandbox: the job's actor lapses it (its cores lend nothing, it is
    placed nothing, its name stays), and once it is heard again its node is the job's
    again: the sandbox opened in the stall runs, and its cores are back. Before, the
    agent was dropped for good and its node left the job for the rest of the run."""
    name = f"stall-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="tangram-stall-")
    os.chmod(root, 0o755)
    backend = functools.partial(_Stalling, cores=[0], root=root)
    try:
        async with tray.connect(
            name=name, capacity={"cpu": 1}, heartbeat=HEARTBEAT, lease_timeout=2.0
        ) as job:
            agent = await tray.start_agent(
                job, name="s", node_id=cluster["nodes"]["a"].node_id, backend=backend
            )
            try:
                seen: list[bool] = []

                async def watch() -> None:
                    while True:
                        hosts = await job.actor.hosts.remote()
                        seen.append(hosts["s"]["lapsed"] if "s" in hosts else None)
                        await anyio.sleep(0.2)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    async with job.sandbox("in-the-stall") as sbx:
                        assert sbx.host == "s"
                        assert (await sbx.run("echo back")).stdout == b"back\n"

                    async def back() -> bool:
                        hosts = await job.actor.hosts.remote()
                        return "s" in hosts and not hosts["s"]["lapsed"]

                    await wait_for(back, 10.0)
                    tg.cancel_scope.cancel()
                assert True in seen, seen  # it lapsed during the stall
                assert None not in seen, seen  # and was never dropped
                info = await job.actor.info.remote()
                assert info["capacity"]["cpu@s"].total == 1
                async with job.sandbox("after") as sbx:
                    assert sbx.host == "s"
            finally:
                await agent.aclose()
    finally:
        shutil.rmtree(root, ignore_errors=True)
