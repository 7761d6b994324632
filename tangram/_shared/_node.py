"""One scheduler per job on a node without Ray: a process of its own on a Unix socket.

A job launched without Ray (torchrun, multiprocessing, a shell loop starting workers)
still shares its node's cores, devices and quotas among its processes. The first worker
to ask starts the job's scheduler process; every worker, that one included, reaches it
on a Unix socket named after the job (:func:`socket_path`) through the same proxy as on
Ray (:mod:`._socket` is the transport). The process holds the job's scheduler and the
node's host agent, which owns the sandboxes and GPU services, so core ids are chosen by
the process that owns the cores, never by each worker, and each GPU service is loaded
once for the node.

Starting is serialised by a lock file next to the socket: a worker holds it while it
tries the socket and, if nothing answers, starts the process and waits for it, so two
workers racing end with one scheduler. The scheduler process ends on its own once no
worker has been connected for ``IDLE`` lease timeouts, its agent's sandboxes and
services first; it ends only while holding the same lock, so a worker that is
connecting keeps it. A worker's grants return the moment its connection closes (the
kernel closes it when the process dies), or within the lease timeout if it only stalls.

Which processes are one job: those with the same ``$TANGRAM_JOB``, else the same
``$TORCHELASTIC_RUN_ID`` (torchrun) or ``$SLURM_JOB_ID``, else the same POSIX session
(every process a shell command starts), and in each case the same config file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import pickle
import platform
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from .._core._policy import Policy
from .._runtime._run import Runtime
from ..errors import AsyncioRequiredError, SchedulerUnavailableError
from ._agent import BackendSpec, HostAgentActor
from ._cluster import ClusterSchedulerActor
from ._protocol import (
    DEFAULT_HEARTBEAT,
    DEFAULT_TIMEOUT,
    IDLE,
    ActorLostError,
    logger,
    lost,
    task_failed,
)
from ._proxy import RemoteRuntime, attach, check_capacity
from ._socket import Connection, LocalHandle, Server

__all__ = ["START_SECONDS", "job_key", "node_host", "open_node", "socket_path"]

START_SECONDS = 60.0
"""How long a worker waits for the scheduler process it started to answer."""


def node_host() -> str:
    """This node's name in capacity kinds (``cpu@<host>``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", platform.node())[:32]
    return name or "node"


def job_key(config: str | None) -> str:
    """What names this job's scheduler on this node (see the module's docstring)."""
    for variable in ("TANGRAM_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(variable)
        if value:
            job = f"{variable}={value}"
            break
    else:
        job = f"session={os.getsid(0)}"
    # The file, not how it was spelled: ``t.toml`` and its absolute path are one job's.
    where = os.path.realpath(config) if config else ""
    return hashlib.sha256(f"{job}\0{where}".encode()).hexdigest()[:20]


def _directory() -> Path:
    """The directory of this user's job sockets, private to the user.

    :raises SchedulerUnavailableError: it exists but another user may write it.
    """
    base = os.environ.get("TANGRAM_RUN_DIR")
    if base:
        folder = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        folder = Path(os.environ["XDG_RUNTIME_DIR"]) / "tangram"
    else:
        folder = Path(tempfile.gettempdir()) / f"tangram-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise SchedulerUnavailableError(
            f"{folder} is not a directory of this user's alone: another user could stand "
            "in for the job's scheduler there (set $TANGRAM_RUN_DIR to a private one)"
        )
    return folder


def socket_path(key: str) -> Path:
    return _directory() / f"{key}.sock"


# -- the scheduler process ----------------------------------------------------------------


class _NodeScheduler(ClusterSchedulerActor):
    """The job's scheduler in a process of its own, served on the socket."""

    server: Server
    lock: Path
    host: str
    done: asyncio.Event

    def _node_id(self) -> str:
        return self.host

    def lost(self, cids: set[str]) -> None:
        """A worker's connection closed: what its proxies hold or wait for returns now."""
        for cid in cids:
            if self._drop_client(cid):
                logger.info("proxy %s left with its connection", cid[:8])

    async def _retire(self) -> bool:
        # Only while no worker is starting or connecting (they hold the lock) and none is
        # connected. The lock is held until the agent has stopped: a worker arriving
        # meanwhile waits, then finds no socket and starts a new scheduler process, which
        # never runs beside this one's sandboxes and services.
        try:
            held = open(self.lock, "a")  # noqa: ASYNC230, SIM115 - a local file, closed below
        except FileNotFoundError:
            # The run directory is gone (a /tmp cleaner, a benchmark's temporary one): no
            # worker can find this process any more, so none can be connecting.
            held = open(os.devnull, "a")  # noqa: ASYNC230, SIM115
        with held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if self.server.connections:
                return False
            self.server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock.with_suffix(".sock"))
            ended = await super()._retire()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock)
            log = self.lock.with_suffix(".log")
            with contextlib.suppress(OSError):
                if log.stat().st_size == 0:  # nothing went wrong: nothing to keep
                    log.unlink()
        return ended

    def _kill(self, agent: Any) -> None:
        """The agent lives in this process and was stopped; it ends with it."""

    def _end(self) -> None:
        self.done.set()


