"""The values both sides hold: what the tests passed the answer, and what it returned.

Part of the harness (:mod:`._harness`), joined into the one program the sandbox runs, so
it imports nothing but the standard library and has no ``from __future__`` import (see
:mod:`._checks`).

Values cross the wire as copies. In one program (the classic recipe) a list the tests
pass is the list the answer keeps (``self.data = data``), and a list the answer returns
and keeps (``return self._items``) is the list the tests then change. Each side keeps
such values, a *root* per call's arguments (its number, ``seq``) and per call's result
(``-seq``), their parts (lists, dicts, sets, bytearrays, deques, the standard library's
dicts) named by the places :func:`._wire.places_of` gives them, alike on both sides:

- what the answer does to them is read in its process after each call and done to the
  tests' (``_fork._later``, ``Answer._later``, by the copy-back rules);
- what the tests do to them is read here before each call and done to the answer's, in
  place, before the call runs (:meth:`Shared.changes`, :func:`refill_parts`): a wrong
  ``Stack`` whose ``items()`` leaked its list passed the tests' check that changing the
  result left the stack alone, and a right ``Total(data)`` did not see the tests'
  ``data.append(5)``;
- a result that holds one of them is the tests' own (``Shared.alias``): ``s.items() is
  s.items()`` where it leaks one list, ``a.view() is data`` where it kept ``data``.

A root the tests no longer hold any part of is forgotten on both sides (nothing can
change it or see it change again); so is the oldest past ``KEPT`` roots, and the largest
past a MiB of text together (:data:`KEPT_TEXT`), or one that cannot be read (a cycle):
past those bounds a value is a copy on each side, as before. The tests' side decides
what is carried and names it at each call (``carried``); the answer's keeps those and
no others, so the two never disagree (counted apart, one call's large result made the
answer's side forget what the tests went on sending changes to, unheard).
"""

import collections
import json
import math
import sys
from collections.abc import Callable, Mapping

if __name__ != "__main__":  # imported by tangram; in the sandbox the program holds them
    from typing import Any

    from ._wire import KEPT, decode, encode

__all__ = ["KEPT_TEXT", "Shared", "arguments", "refill", "refill_parts", "text", "unheld"]

KEPT_TEXT = 1 << 20
"""Characters of kept values read again at each call, on each side."""


def refill(part: Any, copy: Any) -> None:
    """Make ``part`` (a list, bytearray, deque, set or dict, the standard library's too)
    hold what ``copy`` holds, in place."""
    if isinstance(part, (list, bytearray)):
        part[:] = copy
    else:
        part.clear()  # then a Counter's update sets, as a dict's does
        if isinstance(part, collections.deque):
            part.extend(copy)
        else:
            part.update(copy)


def refill_parts(parts: "Mapping[tuple[Any, ...], Any]", data: Any, handle: Any) -> None:
    """Refill ``parts`` (by their places) as ``data`` says: the other side's parts, each
    sent as its place (``al``) with what it holds now; a new value inside one is a copy.

    :raises ValueError: a place that is no part here, or not one like it.
    """

    def refilled(place: "list[Any]", copy: Any) -> Any:
        known = all(type(step) in (int, str) for step in place)
        part = parts.get(tuple(place)) if known else None
        if type(part) is not type(copy):
            raise ValueError("malformed changes")
        refill(part, copy)
        return part

    decode(data, handle, alias=refilled)


def arguments(
    args: "list[Any]",
    kwargs: "dict[str, Any]",
    before: "dict[int, tuple[list[Any], Any]]",
    keep: "Callable[[Any], int]",
) -> "tuple[Any, Any]":
    """A call's arguments encoded as the harness sent them (one numbering for both), each
    part that was there ``before`` it as its place then."""
    places = {number: path for number, (path, _) in before.items()}
    memo: dict[int, int] = {}
    return (
        encode(list(args), keep, memo=memo, places=places),
        encode(dict(kwargs), keep, memo=memo, places=places),
    )


def text(data: Any) -> str:
    """Encoded ``data`` as one text, a set's items sorted by theirs, places left out."""
    return json.dumps(_canonical(data))


