"""A local command's standard streams: its input fed, its outputs kept up to a limit.

What a command writes past ``output_limit`` is hostile volume, not data: it is moved to
``/dev/null`` by the kernel at a paced rate (:func:`_discard`), so a flood costs the
trainer's event loop a few calls a second rather than a core.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

import anyio

from .._backend import ExecRequest, ExecResult
from ._proctree import Tree, kill_tree
from ._spawner import Child

__all__ = ["communicate"]

_READ_CHUNK = 1 << 16
_DISCARD_CHUNK = 1 << 20
_DISCARD_PACE = 0.02
_F_SETPIPE_SZ = 1031


async def _discard(fd: int) -> None:
    """Drop what is left on a pipe past the output limit, paced, until its end.

    Read and dropped as fast as a command writes it, a flood held most of a core of the
    trainer's event-loop thread (3.7 s of CPU in a 5 s action). Here the kernel moves a
    full pipe to ``/dev/null`` (``splice``) every ``_DISCARD_PACE`` seconds: the command
    is slowed to about 50 MiB/s of discarded output, never stopped, and the trainer pays
    some fifty calls a second.
    """
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _DISCARD_CHUNK)
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        while True:
            await anyio.wait_readable(fd)
            try:
                moved = _splice(fd, null)
            except BlockingIOError:
                continue
            if not moved:
                return
            await anyio.sleep(_DISCARD_PACE)
    finally:
        os.close(null)


def _splice(fd: int, null: int) -> int:
    splice = getattr(os, "splice", None)
    if splice is None:  # not Linux: read and drop
        return len(os.read(fd, _DISCARD_CHUNK))
    moved: int = splice(fd, null, _DISCARD_CHUNK)
    return moved


async def communicate(process: Child, request: ExecRequest, tree: Tree) -> ExecResult:
    """Feed ``process`` its input and keep its outputs until it ends or times out; what it
    leaves running (``tree``) is killed then, closing the pipes those leftovers held."""
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    outputs: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
    dropped = {1: False, 2: False}
    timed_out = False
    open_pipes = [2]
    done = anyio.Event()

    async def feed() -> None:
        assert process.stdin is not None
        fd = process.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(request.stdin)
        try:
            while view:
                await anyio.wait_writable(fd)
                try:
                    written = os.write(fd, view[:_READ_CHUNK])
                except BlockingIOError:
                    continue
                view = view[written:]
        except (BrokenPipeError, OSError):
            pass  # the command did not read its input: its business
        finally:
            process.stdin.close()

    async def drain(stream: int) -> None:
        pipe = process.stdout if stream == 1 else process.stderr
        assert pipe is not None
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        buffer = outputs[stream]
        while True:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                open_pipes[0] -= 1
                if not open_pipes[0]:
                    done.set()
                return
            room = request.output_limit - len(buffer)
            if room > 0:
                buffer.extend(chunk[:room])
            if len(chunk) > room:
                dropped[stream] = True
                await _discard(fd)

    async def wait_exit() -> None:
        if process.pidfd is None:  # a kernel without pidfds (before Linux 5.3)
            await anyio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
            return
        await anyio.wait_readable(process.pidfd)

    async with anyio.create_task_group() as io:
        io.start_soon(feed)
        io.start_soon(drain, 1)
        io.start_soon(drain, 2)
        with anyio.move_on_after(request.timeout) as scope:
            await wait_exit()
        timed_out = scope.cancelled_caught
        # The command is done (or out of time): whatever it left running goes now, which
        # also closes the pipes those leftovers held, so the readers reach end of file.
        leftovers = await anyio.to_thread.run_sync(kill_tree, tree)
        with anyio.move_on_after(5.0):
            await done.wait()
        io.cancel_scope.cancel()
    for pipe in (process.stdout, process.stderr):
        pipe.close()
    status = await anyio.to_thread.run_sync(process.wait)
    return ExecResult(
        exit_code=None if timed_out or status < 0 else status,
        stdout=bytes(outputs[1]),
        stderr=bytes(outputs[2]),
        stdout_truncated=dropped[1],
        stderr_truncated=dropped[2],
        timed_out=timed_out,
        signal=-status if status < 0 else None,
        leftovers_killed=leftovers,
    )
