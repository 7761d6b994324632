"""Chaos: many thousands of actions meeting every way an action can end, under checks.

Each worker loops over actions with random demands (rigid, elastic, resizable, rate and
mixed) and a random fate: it completes, raises, raises a ``KeyboardInterrupt``, is
cancelled by its own deadline or by an outside canceller at any stage (queued, being
admitted, running, waiting for a resize), or gives up with ``wait_timeout``; meanwhile
capacities are cut and raised. An :class:`~tangram.testing.InvariantChecker` checks every
decision; at the end nothing may be held, queued or leased, no task may be left, and every
action the runtime saw must be accounted completed, failed or cancelled, with the
completed and failed counts equal to what the bodies themselves saw.

The big run (100k actions) is on asyncio in real time with zero-length bodies: every
sleep is a bare checkpoint, so it costs only the scheduling. Time-driven fates (deadlines
that land mid-body, wait timeouts, rate refills) run on trio's
``MockClock(autojump_threshold=0)``, where virtual time jumps to the next deadline
whenever every task is blocked (10k actions of seconds-long bodies), and on asyncio in
debug mode with sub-millisecond bodies (2k actions). Outside cancellation and capacity
changes are paced by the actions (a share of actions cancels another one or changes a
capacity), not by the clock, so every profile sees the same mix.

``TANGRAM_LONG=1`` scales every count up (1M real-time actions, 200k virtual, 20k debug);
the default is the short profile CI runs on every push.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
import trio.testing
from conftest import Backend

import tangram
from tangram.errors import CapacityExceededError, WaitTimeoutError
from tangram.gpu import TorchService
from tangram.testing import InvariantChecker, check_idle

LONG = os.environ.get("TANGRAM_LONG") == "1"
REAL_ACTIONS = 1_000_000 if LONG else 100_000
VIRTUAL_ACTIONS = 200_000 if LONG else 10_000
DEBUG_ACTIONS = 20_000 if LONG else 2_000

CAPACITY: dict[str, object] = {"cpu": 16, "gpu": 4, "mem": "64GiB"}
# A rate that binds at the speed each profile runs: real-time runs with zero-length bodies
# would otherwise wait most of their time for the budget to refill.
VIRTUAL_RATE = tangram.Rate(400, burst=40)
REAL_RATE = tangram.Rate(20_000, burst=100)

DEMANDS: list[Callable[[random.Random], dict[str, object]]] = [
    lambda r: {"cpu": r.randint(1, 4)},
    # Now and then more than any capacity the run sets (at most 32 cores): refused at the
    # call, so a short run sees that fate whatever the timing of its capacity cuts.
    lambda r: {"cpu": r.randint(1, 40)},
    lambda r: {"cpu": 1, "mem": f"{r.randint(1, 8)}GiB"},
    lambda r: {"cpu": tangram.Elastic(1, r.randint(1, 8))},
    lambda r: {"cpu": tangram.Elastic(2, 16, resizable=True), "mem": "1GiB"},
    lambda r: {"gpu": tangram.Elastic(1, 4, resizable=True)},
    lambda r: {"gpu": 1, "cpu": 2},
    lambda r: {"search": 1},
    lambda r: {"search": 2, "cpu": 1},
]


class Interrupt(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` raised by a body (and caught right outside its action)."""


class Tally:
    def __init__(self) -> None:
        self.attempted = 0
        self.completed = 0
        self.failed = 0
        self.interrupted = 0
        self.body_cancelled = 0
        self.wait_timeouts = 0
        self.rejected = 0
        self.never_started = 0
        self.left_units = 0.0  # units still held once every worker ended (0 unless leaked)


async def body(lease: tangram.Lease, r: random.Random, scale: float) -> None:
    fate = r.random()
    if fate < 0.10:
        await anyio.sleep(r.random() * scale)
        raise ValueError("the tool failed")
    if fate < 0.13:
        await anyio.sleep(r.random() * scale)
        raise Interrupt
    elastic = lease.action.demand.elastic
    if elastic is not None and elastic.resizable and r.random() < 0.5:
        # Follow resizes for a while, as a cgroup-pinned tool would.
        with anyio.move_on_after(r.random() * 3 * scale):
            while True:
                await lease.wait_resized()
        return
    await anyio.sleep(r.expovariate(1.0) * scale)


