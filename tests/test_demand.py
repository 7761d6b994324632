import math

import pytest

from tangram import Amdahl, Elastic, Rate
from tangram._core._demand import Demand, build_demand
from tangram._core._resources import parse_capacity
from tangram.errors import (
    CapacityExceededError,
    DemandTypeError,
    InvalidDemandError,
    UnknownResourceError,
)

CAP = parse_capacity({"cpu": 16, "gpu": 2, "mem": "8GiB", "api": Rate(5, burst=10)})


def test_rigid_amounts() -> None:
    demand = build_demand({"cpu": 2, "gpu": 0.5, "mem": "1GiB", "api": 3}, CAP)
    assert dict(demand.rigid) == {"cpu": 2.0, "gpu": 0.5, "mem": 2.0**30, "api": 3.0}
    assert demand.elastic is None and demand.elastic_kind is None
    assert demand.minimum == demand.rigid
    assert demand.amount("cpu") == 2.0 and demand.amount("gpu", 7) == 0.5


def test_sizes_may_be_plain_bytes() -> None:
    assert dict(build_demand({"mem": 1024}, CAP).rigid) == {"mem": 1024.0}


def test_zero_amounts_are_dropped() -> None:
    assert dict(build_demand({"cpu": 0, "gpu": 1}, CAP).rigid) == {"gpu": 1.0}


def test_elastic_demand() -> None:
    elastic = Elastic(2, 8, efficiency=Amdahl(0.9), resizable=True)
    demand = build_demand({"cpu": elastic, "gpu": 1}, CAP)
    assert demand.elastic is elastic and demand.elastic_kind == "cpu"
    assert dict(demand.minimum) == {"gpu": 1.0, "cpu": 2.0}
    assert demand.amount("cpu", 5) == 5.0
    assert demand.amount("gpu", 5) == 1.0


def test_elastic_max_may_exceed_capacity() -> None:
    # Only the minimum has to fit; the grant is clamped to what exists.
    assert build_demand({"cpu": Elastic(1, 64)}, CAP).elastic == Elastic(1, 64)


def test_unknown_kind() -> None:
    with pytest.raises(UnknownResourceError, match="'tpu'") as info:
        build_demand({"tpu": 1}, CAP)
    assert isinstance(info.value, LookupError)
    assert "cpu" in str(info.value)  # it lists what the runtime has


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, -math.inf])
def test_bad_numbers(value: float) -> None:
    with pytest.raises(InvalidDemandError, match="'cpu'"):
        build_demand({"cpu": value}, CAP)


@pytest.mark.parametrize("value", [True, False, None, [1], "4", b"1"])
def test_bad_types(value: object) -> None:
    with pytest.raises(DemandTypeError, match="'cpu'") as info:
        build_demand({"cpu": value}, CAP)
    assert isinstance(info.value, TypeError)


def test_bad_size_text() -> None:
    with pytest.raises(InvalidDemandError, match="'mem'"):
        build_demand({"mem": "2 elephants"}, CAP)


def test_empty_demand() -> None:
    with pytest.raises(InvalidDemandError, match="empty"):
        build_demand({}, CAP)
    with pytest.raises(InvalidDemandError, match="empty"):
        build_demand({"cpu": 0}, CAP)


@pytest.mark.parametrize(
    ("amounts", "kind"),
    [
        ({"cpu": 17}, "cpu"),
        ({"cpu": 16.5}, "cpu"),
        ({"mem": "9GiB"}, "mem"),
        ({"api": 11}, "api"),  # a rate demand is bounded by the burst, not the rate
        ({"cpu": Elastic(17, 20)}, "cpu"),
        ({"gpu": 1, "cpu": 20}, "cpu"),
    ],
)
def test_more_than_capacity(amounts: dict[str, object], kind: str) -> None:
    with pytest.raises(CapacityExceededError, match=repr(kind)):
        build_demand(amounts, CAP)


