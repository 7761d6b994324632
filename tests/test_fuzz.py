"""Fuzzing the public API: every bad input is a typed error at the call, never a hang or a
wrong grant.

Hypothesis throws arbitrary values (numbers of every kind, NaN and infinities, text that
looks like sizes and rates, containers, None, booleans) at the places a caller hands
tangram data: ``Runtime(capacity=...)``, ``Rate``, ``Elastic``, ``acquire(...)`` and its
keywords, ``set_capacity`` and the efficiency-model parser. For each input exactly one of
two things may happen: the call raises a :class:`tangram.errors.TangramError` that is also
the builtin a caller would catch (``ValueError``, ``TypeError``, ``LookupError``), or it
works, and then a demand is granted within the capacity, promptly, and returned in full.

There is no trace reader yet (it comes with the simulator's trace format); its fuzz target
belongs with it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tangram
import tangram.gpu
import tangram.quota
from tangram._core._efficiency import efficiency_from_dict
from tangram.errors import InvalidCapacityError, TangramError
from tangram.testing import InvariantChecker, check_idle

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BUILTINS = (ValueError, TypeError, LookupError)

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    # Past a float's range: ``float()`` of these raises OverflowError, not a ValueError.
    st.sampled_from([0, 1, -1, 0.5, 1e-300, 1e300, True, False, 10**400, -(10**400), 2**53 + 1]),
)
unit_text = st.builds(
    lambda n, unit: f"{n}{unit}",
    st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True)),
    st.sampled_from(["", "GiB", "MiB", "GB", "k", "B", "/s", "/min", "/h", " bananas", "/0s"]),
)
junk = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()),
)
rates = st.builds(
    lambda per, burst: (per, burst),
    st.one_of(numbers, junk),
    st.one_of(st.none(), numbers, junk),
)


@st.composite
def rate_objects(draw: st.DrawFn) -> object:
    per, burst = draw(rates)
    try:
        return tangram.Rate(per) if burst is None else tangram.Rate(per, burst)
    except TangramError:
        return draw(numbers)


amounts = st.one_of(numbers, unit_text, junk, rate_objects())
names = st.one_of(
    st.sampled_from(["cpu", "gpu", "mem", "api", ""]), st.text(max_size=5), st.integers()
)


def typed(exc: BaseException) -> bool:
    return isinstance(exc, TangramError) and isinstance(exc, BUILTINS)


@SETTINGS
@given(st.one_of(st.dictionaries(names, amounts, max_size=4), junk, st.lists(amounts, max_size=2)))
def test_any_capacity_builds_or_fails_typed(capacity: Any) -> None:
    try:
        runtime = tangram.Runtime(capacity)
    except Exception as exc:
        assert typed(exc), repr(exc)
        assert isinstance(exc, InvalidCapacityError)
        return
    for name, resource in runtime.capacity.items():
        assert isinstance(name, str) and name
        assert math.isfinite(resource.total) and resource.total >= 0


@SETTINGS
@given(rates)
def test_any_rate_builds_or_fails_typed(args: tuple[object, object]) -> None:
    per, burst = args
    try:
        rate = tangram.Rate(per) if burst is None else tangram.Rate(per, burst)  # type: ignore[arg-type]
    except Exception as exc:
        assert typed(exc), repr(exc)
        return
    assert rate.per_second > 0 and rate.burst > 0
    assert math.isfinite(rate.per_second) and math.isfinite(rate.burst)


@SETTINGS
@given(
    st.one_of(numbers, junk),
    st.one_of(numbers, junk),
    st.one_of(st.none(), junk, st.just(tangram.Linear()), st.just(tangram.Amdahl(0.5))),
    st.one_of(st.booleans(), junk),
)
def test_any_elastic_builds_or_fails_typed(
    low: object, high: object, efficiency: object, resizable: object
) -> None:
    try:
        elastic = tangram.Elastic(low, high, efficiency=efficiency, resizable=resizable)  # type: ignore[arg-type]
    except Exception as exc:
        assert typed(exc), repr(exc)
        return
    assert 1 <= elastic.min <= elastic.max


spec_values = st.one_of(numbers, junk, st.lists(st.one_of(numbers, junk), max_size=5), unit_text)


@SETTINGS
@given(
    st.one_of(
        st.dictionaries(
            st.sampled_from(["model", "parallel_fraction", "alpha", "speedup", "x"]),
            st.one_of(
                st.sampled_from(["amdahl", "power", "linear", "table", "AMDAHL"]), spec_values
            ),
            max_size=4,
        ),
        junk,
    )
)
def test_any_efficiency_spec_parses_or_fails_typed(spec: Any) -> None:
    try:
        model = efficiency_from_dict(spec)
    except Exception as exc:
        assert typed(exc), repr(exc)
        return
    speedups = [model.speedup(m) for m in range(1, 9)]
    assert speedups[0] > 0
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(speedups))


CAPACITY: dict[str, object] = {
    "cpu": 8,
    "gpu": 2,
    "mem": "16GiB",
    "api": tangram.Rate(1000, burst=50),
}
LIMIT = {"cpu": 8.0, "gpu": 2.0, "mem": 16 * 2**30, "api": 50.0}

demand_values = st.one_of(
    numbers,
    unit_text,
    junk,
    st.builds(
        lambda a, b, r: tangram.Elastic(a, b, resizable=r),
        st.integers(1, 4),
        # Up to the largest bound an Elastic takes: "as many as there are".
        st.one_of(st.integers(4, 12), st.just(2**53)),
        st.booleans(),
    ),
)
demands = st.dictionaries(
    st.one_of(st.sampled_from(["cpu", "gpu", "mem", "api"]), st.text(max_size=4)),
    demand_values,
    max_size=4,
)
keywords = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.one_of(st.text(max_size=5), junk, numbers),
        "trajectory": st.one_of(st.text(max_size=5), junk, numbers),
        "estimate": st.one_of(numbers, junk),
        "wait_timeout": st.one_of(numbers, junk),
    },
)


def _run(fn: Any) -> Any:
    async def main() -> Any:
        with anyio.fail_after(10):  # never a hang
            return await fn()

    return anyio.run(main, backend="asyncio")


@SETTINGS
@given(st.one_of(demands, junk), keywords)
def test_any_acquire_is_granted_within_capacity_or_fails_typed(
    demand: Any, kwargs: dict[str, Any]
) -> None:
    async def main() -> None:
        async with tangram.Runtime(CAPACITY) as runtime:
            checker = InvariantChecker(runtime)
            try:
                context = runtime.acquire(demand, **kwargs)
            except Exception as exc:
                assert typed(exc), repr(exc)
                return
            # Nothing else holds anything: a demand accepted at the call starts at once
            # (or after a short refill of the rate budget), with a grant that fits.
            with anyio.fail_after(5):
                async with context as lease:
                    grant = dict(lease.grant)
                    for name, amount in grant.items():
                        assert 0 < amount <= LIMIT[name] + 1e-9, (name, amount)
                    if lease.units is not None:
                        elastic = context.action.demand.elastic
                        assert elastic is not None
                        assert (
                            elastic.min
                            <= lease.units
                            <= min(elastic.max, 8 if "cpu" in grant else 2)
                        )
            check_idle(runtime)
            checker.check()

    try:
        _run(main)
    except TimeoutError as exc:
        # A wait_timeout of zero may time out a rate demand waiting for its refill.
        assert isinstance(exc, tangram.errors.WaitTimeoutError), repr(exc)


@SETTINGS
@given(st.one_of(st.dictionaries(names, amounts, max_size=3), junk))
def test_any_set_capacity_applies_or_fails_typed_and_leaves_it_alone(update: Any) -> None:
    async def main() -> None:
        async with tangram.Runtime(CAPACITY) as runtime:
            checker = InvariantChecker(runtime)
            async with runtime.acquire(cpu=2):
                before = runtime.capacity
                try:
                    if isinstance(update, Mapping):
                        runtime.set_capacity(update)
                    else:
                        runtime.set_capacity(update)  # a positional non-mapping
                except Exception as exc:
                    assert typed(exc), repr(exc)
                    assert runtime.capacity is before
            checker.check()
            check_idle(runtime)
            # Whatever happened, the runtime still grants what fits.
            if runtime.capacity["cpu"].total >= 1:
                async with runtime.acquire(cpu=1):
                    pass
            checker.check()

    _run(main)


@pytest.mark.parametrize(
    ("demand", "error"),
    [
        ({"cpu": True}, TypeError),
        ({"cpu": "2GiB"}, TypeError),
        ({"cpu": -1}, ValueError),
        ({"cpu": math.nan}, ValueError),
        ({"cpu": 9}, ValueError),
        ({"disk": 1}, LookupError),
        ({}, ValueError),
        ({"cpu": tangram.Elastic(1, 2), "gpu": tangram.Elastic(1, 2)}, ValueError),
        ({"api": tangram.Elastic(1, 2)}, ValueError),
    ],
)
def test_known_bad_demands_fail_with_the_expected_builtin(
    demand: dict[str, object], error: type[Exception]
) -> None:
    runtime = tangram.Runtime(CAPACITY)
    with pytest.raises(error) as info:
        runtime.acquire(demand)
    assert isinstance(info.value, TangramError)


#: Every public class of settings, with what it needs besides the setting under test.
SETTINGS_CLASSES: dict[type, dict[str, object]] = {
    tangram.Rate: {"per_second": 1},
    tangram.Amdahl: {"parallel_fraction": 0.5},
    tangram.Power: {"alpha": 0.5},
    tangram.ElasticPolicy: {},
    tangram.FcfsPolicy: {},
    tangram.Estimator: {},
    tangram.ServiceSpec: {"name": "s"},
    tangram.SandboxPool: {},
    tangram.LocalBackend: {},
    tangram.DockerConfig: {},
    tangram.quota.ApiKey: {"name": "k", "requests": 10},
    tangram.quota.Adapt: {},
    tangram.quota.Retry: {},
    tangram.quota.SetAside: {},
    tangram.gpu.TorchService: {"name": "t", "factory": lambda device: None},
    tangram.gpu.VllmService: {"name": "v", "servers": ["http://127.0.0.1:1"], "memory": "1GiB"},
}
#: Settings that take any object: names, and what the user's own code hands over.
ANY = {"name", "image", "user", "factory", "request", "transport", "efficiency", "order"}


def _settings() -> list[Any]:
    cases = []
    for cls, needs in SETTINGS_CLASSES.items():
        for param in inspect.signature(cls).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in ANY:
                continue
            cases.append(pytest.param(cls, needs, param.name, id=f"{cls.__name__}.{param.name}"))
    return cases


@pytest.mark.parametrize("value", [10**400, -(10**400), object()], ids=["huge", "-huge", "object"])
@pytest.mark.parametrize(("cls", "needs", "setting"), _settings())
def test_every_setting_refuses_a_number_past_a_float_or_a_wrong_type_at_the_call(
    cls: type, needs: dict[str, object], setting: str, value: object
) -> None:
    """An int past a float's range used to pass the checks (``10**400 >= 0``) and raise
    ``OverflowError`` at first use, in a sum or in ``setrlimit``, far from the call; and
    some settings took any object, to fail at the first sandbox made."""
    with pytest.raises(TangramError) as info:
        cls(**{**needs, setting: value})
    assert isinstance(info.value, BUILTINS)
