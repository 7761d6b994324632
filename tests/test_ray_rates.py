"""A job's API rates lent to its nodes' agents, on a real multi-node Ray cluster.

``ray.cluster_utils.Cluster`` starts a head and two worker nodes as separate raylets on
this machine, each with a host agent that decides its node; rollout processes on each
node make API calls (``acquire`` of a ``Rate`` kind alone), which their node's agent
grants from its share of the job's rate (issue 30: no message to the job's actor per
API call). The API itself is what cannot exist here: each call's grant is its
stand-in, timed where the worker receives it. With ``CI`` set these never skip; without
it they skip where Ray is not installed.
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
from ray_support import two_node_cluster

import tangram
from tangram._core._stats import most_in_window
from tangram._shared._node_rates import RAMP
from tangram._shared._rates import LEASE_AT
from tangram.errors import SchedulerUnavailableError, WaitTimeoutError

if os.environ.get("CI"):
    import ray
else:
    ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import tangram.ray as tray

importlib.import_module("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.anyio
HEARTBEAT = 0.5
LEASE_TIMEOUT = 3.0
RATE = 100.0
BURST = 10.0


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    with two_node_cluster("tangram-rates") as nodes:
        yield nodes


@pytest.fixture
async def job(cluster: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A job's scheduler with an API rate, and a deciding agent on each worker node."""
    roots = {host: tempfile.mkdtemp(prefix=f"tangram-{host}-") for host in ("a", "b")}
    name = f"rates-{uuid.uuid4().hex[:8]}"
    agents: dict[str, tray.HostAgent] = {}
    try:
        async with tray.connect(
            name=name,
            capacity={"cpu": 1, "api": tangram.Rate(RATE, burst=BURST)},
            heartbeat=HEARTBEAT,
            lease_timeout=LEASE_TIMEOUT,
        ) as remote:
            for host in ("a", "b"):
                backend = functools.partial(tangram.LocalBackend, cores=[0], root=roots[host])
                agents[host] = await tray.start_agent(
                    remote,
                    name=host,
                    node_id=cluster["nodes"][host].node_id,
                    backend=backend,
                )
            try:
                yield {"remote": remote, "name": name, "agents": agents, **cluster}
            finally:
                for agent in agents.values():
                    with contextlib.suppress(ray.exceptions.RayError):
                        await agent.aclose()
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


