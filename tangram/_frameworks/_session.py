"""One tangram scheduler per process and event loop, started on first use.

verl and OpenRLHF build tools, reward managers and agent executors themselves, in worker
processes tangram never sees start, and call them from whichever event loop is running
there (verl's agent-loop workers, its reward loop, vLLM's engine loop, worker threads with
loops of their own). So the adapters cannot be handed a runtime: each call asks
:func:`session` for one. The first call on a loop starts, *in a task of that loop*, the
scheduler the config names plus the pools it declares (sandboxes, GPU services, API
quotas); later calls on the same loop reuse them. A new loop gets its own: a runtime is
bound to the loop it was entered in, and using it from another would race its state.

The scheduler lives in its own task (not the caller's) because a runtime's ``async with``
must end in the task that entered it, and the first caller, a single tool call, ends long
before the process does. It stops when its loop's ``asyncio.run`` cancels leftover
tasks, at interpreter exit for loops still running in other threads, or at :func:`aclose`.

Where limits hold: with ``mode = "shared"`` (the default) every loop of every process of
a job reaches the job's one scheduler, and sandboxes and GPU services come from the host
agent of the node the scheduler places them on (see :mod:`._config`); this loop keeps
only a proxy. In a Ray job that scheduler is a Ray actor; outside Ray it is a process of
the job on this node, reached on a Unix socket. With ``mode = "local"`` each process (and
each loop in it) has its own scheduler, so ``cpu = 8`` means 8 per process. ``mode =
"ray"`` shares the named actor the driver created.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import importlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import attrs

from .._runtime._group import Gate
from .._runtime._run import _enter_current, _exit_current
from .._sandbox._backend import SandboxBackend, backend_class
from .._sandbox._pool import SandboxPool
from ..errors import InvalidSettingError, SettingTypeError
from ._config import (
    ENV_VAR,
    Config,
    ConfigError,
    GpuConfig,
    GpuServiceConfig,
    SandboxConfig,
    load,
)
from ._open import check_shared, open_scheduler, open_shared

__all__ = [
    "Resources",
    "aclose",
    "check",
    "config_for",
    "load_object",
    "portal_call",
    "release_later",
    "session",
]


class JobSandboxes:
    """The job's sandboxes in shared mode: ``sandbox(name)`` as on a :class:`SandboxPool`.

    Each block is a :class:`tangram.ray.RemoteSandbox` on the host agent the scheduler
    places it on, with the ``run``/``put``/``get`` an adapter calls on a local sandbox,
    so adapters need not know which mode they run in.
    """

    def __init__(self, remote: Any) -> None:
        self._remote = remote

    def __repr__(self) -> str:
        return f"<tangram job sandboxes via {self._remote!r}>"

    def sandbox(self, trajectory_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        block: contextlib.AbstractAsyncContextManager[Any] = self._remote.sandbox(trajectory_id)
        return block


class JobGpu:
    """The job's GPU services in shared mode: ``use(name)`` as on a :class:`GpuPool`.

    A block is a :class:`tangram.ray.RemoteService` on a node's agent, where the service
    is loaded once for every worker of that node.
    """

    def __init__(self, remote: Any) -> None:
        self._remote = remote

    def __repr__(self) -> str:
        return f"<tangram job GPU services via {self._remote!r}>"

    def use(self, name: str) -> contextlib.AbstractAsyncContextManager[Any]:
        block: contextlib.AbstractAsyncContextManager[Any] = self._remote.service(name)
        return block


@attrs.frozen
class Resources:
    """What one loop's scheduler serves: the scheduler and the pools the config declared.

    In shared mode, ``sandboxes`` and ``gpu`` are :class:`JobSandboxes` and
    :class:`JobGpu`: the same calls (``sandbox(name)``, ``use(name)``) reach the job's
    host agents instead of pools of this process.
    """

    scheduler: Any
    config: Config
    sandboxes: SandboxPool | JobSandboxes | None = None
    gpu: Any = None  # tangram.gpu.GpuPool; typed loosely so torch stays an optional import
    quotas: Mapping[str, Any] = attrs.field(factory=dict)
    job: bool = False  # the scheduler is the job's (shared mode)
    gates: dict[float, Gate] = attrs.field(factory=dict)  # this loop's, per wait
    # step_logs' running totals, per set of kinds: kept here, so they go with the session
    # (a cache keyed by the scheduler, whose values held it, kept every one alive).
    steps: dict[tuple[str, ...], Any] = attrs.field(factory=dict)

    def group(
        self, key: str, wait: float
    ) -> contextlib.AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """One sample of group ``key`` (:mod:`tangram._runtime._group`): in shared mode the
        job's gate, so a group's samples wait for each other whichever worker holds
        them; else this loop's."""
        if self.job:
            block: contextlib.AbstractAsyncContextManager[Callable[[], Awaitable[None]]] = (
                self.scheduler.group(key, wait)
            )
            return block
        gate = self.gates.get(wait)
        if gate is None:
            gate = self.gates[wait] = Gate(wait)
        return gate.sample(key)

    def sandbox_pool(self) -> SandboxPool:
        if self.sandboxes is None:
            raise ConfigError(
                f"{self.config.source or 'the tangram config'} has no [sandbox] table"
            )
        # Typed as the local pool: what adapters call on it (``sandbox(name)`` and, on the
        # sandbox it yields, run/put/get/python) a JobSandboxes block has too.
        return cast(SandboxPool, self.sandboxes)

    def gpu_pool(self) -> Any:
        if self.gpu is None:
            raise ConfigError(f"{self.config.source or 'the tangram config'} has no [gpu] table")
        return self.gpu

    def quota(self, name: str) -> Any:
        try:
            return self.quotas[name]
        except KeyError:
            raise ConfigError(
                f"{self.config.source or 'the tangram config'} has no [quota.{name}] "
                f"(have {sorted(self.quotas)})"
            ) from None