async def worker(
    runtime: tangram.Runtime,
    r: random.Random,
    tally: Tally,
    budget: list[int],
    scopes: set[anyio.CancelScope],
    scale: float,
) -> None:
    while budget[0] > 0:
        budget[0] -= 1
        tally.attempted += 1
        demand = r.choice(DEMANDS)(r)
        wait_timeout = r.random() * 2 * scale if r.random() < 0.1 else None
        try:
            context = runtime.acquire(
                demand, kind=f"k{r.randint(0, 5)}", trajectory="t", wait_timeout=wait_timeout
            )
        except CapacityExceededError:
            tally.rejected += 1  # asks for more than the capacity is right now
            continue
        deadline = r.random() * 3 * scale if r.random() < 0.15 else float("inf")
        entered = False
        with anyio.move_on_after(deadline) as scope:
            scopes.add(scope)
            try:
                async with context as lease:
                    entered = True
                    await body(lease, r, scale)
                tally.completed += 1
            except CapacityExceededError:  # a ValueError too: catch it first
                tally.rejected += 1  # the capacity was cut while it waited
            except ValueError:
                tally.failed += 1
            except Interrupt:
                tally.interrupted += 1
            except WaitTimeoutError:
                tally.wait_timeouts += 1
            finally:
                scopes.discard(scope)
        if scope.cancelled_caught:
            if entered:
                tally.body_cancelled += 1
            else:
                tally.never_started += 1
        # Chaos from outside, at a pace set by the actions, not the clock: cancel some
        # other action wherever it is, and change a capacity now and then.
        if scopes and r.random() < 0.05:
            r.choice(list(scopes)).cancel()
        if r.random() < 0.004:
            change_capacity(runtime, r)
        await anyio.lowlevel.checkpoint()


def change_capacity(runtime: tangram.Runtime, r: random.Random) -> None:
    """Cut or raise capacities at run time, as nodes leave and join."""
    change: dict[str, object] = {}
    if r.random() < 0.7:
        change["cpu"] = r.choice([2, 4, 8, 12, 16, 24, 32])
    if r.random() < 0.5:
        change["gpu"] = r.choice([1, 2, 4, 8])
    if r.random() < 0.3:
        change["mem"] = f"{r.choice([4, 32, 64, 128])}GiB"
    runtime.set_capacity(change)


async def chaos(
    actions: int, *, workers: int, seed: int, scale: float, rate: tangram.Rate = VIRTUAL_RATE
) -> Tally:
    r = random.Random(seed)
    tally = Tally()
    budget = [actions]
    scopes: set[anyio.CancelScope] = set()
    runtime = tangram.Runtime({**CAPACITY, "search": rate})
    checker = InvariantChecker(runtime)
    async with runtime:
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(
                    worker, runtime, random.Random(r.random()), tally, budget, scopes, scale
                )
        stats = runtime.stats()
        tally.left_units = sum(
            abs(use.held) for kind, use in stats.resources.items() if kind != "search"
        )
        check_idle(runtime)
    checker.verify()
    outcomes = stats.kinds.values()
    completed = sum(k.completed for k in outcomes)
    failed = sum(k.failed for k in outcomes)
    cancelled = sum(k.cancelled for k in outcomes)
    assert tally.attempted == actions
    assert completed + failed + cancelled == checker.submitted == checker.accounted()
    assert completed == tally.completed
    assert failed == tally.failed
    # Everything else the runtime saw ended cancelled: interrupts, cancellations in the
    # body or the queue, wait timeouts and waits failed by a capacity cut.
    assert checker.submitted <= actions
    assert checker.checks > actions
    # Every fate actually happened, so the run tested what it claims.
    for name in ("completed", "failed", "interrupted", "body_cancelled", "wait_timeouts"):
        assert getattr(tally, name) > 0, name
    assert tally.never_started > 0 and tally.rejected > 0 and stats.resizes > 0
    return tally


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return ("trio", {"clock": autojump_clock})


@pytest.mark.anyio
async def test_chaos_on_a_virtual_clock() -> None:
    # Seconds-long bodies, deadlines and rate refills, at no cost in real time.
    await chaos(VIRTUAL_ACTIONS, workers=64, seed=1, scale=1.0)


@pytest.mark.parametrize(
    ("real_backend", "actions", "scale"),
    [
        # Zero-length bodies: every sleep is a bare checkpoint, so the run measures the
        # scheduler; deadlines of zero cancel actions before they start.
        pytest.param(("asyncio", {}), REAL_ACTIONS, 0.0, id="asyncio"),
        # Sub-millisecond bodies and deadlines, so they also land mid-body and mid-wait.
        pytest.param(("asyncio", {"debug": True}), DEBUG_ACTIONS, 1e-4, id="asyncio+debug"),
    ],
)
def test_chaos_in_real_time_on_asyncio(real_backend: Backend, actions: int, scale: float) -> None:
    name, options = real_backend

    async def main() -> None:
        await chaos(actions, workers=32, seed=2, scale=scale, rate=REAL_RATE)
        current = asyncio.current_task()
        assert {t for t in asyncio.all_tasks() if not t.done()} == {current}

    anyio.run(main, backend=name, backend_options=options)


# -- executor faults -------------------------------------------------------------------


