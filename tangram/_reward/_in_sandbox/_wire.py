"""The wire format between the code reward's harness and the answer's process.

Part of the harness (:mod:`._harness`), joined into the one program the sandbox runs, so
it imports nothing but the standard library and has no ``from __future__`` import (see
:mod:`._checks`). The answer's side is not trusted: :func:`decode` builds only plain
values, whatever was sent.

JSON, with lists as arrays and everything else that is not a JSON scalar as a one-key
object naming its type; a JSON object is therefore always such a tag. Handles stand for
objects of the answer's own classes, which stay in its process.
"""

import collections
import sys
from collections.abc import Callable

if __name__ != "__main__":  # for the type checker: the sandbox's program needs none
    from typing import Any

__all__ = ["METHOD", "VALUE_METHODS", "Lazy", "decode", "encode", "namedtuple_fields"]

_MAX_DEPTH = 200
# Ints past this many bits travel as hex: CPython refuses to parse decimal strings over
# 4300 digits, and hex is linear both ways.
_BIG_INT_BITS = 10_000

_SEQUENCES: dict[type, str] = {tuple: "t", set: "s", frozenset: "fs"}
_BUILD: dict[str, Callable[[Any], Any]] = {"t": tuple, "s": set, "fs": frozenset}
_HEX: dict[type, str] = {bytes: "b", bytearray: "ba"}
_FROM_HEX: dict[str, Callable[[str], Any]] = {"b": bytes.fromhex, "ba": bytearray.fromhex}
# The standard library's mappings travel as themselves, with their own comparison and
# lookups: as a dict, a wrong order passed ``== OrderedDict(...)``, and a right answer's
# ``Counter(...).most_common()`` or a ``defaultdict``'s missing key failed.
_MAPPINGS: dict[type, str] = {
    collections.OrderedDict: "od",
    collections.Counter: "ct",
    collections.defaultdict: "dd",
}
# The methods of the builtin values: one of the answer's objects that had them passed
# ``f(x).startswith("Hello")`` by saying yes (see ``._calls.Remote``), and so did a
# namedtuple with a field of such a name holding its function; that travels as a tuple.
VALUE_METHODS = frozenset(
    name
    for kind in (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex)
    for name in dir(kind)
    if not name.startswith("_")
)
# A namedtuple travels with its class's name and fields, and the harness makes a class of
# those (one per name and fields, at most so many, each of at most so many fields): as a
# tuple, a right answer's ``p.x`` or ``cache_info().hits`` failed. Its comparison is a
# tuple's either way; the class is the harness's, so nothing of the answer's runs there.
_NAMED: dict[tuple[str, tuple[str, ...]], type] = {}
_MOST_NAMED = 1024
_MOST_FIELDS = 256
# The factories a ``defaultdict`` travels with, by name; any other is sent as none (its
# missing keys then raise ``KeyError``, as a dict's did before).
_FACTORIES: dict[str, Callable[[], Any]] = {
    factory.__name__: factory
    for factory in (int, float, complex, str, bytes, bool, list, dict, set, frozenset, tuple)
}


class Lazy:
    """An iterator the answer returned, sent as a handle of its own: the harness takes
    its items from the answer's process as the tests ask for them."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator


class _Method:
    """What an attribute read answers for an attribute that can be called (a method):
    the tests then call it by name, so no handle is kept for each read."""

    def __repr__(self) -> str:
        return "METHOD"


METHOD = _Method()


def encode(value: Any, handle: Callable[[Any], int], depth: int = 0) -> Any:
    """``value`` as JSON-able data; ``handle`` names an object that cannot be sent.

    :raises ValueError: nested deeper than the wire allows.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply to send")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return {"i": format(value, "x")} if value.bit_length() > _BIG_INT_BITS else value
    if kind is float:
        return value if value - value == 0 else {"f": repr(value)}

    def inner(item: Any) -> Any:
        return encode(item, handle, depth + 1)

    if kind is list:
        return [inner(item) for item in value]
    if kind in _SEQUENCES:
        return {_SEQUENCES[kind]: [inner(item) for item in value]}
    if kind in _HEX:
        return {_HEX[kind]: value.hex()}
    if kind is dict:
        return {"d": [[inner(k), inner(v)] for k, v in value.items()]}
    if kind is complex:
        return {"c": [inner(value.real), inner(value.imag)]}
    if kind is range:
        return {"r": [value.start, value.stop, value.step]}
    if kind is slice:  # ``s[1:]`` on an object the tests built
        return {"sl": [inner(value.start), inner(value.stop), inner(value.step)]}
    fields = namedtuple_fields(kind)
    if fields is not None and len(fields) == tuple.__len__(value):
        items = [inner(item) for item in tuple.__iter__(value)]
        return {"nt": [kind.__name__, list(fields), items]}
    if kind in _MAPPINGS:
        pairs = [[inner(k), inner(v)] for k, v in value.items()]
        if kind is collections.defaultdict:
            factory = value.default_factory
            name = next((n for n, made in _FACTORIES.items() if made is factory), None)
            return {"dd": [name, pairs]}
        return {_MAPPINGS[kind]: pairs}
    if kind is collections.deque:
        return {"dq": [[inner(item) for item in value], value.maxlen]}
    # Imported where the value was made, so looked up, never imported, to send one.
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and kind is fractions.Fraction:
        return {"fr": [inner(value.numerator), inner(value.denominator)]}
    if decimal is not None and kind is decimal.Decimal:
        return {"dc": str(value)}
    if kind is Lazy:
        return {"g": handle(value.iterator)}
    if value is METHOD:
        return {"m": 0}
    # Whether it can be called travels with it: a stand-in that could always be called
    # passed ``callable(make_adder(1))`` for an answer returning ``object()``.
    return {"hc": handle(value)} if callable(value) else {"h": handle(value)}


