"""The package's layers know only the layers above them (docs: DESIGN.md, "Layers").

model -> policy -> runtime -> executors -> edges: a module may import from its own layer
and the ones before it, never after. The model and the policy are pure: no event loop, no
clock, no I/O, so the live runtime and the simulator make the same decisions and the
policy can be property-tested. Imports are read from the source with :mod:`ast`, so the
check sees what each module asks for, not what happens to be loaded already.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import tangram

PACKAGE = Path(tangram.__file__).parent

LAYERS = ["model", "policy", "runtime", "executors", "package", "edges"]

KNOWN: dict[str, str] = {
    "errors": "model",
    "_units": "model",
    "_resources": "model",
    "_efficiency": "model",
    "_demand": "model",
    "_action": "model",
    "_estimator": "policy",
    "_policy": "policy",
    "_ledger": "policy",
    "_stats": "policy",
    "_runtime": "runtime",
    "_lease": "runtime",
    "_simulate": "runtime",
    "_trace": "runtime",
    "_generate": "runtime",
    "_baselines": "runtime",
    # The package facade re-exports the core (model to runtime) and nothing that needs an
    # extra; executors with optional dependencies have their own public modules.
    "__init__": "package",
    "_cli": "edges",
    "_demo": "edges",
    # The pytest plugin and invariant checker for users' suites.
    "testing": "edges",
    # In-memory sandbox backend and model service for users' tests (testing re-exports).
    "_memory": "executors",
    # The config file reads capacities, pools and the Ray mode: it builds on everything.
    "_config": "edges",
    "config": "edges",
    "_doctor": "edges",
    # The simulator's GPU residency model and the live runtime's trace recorder.
    "_sim_gpu": "runtime",
    "_record": "runtime",
    "_report": "edges",
}

# Modules added by later work land in a layer by name; anything else must be listed above.
PREFIXES: list[tuple[str, str]] = [
    ("executors", "executors"),
    ("_executor", "executors"),
    ("_quota", "executors"),
    ("quota", "executors"),
    ("_sandbox", "executors"),
    ("_local", "executors"),
    ("_cgroup", "executors"),
    ("_container", "executors"),
    ("_service", "executors"),
    ("_nvml", "executors"),
    ("_docker", "executors"),
    ("_gpu", "executors"),
    ("gpu", "executors"),
    ("_cpu", "executors"),
    ("_api", "executors"),
    ("_cli", "edges"),
    ("_demo", "edges"),
    ("_ray", "edges"),
    ("ray", "edges"),
    ("adapters", "edges"),
    ("_pytest", "edges"),
    ("pytest_plugin", "edges"),
    ("_bench", "edges"),
]

PURE_LAYERS = {"model", "policy"}

# An event loop, a clock, randomness or any I/O: none belongs in a pure layer.
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


def layer_of(name: str) -> str | None:
    if name in KNOWN:
        return KNOWN[name]
    top = name.split(".")[0]
    if top in KNOWN:
        return KNOWN[top]
    for prefix, layer in PREFIXES:
        if top.startswith(prefix):
            return layer
    return None


def rank(name: str) -> int:
    layer = layer_of(name)
    assert layer is not None, name
    return LAYERS.index(layer)


def imports(name: str, path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, imported module, internal?) for every import in the module.

    Internal modules are named below ``tangram`` (``"_policy"``; the package itself is
    ``"__init__"``); external ones by their top-level name (``"anyio"``).
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


def test_every_module_has_a_layer() -> None:
    unknown = [name for name, _ in modules() if layer_of(name) is None]
    assert not unknown, f"add these modules to a layer in tests/test_layers.py: {unknown}"


def test_the_core_modules_exist() -> None:
    # A renamed module would silently drop out of the checks below.
    names = {name for name, _ in modules()}
    missing = {name for name, layer in KNOWN.items() if layer != "edges"} - names
    assert not missing


@pytest.mark.parametrize("name", [name for name, _ in modules()])
def test_imports_follow_the_layer_order(name: str) -> None:
    path = dict(modules())[name]
    if layer_of(name) is None:
        pytest.fail(f"{name} has no layer (see test_every_module_has_a_layer)")
    wrong = [
        f"line {line}: {name} ({layer_of(name)}) imports {target} ({layer_of(target)})"
        for line, target, internal in imports(name, path)
        if internal and layer_of(target) is not None and rank(target) > rank(name)
    ]
    assert not wrong


@pytest.mark.parametrize("name", [name for name, _ in modules() if layer_of(name) in PURE_LAYERS])
def test_pure_layers_have_no_loop_clock_or_io(name: str) -> None:
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


def test_estimator_depends_on_the_efficiency_models_only() -> None:
    path = dict(modules())["_estimator"]
    internal = {target for _, target, is_internal in imports("_estimator", path) if is_internal}
    assert internal == {"_efficiency"}


def test_errors_import_nothing_of_the_package() -> None:
    path = dict(modules())["errors"]
    assert not [t for _, t, internal in imports("errors", path) if internal]


def test_the_checker_sees_imports() -> None:
    # The checker itself: the ledger imports the policy, the runtime the ledger.
    ledger = {t for _, t, internal in imports("_ledger", PACKAGE / "_ledger.py") if internal}
    assert {"_policy", "_action", "_estimator", "_resources"} <= ledger
    runtime = {t for _, t, internal in imports("_runtime", PACKAGE / "_runtime.py") if internal}
    assert {"_ledger", "errors", "_lease"} <= runtime
    package = {t for _, t, internal in imports("__init__", PACKAGE / "__init__.py") if internal}
    assert {"errors", "_runtime", "_policy"} <= package