class _Hosted:
    """The scheduler task of one (config, loop) and the way to stop it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ready: asyncio.Future[Resources] = loop.create_future()
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


_lock = threading.Lock()
_configs: dict[str, Config] = {}
_hosted: dict[str, weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hosted]] = {}


def _key(path: str | os.PathLike[str] | None) -> str:
    if path is None:
        named = os.environ.get(ENV_VAR)
        if not named:
            raise ConfigError(
                f"no tangram config: set ${ENV_VAR} or name one in the "
                "adapter's settings (`tangram_config`)"
            )
        path = named
    return str(Path(path).resolve())


def config_for(path: str | os.PathLike[str] | None = None) -> Config:
    """The config at ``path`` (default ``$TANGRAM_CONFIG``), read once per process."""
    key = _key(path)
    with _lock:
        found = _configs.get(key)
    if found is None:
        found = load(key)
        with _lock:
            found = _configs.setdefault(key, found)
    return found


def check(path: str | os.PathLike[str] | None = None, *, needs: tuple[str, ...] = ()) -> Config:
    """Load the config now and check that it declares what the caller will use.

    Adapters call this where the framework builds them (a tool's ``__init__``, a reward
    manager's, an agent executor's), so a missing ``$TANGRAM_CONFIG``, a path absent on
    this node or a missing table fails the worker at start, not every call after it.
    ``needs`` names tables: ``"sandbox"``, ``"gpu"``, ``"quota.NAME"``. The pools
    themselves are built and checked too (a bad ``[sandbox]`` option), without starting.
    In shared mode the job's scheduler and this node's agent are
    reached too (found or started), so a worker they refuse fails here.

    :raises ConfigError: no config, an unreadable or invalid one, a table missing, or a
        job's scheduler that refuses this worker.
    :raises InvalidSettingError: ``needs`` names what is not a table (``SettingTypeError``
        for a plain string, whose letters it would otherwise check one by one).
    """
    if isinstance(needs, str) or not all(isinstance(need, str) for need in needs):
        raise SettingTypeError(f"`needs` must be a tuple of table names (got {needs!r})")
    for need in needs:
        quota = need.startswith("quota.") and need != "quota."
        if need not in ("sandbox", "gpu") and not quota:
            raise InvalidSettingError(
                f"`needs` names 'sandbox', 'gpu' or 'quota.NAME' tables (got {need!r})"
            )
    config = config_for(path)
    where = config.source or "the tangram config"
    for need in needs:
        if need == "sandbox" and config.sandbox is None:
            raise ConfigError(f"{where} has no [sandbox] table")
        if need == "gpu" and config.gpu is None:
            raise ConfigError(f"{where} has no [gpu] table")
        if need.startswith("quota."):
            name = need.partition(".")[2]
            if name not in {q.name for q in config.quotas}:
                raise ConfigError(f"{where} has no [quota.{name}] table")
    if config.sandbox is not None:
        _sandbox_pool(config.sandbox)  # a bad backend option fails here, not at a call
    check_shared(config)
    if config.source in _reached:
        return config  # a worker builds several tools from one file
    if config.mode == "shared":
        _reach_job(config)
    elif config.sandbox is not None:
        _start_backend(config)
    _reached.add(config.source)
    return config


_reached: set[str | None] = set()


def _in_thread(config: Config, reach: Callable[[], Any], why: str) -> None:
    """Run the coroutine function ``reach`` on a loop of its own in a thread of its own
    (a constructor may be called on a thread whose loop is running).

    :raises ConfigError: what ``reach`` raised, as one, or saying ``why`` it failed.
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(reach())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="tangram-reach", daemon=True)
    thread.start()
    thread.join()
    if not failure:
        return
    exc = failure[0]
    if isinstance(exc, ConfigError):
        raise exc
    where = config.source or "the tangram config"
    raise ConfigError(f"{where}: {why}: {type(exc).__name__}: {exc}") from exc