def _canonical(data: Any) -> Any:
    if type(data) is list:
        return [_canonical(item) for item in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "al" and type(body) is list and len(body) == 2:
            return _canonical(body[1])  # where it was is no change
        if tag in ("s", "fs") and type(body) is list:
            return {tag: sorted((_canonical(item) for item in body), key=json.dumps)}
        return {tag: _canonical(body)}
    return data


class _Root:
    """The tests' side of one kept value: its parts by place, and their text when last
    carried (``None``: not carried, past the bounds)."""

    __slots__ = ("parts", "text")

    def __init__(self, parts: "dict[tuple[Any, ...], Any]") -> None:
        self.parts = parts
        self.text: str | None = None


class Shared:
    """The harness's side: the tests' parts of the values both sides keep, by root."""

    def __init__(self) -> None:
        self._roots: dict[int, _Root] = {}
        self._pending: set[int] = set()
        self.touched: set[int] = set()
        """The roots a call refilled from the answer's copies: their texts are read again
        after it (only theirs: another root of the same parts still owes the answer's
        copy of it the change)."""

    def clear(self) -> None:
        self._roots.clear()
        self._pending.clear()
        self.touched.clear()

    def parts(self, key: Any) -> "dict[tuple[Any, ...], Any] | None":
        """The tests' parts of root ``key``, by place; None for one not kept."""
        root = self._roots.get(key) if type(key) is int else None
        return None if root is None else root.parts

    def forget(self, keys: Any) -> None:
        """Forget the roots the answer's process says it holds no part of (``keys``)."""
        if type(keys) is list:
            for key in keys:
                if type(key) is int and key in self._roots:
                    self._drop(key)

    def pend(self, key: int) -> None:
        """The answer changed root ``key`` and the change was not copied back: its parts
        are the tests' no longer, in this reading, where a result holds them."""
        self._pending.add(key)

    def keep(self, key: int, parts: "dict[tuple[Any, ...], Any]", handle: Any) -> None:
        """Keep ``parts`` as root ``key``, the answer's process having kept it too."""
        root = self._roots[key] = _Root(parts)
        root.text = self._read(root, handle)[1]
        while len(self._roots) > KEPT:
            self._drop(next(iter(self._roots)))
        self._bound()

    def carried(self) -> "list[int]":
        """The roots this side carries: the answer's process keeps these and no others."""
        return list(self._roots)

    def _drop(self, key: int) -> None:
        del self._roots[key]
        self._pending.discard(key)
        self.touched.discard(key)

    def alias(self, head: "list[Any]", path: "list[Any]", copy: Any) -> Any:
        """What a result holds where the answer's held a part of an earlier root (``head``
        names it): the tests' own part, unless the root is not carried or its part is
        not the tests' in this reading; else the copy."""
        key = head[0] if len(head) == 1 else None
        root = self._roots.get(key) if type(key) is int else None
        if root is None or key in self._pending:
            return copy
        known = all(type(step) in (int, str) for step in path)
        part = root.parts.get(tuple(path)) if known else None
        return part if type(part) is type(copy) else copy

    def changes(self, handle: Any) -> "tuple[list[dict[str, Any]], list[int]]":
        """Before a call: the tests' changes to the roots, each as its parts now (for
        :func:`refill_parts` in the answer's process), and the roots carried on (for the
        answer's process to keep, and no others: the ones the tests no longer hold any
        part of are dropped after their last changes, ``s.items().append(9)`` changing
        a result the tests then let go).

        A root whose change by the answer was not copied back in this reading (pending)
        sends none: the tests' part is the older copy, and sent whole it undid the
        answer's change."""
        changed = []
        read: dict[Any, tuple[Any, str | None]] = {}  # roots of the same parts: read once
        for key, root in self._roots.items():
            if key in self._pending:
                continue
            same = tuple((place, id(part)) for place, part in root.parts.items())
            if same not in read:
                read[same] = self._read(root, handle)
            data, now = read[same]
            if now != root.text:
                root.text = now
                if now is not None:
                    changed.append({"seq": key, "parts": data})
        for key in self._unheld():
            self._drop(key)
        self._bound()
        return changed, self.carried()

    def rebase(self, handle: Any) -> None:
        """After a call that refilled the tests' parts: their texts as they are now, so
        that what the answer did is not sent back to it as the tests' change."""
        if self.touched:
            for key in self.touched:
                root = self._roots.get(key)
                if root is not None:
                    root.text = self._read(root, handle)[1]
            self.touched.clear()
            self._bound()

    def _read(self, root: _Root, handle: Any) -> "tuple[Any, str | None]":
        """A root's parts encoded (each as its place, so that the answer's process refills
        its own) and their text; None for one past the bounds."""
        if sum(len(part) for part in root.parts.values()) > KEPT_TEXT:
            return None, None  # a character an item at least: no need to encode it
        places = {id(part): list(place) for place, part in root.parts.items()}
        try:
            data = encode(list(root.parts.values()), handle, memo={}, places=places)
            now = json.dumps(data)
        except (TypeError, ValueError, RecursionError, MemoryError):
            return None, None  # something that cannot be sent, or nested past the wire
        return (data, now) if len(now) <= KEPT_TEXT else (None, None)

    def _bound(self) -> None:
        """Carry at most :data:`KEPT_TEXT` characters of roots, the smallest first, and
        none that cannot be read: the others are dropped, here and (not carried) in the
        answer's process. Newest first, an answer that returned one large value made
        every older one a copy again (its leaked list among them)."""
        sizes = sorted(
            (math.inf if root.text is None else len(root.text), index, key)
            for index, (key, root) in enumerate(self._roots.items())
        )
        total = 0.0
        for size, _, key in sizes:
            total += size
            if total > KEPT_TEXT:
                self._drop(key)

    def _unheld(self) -> "list[int]":
        """The roots the tests hold no part of: each part's references are all from
        these roots (their places, and the other parts that hold it). A part held through
        a tuple counts as held; without ``sys.getrefcount``, every part does."""
        if getattr(sys, "getrefcount", None) is None or not self._roots:
            return []
        return _unheld(self._roots, lambda root: root.parts.items(), [])


def unheld(kept: "Mapping[Any, tuple[Any, ...]]") -> "list[Any]":
    """In the answer's process: the roots (``_fork``'s ``kept``: arguments, keyword
    arguments, their parts' places, text) whose parts the answer no longer holds, as
    :meth:`Shared._unheld` finds the tests'. Nothing can change them there again."""
    if getattr(sys, "getrefcount", None) is None:
        return []
    around = [holder for root in kept.values() for holder in root[:2]]
    return _unheld(kept, lambda root: root[2].values(), around)


def _unheld(
    roots: "Mapping[Any, Any]", parts_of: "Callable[[Any], Any]", around: "list[Any]"
) -> "list[Any]":
    """The keys of ``roots`` none of whose parts (``parts_of`` each: their places and
    them) more refer to than these: one per root that names it, one per item of a part
    or of a list or dict ``around`` them that is it. Each root holds each of its parts
    once (no list of them is made here: it would refer to them too)."""
    objects, ours, nesting = _ours(roots, parts_of, around)
    held = _held_elsewhere(objects, ours)
    reached = [number for number in held if number in nesting]
    while reached:  # and what a held part holds is held, as far as it goes
        part = objects[reached.pop()]
        if not isinstance(part, (set, bytearray)):
            for item in part.values() if isinstance(part, dict) else part:
                if id(item) in objects and id(item) not in held:
                    held.add(id(item))
                    if id(item) in nesting:
                        reached.append(id(item))
    return [
        key
        for key, root in roots.items()
        if not any(id(part) in held for _, part in parts_of(root))
    ]


def _ours(
    roots: "Mapping[Any, Any]", parts_of: "Callable[[Any], Any]", around: "list[Any]"
) -> "tuple[dict[int, Any], dict[int, int], set[int]]":
    """The roots' parts by ``id``, how many references to each :func:`_unheld` counts,
    and the parts with parts inside them (by ``id``: only ``objects`` may refer to them).
    Only those are read item by item (a list of a million numbers the tests hold was
    read at every call)."""
    ours: dict[int, int] = {}
    objects: dict[int, Any] = {}
    nesting: set[int] = set()
    for root in roots.values():
        inside = {tuple(path[:end]) for path, _ in parts_of(root) for end in range(1, len(path))}
        for path, part in parts_of(root):
            ours[id(part)] = ours.get(id(part), 0) + 1
            objects[id(part)] = part
            if tuple(path) in inside:
                nesting.add(id(part))
    for holder in [*(objects[number] for number in nesting), *around]:
        if not isinstance(holder, (set, bytearray)):  # those hold no list, dict or set
            for item in holder.values() if isinstance(holder, dict) else holder:
                if id(item) in ours:
                    ours[id(item)] += 1
    return objects, ours, nesting


def _held_elsewhere(objects: "dict[int, Any]", ours: "dict[int, int]") -> "set[int]":
    """The parts that more refer to than ``ours`` says: the tests hold them. Counted
    against a new list referred to as each part is here (``-1``: no ``id`` is negative),
    so that what this frame and Python's iteration add is left out."""
    objects[-1] = []
    counts = {number: sys.getrefcount(part) for number, part in objects.items()}
    base = counts.pop(-1)
    del objects[-1]
    return {number for number, found in counts.items() if found - base > ours[number]}
