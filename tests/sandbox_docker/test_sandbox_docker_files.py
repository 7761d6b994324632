"""File moves and stdin on the Docker backend against hostile sandboxes (issue #17).

The deadlines here are hang guards with wide margins (speed is measured by
benchmarks/cpu_sandbox.py): before the fix a 16 MiB ``put`` took 41 s at the parked
container's 1% CPU share, a FIFO hung ``get`` forever, and a paused container hung it with
no timeout at all.
"""

from __future__ import annotations

import contextlib
import os

import aiodocker
import anyio
import pytest

from tangram.errors import SandboxBrokenError

from .docker_support import (
    Setup,
    config,
    open_pool,
)

pytestmark = pytest.mark.anyio


async def test_sixteen_mib_go_in_and_out_of_a_parked_sandbox(setup: Setup) -> None:
    data = os.urandom(16 << 20)
    async with setup.pool.sandbox("t") as sbx:
        with anyio.fail_after(20):
            await sbx.put("big/blob.bin", data)
            assert (await sbx.run("wc -c < big/blob.bin")).stdout == b"16777216\n"
            assert await sbx.get("big/blob.bin") == data


async def test_get_refuses_fifos_and_escaping_symlinks(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        made = await sbx.run(
            code=(
                "import os\n"
                "os.mkfifo('fifo')\n"
                "os.symlink('/etc/passwd', 'passwd')\n"
                "os.symlink('/tmp', 'tmp')\n"
                "os.symlink('/dev/zero', 'zero')\n"
                "os.mkdir('dir')\n"
                "os.symlink('../fifo', 'dir/back')\n"
            )
        )
        assert made.ok, made
        for path in ("fifo", "passwd", "zero", "dir/back"):
            with anyio.fail_after(10), pytest.raises(OSError):
                await sbx.get(path)
        with anyio.fail_after(10), pytest.raises(OSError):
            await sbx.put("tmp/escaped", b"x")
        assert (await sbx.run("ls /tmp")).stdout == b""
        # Writing over a FIFO or a symlink replaces the name; nothing is written through it.
        await sbx.put("fifo", b"plain")
        assert await sbx.get("fifo") == b"plain"
        await sbx.put("passwd", b"mine")
        assert await sbx.get("passwd") == b"mine"
        assert (await sbx.run("echo alive")).stdout == b"alive\n"
    assert setup.pool.replaced == 0


async def test_get_on_a_paused_container_is_a_typed_error(docker: None) -> None:
    async with (
        open_pool(config=config(io_timeout=2.0)) as setup,
        setup.pool.sandbox("t") as sbx,
    ):
        await sbx.put("f", b"x")
        container = sbx._handle.container  # type: ignore[attr-defined]
        await container.pause()
        try:
            with anyio.fail_after(30), pytest.raises(SandboxBrokenError):
                await sbx.get("f")
        finally:
            with contextlib.suppress(aiodocker.DockerError):  # removed as broken
                await container.unpause()
        with pytest.raises(SandboxBrokenError):
            await sbx.run("true")


async def test_a_large_stdin_arrives_whole_within_the_actions_time(setup: Setup) -> None:
    data = b"z" * (128 << 20)
    async with setup.pool.sandbox("t") as sbx:
        with anyio.fail_after(60):
            result = await sbx.run("wc -c", stdin=data, timeout=30)
        assert result.ok, result
        assert result.stdout == b"134217728\n"
        ignored = await sbx.run("true", stdin=data, timeout=30)
        assert ignored.ok, ignored
        assert (await sbx.run("cat", stdin=b"small")).stdout == b"small"


async def test_a_cancelled_put_or_large_stdin_leaves_the_sandbox_as_it_was(docker: None) -> None:
    data = os.urandom(64 << 20)
    # A few live sandboxes reserved, so the work dir keeps room for the 64 MiB file.
    async with open_pool(sandboxes=8) as setup, setup.pool.sandbox("t") as sbx:
        await sbx.put("f", b"old")
        for delay in (0.0, 0.05, 0.2):
            with anyio.move_on_after(delay):
                await sbx.put("f", data)
            assert await sbx.get("f") in (b"old", data)
            with anyio.move_on_after(delay):
                await sbx.run("wc -c", stdin=data)
            assert (await sbx.run("ls -a")).stdout == b".\n..\nf\n"  # no partial file left
        assert (await sbx.run("cat", stdin=b"next")).stdout == b"next"
    assert setup.pool.replaced == 0
    assert setup.runtime.stats().resources["cpu"].held == 0
