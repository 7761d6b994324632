"""Instruments: any number attach and detach in any order, and one that raises is dropped.

The observers that ship with tangram (the invariant checker, the trace recorder) used to
replace methods on the runtime's ledger, so detaching them in the wrong order put back a
stale method and silently unhooked the other. Each order is tried here, with the
shipped observers and with plain counting instruments.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math

import anyio
import pytest
import trio.testing
from conftest import Backend, assert_idle, virtual_backend

import tangram
from tangram._sim._record import TraceRecorder
from tangram.testing import InvariantChecker

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend(autojump_clock: trio.testing.MockClock) -> Backend:
    return virtual_backend(autojump_clock)


class Log(tangram.Instrument):
    """Writes every event it hears as a short tuple."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def action_queued(self, lease: tangram.Lease) -> None:
        self.events.append(("queued", lease.action.kind, lease.queued_at))

    def action_granted(self, lease: tangram.Lease) -> None:
        self.events.append(("granted", lease.action.kind, lease.admitted_at, lease.units))

    def action_resized(self, lease: tangram.Lease, now: float) -> None:
        self.events.append(("resized", lease.action.kind, now, lease.units))

    def action_finished(self, lease: tangram.Lease, outcome: tangram.Outcome) -> None:
        ran = not math.isnan(lease.admitted_at)
        self.events.append(("finished", lease.action.kind, lease.finished_at, outcome, ran))

    def after_plan(self, plan: tangram.abc.Plan, now: float) -> None:
        self.events.append(("plan", now, len(plan.admits), len(plan.resizes)))

    def capacity_changed(self, capacity: tangram.Capacity) -> None:
        self.events.append(("capacity", capacity["cpu"].total))

    def count(self, name: str) -> int:
        return sum(1 for event in self.events if event[0] == name)


class Finishes(tangram.Instrument):
    """Overrides one hook only."""

    def __init__(self) -> None:
        self.outcomes: list[tangram.Outcome] = []

    def action_finished(self, lease: tangram.Lease, outcome: tangram.Outcome) -> None:
        self.outcomes.append(outcome)


class Broken(tangram.Instrument):
    def __init__(self) -> None:
        self.calls = 0

    def action_granted(self, lease: tangram.Lease) -> None:
        self.calls += 1
        raise ValueError("an observer's bug")


async def one_action(runtime: tangram.Runtime, kind: str = "a") -> None:
    async with runtime.acquire(cpu=1, kind=kind):
        await anyio.sleep(1)


async def test_every_event_of_an_action_in_order() -> None:
    log = Log()
    async with tangram.Runtime({"cpu": 4}) as runtime:
        runtime.add_instrument(log)
        async with anyio.create_task_group() as tg:

            async def grower() -> None:
                elastic = tangram.Elastic(1, 4, resizable=True)
                async with runtime.acquire(cpu=elastic, kind="grow", estimate=10) as lease:
                    await lease.wait_resized()
                    await anyio.sleep(1)

            async with runtime.acquire(cpu=2, kind="rigid", estimate=1):
                tg.start_soon(grower)
                await anyio.sleep(1)
        runtime.set_capacity(cpu=3)
        hogging, late_done = anyio.Event(), anyio.Event()

        async def hog() -> None:
            # Another task: one holding all 3 itself would get its answer at once.
            with contextlib.suppress(LookupError):
                async with runtime.acquire(cpu=3, kind="hog"):
                    hogging.set()
                    await late_done.wait()
                    raise LookupError("the hog fails")

        async with anyio.create_task_group() as tg:
            tg.start_soon(hog)
            await hogging.wait()
            with pytest.raises(tangram.errors.WaitTimeoutError):
                async with runtime.acquire(cpu=1, kind="late", wait_timeout=2):
                    pass
            late_done.set()
        with pytest.raises(ZeroDivisionError):
            async with runtime.acquire(cpu=1, kind="fails"):
                1 / 0  # noqa: B018
    completed, failed, cancelled = (
        tangram.Outcome.COMPLETED,
        tangram.Outcome.FAILED,
        tangram.Outcome.CANCELLED,
    )
    actions = [e for e in log.events if e[0] not in ("plan", "capacity")]
    assert actions == [
        ("queued", "rigid", 0.0),
        ("granted", "rigid", 0.0, None),
        ("queued", "grow", 0.0),
        ("granted", "grow", 0.0, 2),
        ("finished", "rigid", 1.0, completed, True),
        ("resized", "grow", 1.0, 4),
        ("finished", "grow", 2.0, completed, True),
        ("queued", "hog", 2.0),
        ("granted", "hog", 2.0, None),
        ("queued", "late", 2.0),
        ("finished", "late", 4.0, cancelled, False),
        ("finished", "hog", 4.0, failed, True),
        ("queued", "fails", 4.0),
        ("granted", "fails", 4.0, None),
        ("finished", "fails", 4.0, failed, True),
    ]
    assert ("capacity", 3.0) in log.events
    # Each grant and resize is reported before the pass that made it.
    for i, event in enumerate(log.events):
        if event[0] in ("granted", "resized"):
            after = next(e for e in log.events[i:] if e[0] == "plan")
            assert after[1] == event[2]


