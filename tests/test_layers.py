"""The package's tree is its architecture: each private subpackage is one layer.

model -> policy -> runtime -> executors -> edges (docs/architecture.md). A module may import
from its own subpackage and from the layers below it, never from a layer above it or from a
sibling at its own level: the executors do not know each other, and nothing in the library
imports the tools. The core is pure (no event loop, no clock, no I/O) so that the live
runtime and the simulator make the same decisions and the policy can be property-tested.

Imports are read from the source with :mod:`ast`, so the check sees what each module asks
for (lazy imports inside functions included), not what happens to be loaded already.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import tangram

PACKAGE = Path(tangram.__file__).parent

# Rank of each top-level name below ``tangram``: imports only point to a lower rank, or to
# the same subpackage. Names that share a rank are siblings and may not import each other.
RANKS: dict[str, int] = {
    # The helper every public module (errors too) ends with, then the error tree.
    "_core._exports": 0,
    "errors": 1,
    # Model and policy, pure: units, resources, demands, the estimator, the policy, the
    # ledger, stats, the shared validators and the GPU placement rules.
    "_core": 2,
    # The live runtime: the scheduler task, leases, instruments.
    "_runtime": 3,
    # The virtual-clock simulator and traces (the recorder observes a live runtime).
    "_sim": 4,
    # Executors, one subpackage each; none imports another.
    "_sandbox": 5,
    "_gpu": 5,
    "_quota": 5,
    # Edges: the shared scheduler on Ray (it places work on the executors of each host),
    # in-memory executors for tests.
    "_shared": 6,
    "_testing": 6,
    # The code reward: a judge run in a sandbox (the program inside it, and the host's side).
    "_reward": 6,
    # The public face of each optional part sits right above it ...
    "gpu": 7,
    "quota": 7,
    "ray": 7,
    # The extension interfaces (a policy, a backend, any scheduler), as anyio.abc.
    "abc": 7,
    # ... so that what the framework adapters build on uses it as a user would.
    "_frameworks": 8,
    # The package facade, the config file's, the test kit's, the metrics export's and the
    # kit framework adapters are built from.
    "__init__": 9,
    "config": 9,
    "testing": 9,
    "metrics": 9,
    "integrations": 9,
    # The SandboxFusion-compatible server: it opens the adapters' session, so it sits above
    # ``_frameworks`` (a sibling could not import it), below the CLI that starts it.
    "_fusion": 9,
    # The CLI, the bench and the reports: a user of the library, never imported by it.
    "_tools": 10,
}

PURE = {"_core"}

# An event loop, a clock, randomness or any I/O: none belongs in the pure core.
IMPURE = {
    "anyio",
    "asyncio",
    "trio",
    "sniffio",
    "time",
    "datetime",
    "random",
    "os",
    "io",
    "sys",
    "socket",
    "select",
    "selectors",
    "signal",
    "ssl",
    "subprocess",
    "threading",
    "multiprocessing",
    "concurrent",
    "logging",
    "pathlib",
    "shutil",
    "tempfile",
    "urllib",
    "http",
    "httpx",
    "aiodocker",
    "torch",
    "pynvml",
    "ray",
    "contextvars",
}


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package as (dotted name below ``tangram``, path)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        yield ".".join(parts), path


def top(name: str) -> str:
    return name.split(".")[0]


def imports(name: str, path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, imported module, internal?) for every import in the module.

    Internal modules are named below ``tangram`` (``"_core._policy"``; the package itself
    is ``"__init__"``); external ones by their top-level name (``"anyio"``).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    here = [] if name == "__init__" else name.split(".")
    base = here if is_package else here[:-1]
    local = {n for n, _ in modules()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tangram":
                    yield node.lineno, ".".join(parts[1:]) or "__init__", True
                else:
                    yield node.lineno, parts[0], False
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "tangram":
                    yield node.lineno, parts[0], False
                    continue
                target = parts[1:]
            else:
                target = base[: len(base) - (node.level - 1)] + (
                    node.module.split(".") if node.module else []
                )
            prefix = ".".join(target)
            for alias in node.names:
                # ``from . import errors`` imports a module; ``from .x import y`` a name.
                candidate = f"{prefix}.{alias.name}" if prefix else alias.name
                if candidate in local:
                    yield node.lineno, candidate, True
                else:
                    yield node.lineno, prefix or "__init__", True


def rank(name: str) -> int:
    return RANKS.get(name, RANKS[top(name)])


def allowed(importer: str, imported: str) -> bool:
    if top(importer) == top(imported):
        return True
    return rank(imported) < rank(importer)


def test_every_module_sits_in_a_layer() -> None:
    unknown = sorted({top(name) for name, _ in modules()} - set(RANKS))
    assert "_core._exports" in dict(modules())
    assert not unknown, f"give these a rank in tests/test_layers.py: {unknown}"


def test_the_layers_are_subpackages() -> None:
    # Private modules live in a layer's subpackage; only public modules sit at the top.
    flat = [path.name for path in PACKAGE.glob("_*.py") if path.name != "__init__.py"]
    assert not flat
    for name in RANKS:
        if name.startswith("_") and name != "__init__" and "." not in name:
            assert (PACKAGE / name / "__init__.py").is_file(), name


@pytest.mark.parametrize("name", [name for name, _ in modules()])
def test_imports_point_down(name: str) -> None:
    path = dict(modules())[name]
    wrong = [
        f"line {line}: {name} imports {target}"
        for line, target, internal in imports(name, path)
        if internal and not allowed(name, target)
    ]
    assert not wrong


@pytest.mark.parametrize("name", [name for name, _ in modules() if top(name) in PURE])
def test_the_core_has_no_loop_clock_or_io(name: str) -> None:
    path = dict(modules())[name]
    impure = [
        f"line {line}: imports {target}"
        for line, target, internal in imports(name, path)
        if not internal and target in IMPURE
    ]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Await, ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith)):
            impure.append(f"line {node.lineno}: {type(node).__name__}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"open", "print", "input", "__import__"}
        ):
            impure.append(f"line {node.lineno}: calls {node.func.id}()")
    assert not impure


def test_no_module_is_over_800_lines() -> None:
    long = {
        name: n
        for name, path in modules()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 800
    }
    assert not long


def test_no_import_cycles() -> None:
    graph = {
        name: {t for _, t, internal in imports(name, path) if internal and t != name}
        for name, path in modules()
    }
    # A package's __init__ re-exporting its children is not a cycle between modules.
    packages = {name for name, path in modules() if path.name == "__init__.py"}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in packages:
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state and name not in packages:
            visit(name)
    assert not cycles


def test_estimator_depends_on_the_efficiency_models_only() -> None:
    """And on the argument checks every layer shares, which import nothing of a layer."""
    path = dict(modules())["_core._estimator"]
    internal = {t for _, t, is_internal in imports("_core._estimator", path) if is_internal}
    assert internal <= {"_core._efficiency", "_core._validate", "errors"}


def test_errors_import_only_the_publish_helper() -> None:
    for name in ("errors", "_core._exports"):
        found = {t for _, t, internal in imports(name, dict(modules())[name]) if internal}
        assert found <= {"_core._exports"} - {name}


def test_the_checker_sees_imports() -> None:
    # The checker itself: the ledger imports the policy, the runtime the ledger.
    found = dict(modules())
    ledger = {t for _, t, i in imports("_core._ledger", found["_core._ledger"]) if i}
    assert {"_core._policy", "_core._action", "_core._estimator"} <= ledger
    runtime = {t for _, t, i in imports("_runtime._run", found["_runtime._run"]) if i}
    assert {"_core._ledger", "errors"} <= runtime
    package = {t for _, t, i in imports("__init__", PACKAGE / "__init__.py") if i}
    assert {"errors", "_runtime._run", "_core._policy"} <= package
    assert not allowed("_core._policy", "_runtime._run")
    assert not allowed("_gpu._pool", "_sandbox._pool")
    assert allowed("_shared._agent", "_gpu._pool")


# Each sandbox backend is one folder of ``_sandbox``; the shared modules beside them (the
# pool, the seam, the core sets) never import a backend, and no backend imports another.
def _backend_folders() -> tuple[str, ...]:
    from tangram._sandbox._backend import BACKENDS

    return tuple("_sandbox." + where.partition(":")[0].lstrip(".") for where in BACKENDS.values())


BACKEND_FOLDERS = _backend_folders()


def _folder(name: str) -> str | None:
    return next((f for f in BACKEND_FOLDERS if name == f or name.startswith(f + ".")), None)


@pytest.mark.parametrize("name", [name for name, _ in modules() if top(name) == "_sandbox"])
def test_sandbox_backends_stay_in_their_folders(name: str) -> None:
    path = dict(modules())[name]
    mine = _folder(name)
    wrong = [
        f"line {line}: {name} imports {target}"
        for line, target, internal in imports(name, path)
        if internal and (theirs := _folder(target)) is not None and theirs != mine
    ]
    assert not wrong


def test_each_backend_has_its_folder() -> None:
    assert len(BACKEND_FOLDERS) >= 2
    for folder in BACKEND_FOLDERS:
        assert "." not in folder.removeprefix("_sandbox."), folder
        assert (PACKAGE / folder.replace(".", "/") / "__init__.py").is_file(), folder
