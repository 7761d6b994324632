"""The error tree: every error is a TangramError and the builtin the tree says it is.

The trees (errors, then warnings) are read from the ``tangram.errors`` docstring, so the
picture users read and the classes they catch cannot drift apart. Which error each public
call raises for bad input is ``tests/test_bad_input.py``.
"""

from __future__ import annotations

import builtins
import pickle
import re

import pytest

import tangram
from tangram import errors

# "    │   ├── DemandTypeError (TypeError)      a value of the wrong type"
_LINE = re.compile(
    r"^(?P<indent>[\s│]*)(?:[├└]── )?(?P<name>\w+(?:Error|Warning))(?: \((?P<builtin>\w+)\))?"
)


def _tree() -> dict[str, tuple[str | None, str | None]]:
    """Map each error in the docstring tree to (its parent in the tree, its named builtin)."""
    assert errors.__doc__ is not None
    tree: dict[str, tuple[str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in errors.__doc__.splitlines():
        match = _LINE.match(line)
        if match is None or not line.strip().lstrip("│├└─ ").startswith(match["name"]):
            continue
        depth = len(match["indent"]) + (4 if "──" in line else 0)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1] if stack else None
        tree[match["name"]] = (parent, match["builtin"])
        stack.append((depth, match["name"]))
    return tree


TREE = _tree()
WARNINGS = {name for name in TREE if name.endswith("Warning")}


def test_the_tree_names_every_error_and_nothing_else() -> None:
    assert set(TREE) == set(errors.__all__)
    assert TREE["TangramError"] == (None, None)
    assert TREE["TangramWarning"] == (None, "UserWarning")


@pytest.mark.parametrize("name", sorted(TREE))
def test_error_matches_its_place_in_the_tree(name: str) -> None:
    error = getattr(errors, name)
    parent, builtin = TREE[name]
    if name in WARNINGS:
        assert issubclass(error, errors.TangramWarning)
    else:
        assert issubclass(error, errors.TangramError)
    assert issubclass(error, Exception)
    if parent is not None:
        assert issubclass(error, getattr(errors, parent)), f"{name} is not a {parent}"
    if builtin is not None:
        assert issubclass(error, getattr(builtins, builtin)), f"{name} is not a {builtin}"
    assert error.__doc__, f"{name} needs a docstring saying when it is raised"


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("InvalidDemandError", ValueError),
        ("DemandTypeError", TypeError),
        ("DemandTypeError", ValueError),
        ("UnknownResourceError", LookupError),
        ("CapacityExceededError", ValueError),
        ("InvalidCapacityError", ValueError),
        ("WaitTimeoutError", TimeoutError),
        ("RuntimeClosedError", RuntimeError),
        ("NoCurrentRuntimeError", RuntimeError),
        ("InvalidSettingError", ValueError),
        ("SettingTypeError", TypeError),
        ("SettingTypeError", ValueError),
        ("InvalidCapacityError", errors.InvalidSettingError),
        ("SelfDeadlockError", RuntimeError),
        ("LeaseNotResizableError", RuntimeError),
        ("LeaseReleasedError", RuntimeError),
        ("InstrumentNotAttachedError", KeyError),
        ("UnknownBackendError", LookupError),
        ("UnknownSandboxError", KeyError),
        ("UnknownSandboxError", errors.SandboxClosedError),
        ("DeadlockRiskWarning", UserWarning),
    ],
)
def test_the_builtins_callers_catch(name: str, builtin: type[Exception]) -> None:
    """Spelled out as well, so a tree that lost its annotations cannot pass silently."""
    assert issubclass(getattr(errors, name), builtin)


def test_no_error_is_a_cancellation_or_base_exception_only() -> None:
    for name in errors.__all__:
        error = getattr(errors, name)
        assert not issubclass(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


@pytest.mark.parametrize("name", errors.__all__)
def test_errors_pickle_with_their_message(name: str) -> None:
    """Errors cross process boundaries (Ray workers): they must survive pickling."""
    error = getattr(errors, name)("what happened")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == "what happened"


@pytest.mark.parametrize(
    "name", sorted(n for n in errors.__all__ if issubclass(getattr(errors, n), KeyError))
)
def test_a_key_error_of_ours_reads_as_its_message(name: str) -> None:
    """KeyError's own str() quotes its message; ours reads as a sentence like the rest."""
    assert str(getattr(errors, name)("not attached")) == "not attached"


def test_errors_are_reachable_from_the_package() -> None:
    assert tangram.errors is errors


@pytest.mark.parametrize(
    ("value", "error", "builtin"),
    [("8", errors.SettingTypeError, TypeError), (-1, errors.InvalidSettingError, ValueError)],
)
def test_the_shared_checks_raise_tangram_errors_by_default(
    value: object, error: type[Exception], builtin: type[Exception]
) -> None:
    """Every layer's settings go through these checks (pools, quotas, the simulator)."""
    from tangram._core._validate import seconds

    with pytest.raises(error, match=r"`timeout` must be a number of seconds") as info:
        seconds("timeout", value)
    assert isinstance(info.value, builtin)
    assert f"(got {value!r})" in str(info.value)
