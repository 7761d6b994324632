"""What the code reward's harness counts as a test and as a pass: its trusted comparisons.

Part of the harness (:mod:`._harness`): :mod:`.._grade` joins the two sources into the one
program the sandbox runs, so this module imports nothing but the standard library, and
has no ``from __future__`` import (in the joined program that would not be its first
statement); its annotations are evaluated, which Python 3.10 (the harness's floor)
allows. The host imports it too, to count a label's tests before it is sent.
"""

import ast
import contextlib
import json
import re
from collections.abc import Mapping

if __name__ != "__main__":  # for the type checker: the sandbox's program needs none
    from typing import Any

__all__ = ["call_passed", "count_tests", "same_output", "test_plan"]

# -- which statements of an assertion test are tests ---------------------------------------

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


_Steps = list[tuple[ast.Module, bool]]
"""Pieces of the tests in the order they run, each with whether it is a test."""


def test_plan(source: str, entry_point: str | None) -> tuple[ast.Module, _Steps, bool]:
    """The parsed tests, the steps they run in (each with whether it is a test), and
    whether ``check(entry_point)`` runs after them.

    A test is a top-level statement other than a ``def`` or ``class`` that holds, anywhere
    in it, an ``assert``, a call of a function the tests define (``check(add)``) or a
    ``unittest.main()``, which runs the tests' ``TestCase`` classes and exits 0 only if
    they all pass; or a ``for``, ``if``, ``with`` or ``try`` around them (counting only
    top-level asserts left those unchecked after the last one). Every other statement is
    set-up, and a set-up statement that fails fails every test after it; the statements
    after the last test run as part of it, so no statement of the tests can fail unseen.
    When the source defines ``check`` but never calls it (HumanEval's form),
    ``check(entry_point)`` is one more test, after every statement.

    :raises SyntaxError: the tests do not parse.
    """
    tree = ast.parse(source, "<tests>")
    defined = {stmt.name for stmt in tree.body if isinstance(stmt, ast.FunctionDef)}
    mains = {  # ``from unittest import main``, under whatever name
        alias.asname or alias.name
        for stmt in tree.body
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "unittest" and not stmt.level
        for alias in stmt.names
        if alias.name == "main"
    }
    tests: list[bool] = []
    calls_check = False
    for stmt in tree.body:
        if isinstance(stmt, _DEFINITIONS):
            tests.append(False)
            continue
        nodes = list(ast.walk(stmt))
        called = {
            node.func.id
            for node in nodes
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in defined
        }
        calls_check = calls_check or "check" in called
        tests.append(
            bool(called)
            or any(isinstance(node, ast.Assert) or _runs_unittest(node, mains) for node in nodes)
        )
    check = bool(entry_point) and "check" in defined and not calls_check
    steps = [([stmt], is_test) for stmt, is_test in zip(tree.body, tests, strict=True)]
    if not check and any(tests):
        last = max(i for i, is_test in enumerate(tests) if is_test)
        steps = [*steps[:last], (tree.body[last:], True)]
    modules = [(ast.Module(body=body, type_ignores=[]), is_test) for body, is_test in steps]
    return tree, modules, check


def _runs_unittest(node: ast.AST, mains: set[str]) -> bool:
    """Whether ``node`` is a call of ``unittest.main`` (or of ``main`` imported from it)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in mains
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "main"
        and isinstance(func.value, ast.Name)
        and func.value.id == "unittest"
    )


def count_tests(suite: Mapping[str, Any]) -> int:
    """How many tests a suite (the payload's ``tests``) holds: the verdict's ``total``."""
    if suite["kind"] == "assert":
        _, steps, check = test_plan(suite["source"], suite.get("entry_point"))
        return sum(is_test for _, is_test in steps) + int(check)
    return len(suite["cases"])


# -- how standard output compares -----------------------------------------------------------

# A number as the expected outputs write one: ASCII digits only, no ``_``, no ``inf`` or
# ``nan``, all of which Python's ``float()`` accepts. Lines are lowered first, hence ``e``.
# Matched from the start and checked for reaching the end (not ``fullmatch``), so a long
# line that is no number fails in linear time: the grammar has one parse, the greedy one.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?", re.ASCII)


def _number(text: str) -> bool:
    found = _NUMBER.match(text)
    return found is not None and found.end() == len(text)


def same_output(got: str, want: str) -> bool:
    """SandboxFusion's stdio check (``sandbox/utils/testing.py``, ``lower_cmp=True``), with
    integers compared exactly.

    Both sides stripped and split into lines; a trailing empty line on one side dropped;
    the same number of lines; each pair equal after ``strip()`` and ``lower()``, or, where
    the expected line is a decimal or exponent literal (it holds ``.`` or ``e``), both
    ASCII number literals within a relative 1e-5. SandboxFusion applies the tolerance to
    integers too and parses with ``float()``, so ``999990001`` passed for ``1000000000``,
    and ``1_000`` or fullwidth digits for ``1000``.
    """
    got_lines = got.strip().split("\n")
    want_lines = want.strip().split("\n")
    if len(got_lines) - len(want_lines) == 1 and got_lines[-1] == "":
        got_lines = got_lines[:-1]
    if len(want_lines) - len(got_lines) == 1 and want_lines[-1] == "":
        want_lines = want_lines[:-1]
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines, strict=True):
        g, w = g.lower().strip(), w.lower().strip()
        if g == w:
            continue
        if ("." in w or "e" in w) and _number(w) and _number(g):
            a, b = float(g), float(w)
            if abs(a - b) / max(abs(b), 1e-10) < 1e-5:
                continue
        return False
    return True


# -- how a call's result compares -----------------------------------------------------------


def _expected(value: Any) -> list[Any]:
    """What a call test's return value may equal: as given, unwrapped, or parsed."""
    found = [value]
    if type(value) is list and len(value) == 1:
        found.append(value[0])  # APPS and TACO wrap the return value in a list
    if type(value) is str:
        with contextlib.suppress(ValueError):
            found.append(json.loads(value))
    return found


def _key(key: Any) -> Any:
    """A dict key as a JSON object's key; one ``str()`` cannot write (an int past CPython's
    4300 digits, or a tuple holding one) stays as it is, which no JSON key equals."""
    if type(key) is str:
        return key
    try:
        return str(key)
    except Exception:  # the key is the answer's data: nothing it does may escape
        return key


def _jsonish(value: Any) -> Any:
    """The value as JSON would carry it, so a tuple result equals a JSON list."""
    if type(value) in (list, tuple):
        return [_jsonish(item) for item in value]
    if type(value) is dict:
        shaped = {_key(k): _jsonish(v) for k, v in value.items()}
        # ``1`` and ``"1"`` as keys of one dict would merge into one, hiding an entry.
        return shaped if len(shaped) == len(value) else value
    return value


def call_passed(result: Any, expected: Any) -> bool:
    """Whether a call test's result (decoded from the answer) is its expected value.

    The harness calls this inside the case's guard: any exception is that case failing.
    """
    shaped = _jsonish(result)
    return any(result == want or shaped == want for want in _expected(expected))
