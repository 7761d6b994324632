"""Many sandboxes, a stalled daemon and a killed trainer, on the real daemon (issue #17).

Before the fix a process hung for good past ~100 live sandboxes (each held one attach
connection of the HTTP client's pool of 100), waited forever on a daemon that stopped
answering, and a trainer killed with its sandboxes alive left every container behind.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import textwrap
from collections.abc import AsyncIterator

import aiodocker
import anyio
import anyio.abc
import pytest
from anyio import open_process

import tangram
from tangram._sandbox._docker._backend import DockerBackend
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import SandboxBrokenError, SandboxError

from .docker_support import (
    IMAGE,
    REPO,
    config,
    open_pool,
)

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_more_live_sandboxes_than_the_http_pool_holds(docker: None) -> None:
    count = 110
    async with open_pool() as setup:
        entered = 0
        done = anyio.Event()

        async def trajectory(name: str) -> None:
            nonlocal entered
            async with setup.pool.sandbox(name) as sbx:
                entered += 1
                if entered == count:
                    done.set()
                await done.wait()  # every sandbox is live at once
                assert (await sbx.run(["echo", name])).stdout == f"{name}\n".encode()

        with anyio.fail_after(500):
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(trajectory, f"t{i}")
        assert setup.pool.replaced == 0


class Gate:
    """A switch that stops a forwarded daemon from answering, as a stalled dockerd would."""

    def __init__(self) -> None:
        self.stalled = False

    async def wait_open(self) -> None:
        while self.stalled:  # noqa: ASYNC110 - polled from the test's own switch
            await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def stalling_docker() -> AsyncIterator[tuple[str, Gate]]:
    """The local daemon on a loopback port that stops forwarding while ``gate.stalled``."""
    gate = Gate()

    async def pipe(source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteSendStream) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                await gate.wait_open()
                await sink.send(chunk)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await sink.aclose()

    async def forward(client: anyio.abc.SocketStream) -> None:
        async with client:
            await gate.wait_open()
            daemon = await anyio.connect_unix("/var/run/docker.sock")
            async with daemon, anyio.create_task_group() as tg:
                tg.start_soon(pipe, client, daemon)
                tg.start_soon(pipe, daemon, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, forward)
        yield f"tcp://127.0.0.1:{port}", gate
        tg.cancel_scope.cancel()


def container_id(sbx: Sandbox) -> str:
    return str(sbx._handle.id)  # type: ignore[attr-defined]


async def remove(ids: list[str]) -> None:
    client = aiodocker.Docker()
    try:
        for ident in ids:
            with contextlib.suppress(aiodocker.DockerError):
                await client.containers.container(ident).delete(force=True)
    finally:
        await client.close()


async def exists(ident: str) -> bool:
    client = aiodocker.Docker()
    try:
        await client.containers.get(ident)
    except aiodocker.DockerError:
        return False
    finally:
        await client.close()
    return True


async def test_a_stalled_daemon_is_a_typed_error_not_a_hang(docker: None) -> None:
    made: list[str] = []
    try:
        async with stalling_docker() as (url, gate):
            backend = DockerBackend([url], config=config(api_timeout=2.0))
            async with (
                SandboxPool(backend) as pool,
                tangram.Runtime(capacity=pool.capacity()) as runtime,
                pool.sandbox("t") as sbx,
            ):
                made.append(container_id(sbx))
                assert (await sbx.run("echo hi")).stdout == b"hi\n"
                gate.stalled = True
                with anyio.fail_after(30), pytest.raises(SandboxBrokenError):
                    await sbx.run("true", timeout=2)
                assert runtime.stats().resources["cpu"].held == 0
                with anyio.fail_after(30), pytest.raises(SandboxError):
                    async with pool.sandbox("u"):
                        pass
                gate.stalled = False
    finally:
        await remove(made)


TRAINER = """
import anyio
from tangram._sandbox._docker._backend import DockerBackend, DockerConfig
from tangram._sandbox._pool import SandboxPool

async def main():
    backend = DockerBackend(config=DockerConfig(image={image!r}))
    async with SandboxPool(backend, warm=3) as pool:
        await pool.wait_warm()
        print(" ".join(handle.id for handle in pool._warm), flush=True)
        await anyio.sleep(300)

anyio.run(main)
"""


async def killed_trainer() -> list[str]:
    """Start a trainer with three warm sandboxes, kill it with SIGKILL, return their ids."""
    script = textwrap.dedent(TRAINER.format(image=IMAGE))
    async with await open_process([sys.executable, "-c", script], cwd=REPO) as trainer:
        assert trainer.stdout is not None
        with anyio.fail_after(60):
            line = b""
            async for chunk in trainer.stdout:
                line += chunk
                if line.endswith(b"\n"):
                    break
        trainer.send_signal(signal.SIGKILL)
        await trainer.wait()
    ids = line.decode().split()
    assert len(ids) == 3, line
    return ids


async def test_a_killed_trainers_sandboxes_are_reaped_at_the_next_start(docker: None) -> None:
    ids = await killed_trainer()
    try:
        assert all([await exists(ident) for ident in ids])
        async with open_pool():
            assert not any([await exists(ident) for ident in ids])
    finally:
        await remove(ids)


async def test_doctor_lists_and_removes_orphaned_sandboxes(docker: None) -> None:
    from tangram._tools import _doctor

    async with open_pool() as setup, setup.pool.sandbox("live") as live:
        ids = await killed_trainer()
        try:
            listed = await anyio.to_thread.run_sync(_doctor.orphaned_sandboxes)
            assert set(ids) <= {entry["id"] for entry in listed}
            assert container_id(live) not in {entry["id"] for entry in listed}
            removed = await anyio.to_thread.run_sync(_doctor.reap_orphaned_sandboxes)
            assert set(ids) <= set(removed)
            assert not any([await exists(ident) for ident in ids])
            assert await exists(container_id(live))
            assert (await live.run("echo alive")).stdout == b"alive\n"
        finally:
            await remove(ids)


async def test_tangram_doctor_reap_removes_them(
    docker: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from tangram._tools import _cli

    ids = await killed_trainer()
    try:
        # The command runs its own event loop, as from a shell.
        assert await anyio.to_thread.run_sync(_cli.main, ["doctor", "--reap"]) == 0
        out = capsys.readouterr().out
        assert all(ident[:12] in out for ident in ids), out
        assert not any([await exists(ident) for ident in ids])
    finally:
        await remove(ids)