class _NodeAgent(HostAgentActor):
    """The node's host agent, inside the scheduler's process."""

    decides_cores = False  # the job's books are in this very process

    handle: LocalHandle
    host: str

    def _me(self) -> Any:
        return self.handle

    def _node_id(self) -> str:
        return self.host

    def _end(self) -> None:
        """The scheduler in this process ends the process."""


class _Node:
    """The object workers call ``start_agent`` on: the node's agent, made once."""

    def __init__(self, server: Server, scheduler: LocalHandle, host: str) -> None:
        self._server = server
        self._scheduler = scheduler
        self._host = host
        self._agent: _NodeAgent | None = None

    async def start_agent(
        self,
        backend: BackendSpec,
        warm: int,
        timeout: float | None,  # noqa: ASYNC109 - the sandbox pool's command limit
        services: Sequence[Any],
        devices: Sequence[Any] | None,
    ) -> dict[str, Any]:
        """Start this node's agent with the first caller's description; later callers
        wait for the same start. A failed start is forgotten, so the next caller retries."""
        agent = self._agent
        if agent is None:
            agent = self._agent = _NodeAgent(
                self._host, self._scheduler, backend, warm, list(services), devices, timeout, True
            )
            agent.host = self._host
            agent.handle = self._server.add("agent", agent)
        try:
            return await agent.start()
        except BaseException:
            if self._agent is agent:
                self._agent = None
                self._server.objects.pop("agent", None)
            raise


async def _serve(listener: socket.socket, spec: Mapping[str, Any]) -> None:
    scheduler = _NodeScheduler(
        spec["capacity"],
        spec["policy"],
        spec["heartbeat"],
        spec["lease_timeout"],
        spec["token"],
        spec["idle"],
    )
    server = Server(frozenset({"send", "poll"}), scheduler.lost)
    scheduler.server = server
    scheduler.lock = Path(spec["lock"])
    scheduler.host = spec["host"]
    scheduler.done = asyncio.Event()
    handle = server.add("scheduler", scheduler)
    server.add("node", _Node(server, handle, spec["host"]))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, scheduler.done.set)
    loop.add_signal_handler(signal.SIGINT, scheduler.done.set)
    await scheduler.info()  # the runtime and its watchdog start now, not at a first call
    assert scheduler._main is not None
    # The scheduler's own task ending for any reason ends the process too.
    scheduler._main.add_done_callback(lambda _: scheduler.done.set())
    await server.listen(listener)
    await scheduler.done.wait()
    server.close()
    agents = scheduler._agents()
    if agents:  # stopped by a signal: the agent's sandboxes go first
        with contextlib.suppress(*lost(), asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(a.stop.remote() for a in agents.values())),
                spec["lease_timeout"],
            )
    with contextlib.suppress(Exception):
        await scheduler.close()


