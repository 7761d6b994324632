"""CPU sandboxes scheduled per action: the pool, the sandbox rollout code sees, and the seam.

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
Docker, CPU affinity for the embedded local backend) behind :class:`SandboxBackend`.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import logging
import math
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
import attrs

from .._core._demand import Elastic
from .._runtime._lease import Lease
from .._runtime._run import Runtime, current_runtime
from ..errors import (
    InvalidCapacityError,
    SandboxBrokenError,
    SandboxClosedError,
    SandboxError,
)

__all__ = [
    "DEFAULT_OUTPUT_LIMIT",
    "DEFAULT_TIMEOUT",
    "CoreSet",
    "ExecRequest",
    "ExecResult",
    "Host",
    "RunResult",
    "Sandbox",
    "SandboxBackend",
    "SandboxHandle",
    "SandboxPool",
    "numa_nodes",
]

logger = logging.getLogger("tangram.sandbox")

DEFAULT_TIMEOUT = 60.0
"""Seconds an action may run before its process tree is killed."""
DEFAULT_OUTPUT_LIMIT = 1 << 20
"""Bytes of stdout and of stderr kept per action; the rest is read and dropped."""
CPUS_ENV = "TANGRAM_CPUS"
"""Environment variable that tells a command how many cores it was granted."""


# -- value objects --------------------------------------------------------------------


@attrs.frozen
class Host:
    """One machine sandboxes run on: its cores and the runtime resource that counts them.

    ``resource`` is the runtime capacity kind actions on this host acquire (``"cpu"`` for
    a single host; ``"cpu@name"`` per host when a pool spans several, because an
    action's cores must all come from the machine its sandbox lives on).
    """

    name: str
    cores: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...] = ()
    resource: str = "cpu"


@attrs.frozen
class ExecRequest:
    """What a backend runs for one action (already validated by the pool)."""

    argv: tuple[str, ...]
    stdin: bytes
    env: Mapping[str, str]
    timeout: float
    output_limit: int
    cores: tuple[int, ...]
    quota: float


@attrs.frozen
class ExecResult:
    """What a backend reports for one action."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    signal: int | None = None
    cpu_seconds: float = math.nan
    leftovers_killed: int = 0


@attrs.frozen
class RunResult:
    """The outcome of ``await sbx.run(...)``.

    A command that fails, times out or is killed is a *result*, not an exception: rollout
    code turns it into an observation for the model. Exceptions are kept for the
    sandbox itself failing (:class:`SandboxBrokenError`).

    ``cores`` are the core ids granted when the action started and ``units`` their count;
    ``max_units`` the most it held after resizes. ``queue_seconds`` is the wait for the
    grant, ``overhead_seconds`` applying it, ``exec_seconds`` the run itself.
    ``cpu_seconds`` is CPU time the action used as its cgroup (or process tree) accounted
    it, NaN where the backend cannot tell.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    signal: int | None
    cores: tuple[int, ...]
    units: int
    max_units: int
    resizes: int
    queue_seconds: float
    overhead_seconds: float
    exec_seconds: float
    cpu_seconds: float
    leftovers_killed: int

    @property
    def ok(self) -> bool:
        """Exited with status 0 within its time."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        """Some output was dropped at the output limit."""
        return self.stdout_truncated or self.stderr_truncated


# -- the backend seam -----------------------------------------------------------------


class SandboxHandle(abc.ABC):
    """One live sandbox in a backend: a container, or a work dir for the local backend.

    The pool calls :meth:`apply` before and during an action, :meth:`park` after it, and
    never runs two actions on one handle at once.
    """

    host: Host

    @abc.abstractmethod
    async def execute(self, request: ExecRequest) -> ExecResult:
        """Run one action to completion (or its timeout) with ``request.cores``.

        :raises SandboxBrokenError: the sandbox died; the pool will not reuse it.
        """

    @abc.abstractmethod
    async def apply(self, cores: tuple[int, ...], quota: float) -> None:
        """Pin the sandbox to ``cores`` with ``quota`` cores' worth of CPU time.

        Called at an action's start (before :meth:`execute` or concurrently with its
        start) and on every resize while it runs.
        """

    @abc.abstractmethod
    async def park(self) -> None:
        """Take the cores back after an action: the sandbox keeps its state, no CPU."""

    @abc.abstractmethod
    async def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (relative to the work dir)."""

    @abc.abstractmethod
    async def get_file(self, path: str) -> bytes:
        """Read ``path`` (relative to the work dir).

        :raises FileNotFoundError: there is no such file.
        """

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Remove the sandbox and everything in it; safe to call twice."""


class SandboxBackend(abc.ABC):
    """Where sandboxes live. One required method, :meth:`create`, plus ``aclose``.

    ``python`` is the interpreter ``sbx.run(code=...)`` uses inside the sandbox.
    """

    python: str = "python3"

    @abc.abstractmethod
    async def start(self) -> Sequence[Host]:
        """Connect (once) and return the hosts this backend places sandboxes on."""

    @abc.abstractmethod
    async def create(self, host: Host) -> SandboxHandle:
        """Create one parked sandbox on ``host``."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections; sandboxes were destroyed by the pool before this."""