def _start_backend(config: Config) -> None:
    """Start the ``[sandbox]`` backend once and close it again (a per-process scheduler).

    The pools of a per-process scheduler start with its first call; a backend that
    cannot start on this machine (no Docker daemon, bubblewrap asked for and missing)
    would fail every call. Starting it here fails the worker where the framework builds
    it instead. Nothing is created: a backend's start reaches its daemon or surveys the
    host's isolation, and leaves no sandbox.

    :raises ConfigError: the backend cannot start here.
    """
    assert config.sandbox is not None
    sandbox = config.sandbox

    async def reach() -> None:
        backend = _backend(sandbox)
        try:
            await backend.start()
        finally:
            await backend.aclose()

    _in_thread(config, reach, f"the [sandbox] backend {sandbox.backend!r} cannot start here")


def _reach_job(config: Config) -> None:
    """Find or start the job's scheduler and this node's agent, then let go of them.

    Shared mode's failures that no file check can see (a worker whose config states
    another capacity than the job's scheduler, an agent whose sandbox backend cannot
    start here, a scheduler actor Ray cannot place) then fail the worker where the
    framework builds it, not its first tool call. It runs in a thread of its own with a
    loop of its own: a constructor may be called on a thread whose loop is running.

    :raises ConfigError: the job's scheduler or this node's agent refused or failed.
    """

    async def reach() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await _open(config, stack)

    _in_thread(config, reach, "the job's shared scheduler cannot serve this worker")