def _running(argv: list[str]) -> list[int]:
    """Host pids of live processes whose argv is exactly ``argv``."""
    wanted = [part.encode() for part in argv]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0") != wanted:
                continue
            state = (entry / "stat").read_bytes().rpartition(b")")[2].split()[0]
        except OSError:
            continue
        if state != b"Z":
            found.append(int(entry.name))
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sandbox_process_killed_mid_action_is_a_result_and_units_return(
    tmp_path: Path,
) -> None:
    async with (
        tangram.SandboxPool(tangram.LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
        pool.sandbox("t") as sbx,
    ):
        checker = InvariantChecker(runtime)
        results: list[tangram.RunResult] = []

        # Commands run in their own pid namespace, so ``$$`` is not the host's pid: the
        # command is found by an argv no other process has.
        argv = ["sleep", f"{30 + secrets.randbelow(10**6) / 10**7:.7f}"]

        async def victim() -> None:
            results.append(await sbx.run(argv, cpu=1, timeout=60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            with anyio.fail_after(20):
                while True:  # another process starts it: poll, with a deadline
                    if pids := _running(argv):
                        break
                    await anyio.sleep(0.01)
            [pid] = pids
            assert runtime.stats().resources["cpu"].held == 1
            os.kill(pid, signal.SIGKILL)
        [result] = results
        assert result.signal == signal.SIGKILL and result.exit_code is None and not result.ok
        check_idle(runtime)
        # A killed command is the command's failure, not the sandbox's: it runs on.
        assert (await sbx.run("echo next")).stdout == b"next\n"
        check_idle(runtime)
    checker.verify()


async def _resetting_server(
    listener: anyio.abc.Listener[anyio.abc.SocketStream], seen: list[int]
) -> None:
    async def handle(stream: anyio.abc.SocketStream) -> None:
        seen.append(1)
        with anyio.move_on_after(5):
            await stream.receive()
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        # SO_LINGER with a zero timeout makes close() send RST: a connection reset.
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        await stream.aclose()

    await listener.serve(handle)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_api_that_resets_the_connection_fails_typed_and_leaks_no_slot() -> None:
    from tangram.quota import ApiKey, Quota, Retry

    quota = Quota(
        [ApiKey(name="k", requests=tangram.Rate(100, burst=10), concurrency=2)],
        retry=Retry(attempts=3, wait_initial=0.001, wait_max=0.01, wait_jitter=0.0),
        adapt=None,
    )
    seen: list[int] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as server:
        server.start_soon(_resetting_server, listener, seen)
        async with tangram.Runtime(capacity=quota.capacity()) as runtime:
            checker = InvariantChecker(runtime)
            async with quota.client(base_url=f"http://127.0.0.1:{port}") as client:
                errors: list[BaseException] = []

                async def call() -> None:
                    try:
                        await client.get("/v1")
                    except httpx.TransportError as exc:
                        errors.append(exc)

                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(call)
            assert len(errors) == 8
            assert all(isinstance(e, (httpx.ReadError, httpx.RemoteProtocolError)) for e in errors)
            assert len(seen) >= 8 * 3  # each request was retried up to its attempts
            assert runtime.stats().resources["api.k.concurrency"].held == 0
            check_idle(runtime)
        checker.verify()
        server.cancel_scope.cancel()
    await listener.aclose()


class _FlakyRestore(TorchService):
    """A torch service whose restores fail at random, as CUDA does when a device is full."""

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(name, lambda: _tiny_model(seed), memory="1MiB")
        self.restores = 0

    def _allocate(self, target: object) -> object:
        import torch

        self.restores += 1
        if self.restores % 3 == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")
        return super()._allocate(target)  # type: ignore[arg-type]


def _tiny_model(seed: int) -> object:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


@pytest.mark.anyio
async def test_restores_that_fail_under_cancellation_leave_nothing_held() -> None:
    """Real torch services on a CPU budget that fits one of four at a time.

    Every third restore fails (an injected allocation failure, the CUDA out-of-memory
    path) and actions are cancelled at random; every action ends as a result, a typed error
    or a cancellation, and nothing is held or granted at the end.
    """
    import torch

    from tangram.errors import GpuOutOfMemoryError
    from tangram.gpu import Device, GpuPool

    rng = random.Random(7)
    services = [_FlakyRestore(f"s{i}", i) for i in range(4)]
    pool = GpuPool(services, devices=[Device("cpu:0", memory="1MiB")])
    outcomes = {"ok": 0, "oom": 0, "cancelled": 0}
    async with pool, tangram.Runtime(capacity=pool.capacity()) as runtime:
        checker = InvariantChecker(runtime)

        async def call(name: str) -> None:
            with anyio.CancelScope() as scope:
                if rng.random() < 0.2:
                    scope.deadline = anyio.current_time() + rng.random() * 0.01
                try:
                    async with pool.use(name) as svc:
                        await svc(torch.ones(2, 16))
                    outcomes["ok"] += 1
                except GpuOutOfMemoryError:
                    outcomes["oom"] += 1
                    return
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1

        # Waves of concurrent actions on one service each, so every wave evicts the last
        # service and restores the next: 12 waves, 3 restores per service.
        for wave in range(12):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(call, f"s{wave % 4}")
        assert sum(outcomes.values()) == 60
        assert sum(s.restores for s in services) >= 6  # services were evicted and restored
        assert outcomes["ok"] > 0 and outcomes["oom"] > 0
        assert all(usage["granted"] == 0 for usage in pool.usage().values())
        check_idle(runtime)
        checker.verify()