# -- core choice ----------------------------------------------------------------------


def numa_nodes(cores: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Group ``cores`` by the NUMA node Linux reports for them (one group if unknown)."""
    wanted = set(cores)
    groups: list[tuple[int, ...]] = []
    base = Path("/sys/devices/system/node")
    with contextlib.suppress(OSError):
        for node in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            listed = parse_cpu_list((node / "cpulist").read_text())
            group = tuple(c for c in listed if c in wanted)
            if group:
                groups.append(group)
    seen = {c for g in groups for c in g}
    rest = tuple(c for c in cores if c not in seen)
    if rest:
        groups.append(rest)
    return tuple(groups)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def format_cpu_list(cores: Sequence[int]) -> str:
    """The inverse of :func:`parse_cpu_list`, with ranges folded."""
    parts: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


class CoreSet:
    """Which core ids are free on one host, and a choice that keeps an action together.

    The runtime guarantees the *count* of cores lent never exceeds the capacity; this
    picks the ids. A new action goes to the NUMA node whose free cores fit it most
    tightly (best fit keeps big free blocks for big actions), taking neighbouring ids;
    a growing action takes free cores of its own node first, nearest first; a shrinking
    one gives back the cores furthest from its first core.
    """

    def __init__(self, nodes: Sequence[Sequence[int]]) -> None:
        self._node_of = {core: index for index, node in enumerate(nodes) for core in node}
        self._nodes = [tuple(node) for node in nodes]
        self._free = set(self._node_of)

    @property
    def free(self) -> frozenset[int]:
        return frozenset(self._free)

    def __len__(self) -> int:
        return len(self._node_of)

    def take(self, count: int, near: Sequence[int] = ()) -> tuple[int, ...]:
        """Take ``count`` free cores, next to ``near`` when given.

        :raises InvalidCapacityError: fewer than ``count`` cores are free, which means
            the runtime's capacity for this host is larger than the cores it has.
        """
        if count > len(self._free):
            raise InvalidCapacityError(
                f"asked for {count} cores but only {len(self._free)} of {len(self)} are free: "
                "the runtime's cpu capacity exceeds the cores the sandbox pool owns"
            )
        chosen: list[int] = []
        if near:
            anchor = near[0]
            home = self._node_of[anchor]
            order = sorted(self._free, key=lambda c: (self._node_of[c] != home, abs(c - anchor), c))
            chosen = order[:count]
        else:
            fits = [
                (len(free), index, free)
                for index, node in enumerate(self._nodes)
                if len(free := [c for c in node if c in self._free]) >= count
            ]
            if fits:
                _, _, free = min(fits, key=lambda item: (item[0], item[1]))
                chosen = _tightest_window(free, count)
            else:  # spans nodes: fill the emptiest nodes first
                by_node = sorted(
                    ([c for c in node if c in self._free] for node in self._nodes),
                    key=len,
                    reverse=True,
                )
                for free in by_node:
                    chosen.extend(free[: count - len(chosen)])
                    if len(chosen) == count:
                        break
        self._free.difference_update(chosen)
        return tuple(chosen)

    def give(self, cores: Sequence[int]) -> None:
        """Return ``cores``; returning a core that is free or unknown is a bug."""
        for core in cores:
            if core not in self._node_of or core in self._free:
                raise RuntimeError(f"core {core} returned twice or never lent")
        self._free.update(cores)

    def resize(self, cores: tuple[int, ...], count: int) -> tuple[int, ...]:
        """Grow or shrink a held set to ``count`` cores, keeping the ones it had."""
        if count == len(cores):
            return cores
        if count < len(cores):
            anchor = cores[0]
            keep = sorted(cores, key=lambda c: (abs(c - anchor), c))[:count]
            drop = [c for c in cores if c not in keep]
            self.give(drop)
            return tuple(c for c in cores if c in keep)
        extra = self.take(count - len(cores), near=cores)
        return cores + extra


def _tightest_window(free: list[int], count: int) -> list[int]:
    """The ``count`` free cores spanning the smallest id range (neighbours share caches)."""
    ordered = sorted(free)
    best = min(range(len(ordered) - count + 1), key=lambda i: ordered[i + count - 1] - ordered[i])
    return ordered[best : best + count]


# -- the pool -------------------------------------------------------------------------


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Active:
    """One running action: its lease, its sandbox and the core ids it holds now."""

    lease: Lease
    handle: SandboxHandle
    resource: str
    cores: tuple[int, ...] = ()
    quota: float = 0.0
    max_units: int = 0
    error: SandboxBrokenError | None = None


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
        runtime: Runtime | None = None,
        warm: int = 0,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        timeout: float = DEFAULT_TIMEOUT,
        kind: str = "sandbox",
    ) -> None:
        if backend is not None and not isinstance(backend, SandboxBackend):
            raise TypeError(f"`backend` must be a tangram.SandboxBackend (got {backend!r})")
        if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
            raise ValueError(f"`warm` must be a whole number >= 0 (got {warm!r})")
        if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 0:
            raise ValueError(f"`output_limit` must be a whole number >= 0 (got {output_limit!r})")
        _check_timeout(timeout)
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
            raise TypeError(f"`trajectory_id` must be a string (got {trajectory_id!r})")
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
        except BaseException:
            state.sandboxes -= 1
            raise
        self._live.add(handle)
        return handle

    async def _destroy(self, handle: SandboxHandle) -> None:
        if handle not in self._live:
            return
        self._live.discard(handle)
        state = self._hosts.get(handle.host.name)
        if state is not None:
            state.sandboxes -= 1
        try:
            await handle.destroy()
        except Exception:
            logger.exception("could not destroy sandbox %r", handle)

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
        async with runtime.acquire(
            {resource: cpu}, kind=kind, trajectory=sandbox.trajectory_id
        ) as lease:
            active = _Active(lease, handle, resource)
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
                if active.lease.action.demand.elastic is not None:
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


async def default_backend() -> SandboxBackend:
    """Docker when it is usable here, else the embedded local backend (logged either way)."""
    from ._local import LocalBackend

    try:
        from ._docker import DockerBackend, docker_usable

        if await docker_usable():
            logger.info("sandbox pool: using the Docker backend")
            return DockerBackend()
    except ImportError:
        pass
    logger.info("sandbox pool: Docker is not usable here; using the local backend")
    return LocalBackend()


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"`timeout` must be a number of seconds (got {timeout!r})")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"`timeout` must be > 0 and finite seconds (got {timeout!r})")
    return float(timeout)


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
            raise TypeError("give exactly one of `command` and `code`")
        argv: tuple[str, ...]
        if code is not None:
            if not isinstance(code, str):
                raise TypeError(f"`code` must be a string (got {code!r})")
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
            raise TypeError(f"`command` must be a string or a list of strings (got {command!r})")
        seconds = self._pool.timeout if timeout is None else _check_timeout(timeout)
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        if not isinstance(data, bytes):
            raise TypeError(f"`stdin` must be bytes or str (got {stdin!r})")
        variables = dict(env or {})
        for key, value in variables.items():
            if not isinstance(key, str) or not isinstance(value, str) or "=" in key:
                raise TypeError(f"`env` must map names to strings (got {key!r}: {value!r})")
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float, Elastic)):
            raise TypeError(f"`cpu` must be a number of cores or tangram.Elastic (got {cpu!r})")
        async with self._lock:
            self._check()
            return await self._pool._run(
                self, argv, cpu, seconds, data, variables, kind or self._pool.kind
            )

    async def put(self, path: str, data: bytes | str) -> None:
        """Write a file into the sandbox's work dir (creating parent dirs)."""
        payload = data.encode() if isinstance(data, str) else data
        async with self._lock:
            self._check()
            await self._handle.put_file(_relative(path), payload)

    async def get(self, path: str) -> bytes:
        """Read a file from the sandbox's work dir.

        :raises FileNotFoundError: there is no such file.
        """
        async with self._lock:
            self._check()
            return await self._handle.get_file(_relative(path))


def _relative(path: str) -> str:
    """A work-dir-relative path that cannot climb out of the work dir."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"`path` must be a non-empty string (got {path!r})")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or os.path.isabs(path):
        raise ValueError(f"`path` must be relative to the work dir, without '..' (got {path!r})")
    return "/".join(parts)