@pytest.mark.parametrize("attach", list(itertools.permutations(range(3))))
async def test_any_attach_and_detach_order_keeps_the_others_hearing(
    attach: tuple[int, ...],
) -> None:
    for detach in itertools.permutations(range(3)):
        logs = [Log(), Log(), Finishes()]
        async with tangram.Runtime({"cpu": 2}) as runtime:
            for i in attach:
                runtime.add_instrument(logs[i])
            attached = set(range(3))
            steps: list[int | None] = [None, *detach]  # one action before any detach
            for gone in steps:
                if gone is not None:
                    runtime.remove_instrument(logs[gone])
                    attached.discard(gone)
                before = [_heard(log) for log in logs]
                await one_action(runtime)
                for j, log in enumerate(logs):
                    gained = _heard(log) - before[j]
                    assert gained == (_per_action(log) if j in attached else 0), (attach, detach)


def _heard(instrument: tangram.Instrument) -> int:
    if isinstance(instrument, Log):
        return len(instrument.events)
    assert isinstance(instrument, Finishes)
    return len(instrument.outcomes)


def _per_action(instrument: tangram.Instrument) -> int:
    # Log: queued, granted, a pass, finished (an uncontended acquire starts in its own
    # pass; its release leaves nothing to plan). Finishes: the end only.
    return 4 if isinstance(instrument, Log) else 1


@pytest.mark.parametrize("order", ["checker first", "recorder first"])
async def test_the_checker_and_the_recorder_detach_in_either_order(order: str) -> None:
    async with tangram.Runtime({"cpu": 2}) as runtime:
        checker = InvariantChecker(runtime)
        recorder = TraceRecorder(runtime)
        await one_action(runtime)
        first, second = (checker, recorder) if order == "checker first" else (recorder, checker)
        first.detach()
        checks, actions = checker.checks, recorder.actions
        await one_action(runtime)
        # The one still attached still hears; the detached one does not.
        if second is checker:
            assert checker.checks > checks and recorder.actions == actions
        else:
            assert recorder.actions == actions + 1 and checker.checks == checks
        second.detach()
        await one_action(runtime)
        assert recorder.actions == actions + (second is recorder)
        checker.verify()
        assert_idle(runtime)


async def test_a_raising_instrument_is_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken, log = Broken(), Log()
    async with tangram.Runtime({"cpu": 2}) as runtime:
        runtime.add_instrument(broken)
        runtime.add_instrument(log)
        with caplog.at_level(logging.ERROR, logger="tangram"):
            await one_action(runtime)
            await one_action(runtime)
        assert broken.calls == 1
        assert log.count("granted") == log.count("finished") == 2
        (record,) = [r for r in caplog.records if "detached" in r.getMessage()]
        assert "action_granted" in record.getMessage() and record.exc_info is not None
        with pytest.raises(KeyError):
            runtime.remove_instrument(broken)
        assert runtime.stats().kinds["a"].completed == 2
        assert_idle(runtime)


async def test_attaching_twice_is_one_attachment_and_only_instruments_attach() -> None:
    finishes = Finishes()
    async with tangram.Runtime({"cpu": 1}) as runtime:
        runtime.add_instrument(finishes)
        runtime.add_instrument(finishes)
        await one_action(runtime)
        assert finishes.outcomes == [tangram.Outcome.COMPLETED]
        runtime.remove_instrument(finishes)
        with pytest.raises(
            tangram.errors.InstrumentNotAttachedError, match="is not attached"
        ) as info:
            runtime.remove_instrument(finishes)
        assert isinstance(info.value, KeyError)
        assert not str(info.value).startswith("'")  # a sentence, not a quoted key
        with pytest.raises(tangram.errors.SettingTypeError, match=r"tangram\.Instrument"):
            runtime.add_instrument(object())  # type: ignore[arg-type]


def test_the_base_instrument_hears_and_does_nothing() -> None:
    runtime = tangram.Runtime({"cpu": 1})
    runtime.add_instrument(tangram.Instrument())
    runtime.set_capacity(cpu=2)  # no hook overridden: nothing is called
    assert runtime.capacity["cpu"].total == 2