def decode(
    data: Any,
    handle: Callable[[int], Any],
    depth: int = 0,
    lazy: Callable[[int], Any] | None = None,
    *,
    call: Callable[[int], Any] | None = None,
    method: bool = False,
) -> Any:
    """Plain Python data from :func:`encode`'s output; ``handle`` resolves a handle,
    ``call`` one of an object that can be called (``handle`` without it), and ``lazy``
    an iterator's (none is accepted without it). :data:`METHOD` is accepted only where
    ``method`` says it is the answer to an attribute read, and only as the whole value:
    anywhere else it was one object every call of the answer could return, equal to
    itself (``f(a) == f(b)`` for any ``a`` and ``b``).

    Builds only literals (and what ``handle``, ``call`` and ``lazy`` return), whatever
    the sender was.

    :raises ValueError: anything :func:`encode` does not write.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, str, int, float):
        return data

    def inner(item: Any) -> Any:
        return decode(item, handle, depth + 1, lazy, call=call)

    if type(data) is list:
        return [inner(item) for item in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = data.items()
    if tag in _BUILD and type(body) is list:
        return _BUILD[tag](inner(item) for item in body)
    if tag in _FROM_HEX and type(body) is str:
        return _FROM_HEX[tag](body)
    if tag == "d" and type(body) is list:
        return dict(_pairs(body, inner))
    if tag in ("od", "ct") and type(body) is list:
        mapping: dict[Any, Any] = (
            collections.OrderedDict() if tag == "od" else collections.Counter()
        )
        mapping.update(dict(_pairs(body, inner)))  # a Counter's update of a dict sets
        return mapping
    if tag == "dd" and type(body) is list and len(body) == 2 and type(body[1]) is list:
        name = body[0]
        if name is None or (type(name) is str and name in _FACTORIES):
            return collections.defaultdict(
                None if name is None else _FACTORIES[name], _pairs(body[1], inner)
            )
    if tag == "dq" and type(body) is list and len(body) == 2 and type(body[0]) is list:
        maxlen = body[1]
        bounded = maxlen is None or (type(maxlen) is int and 0 <= maxlen <= sys.maxsize)
        if bounded:
            return collections.deque((inner(item) for item in body[0]), maxlen)
    if tag == "nt" and type(body) is list and len(body) == 3:
        name, fields, items = body
        named = type(name) is str and _field_names(fields) and type(items) is list
        if named and len(fields) == len(items):
            values = [inner(item) for item in items]
            if VALUE_METHODS.isdisjoint(fields):
                return tuple.__new__(_named(name, tuple(fields)), values)
            return tuple(values)
    if tag == "fr" and type(body) is list and len(body) == 2:
        numerator, denominator = (inner(part) for part in body)
        if type(numerator) is int and type(denominator) is int and denominator:
            import fractions

            return fractions.Fraction(numerator, denominator)
    if tag == "dc" and type(body) is str:
        import decimal

        try:
            return decimal.Decimal(body)
        except decimal.InvalidOperation:
            raise ValueError("malformed decimal") from None
    if tag == "c" and type(body) is list and len(body) == 2:
        real, imag = (inner(part) for part in body)
        if type(real) is float and type(imag) is float:
            return complex(real, imag)
    if tag == "f" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "i" and type(body) is str:
        return int(body, 16)
    if tag == "r" and type(body) is list and [type(part) for part in body] == [int] * 3:
        return range(*body)  # a step of 0 raises ValueError, as a malformed value
    if tag == "sl" and type(body) is list and len(body) == 3:
        return slice(*(inner(part) for part in body))
    if tag == "h" and type(body) is int:
        return handle(body)
    if tag == "hc" and type(body) is int:
        return (call or handle)(body)
    if tag == "g" and type(body) is int and lazy is not None:
        return lazy(body)
    if tag == "m" and body == 0 and type(body) is int and method and depth == 0:
        return METHOD
    raise ValueError(f"malformed value (tag {str(tag)[:20]!r})")


def _pairs(body: list[Any], inner: Callable[[Any], Any]) -> list[tuple[Any, Any]]:
    """A mapping's items, each sent as a two-item list."""
    pairs = [inner(pair) for pair in body]
    if not all(type(pair) is list and len(pair) == 2 for pair in pairs):
        raise ValueError("malformed mapping")
    return [(k, v) for k, v in pairs]


def namedtuple_fields(kind: type) -> "tuple[str, ...] | None":
    """The fields of a namedtuple class, as the wire sends them; ``None`` for any other."""
    fields = getattr(kind, "_fields", None) if issubclass(kind, tuple) else None
    return fields if type(fields) is tuple and _field_names(fields) else None


def _field_names(fields: Any) -> bool:
    """Whether ``fields`` can be a namedtuple's, as the wire carries them."""
    return (
        type(fields) in (tuple, list)
        and len(fields) <= _MOST_FIELDS
        and all(type(field) is str for field in fields)
    )


def _named(name: str, fields: tuple[str, ...]) -> type:
    """The harness's namedtuple class of this name and these fields.

    :raises ValueError: a name or field that a namedtuple cannot have.
    """
    if (name, fields) in _NAMED:
        return _NAMED[(name, fields)]
    make: Any = collections.namedtuple  # of names known only as it runs
    made: type = make(name, fields)  # checks each is an identifier
    if len(_NAMED) < _MOST_NAMED:
        _NAMED[(name, fields)] = made
    return made
