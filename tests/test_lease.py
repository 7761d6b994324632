"""``tangram.Lease``: what the body holds, when things happened, and resize notices."""

from __future__ import annotations

import math

import anyio
import anyio.lowlevel
import pytest
from conftest import assert_idle, wait_until

import tangram
from tangram.errors import LeaseNotResizableError, LeaseReleasedError

pytestmark = pytest.mark.anyio


async def test_rigid_grant() -> None:
    async with tangram.Runtime(capacity={"cpu": 4, "mem": "1KiB"}) as runtime:
        async with runtime.acquire(cpu=2, mem="512B", kind="tool", trajectory="t7") as lease:
            assert dict(lease.grant) == {"cpu": 2.0, "mem": 512.0}
            assert lease.units is None
            assert lease.active
            assert lease.action.kind == "tool"
            assert lease.action.trajectory == "t7"
            assert repr(lease).startswith("<tangram.Lease #")
            assert "kind='tool'" in repr(lease)
            with pytest.raises(TypeError):
                lease.grant["cpu"] = 3  # type: ignore[index]
        assert not lease.active
        assert dict(lease.grant) == {"cpu": 2.0, "mem": 512.0}


async def test_elastic_grant_and_what_it_keeps_after_release() -> None:
    async with tangram.Runtime(capacity={"cpu": 8, "gpu": 1}) as runtime:
        async with runtime.acquire(cpu=tangram.Elastic(2, 6), gpu=1) as lease:
            assert lease.units == 6  # alone: its maximum
            assert dict(lease.grant) == {"gpu": 1.0, "cpu": 6.0}
        # The block has ended: the lease still says what it ran with.
        assert not lease.active
        assert lease.units == 6
        assert dict(lease.grant) == {"gpu": 1.0, "cpu": 6.0}
        assert_idle(runtime)


async def test_timings_are_ordered() -> None:
    leases: list[tangram.Lease] = []
    async with tangram.Runtime(capacity={"cpu": 2}) as runtime:

        async def action(i: int) -> None:
            async with runtime.acquire(cpu=1 + i % 2) as lease:
                leases.append(lease)
                for _ in range(i % 3):
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(action, i)
    assert len(leases) == 20
    for lease in leases:
        assert lease.queued_at <= lease.admitted_at <= lease.started_at <= lease.finished_at
        assert lease.queue_seconds >= 0
        assert lease.overhead_seconds >= 0
        assert lease.exec_seconds >= 0
        assert math.isclose(
            lease.queue_seconds + lease.overhead_seconds + lease.exec_seconds,
            lease.finished_at - lease.queued_at,
            abs_tol=1e-9,
        )


async def test_times_are_nan_until_they_happen() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        async with runtime.acquire(cpu=1) as lease:
            assert not math.isnan(lease.started_at)
            assert math.isnan(lease.finished_at)
            assert math.isnan(lease.exec_seconds)
        assert not math.isnan(lease.exec_seconds)


async def test_wait_resized_returns_the_new_units() -> None:
    elastic = tangram.Elastic(1, 8, efficiency=tangram.Amdahl(0.5), resizable=True)
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=elastic, estimate=100.0) as lease:
            assert lease.units == 8
            heard: list[int] = []

            async def listen() -> None:
                heard.append(await lease.wait_resized())

            async with anyio.create_task_group() as tg:
                tg.start_soon(listen)
                await wait_until(lambda: lease._resized is not None)
                async with runtime.acquire(cpu=elastic, estimate=10.0) as other:
                    assert other.units is not None
                    await wait_until(lambda: bool(heard))
                    assert heard == [lease.units] == [8 - other.units]
        assert_idle(runtime)


async def test_a_resize_between_calls_is_not_lost() -> None:
    """The body was busy when the resize came: its next wait returns at once."""
    elastic = tangram.Elastic(1, 8, efficiency=tangram.Amdahl(0.5), resizable=True)
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=elastic, estimate=100.0) as lease:
            assert lease.units == 8
            async with runtime.acquire(cpu=elastic, estimate=10.0):
                assert lease.units < 8  # shrunk while nobody was waiting
                with anyio.fail_after(5):
                    assert await lease.wait_resized() == lease.units
                # Heard once: the next call waits for the next change.
                with anyio.move_on_after(0.01) as scope:
                    await lease.wait_resized()
                assert scope.cancelled_caught
            # The other action's exit grows this one back; heard without waiting first.
            with anyio.fail_after(5):
                assert await lease.wait_resized() == 8
        assert lease.resizes == 2
        assert_idle(runtime)


@pytest.mark.parametrize("demand", [2, tangram.Elastic(1, 4)], ids=["rigid", "fixed-elastic"])
async def test_a_lease_never_resized_refuses_to_wait(demand: object) -> None:
    """Waiting would never end (issue 20: it used to wait until cancelled)."""
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=demand) as lease:
            with pytest.raises(LeaseNotResizableError, match=r"resizable=True"):
                await lease.wait_resized()
            assert lease.resizes == 0
            assert lease.active
        assert_idle(runtime)


async def test_a_released_lease_refuses_to_wait() -> None:
    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        async with runtime.acquire(cpu=tangram.Elastic(1, 8, resizable=True)) as lease:
            pass
        with pytest.raises(LeaseReleasedError, match="no longer held"):
            await lease.wait_resized()
        assert_idle(runtime)


async def test_a_task_waiting_for_a_resize_hears_the_release() -> None:
    """A follower task outliving the block wakes with an error instead of hanging."""
    heard: list[BaseException] = []

    async def follow(lease: tangram.Lease) -> None:
        try:
            await lease.wait_resized()
        except LeaseReleasedError as exc:
            heard.append(exc)

    async with tangram.Runtime(capacity={"cpu": 8}) as runtime:
        demand = tangram.Elastic(1, 8, resizable=True)
        async with anyio.create_task_group() as tg, runtime.acquire(cpu=demand) as lease:
            tg.start_soon(follow, lease)
            await wait_until(lambda: lease._resized is not None)
        assert len(heard) == 1
        assert "released while waiting" in str(heard[0])
        assert_idle(runtime)


async def test_a_remote_lease_refuses_the_same_waits() -> None:
    """tangram.ray's lease shares the checks; built here without a cluster (it is a plain
    object; the Ray tests drive it through a real one)."""
    from tangram._shared._proxy import RemoteLease

    runtime = tangram.Runtime(capacity={"cpu": 8})
    fixed = runtime.acquire(cpu=tangram.Elastic(1, 4)).action
    lease = RemoteLease(fixed, 1, {"cpu": 4.0}, 4, 0.0, 0.0)
    with pytest.raises(LeaseNotResizableError):
        await lease.wait_resized()

    resizable = runtime.acquire(cpu=tangram.Elastic(1, 4, resizable=True)).action
    lease = RemoteLease(resizable, 2, {"cpu": 4.0}, 4, 0.0, 0.0)
    heard: list[BaseException] = []

    async def follow() -> None:
        try:
            await lease.wait_resized()
        except LeaseReleasedError as exc:
            heard.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        await wait_until(lambda: lease._resized is not None)
        lease.finished_at = anyio.current_time()  # what the proxy's release does
    assert len(heard) == 1
    with pytest.raises(LeaseReleasedError):
        await lease.wait_resized()

    reclaimed = RemoteLease(resizable, 3, {"cpu": 4.0}, 4, 0.0, 0.0)
    reclaimed.reclaimed = True
    with pytest.raises(LeaseReleasedError):
        await reclaimed.wait_resized()
