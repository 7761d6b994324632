"""What the Docker sandbox tests share: the daemon check, the test image, a pool on it.

With ``CI`` set nothing here skips: a missing daemon or image is set up with
``.ci/docker.sh`` (idempotent) and a failure to do so fails the tests. Without ``CI`` the
tests skip on a machine with no Docker. The image is built from the host's own files, with
no registry pull (see ``.ci/docker.sh`` and docs/sandboxes.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import tangram
from tangram._sandbox._pool import Sandbox, SandboxPool

aiodocker = (
    pytest.importorskip("aiodocker") if not os.environ.get("CI") else __import__("aiodocker")
)

from tangram._sandbox._docker._backend import (  # noqa: E402
    DockerBackend,
    DockerConfig,
    docker_usable,
)

IMAGE = os.environ.get("TANGRAM_SANDBOX_IMAGE", "tangram-sandbox-test:latest")
REPO = Path(__file__).resolve().parents[2]
_ready: bool | None = None


async def _docker_ready() -> bool:
    return await docker_usable(DockerConfig(image=IMAGE))


async def ensure_docker() -> None:
    """Skip where Docker is missing, but never on CI, which sets it up instead."""
    global _ready
    if _ready is None:
        _ready = await _docker_ready()
        if not _ready and os.environ.get("CI"):
            await anyio.run_process(["bash", str(REPO / ".ci" / "docker.sh")], check=True)
            _ready = await _docker_ready()
            assert _ready, "Docker is not usable even after .ci/docker.sh"
    if not _ready:
        pytest.skip("no Docker daemon or test image here (run .ci/docker.sh); CI never skips")


def config(**changes: Any) -> DockerConfig:
    return DockerConfig(image=IMAGE, **changes)


class Setup:
    def __init__(self, pool: SandboxPool, runtime: tangram.Runtime) -> None:
        self.pool = pool
        self.runtime = runtime


@contextlib.asynccontextmanager
async def open_pool(**options: Any) -> AsyncIterator[Setup]:
    backend = DockerBackend(
        config=options.pop("config", None) or config(), sandboxes=options.pop("sandboxes", 256)
    )
    async with (
        SandboxPool(backend, **options) as pool,
        tangram.Runtime(capacity=pool.capacity()) as runtime,
    ):
        yield Setup(pool, runtime)


QUOTA_FILES = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max"
CPUSET_FILES = "/sys/fs/cgroup/cpuset/cpuset.cpus /sys/fs/cgroup/cpuset.cpus.effective"


def quota_of(text: str) -> int:
    return int(text.split()[0])


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 20.0) -> None:
    """Poll state kept outside this process (a container's files, Docker's records).

    No event exists to wait on there; the deadline keeps a broken case from hanging.
    """
    with anyio.fail_after(seconds):
        while not await check():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def docker_quota_is(sbx: Sandbox, quota: int) -> bool:
    return bool((await inspect(sbx))["HostConfig"]["CpuQuota"] == quota)


async def inspect(sbx: Sandbox) -> dict[str, Any]:
    details: dict[str, Any] = await sbx._handle.container.show()  # type: ignore[attr-defined]
    return details
