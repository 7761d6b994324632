"""The code reward's wire (``tangram/_reward/_in_sandbox/_wire.py``), in process: what a
value shares travels, and a body the encoder never writes is refused, whatever the
answer's process sent."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from tangram._reward._in_sandbox._wire import decode, encode


def _no_handle(value: Any) -> int:
    raise AssertionError(f"no handle expected for {value!r}")


def _round_trip(value: Any) -> Any:
    return decode(encode(value, _no_handle), _no_handle)


def test_a_value_met_twice_is_one_value_after_the_trip() -> None:
    row = [0, 0]
    counts = collections.Counter("ab")
    back = _round_trip([row, row, {"a": row, "c": counts}, (row, counts), counts])
    assert back == [row, row, {"a": row, "c": counts}, (row, counts), counts]
    assert back[0] is back[1] is back[2]["a"] is back[3][0]
    assert back[2]["c"] is back[3][1] is back[4]
    assert back[0] is not row


def test_equal_values_that_are_not_one_stay_two() -> None:
    back = _round_trip([[0], [0], {}, {}])
    assert back[0] is not back[1] and back[2] is not back[3]


def test_a_cycle_is_refused_at_the_sender() -> None:
    cycle: list[Any] = [1]
    cycle.append(cycle)
    with pytest.raises(ValueError, match="deeply"):
        encode(cycle, _no_handle)


def test_an_argument_travels_as_its_place_and_its_items() -> None:
    inner = [1]
    data = encode([inner, [2]], _no_handle, places={id(inner): [0, 0]})
    assert data == [{"al": [[0, 0], [1]]}, [2]]
    assert decode(data, _no_handle) == [[1], [2]]  # without an alias hook: the copy
    found: list[Any] = []
    mine = [1]
    back = decode(data, _no_handle, alias=lambda place, copy: found.append(place) or mine)
    assert back[0] is mine and found == [[0, 0]]


@pytest.mark.parametrize(
    "data",
    [
        {"same": 0},
        [[1], {"same": 2}],
        {"same": True},
        {"same": -1},
        {"al": [[0], {"same": 0}]},
        {"al": [[0], 5]},
        {"al": [[0], {"t": [1]}]},
        {"al": [0, [1]]},
        {"d": [[1]]},
        {"s": "x"},
        {"fr": [{"i": format(1 << 400_000, "x")}, 3]},
        {"nt": ["P Q", ["x"], [1]]},
    ],
)
def test_a_share_or_alias_the_encoder_never_writes_is_refused(data: Any) -> None:
    with pytest.raises(ValueError):
        decode(data, _no_handle, alias=lambda place, copy: copy)
