"""One Docker sandbox: its runner's channel, its file moves, and its cgroup grants.

The host talks to the runner in frames (:mod:`tangram._sandbox._docker._channel`): one request,
then its data frames (stdin, a file), then one reply, every reply carrying the request's
id and the key this handle sent as the first frame after the start. Anything else on the
channel (a frame that is too big, not a frame, another id, the wrong key) breaks the
sandbox: it is destroyed and :class:`SandboxBrokenError` raised, since whatever wrote it
could also have written a believable reply. An error the runner *reports* (no such file,
a FIFO refused) is raised as such and leaves the sandbox as it was.

A request that is interrupted (the caller cancelled, or an outer deadline) is settled
before the channel is used again: the host sends a cancel, the runner stops what it was
doing and answers both, and the host reads up to the cancel's answer, so no later call
ever gets an earlier one's reply. The runner answers a cancel in every state, idle
included; one that does not answer within ``io_timeout`` cannot be trusted again.

File moves run at one core's share rather than the parked 1%: no command runs between
actions (the runner kills every leftover), so the share serves only the runner's copy,
and a 16 MiB ``put`` takes milliseconds instead of 41 s. The Engine's archive endpoints
cannot replace the runner here: they see neither the tmpfs work dir nor past a read-only
root.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

from ...errors import SandboxBrokenError, SandboxError
from .._backend import ExecRequest, ExecResult, SandboxHandle
from .._cores import format_cpu_list
from ._cgroupfs import PERIOD_US, CgroupFiles
from ._channel import CHUNK, ChannelError, FrameReader, LogRelay, encode
from ._engine import DockerConfig, HostInfo

__all__ = ["BOOT_TIMEOUT", "PARKED_QUOTA_US", "DockerHandle"]

logger = logging.getLogger("tangram.sandbox.docker")

PARKED_QUOTA_US = 1_000
"""The smallest CFS quota the kernel accepts: a parked sandbox's share is 1% of a core."""
BOOT_TIMEOUT = 60.0
"""Seconds a new container's runner has to say it is ready (a start takes about 2.6 s)."""
REPLY_SLACK = 4096
"""Bytes a run reply's data may exceed twice the output limit by (a start error's text)."""
ERRORS: dict[str, type[OSError]] = {
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
    "NotADirectoryError": NotADirectoryError,
    "PermissionError": PermissionError,
    "FileExistsError": FileExistsError,
}
"""Errors the runner reports about a path, raised as the same builtin on the host."""


T = TypeVar("T")


class _Lost(Exception):
    """The channel cannot be trusted any more (the message says why)."""


