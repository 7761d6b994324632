"""The values both sides of a call keep (``_kept``): which of them either side still holds.

A value neither the tests nor the answer hold any part of can change no more, and is
forgotten: read again at every call, such values made a loop of calls with list
arguments spend most of its time re-reading values nobody held.
"""

from __future__ import annotations

import time
from typing import Any

from tangram._reward._in_sandbox._kept import Shared, unheld
from tangram._reward._in_sandbox._wire import places_of


def _handle(value: Any) -> int:
    raise TypeError(type(value).__name__)


def _parts(*args: Any) -> dict[tuple[Any, ...], Any]:
    return {tuple(path): part for path, part in places_of(list(args), {}).values()}


def test_the_tests_side_forgets_what_the_tests_no_longer_hold() -> None:
    shared = Shared()
    outer = [1, [2, 3]]
    inner = outer[1]
    shared.keep(1, _parts(outer), _handle)
    shared.keep(2, _parts([[4], {"k": [5]}]), _handle)  # held by nobody from the start
    pair = ([6], [7])
    shared.keep(3, _parts(pair), _handle)
    same = [9]
    shared.keep(4, _parts([same, same]), _handle)
    assert shared._unheld() == [2]
    del outer  # its inner list is still held: the root is
    assert shared._unheld() == [2]
    del inner
    assert shared._unheld() == [1, 2]
    del pair  # held through a tuple until then
    assert shared._unheld() == [1, 2, 3]
    del same
    assert shared._unheld() == [1, 2, 3, 4]


def test_the_answers_side_forgets_what_it_no_longer_holds() -> None:
    kept: dict[int, tuple[Any, ...]] = {}

    def add(key: int, args: list[Any], kwargs: dict[str, Any]) -> None:
        kept[key] = (args, kwargs, places_of(args, kwargs), "")

    add(1, [[1]], {"k": {"a": [3]}})
    data = [5, [6]]  # as ``self.data = data`` holds it
    add(2, [data], {})
    add(-2, [data[1]], {})  # a later result holding a part of it: held through it
    assert unheld(kept) == [1]
    del data
    assert unheld(kept) == [1, 2, -2]


def test_a_long_flat_value_is_not_read_item_by_item() -> None:
    shared = Shared()
    numbers = list(range(2_000_000))
    shared.keep(1, _parts(numbers), _handle)  # past what is carried, kept for refills
    started = time.perf_counter()
    for _ in range(100):
        assert shared._unheld() == []
    assert time.perf_counter() - started < 0.5
    changed, dropped = shared.changes(_handle)
    assert (changed, dropped) == ([], [])


def test_a_change_the_tests_make_is_sent_once_as_places_of_the_parts() -> None:
    shared = Shared()
    rows = [[0, 0], [0, 0]]
    shared.keep(-5, _parts(rows), _handle)
    assert shared.changes(_handle) == ([], [])
    rows[1][0] = 7
    row = rows.pop(0)  # taken out, then changed: still read
    row.append(9)
    changed, _ = shared.changes(_handle)
    assert [entry["seq"] for entry in changed] == [-5]
    assert changed[0]["parts"] == [
        {"al": [[0], [{"al": [[0, 1], [7, 0]]}]]},
        {"al": [[0, 0], [0, 0, 9]]},
        {"same": 0},
    ]
    assert shared.changes(_handle) == ([], [])