def test_whole_capacity_fits() -> None:
    build_demand({"cpu": 16, "mem": "8GiB", "api": 10, "gpu": Elastic(2, 2)}, CAP)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((4, 2), InvalidDemandError),
        ((0, 4), InvalidDemandError),
        ((-1, 4), InvalidDemandError),
        ((1, 0), InvalidDemandError),
        ((1.5, 4), DemandTypeError),
        ((1, 4.0), DemandTypeError),
        ((True, 4), DemandTypeError),
        ((1, "4"), DemandTypeError),
        ((1, math.inf), DemandTypeError),
    ],
)
def test_bad_elastic(args: tuple[object, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        Elastic(*args)  # type: ignore[arg-type]


def test_elastic_error_names_bounds() -> None:
    with pytest.raises(InvalidDemandError, match=r"`max` must be >= `min` \(got 2 < 4\)"):
        Elastic(4, 2)


def test_elastic_rejects_bad_options() -> None:
    with pytest.raises(DemandTypeError, match="efficiency"):
        Elastic(1, 4, efficiency=0.9)  # type: ignore[arg-type]
    with pytest.raises(DemandTypeError, match="resizable"):
        Elastic(1, 4, resizable=1)  # type: ignore[arg-type]


def test_any_speedup_method_is_an_efficiency() -> None:
    class Halving:
        def speedup(self, units: float) -> float:
            return 1 + units / 2

    assert isinstance(Elastic(1, 4, efficiency=Halving()).efficiency, Halving)


def test_at_most_one_elastic_kind() -> None:
    with pytest.raises(InvalidDemandError, match="at most one"):
        build_demand({"cpu": Elastic(1, 4), "gpu": Elastic(1, 2)}, CAP)


@pytest.mark.parametrize("kind", ["mem", "api"])
def test_elastic_only_on_counts(kind: str) -> None:
    with pytest.raises(InvalidDemandError, match="only counted"):
        build_demand({kind: Elastic(1, 2)}, CAP)


def test_demand_is_frozen_value() -> None:
    a = build_demand({"cpu": 2, "gpu": 1}, CAP)
    b = build_demand({"cpu": 2, "gpu": 1}, CAP)
    assert a == b and hash(a) == hash(b)
    assert isinstance(a, Demand)


@pytest.mark.parametrize("amounts", [4, "cpu", None, [("cpu", 1)]])
def test_demand_must_be_a_mapping(amounts: object) -> None:
    with pytest.raises(DemandTypeError, match="mapping"):
        build_demand(amounts, CAP)  # type: ignore[arg-type]


def test_over_capacity_sizes_read_in_their_units() -> None:
    """Issue 20: ``3.43597e+10`` made the reader do the division."""
    capacity = parse_capacity({"mem": "16GiB", "gpu_mem": 17179869184})
    with pytest.raises(CapacityExceededError) as info:
        build_demand({"mem": "32GiB"}, capacity)
    assert str(info.value) == "demand 'mem' needs 32GiB, more than the whole capacity 16GiB"
    with pytest.raises(CapacityExceededError) as info:
        build_demand({"gpu_mem": 34359738368}, capacity)  # a count is shown exactly
    assert "needs 34359738368, more than the whole capacity 17179869184" in str(info.value)


def test_over_burst_says_burst() -> None:
    with pytest.raises(CapacityExceededError, match="needs 11, more than the whole burst 10"):
        build_demand({"api": 11}, CAP)


def test_a_bare_number_capacity_is_a_count_in_the_callers_unit() -> None:
    """``{"mem": 16}`` declares no unit, so it is a count: demands use the same unit."""
    capacity = parse_capacity({"mem": 16})
    assert dict(build_demand({"mem": 2}, capacity).rigid) == {"mem": 2.0}
    with pytest.raises(DemandTypeError) as info:
        build_demand({"mem": "2GiB"}, capacity)
    message = str(info.value)
    assert "capacity 'mem' is a count (16)" in message
    assert "{'mem': '16GiB'}" in message  # how to declare a size instead
    assert "'2GiB'" in message
