"""Each adapter is a distribution of its own, and no installed top-level name is generic.

A wheel that installed a package named ``adapters`` would overwrite (or be overwritten
by) the unrelated project of that name on the package index. So tangram's wheel holds
``tangram`` alone, and each framework's adapter ships as ``tangram-<framework>`` with
the import name ``tangram_<framework>``, pinned to the tangram it was released with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = {"verl": "tangram_verl", "openrlhf": "tangram_openrlhf"}


def _project(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    return data


def test_the_tangram_wheel_installs_only_tangram() -> None:
    data = _project(ROOT / "pyproject.toml")
    assert data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["tangram"]
    assert (ROOT / "tangram" / "py.typed").is_file()
    assert not (ROOT / "adapters" / "__init__.py").exists()


@pytest.mark.parametrize("framework", sorted(ADAPTERS))
def test_each_adapter_is_its_own_typed_distribution(framework: str) -> None:
    tangram = _project(ROOT / "pyproject.toml")["project"]
    directory = ROOT / "adapters" / framework
    data = _project(directory / "pyproject.toml")
    package = ADAPTERS[framework]
    assert data["project"]["name"] == f"tangram-{framework}"
    assert data["project"]["version"] == tangram["version"]
    assert data["project"]["dependencies"] == [f"tangram=={tangram['version']}"]
    assert data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == [package]
    assert (directory / package / "__init__.py").is_file()
    assert (directory / package / "py.typed").is_file()
    assert (directory / data["project"]["readme"]).is_file()
