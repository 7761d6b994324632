"""CPU sandboxes scheduled per action: the pool and the sandbox rollout code sees.

A trajectory keeps one sandbox for its whole life (files, installed packages, a built
tree), but holds cores only while one of its actions runs: ``sbx.run(...)`` acquires
``cpu`` through the runtime, pins the action to exactly the granted cores, runs, and gives
them back. Between actions the sandbox is *parked*: alive, with its state, and no CPU
share. This is the paper's allocate-on-execution; the trajectory-level alternative reserves
the cores for the trajectory's whole life although they are busy about half of it.

The pool turns the scheduler's *counts* into *core ids*: the runtime decides how many
cores each action holds, the pool's :class:`CoreSet` picks which, keeping one action's
cores together (one NUMA node when the host has several) and never lending a core to two
actions at once. Backends turn core ids into effects (a cgroup cpuset and CFS quota for
Docker, CPU affinity for the embedded local backend) behind the backend seam
(:mod:`tangram._sandbox._backend`).
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc
import attrs

from .._core._demand import Elastic
from .._core._validate import real, whole
from .._core._validate import seconds as _seconds
from .._runtime._run import current_runtime
from .._runtime._scheduler import LeaseLike, Scheduler
from ..errors import (
    DemandTypeError,
    InvalidDemandError,
    InvalidSettingError,
    SandboxBrokenError,
    SandboxClosedError,
    SandboxError,
    SettingTypeError,
)
from ._backend import (
    CPUS_ENV,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_TIMEOUT,
    ExecRequest,
    ExecResult,
    Host,
    RunResult,
    SandboxBackend,
    SandboxHandle,
    default_backend,
    logger,
)
from ._cores import CoreSet

__all__ = ["Sandbox", "SandboxPool"]


# -- the pool -------------------------------------------------------------------------


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Active:
    """One running action: its lease, its sandbox and the core ids it holds now."""

    lease: LeaseLike
    handle: SandboxHandle
    resource: str
    cores: tuple[int, ...] = ()
    quota: float = 0.0
    max_units: int = 0
    error: SandboxBrokenError | None = None
    throttle: float | None = None  # a fractional cpu: the share of its cores it may use


class _HostState:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.cores = CoreSet(host.nodes or (host.cores,))
        self.active: list[_Active] = []
        self.lock = anyio.Lock()
        self.sandboxes = 0


class SandboxPool:
    """Sandboxes for trajectories, with cores lent per action through a runtime.

    ``async with SandboxPool(backend, warm=8) as pool:`` keeps ``warm`` sandboxes created
    and parked ahead of demand, so a trajectory's first action does not pay a container
    start; ``async with pool.sandbox(trajectory_id) as sbx:`` hands one to a trajectory
    and removes it (with all its files) when the block ends, so nothing leaks from one
    trajectory to the next.

    :param backend: where sandboxes live. Default: :class:`tangram.DockerBackend` when
        aiodocker is installed, a daemon answers and its default image is present;
        otherwise the embedded :class:`tangram.LocalBackend` (not a security boundary).
        Pass one explicitly in production so the isolation you get is never a surprise.
    :param runtime: the runtime actions acquire from (default: the current one at each
        action).
    :param warm: parked sandboxes kept ready.
    :param output_limit: bytes of stdout and of stderr kept per action.
    :param timeout: default seconds per action.
    :param kind: the default action kind the estimator learns durations under.
    """

    def __init__(
        self,
        backend: SandboxBackend | None = None,
        *,
        runtime: Scheduler | None = None,
        warm: int = 0,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        timeout: float = DEFAULT_TIMEOUT,
        kind: str = "sandbox",
    ) -> None:
        if backend is not None and not isinstance(backend, SandboxBackend):
            raise SettingTypeError(
                f"`backend` must be a tangram.abc.SandboxBackend (got {backend!r})"
            )
        if runtime is not None and not callable(getattr(runtime, "acquire", None)):
            raise SettingTypeError(f"`runtime` must be a tangram.Runtime or None (got {runtime!r})")
        whole("warm", warm)
        whole("output_limit", output_limit)
        _seconds("timeout", timeout, strict=True)
        if not isinstance(kind, str):
            raise SettingTypeError(f"`kind` must be a string (got {kind!r})")
        self._backend = backend
        self._runtime = runtime
        self._warm_target = warm
        self.output_limit = output_limit
        self.timeout = float(timeout)
        self.kind = kind
        self._state = _State.NEW
        self._hosts: dict[str, _HostState] = {}
        self._warm: list[SandboxHandle] = []
        self._creating = 0
        self._warm_changed: anyio.Event | None = None
        self._warm_error: Exception | None = None
        self._live: set[SandboxHandle] = set()
        self._leaving: dict[SandboxHandle, anyio.Event] = {}
        self._task_group: anyio.abc.TaskGroup | None = None
        self.replaced = 0

    def __repr__(self) -> str:
        return (
            f"<tangram.SandboxPool {self._state.value} backend={type(self._backend).__name__} "
            f"warm={len(self._warm)}/{self._warm_target}>"
        )

    @property
    def backend(self) -> SandboxBackend:
        """The backend in use (chosen on entry when none was given)."""
        if self._backend is None:
            raise SandboxClosedError("the backend is chosen when the pool is entered")
        return self._backend

    @property
    def hosts(self) -> tuple[Host, ...]:
        return tuple(state.host for state in self._hosts.values())

    def capacity(self) -> dict[str, int]:
        """The runtime capacity this pool's hosts provide: ``Runtime(capacity=pool.capacity())``."""
        self._check_open()
        return {state.host.resource: len(state.host.cores) for state in self._hosts.values()}

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> SandboxPool:
        if self._state is not _State.NEW:
            raise SandboxClosedError(
                f"a SandboxPool can be entered once (this one is {self._state.value})"
            )
        if self._backend is None:
            self._backend = await default_backend()
        hosts = await self._backend.start()
        for host in hosts:
            self._hosts[host.name] = _HostState(host)
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._state = _State.OPEN
        self._replenish()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Destroy every sandbox and close the backend; safe twice, finishes when cancelled."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            # Background work is warm creation and destroying replaced sandboxes; the
            # sandboxes it made are in ``_live`` and go below.
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            for handle in list(self._live):
                await self._destroy(handle)
            self._warm.clear()
            if self._backend is not None:
                await self._backend.aclose()

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise SandboxClosedError(
                f"the sandbox pool is {self._state.value}: use it inside `async with pool:`"
            )

    # -- sandboxes ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def sandbox(self, trajectory_id: str) -> AsyncIterator[Sandbox]:
        """A sandbox for one trajectory, removed with its files when the block ends."""
        if not isinstance(trajectory_id, str):
            raise SettingTypeError(f"`trajectory_id` must be a string (got {trajectory_id!r})")
        self._check_open()
        handle = await self._checkout()
        sandbox = Sandbox(self, handle, trajectory_id)
        try:
            yield sandbox
        finally:
            sandbox._closed = True
            with anyio.CancelScope(shield=True):
                await self._destroy(sandbox._handle)

    async def _checkout(self) -> SandboxHandle:
        if self._warm:
            handle = self._warm.pop()
        else:
            handle = await self._create()
        self._replenish()
        return handle

    def _pick_host(self) -> _HostState:
        return min(self._hosts.values(), key=lambda state: state.sandboxes)

    async def _create(self) -> SandboxHandle:
        state = self._pick_host()
        state.sandboxes += 1
        try:
            handle = await self.backend.create(state.host)
        except (OSError, RuntimeError) as exc:
            state.sandboxes -= 1
            if isinstance(exc, SandboxError):
                raise
            # The host's failure (a full disk, no uid left), not the caller's: typed as
            # the pool's, so an adapter never hands it to the model as a tool's output.
            raise SandboxError(
                f"could not create a sandbox on {state.host.name}: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            state.sandboxes -= 1
            raise
        self._live.add(handle)
        return handle

    async def _destroy(self, handle: SandboxHandle) -> None:
        """Destroy ``handle``, or wait for its destruction already under way (a broken
        sandbox's, in the background): a sandbox block ends once its sandbox is gone."""
        if handle not in self._live:
            gone = self._leaving.get(handle)
            if gone is not None:
                with anyio.CancelScope(shield=True):
                    await gone.wait()
            return
        self._live.discard(handle)
        self._leaving[handle] = gone = anyio.Event()
        state = self._hosts.get(handle.host.name)
        if state is not None:
            state.sandboxes -= 1
        # Shielded: the pool's close cancels its background work, and a removal cut off
        # there would leave the container to the reaper of a later run.
        with anyio.CancelScope(shield=True):
            try:
                await handle.destroy()
            except Exception:
                logger.exception("could not destroy sandbox %r", handle)
            finally:
                del self._leaving[handle]
                gone.set()

    def _replenish(self) -> None:
        if self._task_group is None or self._state is not _State.OPEN:
            return
        while len(self._warm) + self._creating < self._warm_target:
            self._creating += 1
            self._task_group.start_soon(self._create_warm)

    async def _create_warm(self) -> None:
        try:
            handle = await self._create()
        except Exception as exc:
            logger.exception("could not create a warm sandbox")
            self._warm_error = exc
            event, self._warm_changed = self._warm_changed, None
            if event is not None:
                event.set()
            return
        finally:
            self._creating -= 1
        if self._state is _State.OPEN:
            self._warm.append(handle)
            event, self._warm_changed = self._warm_changed, None
            if event is not None:
                event.set()
        else:
            await self._destroy(handle)

    async def wait_warm(self) -> None:
        """Wait until the warm set is full (before a rollout step, or a benchmark).

        :raises SandboxClosedError: the pool is not open.
        :raises SandboxError: creating a sandbox failed (the cause is attached).
        """
        self._check_open()
        self._replenish()
        while len(self._warm) < self._warm_target:
            self._check_open()
            if self._warm_error is not None:
                error, self._warm_error = self._warm_error, None
                raise SandboxError(f"could not create a warm sandbox: {error}") from error
            self._warm_changed = event = self._warm_changed or anyio.Event()
            await event.wait()

    def _replace(self, handle: SandboxHandle) -> None:
        """A sandbox broke: destroy it in the background and top the warm set up again."""
        self.replaced += 1
        if self._task_group is not None:
            self._task_group.start_soon(self._destroy, handle)
        self._replenish()

    # -- running actions ----------------------------------------------------------------

    async def _run(
        self,
        sandbox: Sandbox,
        argv: tuple[str, ...],
        cpu: int | float | Elastic,
        timeout: float,  # noqa: ASYNC109 - the command's limit, enforced by the backend
        stdin: bytes,
        env: Mapping[str, str],
        kind: str,
    ) -> RunResult:
        runtime = self._runtime if self._runtime is not None else current_runtime()
        handle = sandbox._handle
        state = self._hosts[handle.host.name]
        resource = state.host.resource
        # An action is pinned to cores of its own, so a fraction of one holds it whole in
        # the runtime's books too (and is throttled to the fraction where the backend can):
        # two cpu=0.5 actions granted one core between them crashed the pool's core
        # assignment, and ran two actions on a core the memory reservation gives one.
        throttle = None
        if isinstance(cpu, float) and not cpu.is_integer():
            cpu, throttle = max(1, math.ceil(cpu)), cpu
        async with runtime.acquire(
            {resource: cpu}, kind=kind, trajectory=sandbox.trajectory_id
        ) as lease:
            active = _Active(lease, handle, resource, throttle=throttle)
            try:
                async with state.lock:
                    state.active.append(active)
                    await self._reconcile(state)
                if active.error is not None:
                    raise active.error
                units = len(active.cores)
                cores = active.cores
                full_env = {**env, CPUS_ENV: str(units)}
                request = ExecRequest(
                    argv, stdin, full_env, timeout, self.output_limit, cores, active.quota
                )
                lease.started_at = anyio.current_time()
                started = lease.started_at
                result = await self._execute(state, active, request)
                finished = anyio.current_time()
            except SandboxBrokenError:
                sandbox._broken = True
                self._replace(handle)
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await self._finish(state, active, sandbox)
        return RunResult(
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
            timed_out=result.timed_out,
            signal=result.signal,
            cores=cores,
            units=units,
            max_units=active.max_units,
            resizes=lease.resizes,
            queue_seconds=lease.queue_seconds,
            overhead_seconds=lease.overhead_seconds,
            exec_seconds=finished - started,
            cpu_seconds=result.cpu_seconds,
            leftovers_killed=result.leftovers_killed,
        )

    async def _execute(
        self, state: _HostState, active: _Active, request: ExecRequest
    ) -> ExecResult:
        # The backend enforces the timeout itself and reports it as a result; this outer
        # limit only catches a backend that stopped answering, which is a broken sandbox.
        grace = 10.0 + request.timeout * 0.5
        result: ExecResult | None = None
        error: Exception | None = None
        with anyio.move_on_after(request.timeout + grace):
            async with anyio.create_task_group() as task_group:
                elastic = active.lease.action.demand.elastic
                if elastic is not None and elastic.resizable:  # no other grant ever changes
                    task_group.start_soon(self._follow, state, active)
                try:
                    result = await active.handle.execute(request)
                except Exception as exc:
                    # Raised outside the task group, so callers catch the error itself
                    # rather than an ExceptionGroup around it.
                    error = exc
                task_group.cancel_scope.cancel()
        if error is not None:
            raise error
        if active.error is not None:
            raise active.error
        if result is None:
            raise SandboxBrokenError(
                f"the sandbox did not answer within {request.timeout + grace:g} s "
                f"(the action's timeout was {request.timeout:g} s)"
            )
        return result

    async def _follow(self, state: _HostState, active: _Active) -> None:
        """Apply every resize of a running action (and any others it makes room for)."""
        while active.error is None:
            await active.lease.wait_resized()
            async with state.lock:
                await self._reconcile(state)

    async def _reconcile(self, state: _HostState) -> None:
        """Bring every running action's core ids in line with its current grant.

        All shrinks are applied before any growth, so a core moves from one action to
        another only after the first has let go of it. The runtime's books are already
        consistent (a grant that grows was made from units another action lost), so the
        pool just follows them; a follower that wakes after its change was applied here
        by someone else finds nothing to do.
        """
        shrinking: list[_Active] = []
        growing: list[_Active] = []
        for active in state.active:
            amount = float(active.lease.grant.get(active.resource, 0.0))
            count = max(1, math.ceil(amount - 1e-9))
            if active.throttle is not None:
                amount = active.throttle
            if count < len(active.cores):
                active.cores = state.cores.resize(active.cores, count)
                active.quota = amount
                shrinking.append(active)
            elif amount != active.quota or count != len(active.cores):
                active.quota = amount
                growing.append(active)
        for active in growing:
            count = max(1, math.ceil(active.quota - 1e-9))
            if active.cores:
                active.cores = state.cores.resize(active.cores, count)
            else:
                active.cores = state.cores.take(count)
            active.max_units = max(active.max_units, len(active.cores))
        for active in (*shrinking, *growing):
            try:
                await active.handle.apply(active.cores, active.quota)
            except SandboxBrokenError as exc:
                # Reported to the action that owns the sandbox, not to whichever action's
                # resize happened to trigger this pass.
                logger.warning("could not apply a grant to %r: %s", active.handle, exc)
                active.error = exc

    async def _finish(self, state: _HostState, active: _Active, sandbox: Sandbox) -> None:
        async with state.lock:
            if active in state.active:
                state.active.remove(active)
            if active.cores:
                state.cores.give(active.cores)
        if not sandbox._broken:
            try:
                await active.handle.park()
            except SandboxBrokenError:
                sandbox._broken = True
                self._replace(active.handle)


class Sandbox:
    """One trajectory's sandbox: its files persist across that trajectory's actions.

    Got from ``async with pool.sandbox(trajectory_id) as sbx:``; not built directly.
    """

    def __init__(self, pool: SandboxPool, handle: SandboxHandle, trajectory_id: str) -> None:
        self._pool = pool
        self._handle = handle
        self.trajectory_id = trajectory_id
        self._closed = False
        self._broken = False
        self._lock = anyio.Lock()

    def __repr__(self) -> str:
        return f"<tangram.Sandbox trajectory={self.trajectory_id!r} host={self.host.name!r}>"

    @property
    def host(self) -> Host:
        return self._handle.host

    @property
    def python(self) -> str:
        """The interpreter ``run(code=...)`` uses inside the sandbox, for callers that need
        flags ``code=`` cannot pass (the code grader runs it with ``-I``)."""
        return self._pool.backend.python

    def _check(self) -> None:
        if self._closed:
            raise SandboxClosedError("this sandbox's `async with` block has ended")
        if self._broken:
            raise SandboxBrokenError(
                "this sandbox broke during an earlier action and was replaced; its files are "
                "gone: start the trajectory on a new sandbox"
            )

    async def run(
        self,
        command: str | Sequence[str] | None = None,
        *,
        code: str | None = None,
        cpu: int | float | Elastic = 1,
        # The command's time limit: on expiry the backend kills its process tree and the
        # result says so (``timed_out``). A cancel scope around ``run`` would instead
        # cancel the caller and lose the output, so this is a parameter, as in
        # subprocess.run.
        timeout: float | None = None,  # noqa: ASYNC109
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        kind: str | None = None,
    ) -> RunResult:
        """Run one action: acquire ``cpu`` through the runtime, run, give the cores back.

        ``command`` is a shell line (``str``, run by ``sh -c``) or an argv list; ``code`` is
        Python source run by the sandbox's interpreter. The command sees its core count in
        ``$TANGRAM_CPUS`` and only its granted cores (``os.sched_getaffinity`` / ``nproc``);
        with ``cpu=Elastic(..., resizable=True)`` those change while it runs.

        Actions of one sandbox run one at a time, in call order.

        :raises SandboxBrokenError: the sandbox died; its units went back to the runtime.
        :raises SandboxClosedError: used after its ``async with`` block.
        """
        if (command is None) == (code is None):
            raise SettingTypeError(
                f"give exactly one of `command` and `code` (got command={command!r}, code={code!r})"
            )
        argv: tuple[str, ...]
        if code is not None:
            if not isinstance(code, str):
                raise SettingTypeError(f"`code` must be a string (got {code!r})")
            argv = (self._pool.backend.python, "-c", code)
        elif isinstance(command, str):
            argv = ("/bin/sh", "-c", command)
        elif (
            isinstance(command, Sequence)
            and command
            and all(isinstance(part, str) for part in command)
        ):
            argv = tuple(command)
        else:
            raise SettingTypeError(
                f"`command` must be a string or a list of strings (got {command!r})"
            )
        seconds = (
            self._pool.timeout if timeout is None else _seconds("timeout", timeout, strict=True)
        )
        data = utf8("`stdin`", stdin) if isinstance(stdin, str) else (stdin or b"")
        if not isinstance(data, bytes):
            raise SettingTypeError(f"`stdin` must be bytes or str (got {stdin!r})")
        variables = dict(env or {})
        for key, value in variables.items():
            if not isinstance(key, str) or not isinstance(value, str) or "=" in key:
                raise SettingTypeError(f"`env` must map names to strings (got {key!r}: {value!r})")
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float, Elastic)):
            raise DemandTypeError(
                f"`cpu` must be a number of cores or tangram.Elastic (got {cpu!r})"
            )
        if not isinstance(cpu, Elastic) and not 0 < real(cpu) < math.inf:
            # Before any arithmetic on it: NaN or infinity raised a bare ValueError from
            # rounding it up, and -0.5 was rounded up to a core instead of refused.
            raise InvalidDemandError(f"`cpu` must be a number of cores > 0 (got {cpu!r})")
        _exec_safe(argv, variables)
        async with self._lock:
            self._check()
            return await self._pool._run(
                self, argv, cpu, seconds, data, variables, kind or self._pool.kind
            )

    async def put(self, path: str, data: bytes | str) -> None:
        """Write a file into the sandbox's work dir (creating parent dirs).

        :raises SandboxBrokenError: the sandbox died; the pool replaces it.
        """
        payload = utf8("`data`", data) if isinstance(data, str) else data
        async with self._lock:
            self._check()
            try:
                await self._handle.put_file(_relative(path), payload)
            except SandboxBrokenError:
                self._break()
                raise

    async def get(self, path: str) -> bytes:
        """Read a file from the sandbox's work dir.

        :raises FileNotFoundError: there is no such file.
        :raises SandboxBrokenError: the sandbox died; the pool replaces it.
        """
        async with self._lock:
            self._check()
            try:
                return await self._handle.get_file(_relative(path))
            except SandboxBrokenError:
                self._break()
                raise

    def _break(self) -> None:
        # As a broken run does: later calls fail at once, and the pool replaces it now
        # rather than when the trajectory next runs a command.
        if not self._broken:
            self._broken = True
            self._pool._replace(self._handle)


