"""The values both sides of a call keep (``_kept``): which of them either side still holds.

A value neither the tests nor the answer hold any part of can change no more, and is
forgotten: read again at every call, such values made a loop of calls with list
arguments spend most of its time re-reading values nobody held.
"""

from __future__ import annotations

from typing import Any

from tangram._reward._in_sandbox._kept import KEPT_TEXT, Shared, _ours, unheld
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
    """Only parts that hold parts are read item by item for references (a list of a
    million numbers the tests hold was read at every call)."""
    numbers = list(range(1000))
    rows = [[1], [2]]
    roots = {1: _parts(numbers), 2: _parts(rows)}
    _, ours, nesting = _ours(roots, lambda parts: parts.items(), [])
    assert id(numbers) not in nesting and id(rows) in nesting
    assert ours[id(numbers)] == 1 and ours[id(rows[0])] == 2  # its root, and rows


def test_the_tests_side_carries_the_smallest_values_and_names_them() -> None:
    """What is carried past the bound is decided here, smallest first, and named to the
    answer's process at each call (``carried``): the largest value is a copy, not the
    older ones (an answer returning one large value made them all copies)."""
    shared = Shared()
    small, older, newer = [1], ["x" * (KEPT_TEXT * 3 // 5)], ["y" * (KEPT_TEXT * 3 // 5)]
    shared.keep(1, _parts(small), _handle)
    shared.keep(2, _parts(older), _handle)
    shared.keep(3, _parts(newer), _handle)  # the two large ones pass the bound together
    assert shared.changes(_handle) == ([], [1, 2])
    small.append(2)
    changed, carried = shared.changes(_handle)
    assert [entry["seq"] for entry in changed] == [1] and carried == [1, 2]


def test_a_change_the_tests_make_is_sent_once_as_places_of_the_parts() -> None:
    shared = Shared()
    rows = [[0, 0], [0, 0]]
    shared.keep(-5, _parts(rows), _handle)
    assert shared.changes(_handle) == ([], [-5])
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
    assert shared.changes(_handle) == ([], [-5])