@ray.remote(num_cpus=0)
class Caller:
    """A rollout process that makes API calls back to back, timing each grant."""

    def __init__(self) -> None:
        self.granted = 0  # wait_one's calls so far
        self.calling: anyio.Event | None = None  # set at wait_one's 20th grant

    async def until_calling(self) -> None:
        """Return once wait_one has had its first grants."""
        self.calling = self.calling or anyio.Event()
        await self.calling.wait()

    async def ready(self) -> None:
        """Return once the actor is up: its start is not in a timed window."""

    async def call(
        self,
        scheduler: str,
        seconds: float,
        concurrency: int = 4,
        amount: float = 1.0,
        start_at: float = 0.0,
    ) -> dict[str, Any]:
        """Call for ``seconds`` from ``start_at`` (a wall-clock time; at once once
        connected where it has passed), so two callers' windows can be the same."""
        grants: list[float] = []
        async with tray.connect(
            name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as remote:
            await anyio.sleep(max(0.0, start_at - time.time()))
            start = time.time()
            deadline = start + seconds

            async def loop() -> None:
                while time.time() < deadline:
                    async with remote.acquire({"api": amount}, kind="search"):
                        grants.append(time.time())

            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(loop)
            return {
                "grants": grants,
                "at_home": remote._local is not None,
                "window": (start, deadline),
            }

    async def wait_one(self, scheduler: str) -> str:
        """One call that must wait (the rate is spent by then), and how it ended."""
        async with tray.connect(
            name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as remote:
            try:
                for _ in range(100_000):
                    async with remote.acquire({"api": 1}, kind="search"):
                        self.granted += 1
                        if self.granted == 2 * BURST:
                            self.calling = self.calling or anyio.Event()
                            self.calling.set()
            except SchedulerUnavailableError:
                return "SchedulerUnavailableError"
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
        return "granted"

    async def too_soon(self, scheduler: str) -> str:
        """A call whose wait runs out before its node is lent anything: the error. The
        calls before it, close together, make the node lease (see ._rates.leases)."""
        async with tray.connect(
            name=scheduler, create=False, heartbeat=HEARTBEAT, lease_timeout=LEASE_TIMEOUT
        ) as remote:
            for _ in range(LEASE_AT - 1):
                async with remote.acquire({"api": 0.01}, kind="search"):
                    pass
            try:
                async with remote.acquire({"api": BURST}, kind="search", wait_timeout=1e-6):
                    pass
            except WaitTimeoutError as exc:
                return str(exc)
        return "granted"


def _on(job: dict[str, Any], host: str) -> Any:
    node = job["head"] if host == "head" else job["nodes"][host].node_id
    return Caller.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    ).remote()


async def test_api_calls_are_granted_on_their_node_within_the_jobs_rate(
    job: dict[str, Any],
) -> None:
    """Two nodes' workers call an API back to back. The job's actor hears a few asks a
    second from each node's agent, not one message per call; every window of the calls
    holds no more than the job's burst and rate allow; and each node gets a fair part."""
    remote: tray.RemoteRuntime = job["remote"]
    seconds = 4.0
    callers = [_on(job, h) for h in ("a", "b")]
    await anyio.to_thread.run_sync(lambda: ray.get([c.ready.remote() for c in callers]))
    before = await remote.actor.counters.remote()
    start_at = time.time() + 1.0
    results = await anyio.to_thread.run_sync(
        lambda: ray.get([c.call.remote(job["name"], seconds, start_at=start_at) for c in callers])
    )
    after = await remote.actor.counters.remote()
    assert all(result["at_home"] for result in results)
    grants = [at for result in results for at in result["grants"]]
    # Timed at the worker, a grant lands up to a round trip after it was made: the
    # windows allow that much (50 ms) of rate on top.
    slack = 0.05 * RATE
    for window in (0.25, 0.5, 1.0, 2.0):
        most = most_in_window(grants, window)
        assert most <= BURST + RATE * window + slack, (window, most)
    assert len(grants) >= 0.6 * RATE * seconds, len(grants)  # the leases do not starve it
    # The fair part is judged while both call: a caller that connected late (its
    # process or its connect slowed by a loaded machine) starts past ``start_at``, and
    # the other has the whole rate meanwhile, as it should.
    begin = max(result["window"][0] for result in results)
    end = min(result["window"][1] for result in results)
    assert end - begin >= seconds / 2, (begin, end)
    shares = sorted(sum(begin <= at <= end for at in result["grants"]) for result in results)
    assert shares[0] >= 0.3 * sum(shares), shares
    # Each agent asks for its share every heartbeat (0.5 s here) while it holds one, and
    # while its share grows from nothing RAMP times a heartbeat, after its first ask and
    # one more at once for the calls that came meanwhile: about 0.04 messages per call at
    # this rate once steady, against one per call through the job's actor (its release
    # too, batched). Each worker's connect, home, first polls and disconnect come on top,
    # once per worker, not per call.
    lends = after["lends"] - before["lends"]
    asks = 2 * (seconds / HEARTBEAT + 1 + RAMP + 2)
    assert lends <= asks < 0.1 * len(grants), (lends, asks, len(grants))
    messages = after["messages"] - before["messages"]
    assert messages <= 0.2 * len(grants), (messages, len(grants))


async def test_a_busy_node_is_lent_what_an_idle_node_does_not_use(job: dict[str, Any]) -> None:
    """Only node a calls: its share grows to nearly the job's whole rate."""
    seconds = 4.0
    result = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").call.remote(job["name"], seconds))
    )
    assert result["at_home"]
    late = [at for at in result["grants"] if at >= result["grants"][0] + 1.5]
    rate = len(late) / (seconds - 1.5)
    assert rate >= 0.75 * RATE, rate
    assert most_in_window(result["grants"], 1.0) <= BURST + RATE * 1.0 + 0.05 * RATE


async def test_calls_from_a_node_without_an_agent_share_the_rate(job: dict[str, Any]) -> None:
    """A worker on the head (no agent) calls through the job's actor, which keeps what no
    node is lent: it is served beside a node's worker, and the two stay within the rate."""
    seconds = 4.0
    results = await anyio.to_thread.run_sync(
        lambda: ray.get([_on(job, h).call.remote(job["name"], seconds) for h in ("a", "head")])
    )
    assert results[0]["at_home"] and not results[1]["at_home"]
    grants = [at for result in results for at in result["grants"]]
    assert most_in_window(grants, 1.0) <= BURST + RATE * 1.0 + 0.05 * RATE
    assert len(results[1]["grants"]) >= 0.2 * len(grants), [len(r["grants"]) for r in results]


async def test_a_node_that_stops_calling_gives_its_share_back_at_once(
    job: dict[str, Any],
) -> None:
    """Node a calls, then stops; a worker with no agent (served by the job's actor)
    calls next. a's agent says it applies the cut to nothing in one more ask, so the job's
    actor has the whole rate back within a heartbeat or two, not at a's lease timeout."""
    busy = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").call.remote(job["name"], 2.0))
    )
    assert busy["at_home"]
    seconds = 1.0 + LEASE_TIMEOUT
    result = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "head").call.remote(job["name"], seconds))
    )
    assert not result["at_home"]
    late = [at for at in result["grants"] if at >= result["grants"][0] + 1.0]
    assert len(late) / (seconds - 1.0) >= 0.75 * RATE