def load_object(spec: str) -> Any:
    """``"package.module:name"`` -> the object (a config names factories this way)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"expected 'module:name' (got {spec!r})")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {spec!r}: {exc}") from exc


async def _resources(path: str | os.PathLike[str] | None) -> Resources:
    key = _key(path)
    config = config_for(key)
    loop = asyncio.get_running_loop()
    with _lock:
        per_loop = _hosted.setdefault(key, weakref.WeakKeyDictionary())
        hosted = per_loop.get(loop)
        if hosted is None or (hosted.task is not None and hosted.task.done()):
            hosted = _Hosted(loop)
            per_loop[loop] = hosted
            hosted.task = loop.create_task(_host(config, hosted), name=f"tangram:{key}")
            # The entry holds its loop (the task, the future), so the weak key alone
            # never let a finished loop go, nor its stopped scheduler and pools: the
            # entry leaves when its task ends (aclose, or the loop cancelling it).
            hosted.task.add_done_callback(functools.partial(_forget, per_loop, loop, hosted))
    try:
        # Shielded: a caller cancelled while the scheduler starts must not cancel the start
        # for the other callers waiting on it.
        return await asyncio.shield(hosted.ready)
    except Exception:
        with _lock:
            if per_loop.get(loop) is hosted:
                del per_loop[loop]  # a failed start is retried by the next call
        raise


def _forget(
    per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hosted],
    loop: asyncio.AbstractEventLoop,
    hosted: _Hosted,
    task: asyncio.Task[None],
) -> None:
    with _lock:
        if per_loop.get(loop) is hosted:
            del per_loop[loop]


async def _host(config: Config, hosted: _Hosted) -> None:
    try:
        async with contextlib.AsyncExitStack() as stack:
            resources = await _open(config, stack)
            hosted.ready.set_result(resources)
            await hosted.stop.wait()
    except Exception as exc:
        if hosted.ready.done():
            raise
        hosted.ready.set_exception(exc)  # every waiting caller sees why it did not start
    except BaseException:
        if not hosted.ready.done():
            hosted.ready.cancel()
        raise


async def _open(config: Config, stack: contextlib.AsyncExitStack) -> Resources:
    quotas = _quotas(config)  # each table checked before anything opens
    if config.mode == "shared":
        return await _open_on_job(config, stack)
    capacity: dict[str, object] = {}
    sandboxes = None
    if config.sandbox is not None:
        sandboxes = await stack.enter_async_context(_sandbox_pool(config.sandbox))
        capacity.update(sandboxes.capacity())
    gpu = None
    if config.gpu is not None:
        gpu = await stack.enter_async_context(_gpu_pool(config.gpu))
        capacity.update(gpu.capacity())
    # A process's own quotas (local), or the creator's statement of a named actor's kinds
    # (ray: a worker looking it up states none, so AIMD's changes to their rates are never
    # "another capacity").
    for quota in quotas.values():
        capacity.update(quota.capacity())
    scheduler = await stack.enter_async_context(open_scheduler(config, capacity=capacity))
    if config.mode == "ray":  # a named actor's proxy: its quotas are the actor's too
        quotas = await _job_quotas(scheduler, config)
    return Resources(scheduler, config, sandboxes, gpu, quotas)


def _quotas(config: Config) -> dict[str, Any]:
    """The config's API quotas, built here: each a Quota of this process's (local mode),
    or built only to check its table where a scheduler of the job runs it."""
    quotas: dict[str, Any] = {}
    if config.quotas:
        try:
            from .._quota._keys import ApiKey
            from .._quota._quota import Quota
        except ModuleNotFoundError as exc:
            if exc.name not in {"httpx", "stamina"}:
                raise
            # The hint ``import tangram.quota`` gives: the config asked for the api extra.
            raise ImportError(
                "tangram.quota needs httpx and stamina: pip install 'tangram[api]'"
            ) from exc

        for q in config.quotas:
            try:
                keys = [ApiKey(**k) for k in q.keys]
                quotas[q.name] = Quota(keys, name=q.name, **q.options)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"[quota.{q.name}]: {exc}") from exc
    return quotas


async def _job_quotas(remote: Any, config: Config) -> dict[str, Any]:
    """The config's quotas as the job scheduler's: it runs each, once for the job, and
    sends every worker's requests (:mod:`tangram._shared._quotas`).

    The scheduler adds their kinds when it builds each quota, and its AIMD changes their
    rates: it reports them as configured (what a later worker states, in ``ray`` mode; in
    shared mode workers state only ``[capacity]``). Built at the scheduler now, not at a
    first request: a worker stating other keys fails here, and the quotas' kinds are the
    job's from the start.
    """
    if not config.quotas:
        return {}
    from .._shared._quotas import JobQuota

    quotas = {q.name: JobQuota(remote, q.name, q.keys, q.options) for q in config.quotas}
    for name, quota in quotas.items():
        try:
            await quota._open()
        except InvalidSettingError as exc:
            raise ConfigError(f"[quota.{name}]: {exc}") from exc
    await remote._refresh()
    return quotas


async def _open_on_job(config: Config, stack: contextlib.AsyncExitStack) -> Resources:
    """Shared mode: a proxy on the job's scheduler, pools on the node agents.

    The pools are described, not built, here: this node's agent builds them on first
    use (whichever worker of the node asks first), so sandboxes and services exist once
    per node, and every worker's blocks go through the agent the scheduler picks.
    """
    agent: dict[str, Any] = {}
    if config.sandbox is not None or config.gpu is not None:
        sandbox = config.sandbox if config.sandbox is not None else SandboxConfig(warm=0)
        agent.update(
            backend=functools.partial(_backend, sandbox),
            warm=sandbox.warm,
            timeout=sandbox.timeout,
        )
    if config.gpu is not None:
        agent["services"] = [functools.partial(_torch_service, s) for s in config.gpu.services]
        agent["devices"] = _devices(config.gpu) or None
    remote = await stack.enter_async_context(
        open_shared(config, capacity=dict(config.capacity), **agent)
    )
    quotas = await _job_quotas(remote, config)
    return Resources(
        remote,
        config,
        JobSandboxes(remote) if config.sandbox is not None else None,
        JobGpu(remote) if config.gpu is not None else None,
        quotas,
        job=True,
    )


def _backend(sandbox: SandboxConfig) -> SandboxBackend:
    """The ``[sandbox]`` backend; a module-level function, so an agent can build it remotely.

    The registry finds the class by name (importing its module only now), and the class
    reads its own options: the config file's keys are each backend's, not this module's.
    """
    options = dict(sandbox.options)
    if sandbox.image is not None:
        options["image"] = sandbox.image
    try:
        return backend_class(sandbox.backend).from_options(options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[sandbox]: {exc}") from exc


def _sandbox_pool(sandbox: SandboxConfig) -> SandboxPool:
    backend = _backend(sandbox)
    extra: dict[str, Any] = {} if sandbox.timeout is None else {"timeout": sandbox.timeout}
    return SandboxPool(backend, warm=sandbox.warm, **extra)


def _gpu_pool(gpu_config: GpuConfig) -> Any:
    from .._gpu._pool import GpuPool

    services = [_torch_service(s) for s in gpu_config.services]
    return GpuPool(services, devices=_devices(gpu_config) or None)


def _torch_service(service: GpuServiceConfig) -> Any:
    """One ``[[gpu.services]]`` entry as a TorchService (built where it will be served)."""
    from .._gpu._torch import TorchService

    try:
        return TorchService(
            service.name, load_object(service.factory), memory=service.memory, **service.options
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[gpu] {service.name!r}: {exc}") from exc


def _devices(gpu_config: GpuConfig) -> list[Any]:
    from .._gpu._devices import Device

    try:
        return [Device(name, memory=memory) for name, memory in gpu_config.devices.items()]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[gpu]: {exc}") from exc


@contextlib.asynccontextmanager
async def session(path: str | os.PathLike[str] | None = None) -> AsyncIterator[Resources]:
    """This loop's scheduler and pools, with the scheduler current inside the block.

    ``tangram.acquire`` (and pools that acquire from the current runtime) reach it, so a
    framework tool's own code can use tangram without being handed anything.

    :raises ConfigError: no config, or one that cannot start.
    """
    resources = await _resources(path)
    token = _enter_current(resources.scheduler)
    try:
        yield resources
    finally:
        _exit_current(token)


async def aclose(path: str | os.PathLike[str] | None = None) -> None:
    """Stop this loop's scheduler for ``path`` (all configs when ``None``) and wait for it."""
    loop = asyncio.get_running_loop()
    keys = [_key(path)] if path is not None else None
    with _lock:
        targets = [
            per_loop.pop(loop)
            for key, per_loop in _hosted.items()
            if (keys is None or key in keys) and loop in per_loop
        ]
    for hosted in targets:
        hosted.stop.set()
        if hosted.task is not None:
            with contextlib.suppress(Exception):
                await hosted.task