def main() -> None:
    """The scheduler process: ``python -m tangram._shared._node``, its description on stdin.

    It binds the socket, then forks: the parent says ``ready`` and exits (the worker that
    started it reaps it at once), the child serves in a session of its own, so a signal
    to the worker's process group does not take the job's scheduler down with it.
    """
    spec = pickle.load(sys.stdin.buffer)
    path = spec["path"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a scheduler process that died without cleaning up
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(1024)
    listener.setblocking(False)
    if os.fork():
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        os._exit(0)
    os.setsid()
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (0, 1, 2):
        os.dup2(os.open(os.devnull, os.O_RDWR) if fd == 0 else log, fd)
    import logging

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    try:
        asyncio.run(_serve(listener, spec))
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(listener.fileno()).st_ino:
                os.unlink(path)


# -- the worker's side --------------------------------------------------------------------


async def _lock(path: Path) -> int:
    """Hold the job's lock file, waiting as long as the holder holds it (a start, at most
    ``START_SECONDS``; a retiring scheduler's agent stopping). Tried, not blocked on,
    so a cancelled caller stops waiting. The scheduler process removes the file as it
    ends, holding it: a lock taken on a file no longer at ``path`` is let go and retaken.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await anyio.sleep(0.02)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _start(spec: Mapping[str, Any]) -> None:
    """Start the scheduler process and wait until it listens.

    :raises SchedulerUnavailableError: it failed to start, with its log's last lines.
    """
    env = dict(os.environ)
    # The worker's own import path, which a test runner or a launcher may have extended.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    with open(os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tangram._shared._node"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
    try:
        out, _ = process.communicate(pickle.dumps(dict(spec)), timeout=START_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        out = b""
    if out.strip() == b"ready":
        return
    tail = b""
    with contextlib.suppress(OSError), open(spec["log"], "rb") as log:
        tail = log.read()[-2000:]
    raise SchedulerUnavailableError(
        f"the job's scheduler process did not start (exit status {process.returncode}); "
        f"its log {spec['log']} ends: {tail.decode(errors='replace').strip()}"
    )


async def _reach(path: Path, spec: Mapping[str, Any]) -> tuple[Connection, dict[str, Any]]:
    """Connect to the job's scheduler on this node, starting it when nothing listens.

    :raises SchedulerUnavailableError: it cannot start, or one listens and does not answer
        within ``START_SECONDS`` (stopped, or wedged): never a second one beside it.
    """
    lock = await _lock(path.with_suffix(".lock"))
    try:
        for attempt in range(2):
            try:
                connection = await Connection.open(str(path))
            except OSError as exc:  # no socket, or nothing listens on it
                if attempt:
                    raise SchedulerUnavailableError(
                        f"the job's scheduler process at {path} does not listen: {exc}"
                    ) from exc
                await anyio.to_thread.run_sync(_start, spec)
                continue
            try:
                with anyio.fail_after(START_SECONDS):
                    info: dict[str, Any] = await connection.handle("scheduler").info.remote()
            except (TimeoutError, ActorLostError) as exc:
                with anyio.CancelScope(shield=True):
                    await connection.aclose()
                raise SchedulerUnavailableError(
                    f"the job's scheduler process at {path} does not answer: {exc!r}"
                ) from exc
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await connection.aclose()
                raise
            return connection, info
        raise AssertionError("unreachable")
    finally:
        os.close(lock)


@contextlib.asynccontextmanager
async def open_node(
    *,
    capacity: Mapping[str, object],
    config: str | None = None,
    policy: Policy | None = None,
    agent: bool = False,
    backend: BackendSpec = None,
    warm: int = 0,
    timeout: float | None = None,  # noqa: ASYNC109 - the sandbox pool's command limit
    services: Sequence[Any] = (),
    devices: Sequence[Any] | None = None,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease_timeout: float = DEFAULT_TIMEOUT,
) -> AsyncIterator[RemoteRuntime]:
    """A proxy on this job's scheduler process on this node, started if none answers.

    As :func:`tangram._shared._on_ray.open_shared`, without Ray: ``capacity`` is what is not
    the node's (an API's rate, quotas), the same for every worker; with ``agent`` the
    node's host agent is started in the scheduler process with ``backend``, ``warm``,
    ``timeout``, ``services`` and ``devices``. ``config`` names the config file: jobs
    of one session with different files get schedulers of their own.

    :raises InvalidCapacityError: the job's scheduler states another capacity.
    :raises SchedulerUnavailableError: the scheduler process cannot start or answer.
    :raises AsyncioRequiredError: not on asyncio (the proxy's calls are asyncio's).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise AsyncioRequiredError(
            "the job's shared scheduler is reached from asyncio only; on trio, set "
            "mode = 'local' for a scheduler of this process's own"
        ) from None
    host = node_host()
    stated = dict(capacity) or {f"cpu@{host}": 0}  # a runtime names at least one kind
    wanted = Runtime(stated).capacity
    key = job_key(config)
    path = await anyio.to_thread.run_sync(socket_path, key)
    spec = {
        "path": str(path),
        "lock": str(path.with_suffix(".lock")),
        "log": str(path.with_suffix(".log")),
        "capacity": stated,
        "policy": policy,
        "heartbeat": heartbeat,
        "lease_timeout": lease_timeout,
        "idle": IDLE * lease_timeout,
        "token": key,
        "host": host,
    }
    connection, info = await _reach(path, spec)
    try:
        if capacity:
            check_capacity(info["capacity"], wanted)
        async with attach(connection.handle("scheduler"), heartbeat=heartbeat, info=info) as remote:
            if agent:
                try:
                    await connection.handle("node").start_agent.remote(
                        backend, warm, timeout, list(services), devices
                    )
                except task_failed() as exc:
                    raise exc.cause from exc
                except lost() as exc:
                    raise SchedulerUnavailableError(
                        f"the job's scheduler process failed: {exc}"
                    ) from exc
                await remote._refresh()
            yield remote
    finally:
        with anyio.CancelScope(shield=True):
            await connection.aclose()


if __name__ == "__main__":
    main()
