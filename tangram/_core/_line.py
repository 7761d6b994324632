"""The waiting line in a policy's priority order: sorted chunks, so every change is cheap.

A policy that admits by priority instead of arrival (size-aware admission) reads the queue
in key order, a window at a time, while actions join and leave from anywhere in it. A
heap gives the front but not the next ``window`` in order without popping, and removal
from its middle needs positions a Python heap cannot keep cheaply; one sorted list makes
every insertion near the front a move of the whole list. Chunks of a few hundred keys
(the layout of ``sortedcontainers.SortedList``, which tangram does not depend on) make
insertion and removal a bisection plus a move inside one chunk, and reading the front a
walk over the first chunks: the cost of a pass stays flat from a thousand waiting actions
to a hundred thousand.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

__all__ = ["Line"]

# Keys per chunk before it splits in two. Big enough that the list of chunks stays short,
# small enough that a move inside a chunk is a few hundred pointers.
_SPLIT = 512

# A key ends with the item itself, after fields that are unique among the keys (a
# sequence number), so two items are never compared.
Key = tuple[Any, ...]
_item = itemgetter(-1)


class Line:
    """Keys kept sorted; iterating yields each key's last element (the item) in key order."""

    __slots__ = ("_chunks", "_count", "_maxes")

    def __init__(self) -> None:
        self._chunks: list[list[Key]] = []
        self._maxes: list[Key] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        return map(_item, itertools.chain.from_iterable(self._chunks))

    def add(self, key: Key) -> None:
        self._count += 1
        maxes = self._maxes
        if not maxes:
            self._chunks.append([key])
            maxes.append(key)
            return
        at = bisect_left(maxes, key)
        if at == len(maxes):
            at -= 1
            chunk = self._chunks[at]
            chunk.append(key)
            maxes[at] = key
        else:
            chunk = self._chunks[at]
            insort(chunk, key)
        if len(chunk) > _SPLIT:
            half = len(chunk) // 2
            self._chunks.insert(at + 1, chunk[half:])
            del chunk[half:]
            maxes[at] = chunk[-1]
            maxes.insert(at + 1, self._chunks[at + 1][-1])

    def remove(self, key: Key) -> None:
        """Take ``key`` out; a key not in the line is ignored."""
        maxes = self._maxes
        at = bisect_left(maxes, key)
        if at == len(maxes):
            return
        chunk = self._chunks[at]
        where = bisect_left(chunk, key)
        if where == len(chunk) or chunk[where] is not key:
            return
        del chunk[where]
        self._count -= 1
        if not chunk:
            del self._chunks[at]
            del maxes[at]
        elif where == len(chunk):
            maxes[at] = chunk[-1]
