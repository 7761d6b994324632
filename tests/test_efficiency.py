import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import amdahls, efficiencies, powers

from tangram import Amdahl, Efficiency, Estimate, Linear, Power, SpeedupTable
from tangram._core._efficiency import efficiency_from_dict
from tangram.errors import DemandTypeError, InvalidDemandError

PROPERTY = settings(deadline=None, max_examples=150, derandomize=True)


def test_linear() -> None:
    assert [Linear().speedup(m) for m in (1, 2, 8)] == [1.0, 2.0, 8.0]


def test_amdahl_duration() -> None:
    # T(m) = T1 * ((1 - p) + p / m): 10 s at p = 0.9 on 4 units is 1 + 9/4 seconds.
    estimate = Estimate(10.0, Amdahl(0.9))
    assert estimate.seconds(1) == pytest.approx(10.0)
    assert estimate.seconds(4) == pytest.approx(1.0 + 9.0 / 4)
    assert estimate.seconds(1e12) == pytest.approx(1.0)  # the serial part remains


def test_amdahl_extremes() -> None:
    assert Amdahl(0.0).speedup(64) == 1.0
    assert Amdahl(1.0).speedup(64) == pytest.approx(64.0)


def test_power_duration() -> None:
    assert Estimate(8.0, Power(0.5)).seconds(4) == pytest.approx(4.0)
    assert Power(1.0).speedup(7) == pytest.approx(7.0)
    assert Power(0.0).speedup(7) == 1.0


def test_table_duration() -> None:
    table = SpeedupTable([1.0, 1.8, 2.4, 2.8])
    assert Estimate(12.0, table).seconds(3) == pytest.approx(5.0)
    assert table.speedup(4) == 2.8
    assert table.speedup(100) == 2.8  # flat past the end
    assert table.speedup(2.5) == 1.8  # a fraction of a unit does not help
    assert table.speedups == (1.0, 1.8, 2.4, 2.8)


def test_estimate_floors_units_at_one() -> None:
    # Zero or fractional units cannot make an action slower than one unit would.
    assert Estimate(5.0, Amdahl(0.5)).seconds(0) == 5.0


@pytest.mark.parametrize("value", [-0.1, 1.1, math.nan, math.inf])
def test_fraction_out_of_range(value: float) -> None:
    with pytest.raises(InvalidDemandError, match="parallel_fraction"):
        Amdahl(value)
    with pytest.raises(InvalidDemandError, match="alpha"):
        Power(value)


@pytest.mark.parametrize("value", ["0.5", None, True])
def test_fraction_wrong_type(value: object) -> None:
    with pytest.raises(DemandTypeError):
        Amdahl(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("speedups", "error"),
    [
        ([], InvalidDemandError),
        ([1.0, 0.5], InvalidDemandError),
        ([0.0, 1.0], InvalidDemandError),
        ([1.0, math.nan], InvalidDemandError),
        ([1.0, math.inf], InvalidDemandError),
        ([1.0, "2"], DemandTypeError),
        ([1.0, True], DemandTypeError),
        ("12", DemandTypeError),
        (3, DemandTypeError),
    ],
)
def test_bad_table(speedups: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        SpeedupTable(speedups)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"model": "linear"}, Linear()),
        ({"model": "amdahl", "parallel_fraction": 0.9}, Amdahl(0.9)),
        ({"model": "power", "alpha": 0.7}, Power(0.7)),
        ({"model": "table", "speedup": [1, 1.9, 2.5]}, SpeedupTable([1.0, 1.9, 2.5])),
        (
            {"model": "amdahl", "parallel_fraction": 0.5, "note": "extra keys are ignored"},
            Amdahl(0.5),
        ),
    ],
)
def test_efficiency_from_dict(spec: dict[str, object], expected: Efficiency) -> None:
    assert efficiency_from_dict(spec) == expected


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"model": "cubic"}, InvalidDemandError, "unknown efficiency model 'cubic'"),
        ({}, InvalidDemandError, "unknown efficiency model None"),
        ({"model": "amdahl"}, InvalidDemandError, "parallel_fraction"),
        ({"model": "power"}, InvalidDemandError, "alpha"),
        ({"model": "table"}, InvalidDemandError, "speedup"),
        ({"model": "amdahl", "parallel_fraction": 2}, InvalidDemandError, "parallel_fraction"),
        ({"model": "amdahl", "parallel_fraction": "high"}, DemandTypeError, "parallel_fraction"),
        ([("model", "linear")], DemandTypeError, "object"),
    ],
)
def test_efficiency_from_dict_rejects(spec: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        efficiency_from_dict(spec)  # type: ignore[arg-type]


def test_models_are_efficiencies() -> None:
    for model in (Linear(), Amdahl(0.5), Power(0.5), SpeedupTable([1.0])):
        assert isinstance(model, Efficiency)
    assert not isinstance(0.5, Efficiency)


@PROPERTY
@given(st.one_of(amdahls, powers), st.integers(1, 512))
def test_speedup_rises_and_efficiency_falls(model: Efficiency, m: int) -> None:
    # The paper's shape: E(m) = speedup(m) / m falls with m while speedup(m) still rises.
    now, more = model.speedup(m), model.speedup(m + 1)
    assert more >= now * (1 - 1e-12)
    assert more / (m + 1) <= now / m * (1 + 1e-12)
    assert 0 < now / m <= 1 + 1e-12


@PROPERTY
@given(efficiencies, st.integers(1, 64), st.floats(min_value=0.001, max_value=1e4))
def test_more_units_never_slower(model: Efficiency, m: int, t1: float) -> None:
    estimate = Estimate(t1, model)
    assert estimate.seconds(m + 1) <= estimate.seconds(m) * (1 + 1e-12)
    assert estimate.seconds(m) == pytest.approx(t1 / model.speedup(m))