async def test_calls_larger_than_a_nodes_burst_are_served_in_turn(job: dict[str, Any]) -> None:
    """Calls of 6 on a burst of 10 from two busy nodes: both cannot hold 6 of the burst
    at once, so neither node's burst is raised to it; their calls go on to the job's
    actor, where one line serves them in turn. Neither node starves, and every window
    stays within the rate (counted in units)."""
    seconds, amount = 4.0, 6.0
    results = await anyio.to_thread.run_sync(
        lambda: ray.get(
            [_on(job, h).call.remote(job["name"], seconds, 3, amount) for h in ("a", "b")]
        )
    )
    counts = sorted(len(result["grants"]) for result in results)
    grants = [at for result in results for at in result["grants"]]
    assert counts[0] >= 0.3 * len(grants), counts
    assert len(grants) * amount >= 0.5 * RATE * seconds, counts
    for window in (0.5, 1.0, 2.0):
        units = most_in_window(grants, window) * amount
        assert units <= BURST + RATE * window + 0.05 * RATE + amount, (window, units)


async def test_a_rate_raised_at_the_jobs_actor_reaches_its_nodes(job: dict[str, Any]) -> None:
    """The job's burst raised from 10 to 50 while its nodes hold shares: a node's call
    of 30, over the burst the node last heard of, is served (by the job's actor), and
    the node learns the new burst at its next ask, as the calls that follow show."""
    remote: tray.RemoteRuntime = job["remote"]
    warm = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").call.remote(job["name"], 1.0))
    )
    assert warm["at_home"]
    await remote.set_capacity({"api": tangram.Rate(RATE, burst=50.0)})
    big = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").call.remote(job["name"], 2.0, 1, 30.0))
    )
    assert len(big["grants"]) >= 3, big["grants"]


async def test_a_nodes_errors_name_the_jobs_kinds(job: dict[str, Any]) -> None:
    """A wait that runs out on a node's share says ``api``, as the job's actor would,
    not the node's own kind for its share."""
    text = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").too_soon.remote(job["name"]))
    )
    assert "api" in text and "@" not in text, text


async def test_the_jobs_actor_dying_fails_a_nodes_api_calls_loudly(
    cluster: dict[str, Any],
) -> None:
    """Issue 30, faults: the job's actor dies while a node's worker calls the API. The
    node's agent stops granting from its share within the lease timeout and fails the
    call with a typed error; it never hangs."""
    name = f"doomed-rates-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="tangram-doomed-rates-")
    try:
        async with tray.connect(
            name=name,
            capacity={"cpu": 1, "api": tangram.Rate(RATE, burst=BURST)},
            heartbeat=HEARTBEAT,
            lease_timeout=LEASE_TIMEOUT,
        ) as remote:
            backend = functools.partial(tangram.LocalBackend, cores=[0], root=root)
            agent = await tray.start_agent(
                remote, name="x", node_id=cluster["nodes"]["a"].node_id, backend=backend
            )
            caller = Caller.options(  # type: ignore[attr-defined]
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    cluster["nodes"]["a"].node_id, soft=False
                )
            ).remote()
            outcome = caller.wait_one.remote(name)
            # Its calls run on node a's share: killed once they do (a fixed 2 s was at
            # times before the caller had even found the actor, on a loaded machine).
            with anyio.fail_after(60):
                await caller.until_calling.remote()
            await anyio.sleep(2.0)  # long enough for its node to lease a share
            killed = time.monotonic()
            ray.kill(remote.actor)
            ended = await outcome
            took = time.monotonic() - killed
            assert ended == "SchedulerUnavailableError", ended
            assert took <= LEASE_TIMEOUT + 5.0, took
            del agent
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_an_agents_share_comes_back_when_it_dies(job: dict[str, Any]) -> None:
    """Node b's agent is killed holding a share: within the lease timeout the job's
    actor lends it to node a, whose worker then has nearly the whole rate."""
    warm = await anyio.to_thread.run_sync(
        lambda: ray.get([_on(job, h).call.remote(job["name"], 2.0) for h in ("a", "b")])
    )
    assert all(result["at_home"] for result in warm)
    ray.kill(job["agents"]["b"].actor)
    await anyio.sleep(LEASE_TIMEOUT + 2 * HEARTBEAT)
    seconds = 4.0
    result = await anyio.to_thread.run_sync(
        lambda: ray.get(_on(job, "a").call.remote(job["name"], seconds))
    )
    late = [at for at in result["grants"] if at >= result["grants"][0] + 1.5]
    assert len(late) / (seconds - 1.5) >= 0.75 * RATE
