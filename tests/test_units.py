import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram._core._units import (
    format_count,
    format_size,
    is_count_text,
    is_rate_text,
    parse_rate,
    parse_size,
)
from tangram.errors import InvalidCapacityError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("512MB", 512e6),
        ("512 MB", 512e6),
        ("2gib", 2 * 2**30),
        ("1.5KiB", 1536),
        ("1e9", 1e9),
        ("100", 100),
        ("7b", 7),
        ("1TB", 1e12),
        (" 3 GiB ", 3 * 2**30),
    ],
)
def test_parse_size(text: str, expected: float) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "16 bananas", "-1GiB", "1e400GiB", "1/s", "x16"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(InvalidCapacityError):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("50/s", 50.0),
        ("50 / sec", 50.0),
        ("3000/min", 50.0),
        ("120/m", 2.0),
        ("7200/h", 2.0),
        ("0.5/s", 0.5),
    ],
)
def test_parse_rate(text: str, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["50", "50/", "/s", "50/fortnight", "-5/s", "1e400/s", "a/s"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(InvalidCapacityError):
        parse_rate(text)


def test_text_shapes() -> None:
    assert is_rate_text("50/s")
    assert not is_rate_text("16GiB")
    assert is_count_text("8")
    assert is_count_text(" 2.5 ")
    assert not is_count_text("8GiB")
    assert not is_count_text("8/s")


@settings(deadline=None, max_examples=200, derandomize=True)
@given(
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.sampled_from(["KiB", "MiB", "GiB", "kB", "MB", "GB"]),
)
def test_parse_size_round_trips(value: float, unit: str) -> None:
    factor = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    parsed = parse_size(f"{value!r}{unit}")
    assert math.isclose(parsed, value * factor, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (32 * 2**30, "32GiB"),
        (3.43597e10, "32GiB"),  # the figure issue 20 saw in a message
        (1.5 * 2**20, "1.5MiB"),
        (2**31 + 1, "2GiB"),
        (1000 * 2**30, "1000GiB"),
        (3 * 2**40, "3TiB"),
        (1536, "1.5KiB"),
        (1023, "1023B"),
        (512, "512B"),
        (0, "0B"),
    ],
)
def test_format_size(value: float, text: str) -> None:
    assert format_size(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(3.0, "3"), (34359738368.0, "34359738368"), (2.5, "2.5"), (math.inf, "inf")],
)
def test_format_count_is_exact_when_whole(value: float, text: str) -> None:
    assert format_count(value) == text


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1, max_value=2.0**50))
def test_a_formatted_size_parses_back_within_its_rounding(value: float) -> None:
    back = parse_size(format_size(value))
    assert math.isclose(back, value, rel_tol=0.005)
