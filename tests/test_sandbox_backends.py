"""Backends are found by name, lazily: the pool never imports one (no import cycle)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

import tangram
from tangram._sandbox import _backend
from tangram._sandbox._docker._backend import DockerBackend
from tangram.errors import SandboxError, UnknownBackendError
from tangram.testing import MemoryBackend

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


def test_the_embedded_backend_is_registered_last() -> None:
    # It needs nothing but this host, so it is the default's last resort, after every
    # backend that needs more (a daemon).
    assert list(_backend.BACKENDS)[-1] == _backend.EMBEDDED_BACKEND
    assert _backend.backend_class(_backend.EMBEDDED_BACKEND) is tangram.LocalBackend


def test_lending_lends_only_the_cores_named(monkeypatch: pytest.MonkeyPatch) -> None:
    local = tangram.LocalBackend.lending([0])
    assert isinstance(local, tangram.LocalBackend) and local._cores == (0,)
    monkeypatch.setenv("DOCKER_HOST", "unix:///elsewhere.sock")
    assert tangram.DockerBackend.lending([0])._cores == {"unix:///elsewhere.sock": (0,)}


class Lent(MemoryBackend):
    """A backend added the documented way: its class and one registry entry."""

    def __init__(self, *, cores: Sequence[int] = (0,)) -> None:
        super().__init__(cores=len(cores))
        self.lent = tuple(cores)


@pytest.fixture
def lent(monkeypatch: pytest.MonkeyPatch) -> str:
    # Mutated in place: the tools hold the registry itself, not a copy of its names.
    monkeypatch.setitem(_backend.BACKENDS, "lent", f"{__name__}:Lent")
    return "lent"


async def test_one_registry_entry_adds_a_backend_everywhere(lent: str) -> None:
    from tangram._tools import _bench, _cli

    assert _backend.backend_class(lent) is Lent
    assert _cli._parser().parse_args(["bench", "--sandbox", lent]).sandbox == lent
    config = _bench.default_config(cores=1, sandbox=lent)
    backend = await _bench._make_backend(config)
    assert isinstance(backend, Lent)
    assert backend.lent == tuple(sorted(os.sched_getaffinity(0)))[:1]
    with pytest.raises(ValueError, match=r"`sandbox` must be one of \['docker', 'local', 'lent'\]"):
        _bench.default_config(cores=1, sandbox="podman")


async def test_the_registrys_order_is_the_default_choice(
    lent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no() -> bool:
        return False

    for cls in (DockerBackend, tangram.LocalBackend):
        monkeypatch.setattr(cls, "usable", classmethod(lambda cls: no()))
    assert isinstance(await _backend.default_backend(), Lent)


async def test_the_bench_refuses_a_backend_that_cannot_start_here(
    lent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tangram._tools import _bench

    async def no() -> bool:
        return False

    monkeypatch.setattr(Lent, "usable", classmethod(lambda cls: no()))
    with pytest.raises(SandboxError, match=r"--sandbox lent: Lent cannot start here"):
        await _bench._make_backend(_bench.default_config(cores=1, sandbox=lent))
