"""In-memory executors: a sandbox backend and a model service that live in this process.

For users' own test suites (``tangram.testing`` exports them): rollout code written
against :class:`tangram.SandboxPool` and :class:`tangram.gpu.GpuPool` runs unchanged, with
no process, container, GPU or model behind it, and the test can read back exactly what
the executors were asked to do: which cores were applied when, which files were written,
which replicas were restored and evicted. The scheduling path is the real one: the pool
still acquires through the runtime, so grants, queueing and invariants are what a real
run would see.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from .._core._validate import whole
from .._gpu._devices import Device
from .._gpu._service import ModelService
from .._sandbox._backend import ExecRequest, ExecResult, Host, SandboxBackend, SandboxHandle
from ..errors import (
    GpuOutOfMemoryError,
    SandboxBrokenError,
    SandboxClosedError,
    SettingTypeError,
)

__all__ = ["MemoryBackend", "MemoryModelService", "MemorySandbox"]

Handler = Callable[["MemorySandbox", ExecRequest], "ExecResult | Awaitable[ExecResult]"]


def _succeed(sandbox: MemorySandbox, request: ExecRequest) -> ExecResult:
    return ExecResult(exit_code=0, stdout=b"", stderr=b"")


@attrs.frozen
class Applied:
    """One grant change a sandbox saw: the cores and CPU quota, or a park (no cores)."""

    cores: tuple[int, ...]
    quota: float


class MemorySandbox(SandboxHandle):
    """A sandbox that is a dict of files and a log; commands go to the backend's handler.

    ``files`` persists across the trajectory's actions like a real work dir; ``applied``
    lists every :meth:`apply` and :meth:`park` in order; ``requests`` every command run.
    Set ``broken`` to make the next command or file move fail as a dead container's would.
    """

    def __init__(self, host: Host, handler: Handler) -> None:
        self.host = host
        self.files: dict[str, bytes] = {}
        self.applied: list[Applied] = []
        self.requests: list[ExecRequest] = []
        self.broken = False
        self.destroyed = False
        self._handler = handler

    def __repr__(self) -> str:
        return f"<MemorySandbox on {self.host.name} files={sorted(self.files)!r}>"

    @property
    def cores(self) -> tuple[int, ...]:
        """The cores applied now (empty while parked)."""
        return self.applied[-1].cores if self.applied else ()

    def _check_alive(self) -> None:
        if self.destroyed:
            raise SandboxClosedError("this in-memory sandbox was destroyed")
        if self.broken:
            raise SandboxBrokenError("this in-memory sandbox was marked broken")

    async def execute(self, request: ExecRequest) -> ExecResult:
        self._check_alive()
        self.requests.append(request)
        result = self._handler(self, request)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, ExecResult):
            raise SettingTypeError(
                f"the handler must return tangram.abc.ExecResult (got {result!r})"
            )
        return result

    async def apply(self, cores: tuple[int, ...], quota: float) -> None:
        self.applied.append(Applied(tuple(cores), float(quota)))

    async def park(self) -> None:
        self.applied.append(Applied((), 0.0))

    async def put_file(self, path: str, data: bytes) -> None:
        # A dead sandbox's files are gone: a move fails as the real backends' do, rather
        # than answering from a dict no command will see again.
        self._check_alive()
        self.files[path] = bytes(data)

    async def get_file(self, path: str) -> bytes:
        self._check_alive()
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    async def destroy(self) -> None:
        self.destroyed = True
        self.files.clear()


class MemoryBackend(SandboxBackend):
    """Sandboxes in this process for tests: ``SandboxPool(MemoryBackend(cores=4))``.

    :param handler: ``handler(sandbox, request) -> ExecResult`` (sync or async) answers
        each command; it can read and write ``sandbox.files`` and sleep to model a
        duration. The default succeeds with no output.
    :param cores: core ids ``0..cores-1`` of the one host the pool places sandboxes on.
    """

    def __init__(self, handler: Handler | None = None, *, cores: int = 4) -> None:
        whole("cores", cores, minimum=1)
        if handler is not None and not callable(handler):
            raise SettingTypeError(f"`handler` must be callable (got {handler!r})")
        self._handler: Handler = handler if handler is not None else _succeed
        self._host = Host("memory", tuple(range(cores)))
        self.sandboxes: list[MemorySandbox] = []

    def __repr__(self) -> str:
        return f"<tangram.testing.MemoryBackend cores={len(self._host.cores)}>"

    async def start(self) -> Sequence[Host]:
        return [self._host]

    async def create(self, host: Host) -> SandboxHandle:
        sandbox = MemorySandbox(host, self._handler)
        self.sandboxes.append(sandbox)
        return sandbox


class MemoryModelService(ModelService):
    """A model service with no model: ``run`` maps ``fn`` over each batch.

    Residency is bookkeeping only, so a test sees the pool's decisions without torch or a
    GPU: ``events`` lists ``("load",)``, ``("restore", replica, device names)``,
    ``("evict", replica)`` and ``("run", replica, batch count)`` in order. Set
    ``fail_restores`` to make that many next restores raise, as a failed copy would.

    :param fn: what one batch is scored with (default: the batch itself).
    :param memory: device bytes a replica holds while resident (``"1GiB"`` or a number).
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Any], Any] | None = None,
        *,
        memory: int | str = "1GiB",
        **options: Any,
    ) -> None:
        super().__init__(name, memory=memory, **options)
        if fn is not None and not callable(fn):
            raise SettingTypeError(f"`fn` must be callable (got {fn!r})")
        self._fn: Callable[[Any], Any] = fn if fn is not None else (lambda batch: batch)
        self.events: list[tuple[Any, ...]] = []
        self.resident: dict[int, tuple[str, ...]] = {}
        self.fail_restores = 0

    async def load(self) -> None:
        self.events.append(("load",))

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        if self.fail_restores > 0:
            self.fail_restores -= 1
            raise GpuOutOfMemoryError(f"{self.name}: restore of replica {replica} (injected)")
        names = tuple(device.name for device in devices)
        self.resident[replica] = names
        self.events.append(("restore", replica, names))

    async def evict(self, replica: int) -> None:
        self.resident.pop(replica, None)
        self.events.append(("evict", replica))

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        if replica not in self.resident:
            raise RuntimeError(f"{self.name}: replica {replica} ran while not resident")
        self.events.append(("run", replica, len(batches)))
        return [self._fn(batch) for batch in batches]
