"""Chaos: many thousands of actions meeting every way an action can end, under checks.

Each worker loops over actions with random demands (rigid, elastic, resizable, rate and
mixed) and a random fate: it completes, raises, raises a ``KeyboardInterrupt``, is
cancelled by its own deadline or by an outside canceller at any stage (queued, being
admitted, running, waiting for a resize), or gives up with ``wait_timeout``; meanwhile
capacities are cut and raised. An :class:`~tangram.testing.InvariantChecker` checks every
decision; at the end nothing may be held, queued or leased, no task may be left, and every
action the runtime saw must be accounted completed, failed or cancelled, with the
completed and failed counts equal to what the bodies themselves saw.

The big run uses trio's ``MockClock(autojump_threshold=0)``: virtual time jumps to the
next deadline whenever every task is blocked, so the run costs CPU for the scheduling
only, not for the simulated seconds of work. A second, smaller run on asyncio (debug mode
too) uses real time with zero-length and sub-millisecond sleeps, for asyncio's own
cancellation paths.

``TANGRAM_LONG=1`` scales every count up (1M actions on the virtual clock); the default
is the short profile CI runs on every push.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
import trio.testing

import tangram
from tangram.errors import CapacityExceededError, WaitTimeoutError
from tangram.testing import InvariantChecker, check_idle

from conftest import Backend

LONG = os.environ.get("TANGRAM_LONG") == "1"
VIRTUAL_ACTIONS = int(os.environ.get("CHAOS_N", 1_000_000 if LONG else 100_000))
REAL_ACTIONS = 100_000 if LONG else 5_000

CAPACITY: dict[str, object] = {
    "cpu": 16,
    "gpu": 4,
    "mem": "64GiB",
    "search": tangram.Rate(400, burst=40),
}

DEMANDS: list[Callable[[random.Random], dict[str, object]]] = [
    lambda r: {"cpu": r.randint(1, 4)},
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


async def body(lease: tangram.Lease, r: random.Random, scale: float) -> None:
    fate = r.random()
    if fate < 0.10:
        await anyio.sleep(r.random() * scale)
        raise ValueError("the tool failed")
    if fate < 0.13:
        await anyio.sleep(r.random() * scale)
        raise Interrupt
    if lease.units is not None and r.random() < 0.5:
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
            except ValueError:
                tally.failed += 1
            except Interrupt:
                tally.interrupted += 1
            except WaitTimeoutError:
                tally.wait_timeouts += 1
            except CapacityExceededError:
                tally.rejected += 1  # the capacity was cut while it waited
            finally:
                scopes.discard(scope)
        if scope.cancelled_caught:
            if entered:
                tally.body_cancelled += 1
            else:
                tally.never_started += 1
        await anyio.lowlevel.checkpoint()


async def canceller(
    r: random.Random, scopes: set[anyio.CancelScope], done: anyio.Event, scale: float
) -> None:
    """Cancel random in-flight actions from outside, at whatever stage they are."""
    while not done.is_set():
        await anyio.sleep(r.random() * scale)
        if scopes:
            r.choice(sorted(scopes, key=id)).cancel()


async def capacity_changer(
    runtime: tangram.Runtime, r: random.Random, done: anyio.Event, scale: float
) -> None:
    while not done.is_set():
        await anyio.sleep(r.random() * 20 * scale)
        change: dict[str, object] = {}
        if r.random() < 0.7:
            change["cpu"] = r.choice([4, 8, 12, 16, 24, 32])
        if r.random() < 0.5:
            change["gpu"] = r.choice([1, 2, 4, 8])
        if r.random() < 0.3:
            change["mem"] = f"{r.choice([8, 32, 64, 128])}GiB"
        runtime.set_capacity(change)
    runtime.set_capacity(cpu=16, gpu=4, mem="64GiB")


async def chaos(actions: int, *, workers: int, seed: int, scale: float) -> Tally:
    r = random.Random(seed)
    tally = Tally()
    budget = [actions]
    scopes: set[anyio.CancelScope] = set()
    done = anyio.Event()
    runtime = tangram.Runtime(CAPACITY)
    checker = InvariantChecker(runtime)
    async with runtime:
        async with anyio.create_task_group() as chaos_tasks:
            chaos_tasks.start_soon(canceller, random.Random(r.random()), scopes, done, scale)
            chaos_tasks.start_soon(
                capacity_changer, runtime, random.Random(r.random()), done, scale
            )
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(
                        worker, runtime, random.Random(r.random()), tally, budget, scopes, scale
                    )
            done.set()
        check_idle(runtime)
        stats = runtime.stats()
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
    assert tally.never_started > 0 and stats.resizes > 0
    return tally


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return ("trio", {"clock": autojump_clock})


@pytest.mark.anyio
async def test_chaos_on_a_virtual_clock() -> None:
    await chaos(VIRTUAL_ACTIONS, workers=64, seed=1, scale=1.0)


@pytest.mark.parametrize(
    "real_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"debug": True}), id="asyncio+debug"),
    ],
)
def test_chaos_in_real_time_on_asyncio(real_backend: Backend) -> None:
    name, options = real_backend

    async def main() -> None:
        await chaos(REAL_ACTIONS, workers=100, seed=2, scale=0.0005)
        current = asyncio.current_task()
        assert {t for t in asyncio.all_tasks() if not t.done()} == {current}

    anyio.run(main, backend=name, backend_options=options)


# -- executor faults -------------------------------------------------------------------


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

        async def victim() -> None:
            results.append(await sbx.run("echo $$ > pid; exec sleep 30", cpu=1, timeout=60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            # The sandbox runs one action at a time (``sbx.get`` would wait for this
            # one): read the command's pid from its work dir directly.
            pid_file = anyio.Path(sbx._handle.workdir) / "pid"  # type: ignore[attr-defined]
            with anyio.fail_after(20):
                while True:  # another process writes it: poll, with a deadline
                    try:
                        pid = int((await pid_file.read_text()).strip())
                        break
                    except (FileNotFoundError, ValueError):
                        await anyio.sleep(0.01)
            assert runtime.stats().resources["cpu"].held == 1
            os.kill(pid, signal.SIGKILL)
        [result] = results
        assert result.signal == signal.SIGKILL and result.exit_code is None and not result.ok
        check_idle(runtime)
        # A killed command is the command's failure, not the sandbox's: it runs on.
        assert (await sbx.run("echo next")).stdout == b"next\n"
        check_idle(runtime)
    checker.verify()


async def _resetting_server(listener: anyio.abc.SocketListener, seen: list[int]) -> None:
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


def test_a_failed_restore_needs_the_gpu_executor() -> None:
    pytest.skip("no GPU model-service executor yet: 'a restore that fails' comes with it")
