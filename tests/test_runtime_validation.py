"""Bad input fails at the call that made it, with a typed error, before anything is queued."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from conftest import assert_idle, hold, wait_until

import tangram
from tangram.errors import (
    CapacityExceededError,
    DemandTypeError,
    InvalidCapacityError,
    InvalidDemandError,
    InvalidSettingError,
    SettingTypeError,
    TangramError,
    UnknownResourceError,
    WaitTimeoutError,
)

CAPACITY = {"cpu": 4, "gpu": 2, "mem": "1GiB", "api": tangram.Rate(5, burst=5)}

# (call on a runtime, the error, a builtin it must also be, text the message must contain)
BAD_CALLS: list[Any] = [
    pytest.param(
        lambda r: r.acquire(disk=1), UnknownResourceError, LookupError, "disk", id="unknown"
    ),
    pytest.param(
        lambda r: r.acquire({"disk": 1}),
        UnknownResourceError,
        LookupError,
        "disk",
        id="unknown-mapping",
    ),
    pytest.param(lambda r: r.acquire(cpu=-1), InvalidDemandError, ValueError, "cpu", id="negative"),
    pytest.param(
        lambda r: r.acquire(cpu=math.nan), InvalidDemandError, ValueError, "nan", id="nan"
    ),
    pytest.param(
        lambda r: r.acquire(cpu=math.inf), InvalidDemandError, ValueError, "inf", id="inf"
    ),
    pytest.param(lambda r: r.acquire(cpu=0), InvalidDemandError, ValueError, "empty", id="zero"),
    pytest.param(
        lambda r: r.acquire({}), InvalidDemandError, ValueError, "empty", id="empty-mapping"
    ),
    pytest.param(lambda r: r.acquire(), InvalidDemandError, ValueError, "empty", id="nothing"),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(1, 0)),
        InvalidDemandError,
        ValueError,
        "max",
        id="zero-max",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(0, 2)),
        InvalidDemandError,
        ValueError,
        "min",
        id="zero-min",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(4, 2)),
        InvalidDemandError,
        ValueError,
        "2 < 4",
        id="min-over-max",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=5), CapacityExceededError, ValueError, "cpu", id="over-total"
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(5, 8)),
        CapacityExceededError,
        ValueError,
        "cpu",
        id="elastic-min-over-total",
    ),
    pytest.param(
        lambda r: r.acquire(mem="2GiB"),
        CapacityExceededError,
        ValueError,
        "mem",
        id="size-over-total",
    ),
    pytest.param(
        lambda r: r.acquire(api=6), CapacityExceededError, ValueError, "api", id="rate-over-burst"
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(1, 2), gpu=tangram.Elastic(1, 2)),
        InvalidDemandError,
        ValueError,
        "one resource",
        id="two-elastic",
    ),
    pytest.param(
        lambda r: r.acquire(mem=tangram.Elastic(1, 2)),
        InvalidDemandError,
        ValueError,
        "mem",
        id="elastic-size",
    ),
    pytest.param(
        lambda r: r.acquire(api=tangram.Elastic(1, 2)),
        InvalidDemandError,
        ValueError,
        "api",
        id="elastic-rate",
    ),
    pytest.param(
        lambda r: r.acquire(cpu="four"), DemandTypeError, TypeError, "cpu", id="text-count"
    ),
    pytest.param(lambda r: r.acquire(cpu=True), DemandTypeError, TypeError, "cpu", id="bool"),
    pytest.param(lambda r: r.acquire(cpu=None), DemandTypeError, TypeError, "cpu", id="none"),
    pytest.param(
        lambda r: r.acquire(mem="lots"), InvalidDemandError, ValueError, "mem", id="bad-size"
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(1.5, 4)),
        DemandTypeError,
        TypeError,
        "min",
        id="fractional-min",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(1, 4, efficiency="fast")),
        DemandTypeError,
        TypeError,
        "efficiency",
        id="bad-efficiency",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=tangram.Elastic(1, 4, resizable=1)),
        DemandTypeError,
        TypeError,
        "resizable",
        id="bad-resizable",
    ),
    pytest.param(
        lambda r: r.acquire([("cpu", 1)]), DemandTypeError, TypeError, "mapping", id="list-demand"
    ),
    pytest.param(
        lambda r: r.acquire({"cpu": 1}, gpu=1),
        DemandTypeError,
        TypeError,
        "not both",
        id="mapping-and-keywords",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, kind=3), DemandTypeError, TypeError, "kind", id="kind-type"
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, trajectory=7),
        DemandTypeError,
        TypeError,
        "trajectory",
        id="trajectory-type",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, estimate="1s"),
        DemandTypeError,
        TypeError,
        "estimate",
        id="estimate-type",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, estimate=-1.0),
        InvalidDemandError,
        ValueError,
        "estimate",
        id="estimate-negative",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, estimate=math.nan),
        InvalidDemandError,
        ValueError,
        "estimate",
        id="estimate-nan",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, estimate=math.inf),
        InvalidDemandError,
        ValueError,
        "estimate",
        id="estimate-inf",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, wait_timeout=-0.5),
        InvalidDemandError,
        ValueError,
        "wait_timeout",
        id="timeout-negative",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, wait_timeout=math.nan),
        InvalidDemandError,
        ValueError,
        "wait_timeout",
        id="timeout-nan",
    ),
    pytest.param(
        lambda r: r.acquire(cpu=1, wait_timeout="soon"),
        DemandTypeError,
        TypeError,
        "wait_timeout",
        id="timeout-type",
    ),
]


@pytest.mark.parametrize(("call", "error", "builtin", "text"), BAD_CALLS)
def test_bad_demand_fails_at_the_call(
    call: Callable[[tangram.Runtime], object],
    error: type[Exception],
    builtin: type[Exception],
    text: str,
) -> None:
    runtime = tangram.Runtime(capacity=CAPACITY)
    with pytest.raises(error, match=text) as info:
        call(runtime)
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, tangram.errors.TangramError)


@pytest.mark.anyio
@pytest.mark.parametrize(("call", "error", "builtin", "text"), BAD_CALLS[:8])
async def test_bad_demand_in_a_running_runtime_queues_nothing(
    call: Callable[[tangram.Runtime], object],
    error: type[Exception],
    builtin: type[Exception],
    text: str,
) -> None:
    async with tangram.Runtime(capacity=CAPACITY) as runtime:
        with pytest.raises(error):
            call(runtime)
        assert runtime.stats().decisions == 0
        assert_idle(runtime)


@pytest.mark.anyio
async def test_module_level_acquire_validates_too() -> None:
    async with tangram.Runtime(capacity=CAPACITY) as runtime:
        with pytest.raises(UnknownResourceError):
            tangram.acquire(disk=1)
        with pytest.raises(DemandTypeError):
            tangram.acquire({"cpu": 1}, cpu=1)
        assert_idle(runtime)


def test_good_demands_are_accepted() -> None:
    runtime = tangram.Runtime(capacity=CAPACITY)
    ok = [
        runtime.acquire(cpu=4),
        runtime.acquire(cpu=0.5),
        runtime.acquire({"cpu": 1, "mem": "512MiB"}),
        runtime.acquire(cpu=tangram.Elastic(1, 64)),  # a max above the total is a bound only
        runtime.acquire(cpu=tangram.Elastic(2, 2, resizable=True), gpu=1, api=5),
        runtime.acquire(cpu=0, gpu=1),  # a zero amount is simply left out
        runtime.acquire(cpu=1, estimate=0, wait_timeout=0),
        runtime.acquire(cpu=1, wait_timeout=math.inf),
    ]
    assert ok[5].action.demand.rigid == (("gpu", 1.0),)
    assert ok[1].action.demand.minimum == (("cpu", 0.5),)


BAD_CAPACITIES: list[Any] = [
    pytest.param({"cpu": -1}, id="negative"),
    pytest.param({"cpu": math.nan}, id="nan"),
    pytest.param({"cpu": math.inf}, id="inf"),
    pytest.param({"cpu": "lots"}, id="text"),
    pytest.param({"cpu": True}, id="bool"),
    pytest.param({"api": "0/s"}, id="zero-rate"),
    pytest.param({"api": "5/fortnight"}, id="bad-period"),
    pytest.param({"": 1}, id="empty-name"),
    pytest.param({}, id="empty"),
    pytest.param([("cpu", 1)], id="not-a-mapping"),
]


@pytest.mark.parametrize("capacity", BAD_CAPACITIES)
def test_bad_capacity_fails_at_construction(capacity: Any) -> None:
    with pytest.raises(InvalidCapacityError) as info:
        tangram.Runtime(capacity=capacity)
    assert isinstance(info.value, ValueError)


def test_bad_policy_fails_at_construction() -> None:
    with pytest.raises(TypeError, match="policy"):
        tangram.Runtime(capacity={"cpu": 1}, policy=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "update",
    [
        pytest.param({"cpu": -1}, id="negative"),
        pytest.param({"cpu": "many"}, id="text"),
        pytest.param({"cpu": "5/s"}, id="count-to-rate"),
        pytest.param({"api": 5}, id="rate-to-count"),
    ],
)
def test_bad_set_capacity_fails_and_changes_nothing(update: dict[str, object]) -> None:
    runtime = tangram.Runtime(capacity=CAPACITY)
    before = runtime.capacity
    with pytest.raises(InvalidCapacityError):
        runtime.set_capacity(update)
    assert runtime.capacity == before
    assert runtime.capacity["cpu"].total == 4


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        pytest.param({"cpu": 1}, {"cpu": True}, id="bool-after-int"),
        pytest.param({"cpu": 1.0}, {"cpu": True}, id="bool-after-float"),
        pytest.param({"cpu": 0, "gpu": 1}, {"cpu": False, "gpu": 1}, id="false-after-zero"),
    ],
)
def test_a_cached_demand_does_not_skip_validation(
    good: dict[str, object], bad: dict[str, object]
) -> None:
    """Equal amounts of another type are validated afresh (True == 1 for a dict key)."""
    runtime = tangram.Runtime(capacity=CAPACITY)
    runtime.acquire(good)
    runtime.acquire(good)  # served from the cache
    with pytest.raises(DemandTypeError):
        runtime.acquire(bad)


@pytest.mark.anyio
async def test_messages_of_a_lowered_capacity_read_in_units() -> None:
    """A waiting demand the cut makes impossible, and one built before the cut."""
    async with tangram.Runtime(capacity={"cpu": 4, "mem": "16GiB"}) as runtime:
        failed: list[str] = []
        holding = anyio.Event()

        async def waiter() -> None:
            try:
                async with runtime.acquire(mem="12GiB"):
                    pass
            except CapacityExceededError as exc:
                failed.append(str(exc))

        async with anyio.create_task_group() as tg:
            release = anyio.Event()

            async def holder() -> None:
                async with runtime.acquire(mem="8GiB"):
                    holding.set()
                    await release.wait()

            tg.start_soon(holder)
            await holding.wait()
            tg.start_soon(waiter)
            await wait_until(lambda: runtime.stats().waiting == 1)
            context = runtime.acquire(mem="10GiB")
            runtime.set_capacity(mem="9GiB")
            await wait_until(lambda: bool(failed))
            assert failed == ["capacity lowered below this demand: mem=12GiB"]
            with pytest.raises(CapacityExceededError, match=r"capacity: mem=10GiB$"):
                async with context:
                    pytest.fail("granted")
            release.set()
        assert_idle(runtime)


@pytest.mark.anyio
async def test_a_wait_timeout_message_reads_in_units() -> None:
    async with tangram.Runtime(capacity={"mem": "1GiB"}) as runtime:
        async with anyio.create_task_group() as tg:
            release = await hold(runtime, tg, mem="1GiB")
            with pytest.raises(WaitTimeoutError, match=r"waited 0 s for mem=512MiB "):
                async with runtime.acquire(mem="512MiB", wait_timeout=0):
                    pytest.fail("granted")
            release.set()
        assert_idle(runtime)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: tangram.Runtime({"cpu": 1}, policy=object()), SettingTypeError, "policy"),
        (lambda: tangram.FcfsPolicy(dop=0), InvalidSettingError, "dop"),
        (lambda: tangram.ElasticPolicy(window=0), InvalidSettingError, "window"),
        (lambda: tangram.ElasticPolicy(order="lifo"), InvalidSettingError, "order"),
        (lambda: tangram.Estimator(decay=0), InvalidSettingError, r"`decay` must be .*\(0, 1\]"),
        (lambda: tangram.Estimator(prior_seconds="1"), SettingTypeError, "prior_seconds"),
        (lambda: tangram.Estimator(max_kinds=True), SettingTypeError, "max_kinds"),
        (lambda: tangram.Estimator(max_kinds=0), InvalidSettingError, "max_kinds"),
        (lambda: tangram.Runtime({"cpu": -1}), InvalidCapacityError, "cpu"),
    ],
)
def test_bad_settings_are_tangram_errors(
    make: Callable[[], object], error: type[Exception], match: str
) -> None:
    """Issue 20: these raised plain ValueError/TypeError; they still are those builtins."""
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, TangramError)
    assert isinstance(info.value, ValueError)
    assert "(got " in str(info.value)


@pytest.mark.anyio
async def test_run_refuses_what_is_not_callable() -> None:
    async with tangram.Runtime(capacity={"cpu": 1}) as runtime:
        with pytest.raises(SettingTypeError, match="`fn`"):
            await runtime.run({"cpu": 1}, 42)  # type: ignore[arg-type]
        assert_idle(runtime)