def _stop_at_exit() -> None:
    """Stop schedulers whose loops still run in other threads (their pools' sandboxes)."""
    with _lock:
        everything = [h for per_loop in _hosted.values() for h in list(per_loop.values())]
    waits = []
    for hosted in everything:
        loop = hosted.loop
        if loop.is_closed() or not loop.is_running() or hosted.task is None:
            continue

        async def stop(h: _Hosted = hosted) -> None:
            h.stop.set()
            if h.task is not None:
                with contextlib.suppress(BaseException):
                    await h.task

        with contextlib.suppress(RuntimeError):
            waits.append(asyncio.run_coroutine_threadsafe(stop(), loop))
    if waits:
        concurrent.futures.wait(waits, timeout=10)


atexit.register(_stop_at_exit)


def release_later(loop: asyncio.AbstractEventLoop, block: Any) -> None:
    """Leave a sandbox's ``async with`` block from a finalizer, on the loop that entered it.

    For sandboxes bound to an object the framework owns and drops without telling anyone
    (an episode whose ``execute`` failed, a verl trajectory's state): when it is collected
    the sandbox goes back, whichever thread the collector runs in.
    """
    if loop.is_closed():
        return

    def start() -> None:
        loop.create_task(block.__aexit__(None, None, None))

    try:
        loop.call_soon_threadsafe(start)
    except RuntimeError:  # closed between the check and the call
        return


# -- callers without a loop ----------------------------------------------------------------

_portal_lock = threading.Lock()
_portal: Any = None
_portal_cm: Any = None


def portal_call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``await fn(*args)`` on this process's tangram loop thread, from a plain thread.

    For synchronous hooks a framework calls from a worker thread (OpenRLHF's
    ``reward_func``): blocking that thread is what the framework expects, and the
    scheduler lives on one loop of its own, started on first use and stopped at exit.
    Never call it from a running event loop: it would block that loop.
    """
    global _portal, _portal_cm
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("portal_call blocks: call it from a thread without a running loop")
    with _portal_lock:
        if _portal is None:
            from anyio.from_thread import start_blocking_portal

            _portal_cm = start_blocking_portal("asyncio")
            _portal = _portal_cm.__enter__()
            atexit.register(_close_portal)
    return _portal.call(fn, *args)


def _close_portal() -> None:
    global _portal, _portal_cm
    with _portal_lock:
        portal, cm = _portal, _portal_cm
        _portal = _portal_cm = None
    if portal is None:
        return
    with contextlib.suppress(Exception):
        portal.call(aclose)
    cm.__exit__(None, None, None)
