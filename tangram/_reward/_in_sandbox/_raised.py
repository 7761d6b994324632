"""The answer's exceptions in the tests' process: the classes it defines, made here, and
what a call raises where the answer's function raised.

Part of the harness (:mod:`._harness`), joined into the one program the sandbox runs, so
it imports nothing but the standard library and has no ``from __future__`` import (see
:mod:`._checks`). Nothing of the answer's runs here: its classes are read from its text,
what it raised from its process's reply.
"""

import ast
import builtins
from collections.abc import Mapping, Sequence

if __name__ != "__main__":  # for the type checker: the sandbox's program needs none
    from typing import Any, TypeGuard

__all__ = ["FIELDS", "MESSAGE_LIMIT", "AnswerError", "exception_classes", "rebuilt"]

MESSAGE_LIMIT = 1000
"""Characters of an error's text that reach the tests."""
FIELDS = 64
"""Attributes of a raised exception that reach the tests (``e.line``), the first set."""


class AnswerError(Exception):
    """The answer's process could not give a result (it raised, died, hung, or lied)."""


def _rebuildable(found: Any) -> "TypeGuard[type[Exception]]":
    """Whether an exception of class ``found`` may be raised in the tests as the answer
    raised it (see :func:`rebuilt`)."""
    return (
        isinstance(found, type)
        and issubclass(found, Exception)
        and not issubclass(found, (StopIteration, StopAsyncIteration))
    )


def _text_of(error: BaseException) -> str:
    """``str()`` of one of :func:`exception_classes`' exceptions: the answer's own text
    for one it raised (its class's ``__str__`` ran there), else its builtin base's."""
    said = vars(error).get("_said")
    if type(said) is str:
        return said
    base = next(k for k in type(error).__mro__ if k.__module__ == "builtins")
    return base.__str__(error)  # type: ignore[call-arg]


def _agrees(made: type, bases: Sequence[str]) -> bool:
    """Whether the bases a raised exception's class has (``bases``, its MRO's names, as
    its process said) hold those of the class made of its name (in order, others
    between: bases the text gives that are not exceptions are left out of it)."""
    said = iter(bases)
    return all(kind.__name__ in said for kind in made.__mro__[1:] if kind is not object)


def exception_classes(body: Sequence[ast.stmt]) -> dict[str, type]:
    """The answer's top-level exception classes, made here as classes of the same names
    and bases (read from its text; bases that are neither builtin exceptions nor another
    of these are left out), so that the tests' ``except InsufficientFunds``,
    ``assertRaises`` and ``isinstance`` name a class: a stand-in for calling the answer
    was none, and a right answer scored 0. Only subclasses of ``Exception`` that do not
    steer control flow (see :func:`rebuilt`); nothing of the answer's runs here."""
    made: dict[str, type] = {}
    classes: set[str] = set()  # every class defined so far, an exception or not
    for node in body:  # in order: a class is defined after its bases
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef)):
            _alias(node, made, classes)
        if not isinstance(node, ast.ClassDef):
            continue
        bases: list[type] = []
        for base in node.bases:
            named = base.id if isinstance(base, ast.Name) else ""
            found = made.get(named) if named in classes else getattr(builtins, named, None)
            if _rebuildable(found) and found not in bases:
                bases.append(found)
        classes.add(node.name)
        made.pop(node.name, None)  # defined again: as this definition says
        for chosen in (bases, bases[:1]):
            try:
                if chosen:
                    made[node.name] = type(node.name, tuple(chosen), {"__str__": _text_of})
                break
            except TypeError:  # bases whose layouts conflict: its first alone
                continue
    return made


def _alias(node: ast.stmt, made: dict[str, type], classes: set[str]) -> None:
    """A name bound at the top level: ``InvalidAge = ValueError`` (or another of the
    answer's exception classes) names that class for the tests, as ``except
    InvalidAge`` does in one program; a name bound to anything else names none. A
    builtin's name is left to the rules for a builtin the answer binds (contested:
    ``_harness``), as it was."""
    found = None
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if isinstance(value, ast.Name):
        named = value.id
        found = made.get(named) if named in classes else getattr(builtins, named, None)
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, ast.AnnAssign):
        if node.value is None:
            return  # an annotation alone binds nothing
        targets = [node.target]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names = [node.name]
    for name in names:
        if hasattr(builtins, name):
            continue
        made.pop(name, None)
        classes.discard(name)
        if _rebuildable(found):
            made[name] = found
            classes.add(name)


def rebuilt(
    name: Any,
    message: Any,
    kinds: Any = None,
    args: Any = None,
    classes: Mapping[str, type] | None = None,
    fields: Any = None,
) -> Exception:
    """What a call raises here when the answer's function raised ``name``.

    The class nearest its own among the answer's exception ``classes`` (see
    :func:`exception_classes`) and the builtin ``Exception`` subclasses (its own, else
    the first of its bases, ``kinds``, that is one), made from its ``args`` where they
    came as data, so ``except ValueError`` catches a ``json.JSONDecodeError`` and
    ``str(e)`` and ``e.args`` are as raised (a ``KeyError('x')`` rebuilt from its text
    said ``"'x'"``; one of the answer's classes says its text, as its ``__str__`` made
    it). Never one
    that steers control flow: ``GeneratorExit``, ``KeyboardInterrupt`` and ``SystemExit``
    (not ``Exception``s), nor ``StopIteration`` and ``StopAsyncIteration``, which raised
    inside ``map``'s or a generator's ``__next__`` end the iteration silently
    (``all(map(...))`` saw nothing false): those become an :class:`AnswerError`, as
    PEP 479 makes one leaving a generator a ``RuntimeError``.
    """
    text = message[:MESSAGE_LIMIT] if type(message) is str else ""
    label = name[:100] if type(name) is str else "an exception"
    said = args if type(args) is tuple else (text,)
    bases = [k for k in kinds[:64] if type(k) is str] if type(kinds) is list else []
    names = [label, *bases]
    for position, kind in enumerate(names):
        own = (classes or {}).get(kind)
        if own is not None and (own.__name__ != kind or not _agrees(own, names[position + 1 :])):
            # Another class of that name (one in a function) was raised, or one that an
            # alias of the answer's names (``InvalidAge = ValueError``) was not.
            own = None
        found = own or getattr(builtins, kind, None)
        if not _rebuildable(found):
            continue
        for given in (said, (text,)):
            try:
                error = found(*given)
            except Exception:
                continue
            if isinstance(error, found):
                if type(fields) is dict:  # its attributes as raised; none of the harness's
                    for key, value in list(fields.items())[:FIELDS]:
                        if type(key) is str and not key.startswith("__") and key != "_said":
                            vars(error)[key] = value
                if own is not None:
                    vars(error)["_said"] = text
                return error
    return AnswerError(f"{label}: {text}")
