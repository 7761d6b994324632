import math

import pytest

import tangram
from tangram import Rate
from tangram._core._resources import Capacity, Shape, parse_capacity
from tangram.errors import InvalidCapacityError


def test_counts_sizes_and_rates() -> None:
    cap = parse_capacity(
        {
            "cpu": 8,
            "gpu": 0.5,
            "mem": "16GiB",
            "disk": "512MB",
            "search": "50/s",
            "judge": "3000/min",
            "llm": Rate(10, burst=40),
        }
    )
    assert cap["cpu"].shape is Shape.COUNT and cap["cpu"].total == 8.0
    assert cap["gpu"].total == 0.5
    assert cap["mem"].shape is Shape.SIZE and cap["mem"].total == 16 * 2**30
    assert cap["disk"].total == 512e6
    assert cap["search"].shape is Shape.RATE
    assert (cap["search"].total, cap["search"].burst) == (50.0, 50.0)
    assert (cap["judge"].total, cap["judge"].burst) == (50.0, 50.0)
    assert (cap["llm"].total, cap["llm"].burst) == (10.0, 40.0)
    assert cap.totals() == {name: res.total for name, res in cap.items()}
    assert len(cap) == 7 and list(cap) == list(cap.totals())


def test_bare_number_text_is_a_count() -> None:
    # A quoted number (environment variable, YAML string) means what the number means.
    assert parse_capacity({"cpu": "8"})["cpu"] == parse_capacity({"cpu": 8})["cpu"]


def test_capacity_passes_through() -> None:
    cap = parse_capacity({"cpu": 4})
    assert parse_capacity(cap) is cap
    assert isinstance(cap, Capacity)


def test_slow_rate_keeps_a_burst_of_one() -> None:
    # Below one unit a second a budget must still be able to hold one whole request.
    assert Rate(0.2).burst == 1.0
    assert parse_capacity({"api": "6/min"})["api"].burst == 1.0
    assert Rate(5).burst == 5.0


@pytest.mark.parametrize(
    ("capacity", "name"),
    [
        ({"cpu": -1}, "cpu"),
        ({"cpu": math.nan}, "cpu"),
        ({"cpu": math.inf}, "cpu"),
        ({"cpu": True}, "cpu"),
        ({"cpu": None}, "cpu"),
        ({"cpu": [4]}, "cpu"),
        ({"cpu": "1e400"}, "cpu"),
        ({"mem": "16 bananas"}, "mem"),
        ({"mem": "-2GiB"}, "mem"),
        ({"api": "50/fortnight"}, "api"),
        ({"api": "0/s"}, "api"),
    ],
)
def test_bad_capacity_names_the_parameter(capacity: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidCapacityError, match=repr(name)):
        parse_capacity(capacity)


@pytest.mark.parametrize("capacity", [{}, [("cpu", 4)], 4, {"": 4}, {3: 4}])
def test_bad_capacity_shape(capacity: object) -> None:
    with pytest.raises(InvalidCapacityError):
        parse_capacity(capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0,), "per_second"),
        ((-1,), "per_second"),
        ((math.nan,), "per_second"),
        ((math.inf,), "per_second"),
        (("fast",), "per_second"),
        ((None,), "per_second"),
        ((True,), "per_second"),
        ((5, 0), "burst"),
        ((5, "lots"), "burst"),
    ],
)
def test_bad_rate(args: tuple[object, ...], field: str) -> None:
    with pytest.raises(InvalidCapacityError, match=f"`{field}`"):
        Rate(*args)  # type: ignore[arg-type]


def test_invalid_capacity_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_capacity({"cpu": -1})
    assert issubclass(tangram.errors.InvalidCapacityError, tangram.errors.TangramError)


def test_with_updates() -> None:
    cap = parse_capacity({"cpu": 8, "mem": "1GiB", "api": "5/s"})
    new = cap.with_updates({"cpu": 4, "api": Rate(2, burst=6)})
    assert new["cpu"].total == 4 and new["mem"] == cap["mem"]
    assert (new["api"].total, new["api"].burst) == (2.0, 6.0)
    assert cap["cpu"].total == 8  # frozen: the original is unchanged
    added = cap.with_updates({"gpu": 2})
    assert added["gpu"].total == 2


@pytest.mark.parametrize("update", [{"cpu": "8GiB"}, {"mem": 4}, {"api": 5}, {"cpu": "5/s"}])
def test_with_updates_rejects_shape_change(update: dict[str, object]) -> None:
    cap = parse_capacity({"cpu": 8, "mem": "1GiB", "api": "5/s"})
    with pytest.raises(InvalidCapacityError, match="changes shape"):
        cap.with_updates(update)


def test_with_updates_validates() -> None:
    with pytest.raises(InvalidCapacityError, match="'cpu'"):
        parse_capacity({"cpu": 8}).with_updates({"cpu": -2})
