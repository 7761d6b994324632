"""The adapters are built from tangram's public names only, as a third framework's would be.

``tangram_verl`` and ``tangram_openrlhf`` are distributions of their own, pinned to a
tangram release: a private module they import may be renamed in any release, and breaks
them with no deprecation. So everything an adapter needs is public, in
:mod:`tangram.integrations` (and ``tangram``, ``tangram.config``, ``tangram.errors``,
``tangram.metrics``), and this test reads every module under ``adapters/`` with
:mod:`ast` (imports inside functions too) and fails on any import of a private module.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ROOT / "adapters"
SOURCES = sorted(ADAPTERS.rglob("*.py"))


def _private(dotted: str) -> bool:
    """Whether a dotted name below ``tangram`` has a private part (``tangram._reward``)."""
    parts = dotted.split(".")
    return parts[0] == "tangram" and any(part.startswith("_") for part in parts[1:])


def private_imports(source: str, filename: str = "<source>") -> Iterator[tuple[int, str]]:
    """(line, what) for each import of a private part of tangram in ``source``.

    ``import tangram._x``, ``from tangram._x import y``, ``from tangram import _x`` and a
    private name of a public module (``from tangram.config import _counts``) all count,
    as does ``importlib.import_module("tangram._x")`` spelled out.
    """
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module.split(".")[0] != "tangram":
                continue
            if _private(module):
                yield node.lineno, f"from {module} import ..."
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield node.lineno, f"from {module} import {alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            first = node.args[0]
            named = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if named and _imports_by_name(node.func) and _private(first.value):
                yield node.lineno, f"import_module({first.value!r})"


def _imports_by_name(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def test_there_are_adapters_to_check() -> None:
    found = {path.relative_to(ADAPTERS).parts[0] for path in SOURCES}
    assert {"verl", "openrlhf"} <= found
    assert any(path.name == "tools.py" for path in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_adapters_import_only_public_modules(path: Path) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for line, what in private_imports(path.read_text(encoding="utf-8"), str(path))
    ]
    assert not found, "use tangram.integrations (or another public module):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from tangram._frameworks import _session\n",
        "from tangram._frameworks._convert import cpu_demand\n",
        "from tangram._reward._grade import grade, parse_tests\n",
        "import tangram._runtime._group\n",
        "import tangram._frameworks._session as s\n",
        "from tangram import _frameworks\n",
        "from tangram.config import _counts\n",
        "def later():\n    from tangram._runtime._group import Gate\n",
        "import importlib\nimportlib.import_module('tangram._frameworks._session')\n",
    ],
)
def test_the_check_sees_each_way_to_import_a_private_module(source: str) -> None:
    # The forms the adapters used before tangram.integrations existed, and the others.
    assert list(private_imports(source))


@pytest.mark.parametrize(
    "source",
    [
        "import tangram\nfrom tangram import integrations\n",
        "from tangram.integrations import Gate, grade, session\n",
        "from tangram.config import ConfigError\nfrom tangram.errors import TangramError\n",
        "import tangram.metrics\nfrom tangram_verl.tools import _preparation\n",
        "from . import _local_helper\n",
    ],
)
def test_the_check_lets_public_imports_through(source: str) -> None:
    assert not list(private_imports(source))


def test_the_kit_exports_its_names_as_its_own() -> None:
    import tangram.integrations as kit

    public = {name for name in vars(kit) if not name.startswith("_")}
    public -= {name for name, value in vars(kit).items() if inspect.ismodule(value)}
    public.discard("annotations")  # the __future__ flag
    assert public == set(kit.__all__)
    for name in kit.__all__:
        value = getattr(kit, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == "tangram.integrations", name
    assert kit.__doc__ and "adapter" in kit.__doc__