class DockerHandle(SandboxHandle):
    """One container: made by :meth:`DockerBackend.create`, never by hand."""

    def __init__(self, config: DockerConfig, info: HostInfo, container: Any) -> None:
        self.host = info.host
        self._config = config
        self._info = info
        self.container = container
        self.id: str = container.id
        self._stream: Any = None
        self._holds_stream = False
        self._reader = FrameReader()
        self._relay = LogRelay(logger, self.id[:12])
        self._key = secrets.token_hex(32)
        self._ids = 0
        self._cgroup: CgroupFiles | None = None
        self._parked = (format_cpu_list(info.host.cores), PARKED_QUOTA_US)
        self._wanted = self._parked
        self._docker_view = self._parked
        self._version = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = anyio.Lock()
        self._destroyed = False

    def __repr__(self) -> str:
        return f"<tangram docker sandbox {self.id[:12]}>"

    @property
    def fast_path(self) -> bool:
        return self._cgroup is not None

    async def _api(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await self._info.call(what, call, self._config.api_timeout)

    async def boot(self) -> None:
        # Attached before it starts, as `docker run -i` does, and through the client whose
        # pool has room for every live sandbox's connection.
        self._info.take_stream()
        self._holds_stream = True
        attached = self._info.streams.containers.container(self.id)
        self._stream = attached.attach(stdin=True, stdout=True, stderr=True)
        await self._api("to attach to a sandbox", self._stream._init)
        await self._api("to start a sandbox", self.container.start)
        # The key goes as the first frame on stdin: not in the container's environment or
        # command line, which `docker inspect` and /proc would show.
        try:
            with anyio.fail_after(BOOT_TIMEOUT):
                await self._write({"op": "hello", "key": self._key})
                ready, _ = await self._frame(0, 0)
        except TimeoutError:
            raise SandboxBrokenError(
                f"the sandbox runner in {self.id[:12]} did not answer in {BOOT_TIMEOUT:g} s"
            ) from None
        if not ready.get("ok") or not ready.get("ready"):
            raise SandboxError(f"the sandbox runner did not start: {ready.get('message')}")
        if self._config.fast_path and self._info.local:
            details = await self._api("to inspect a sandbox", self.container.show)
            pid = int(details.get("State", {}).get("Pid") or 0)
            if pid > 0:
                files = await anyio.to_thread.run_sync(
                    CgroupFiles.find, pid, self._info.cgroup_version
                )
                # Only trust files that show what Docker set: the same daemon's cgroup.
                booted = (self._parked[0], PERIOD_US)
                if files is not None and await anyio.to_thread.run_sync(files.read) == booted:
                    self._cgroup = files
        self._wanted = self._docker_view = (self._parked[0], PERIOD_US)
        # Parked through the API once, so Docker's view matches from the start.
        async with self._lock:
            await self._update(self._parked)
            if self._cgroup is not None:
                self._cgroup.write(*self._parked, growing=False)
            self._wanted = self._docker_view = self._parked

    # -- the channel --------------------------------------------------------------------

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def _broken(self, message: str, cause: BaseException | None = None) -> SandboxBrokenError:
        """Destroy this sandbox and build the error that says why."""
        with anyio.CancelScope(shield=True):
            await self.destroy()
        error = SandboxBrokenError(f"sandbox {self.id[:12]}: {message}")
        error.__cause__ = cause
        return error

    async def _send(self, frame: bytes) -> None:
        """Write ``frame`` and wait for the connection to drain, in a task of its own.

        aiohttp's drain waiter is one future per connection: a wait for it that is
        cancelled cancels the future itself, and every later write on the connection then
        raises that old cancellation. Shielded, a cancellation here never reaches it. The
        task's first step queues the whole frame, so frames keep their order.
        """
        task = asyncio.ensure_future(self._stream.write_in(frame))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _write(self, meta: dict[str, Any], data: bytes = b"") -> None:
        """Send one frame: one buffer, so a cancellation never leaves half of it sent."""
        if self._destroyed:
            raise SandboxBrokenError("the sandbox was destroyed")
        try:
            with anyio.fail_after(self._config.io_timeout):
                await self._send(encode(meta, data))
        except TimeoutError as exc:
            raise await self._broken("the runner took nothing for too long", exc) from exc
        except Exception as exc:
            raise await self._broken(f"lost the runner's channel: {exc!r}", exc) from exc

    async def _receive(self, data_limit: int) -> tuple[dict[str, Any], bytes]:
        """The next frame the runner wrote, its key checked.

        :raises _Lost: the channel failed, or carried something other than the runner's
            frames.
        """
        while True:
            try:
                frame = self._reader.next(data_limit)
            except ChannelError as exc:
                raise _Lost(f"garbage on the runner's channel: {exc}") from exc
            if frame is not None:
                meta, data = frame
                key = meta.get("key")
                if not isinstance(key, str) or not hmac.compare_digest(key, self._key):
                    raise _Lost("a frame without the sandbox's key on the runner's channel")
                return meta, data
            if self._destroyed:
                raise _Lost("the sandbox was destroyed")
            try:
                message = await self._stream.read_out()
            except Exception as exc:
                raise _Lost(f"lost the runner's channel: {exc!r}") from exc
            if message is None:
                raise _Lost("the container stopped (its runner exited)")
            if message.stream == 2:
                self._relay.feed(message.data)
            else:
                self._reader.feed(message.data)

    async def _frame(self, ident: int, data_limit: int) -> tuple[dict[str, Any], bytes]:
        """The next frame, which must answer request ``ident``.

        :raises SandboxBrokenError: it does not (the sandbox is destroyed).
        """
        try:
            meta, data = await self._receive(data_limit)
        except _Lost as exc:
            raise await self._broken(str(exc), exc.__cause__) from exc.__cause__
        if meta.get("id") != ident:
            raise await self._broken(
                f"a reply to request {meta.get('id')!r} while {ident} was waiting"
            )
        return meta, data

    def _raise_reported(self, reply: dict[str, Any]) -> None:
        """Raise what the runner reported as a failure; the sandbox stays as it was."""
        if reply.get("ok"):
            return
        error = str(reply.get("error"))
        message = str(reply.get("message", ""))[:2000]
        if error in ERRORS:
            raise ERRORS[error](message)
        if reply.get("errno") == errno.EFBIG:  # a file over the cap of a get: nothing read
            raise OSError(errno.EFBIG, message)
        raise SandboxError(f"the sandbox runner failed: {error}: {message}")

    @contextlib.asynccontextmanager
    async def _request(self, meta: dict[str, Any], data_limit: int) -> AsyncIterator[int]:
        """Send a request; if the block is interrupted, settle it before anything else.

        A channel failure inside already destroyed the sandbox; any other exit before the
        block's end (a cancellation, an outer deadline) sends a cancel and reads up to its
        answer, or destroys the sandbox when that takes longer than ``io_timeout``.
        """
        ident = self._next_id()
        settled = False
        try:
            # Inside: a cancellation while the request is being written may come after the
            # frame was queued whole, and then the runner will answer it.
            await self._write({**meta, "id": ident})
            yield ident
            settled = True
        except SandboxBrokenError:
            settled = True
            raise
        finally:
            if not settled and not self._destroyed:
                with anyio.CancelScope(shield=True):
                    await self._settle(ident, data_limit)

    async def _settle(self, ident: int, data_limit: int) -> None:
        cancel = self._next_id()
        try:
            with anyio.fail_after(self._config.io_timeout):
                await self._send(encode({"op": "cancel", "id": cancel}))
                while True:
                    meta, _ = await self._receive(data_limit)
                    if meta.get("id") == cancel:
                        return
                    if meta.get("id") != ident:
                        raise _Lost(f"a reply to request {meta.get('id')!r} while settling")
        except Exception as exc:
            logger.warning(
                "sandbox %s did not settle after an interrupted request (%s); removed",
                self.id[:12],
                exc,
            )
        await self.destroy()

    # -- actions and files ----------------------------------------------------------------

    async def execute(self, request: ExecRequest) -> ExecResult:
        data_limit = 2 * request.output_limit + REPLY_SLACK
        meta = {
            "op": "run",
            "argv": list(request.argv),
            "env": dict(request.env),
            "timeout": request.timeout,
            "output_limit": request.output_limit,
            "stdin": len(request.stdin),
        }
        async with self._request(meta, max(data_limit, CHUNK)) as ident:
            await self._send_data(request.stdin)
            reply, data = await self._frame(ident, data_limit)
        self._raise_reported(reply)
        try:
            split = int(reply.get("stdout_len", 0))
            exit_code = reply.get("exit_code")
            signal = reply.get("signal")
            if not (0 <= split <= len(data)) or len(data) - split > max(
                request.output_limit, REPLY_SLACK
            ):
                raise ValueError(f"{split} of {len(data)} bytes as stdout")
            if exit_code is not None and not isinstance(exit_code, int):
                raise ValueError(f"exit code {exit_code!r}")
            if signal is not None and not isinstance(signal, int):
                raise ValueError(f"signal {signal!r}")
            result = ExecResult(
                exit_code=exit_code,
                stdout=data[:split],
                stderr=data[split:],
                stdout_truncated=bool(reply.get("stdout_truncated")),
                stderr_truncated=bool(reply.get("stderr_truncated")),
                timed_out=bool(reply.get("timed_out")),
                signal=signal,
                cpu_seconds=float(reply.get("cpu_seconds", math.nan)),
                leftovers_killed=int(reply.get("leftovers", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise await self._broken(f"a malformed reply: {exc}", exc) from exc
        return result

    @contextlib.asynccontextmanager
    async def _transfer_share(self) -> AsyncIterator[None]:
        """One core's share while a file moves; parked again after, whatever happens."""
        await self._set((self._parked[0], PERIOD_US))
        try:
            yield
        finally:
            if not self._destroyed:
                with anyio.CancelScope(shield=True):
                    await self._set(self._parked)

    async def put_file(self, path: str, data: bytes) -> None:
        async with self._transfer_share():
            request = {"op": "put", "path": path, "size": len(data)}
            async with self._request(request, CHUNK) as ident:
                await self._send_data(data)
                reply, _ = await self._wait(self._frame(ident, 0))
        self._raise_reported(reply)

    async def get_file(self, path: str) -> bytes:
        limit = self._config.work_bytes
        chunks: list[bytes] = []
        got = 0
        async with (
            self._transfer_share(),
            self._request({"op": "get", "path": path, "limit": limit}, CHUNK) as ident,
        ):
            while True:
                reply, data = await self._wait(self._frame(ident, CHUNK))
                if not reply.get("more"):
                    break
                got += len(data)
                if got > limit:
                    raise await self._broken(f"a file of more than {limit} bytes")
                chunks.append(data)
        self._raise_reported(reply)
        if reply.get("size") != got:
            raise await self._broken(f"{got} bytes of a file said to be {reply.get('size')!r}")
        return b"".join(chunks)

    async def _send_data(self, data: bytes) -> None:
        """``data`` as data frames after its request: each a bounded copy, never base64."""
        view = memoryview(data)
        for start in range(0, len(view), CHUNK):
            await self._write({"op": "data"}, view[start : start + CHUNK].tobytes())

    async def _wait(self, step: Coroutine[Any, Any, Any]) -> Any:
        """One step of a file move, with the deadline for progress on the channel."""
        try:
            with anyio.fail_after(self._config.io_timeout):
                return await step
        except TimeoutError as exc:
            raise await self._broken(
                f"no progress on a file move for {self._config.io_timeout:g} s", exc
            ) from exc

    # -- grants -------------------------------------------------------------------------

    async def apply(self, cores: tuple[int, ...], quota: float) -> None:
        quota_us = max(PARKED_QUOTA_US, round(quota * PERIOD_US))
        await self._set((format_cpu_list(cores), quota_us))

    async def park(self) -> None:
        await self._set(self._parked)

    async def _set(self, wanted: tuple[str, int]) -> None:
        # The lock orders every write: a direct write never lands while an API update is
        # in flight, so Docker can never put an older value over a newer one.
        async with self._lock:
            growing = wanted[1] >= self._wanted[1]
            self._wanted = wanted
            self._version += 1
            if self._cgroup is not None:
                try:
                    # On the loop, not in a thread: a cgroupfs write is an in-kernel
                    # update of a few microseconds; a thread hop would cost ten times that.
                    self._cgroup.write(wanted[0], wanted[1], growing)
                except OSError:
                    logger.warning("direct cgroup write failed for %s; using the API", self.id[:12])
                    self._cgroup = None
                else:
                    if self._config.sync_docker_view and self._docker_view != wanted:
                        self._later(self._sync(self._version))
                    return
            await self._update(wanted)
            self._docker_view = wanted

    async def _sync(self, version: int) -> None:
        """Tell Docker the directly written values once they have held for a while.

        Waiting first keeps API calls off the short actions and quick resizes that make
        up most changes; a change that comes while the call is in flight waits for it.
        """
        await anyio.sleep(self._config.sync_after)
        async with self._lock:
            if version != self._version or self._destroyed or self._docker_view == self._wanted:
                return
            try:
                await self._update(self._wanted)
            except SandboxError:
                logger.debug("could not sync Docker's view of %s", self.id[:12], exc_info=True)
                return
            self._docker_view = self._wanted

    def _later(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _update(self, values: tuple[str, int]) -> None:
        cpuset, quota_us = values
        try:
            await self._api(
                "to update a sandbox's grant",
                lambda: self._info.client._query_json(
                    f"containers/{self.id}/update",
                    method="POST",
                    data={"CpusetCpus": cpuset, "CpuQuota": quota_us, "CpuPeriod": PERIOD_US},
                ),
            )
        except SandboxBrokenError:
            raise
        except SandboxError as exc:
            raise SandboxBrokenError(f"cannot update the sandbox {self.id[:12]}: {exc}") from exc

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for task in list(self._tasks):
            task.cancel()
        if self._holds_stream:
            self._holds_stream = False
            self._info.streams_open -= 1
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.close()
        try:
            await self._api(
                "to remove a sandbox", lambda: self.container.delete(force=True, v=True)
            )
        except SandboxError as exc:
            # Left for the reaper: it carries this process as its owner.
            logger.warning("could not remove the sandbox %s: %s", self.id[:12], exc)


def _retrieve(task: asyncio.Future[None]) -> None:
    """Take a write task's outcome: a lost connection is reported by the next read."""
    if not task.cancelled():
        task.exception()