#: Linux's ``MAX_ARG_STRLEN`` (32 pages of 4 KiB), the terminating NUL included: the
#: longest single argument or ``NAME=value`` an ``execve`` takes.
_MAX_ARG_STRLEN = 32 * 4096
#: Of the whole argument list and environment ``execve`` takes (``ARG_MAX``, a quarter of
#: the stack limit, at least 128 KiB), what a backend's own wrapper may need: bubblewrap's
#: options, the sandbox's own variables.
_WRAPPER_ARGS = 32 << 10


def _exec_safe(argv: tuple[str, ...], env: Mapping[str, str]) -> None:
    """Refuse what no ``execve`` can take, before anything is queued or sent.

    A NUL byte in model-written code cannot reach a process: caught in the sandbox it
    cost a round trip and, before the runner answered cancels while idle, the sandbox.

    A lone surrogate (``"\\ud800"``, which JSON may carry) cannot be encoded for one: it
    raised a bare ``UnicodeEncodeError`` from the spawn, after the cores were granted.

    One string longer than ``execve`` takes (``MAX_ARG_STRLEN``, 128 KiB: valid code
    over it passed as ``code=``) failed the spawn with ``E2BIG``, answered exit 126: the
    code's own verdict for a program that never ran.

    :raises InvalidSettingError: a NUL byte or text that is not UTF-8 in an argument or the
        environment, an empty name, or an argument or variable too long for ``execve``.
    """
    for part in argv:
        if "\0" in part:
            raise InvalidSettingError(
                f"the command or code contains a NUL byte (got {part[:80]!r})"
            )
        if len(utf8("the command or code", part)) >= _MAX_ARG_STRLEN:
            raise InvalidSettingError(
                f"an argument of the command or the code is {len(part.encode())} bytes, over "
                f"the {_MAX_ARG_STRLEN - 1} one process argument can hold: write it to a "
                f"file with `put` and run the file (got {part[:80]!r}...)"
            )
    for key, value in env.items():
        if not key or "\0" in key or "\0" in value:
            raise InvalidSettingError(
                f"`env` names must be non-empty, without NUL bytes (got {key!r})"
            )
        if len(utf8("`env`", key + value)) + 1 >= _MAX_ARG_STRLEN:
            raise InvalidSettingError(
                f"`env[{key[:80]!r}]` is over the {_MAX_ARG_STRLEN - 1} bytes one process "
                f"variable can hold"
            )
    total = sum(len(part.encode()) + 1 + 8 for part in argv)  # each string and its pointer
    total += sum(len(key.encode()) + len(value.encode()) + 2 + 8 for key, value in env.items())
    room = max(os.sysconf("SC_ARG_MAX"), _MAX_ARG_STRLEN) - _WRAPPER_ARGS
    if total > room:
        # Under a small stack limit code just under one argument's limit still failed the
        # spawn with E2BIG, answered exit 126: the code's verdict for a program never run.
        raise InvalidSettingError(
            f"the command, its code and `env` take {total} bytes, over the {room} one process "
            "start can take here: write long code to a file with `put` and run the file"
        )


def utf8(name: str, text: str) -> bytes:
    """``text`` as UTF-8, or a typed error naming where the lone surrogate is."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSettingError(
            f"{name} is not UTF-8 text (a lone surrogate "
            f"{text[exc.start : exc.end]!r} at character {exc.start})"
        ) from None


def _relative(path: str) -> str:
    """A work-dir-relative path that cannot climb out of the work dir."""
    if not isinstance(path, str) or not path:
        raise SettingTypeError(f"`path` must be a non-empty string (got {path!r})")
    if "\0" in path:  # the caller's: the OS's own ValueError read as tangram's failure
        raise InvalidSettingError(f"`path` contains a NUL byte (got {path[:80]!r})")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or os.path.isabs(path):
        raise InvalidSettingError(
            f"`path` must be relative to the work dir, without '..' (got {path!r})"
        )
    return "/".join(parts)
