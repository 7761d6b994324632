"""Backends are found by name, lazily: the pool never imports one (no import cycle)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tangram
from tangram._sandbox import _backend
from tangram._sandbox._docker import DockerBackend
from tangram.errors import UnknownBackendError

pytestmark = pytest.mark.anyio


def test_names_find_their_classes() -> None:
    assert _backend.backend_class("local") is tangram.LocalBackend
    assert _backend.backend_class("docker") is tangram.DockerBackend


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(LookupError, match=r"no sandbox backend named 'podman' \(known: "):
        _backend.backend_class("podman")


def test_importing_tangram_loads_no_docker_client() -> None:
    # The backend classes are public names, but aiodocker loads only when one starts.
    code = "import sys, tangram\nprint([m for m in sys.modules if m.startswith('aiodocker')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_the_default_is_local_where_docker_is_not_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no() -> bool:
        return False

    monkeypatch.setattr(DockerBackend, "usable", classmethod(lambda cls: no()))
    assert isinstance(await _backend.default_backend(), tangram.LocalBackend)


async def test_the_default_is_docker_where_it_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    async def yes() -> bool:
        return True

    monkeypatch.setattr(DockerBackend, "usable", classmethod(lambda cls: yes()))
    assert isinstance(await _backend.default_backend(), tangram.DockerBackend)


async def test_no_usable_backend_is_a_tangram_lookup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no() -> bool:
        return False

    for cls in (DockerBackend, tangram.LocalBackend):
        monkeypatch.setattr(cls, "usable", classmethod(lambda cls: no()))
    with pytest.raises(UnknownBackendError, match=r"usable here \(tried: docker, local\)") as info:
        await _backend.default_backend()
    assert isinstance(info.value, LookupError)
    assert "`backend=`" in str(info.value)
