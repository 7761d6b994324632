"""The Docker sandbox backend: pre-created parked containers with allocate-on-execution.

Each sandbox is a container created ahead of demand and *parked*: its cpuset is the host's
whole core list and its CFS quota the smallest the kernel takes (1 ms per 100 ms), so it
holds memory and files but practically no CPU. When an action starts, the container's
cgroup gets the action's cores (cpuset) and their worth of CPU time (CFS quota); a resize
changes both while the command runs; the end parks it again. The container's main process
is a small runner (:mod:`tangram._sandbox._runner`) that takes commands over the attached stdin,
so an action pays neither a container start (~2.6 s) nor a ``docker exec`` (~70 ms).

Grants are applied through the Engine API's update endpoint (``POST
/containers/{id}/update``, called with aiodocker's low-level request since aiodocker has
no wrapper for it) or, when the daemon is on this machine and its cgroup files are
writable here, by writing those files directly, which takes microseconds instead of tens
of milliseconds. Docker's view is kept consistent afterwards: once direct-written values
have held for ``sync_after`` seconds they are sent to the API too (so ``docker inspect``
shows a long action's grant, and the parked values again after it). Every write, direct
or through the API, happens under one lock per container, so a late API call can never
put an older value over a newer one.

Hardened by default (each loosened only by an explicit :class:`DockerConfig` field): no
network, memory and pids limits, read-only root with a tmpfs work dir, every capability
dropped, ``no-new-privileges``, an unprivileged user.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from .._core._units import parse_size
from ..errors import SandboxBrokenError, SandboxError
from ._backend import ExecRequest, ExecResult, Host, SandboxBackend, SandboxHandle
from ._cores import format_cpu_list, numa_nodes

__all__ = ["DockerBackend", "DockerConfig", "docker_usable"]

logger = logging.getLogger("tangram.sandbox.docker")

PERIOD_US = 100_000
"""CFS period: quota is granted cores times this."""
PARKED_QUOTA_US = 1_000
"""The smallest CFS quota the kernel accepts: a parked sandbox's share is 1% of a core."""
LABEL = "tangram.sandbox"
BOOT_TIMEOUT = 60.0
"""Seconds a new container's runner has to say it is ready (a start takes about 2.6 s)."""


def _size(value: str | int) -> int:
    return int(parse_size(value)) if isinstance(value, str) else int(value)


@attrs.frozen(kw_only=True)
class DockerConfig:
    """How sandbox containers are made. Defaults are the hardened ones.

    :param image: any image with ``python3`` on its ``PATH`` (the runner needs it).
    :param memory: memory limit (swap included), ``None`` for none.
    :param pids: most processes (threads count too) in the container, ``None`` for none.
    :param network: ``"none"`` (default) or a Docker network name to allow network.
    :param read_only: read-only root file system (the work dir and ``/tmp`` are tmpfs).
    :param work_size: size of the tmpfs work dir (``/work``).
    :param user: user the runner and commands run as.
    :param cap_drop: capabilities dropped (default all); ``cap_add`` puts some back.
    :param no_new_privileges: forbid setuid gains.
    :param fast_path: write cgroup files directly when the daemon is local.
    :param sync_docker_view: after a direct write, also send the values to the API once
        they have held ``sync_after`` seconds, so ``docker inspect`` shows the grant.
    """

    image: str = "tangram-sandbox-test:latest"
    memory: str | int | None = "1GiB"
    pids: int | None = 256
    network: str = "none"
    read_only: bool = True
    work_size: str | int = "512MiB"
    tmp_size: str | int = "64MiB"
    user: str = "65534:65534"
    cap_drop: tuple[str, ...] = ("ALL",)
    cap_add: tuple[str, ...] = ()
    no_new_privileges: bool = True
    fast_path: bool = True
    sync_docker_view: bool = True
    sync_after: float = 1.0
    env: Mapping[str, str] = attrs.field(factory=dict)

    def container_spec(self, name: str, cores: str, python: str, runner: str) -> dict[str, Any]:
        uid, _, gid = self.user.partition(":")
        tmpfs_owner = f"uid={uid},gid={gid or uid}" if uid.isdigit() else ""
        tmpfs = {
            "/work": ",".join(
                filter(
                    None, ["rw", "exec", f"size={_size(self.work_size)}", "mode=0700", tmpfs_owner]
                )
            ),
            "/tmp": f"rw,nosuid,size={_size(self.tmp_size)},mode=1777",
        }
        host: dict[str, Any] = {
            "NetworkMode": self.network,
            "ReadonlyRootfs": self.read_only,
            "Tmpfs": tmpfs,
            "CapDrop": list(self.cap_drop),
            "CapAdd": list(self.cap_add),
            "SecurityOpt": ["no-new-privileges"] if self.no_new_privileges else [],
            "CpusetCpus": cores,
            "CpuPeriod": PERIOD_US,
            # Booted with one core's quota (the runner's start at the parked 1% would take
            # seconds), parked as soon as it answers.
            "CpuQuota": PERIOD_US,
            "AutoRemove": False,
        }
        if self.memory is not None:
            host["Memory"] = _size(self.memory)
            host["MemorySwap"] = _size(self.memory)
        if self.pids is not None:
            host["PidsLimit"] = self.pids
        return {
            "Image": self.image,
            "Cmd": [python, "-u", "-c", runner],
            "User": self.user,
            "WorkingDir": "/work",
            "Env": [f"{k}={v}" for k, v in self.env.items()],
            "OpenStdin": True,
            "StdinOnce": False,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
            "NetworkDisabled": self.network == "none",
            "Labels": {LABEL: name},
            "HostConfig": host,
        }


class DockerBackend(SandboxBackend):
    """Sandboxes as containers on one or several Docker hosts.

    :param hosts: daemon URLs (``unix:///var/run/docker.sock``, ``tcp://node2:2375``);
        default the local daemon (``DOCKER_HOST`` or the local socket). With several,
        each host's cores are a separate runtime resource ``cpu@<name>``
        (``pool.capacity()`` lists them) because an action's cores must come from the
        host its sandbox lives on.
    :param config: container settings (image, limits, hardening).
    :param cores: per host URL, the core ids to lend (default: all the daemon reports).
    :raises ImportError: aiodocker is missing (``pip install tangram[docker]``).
    """

    python = "python3"

    def __init__(
        self,
        hosts: Sequence[str] | None = None,
        *,
        config: DockerConfig | None = None,
        cores: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        try:
            import aiodocker  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "the Docker sandbox backend needs aiodocker: pip install 'tangram[docker]'"
            ) from exc
        self.config = config if config is not None else DockerConfig()
        self._urls = list(hosts) if hosts else [os.environ.get("DOCKER_HOST", "")]
        self._cores = dict(cores or {})
        self._clients: dict[str, Any] = {}
        self._hosts: dict[str, _HostInfo] = {}

    def __repr__(self) -> str:
        return f"<tangram.DockerBackend hosts={self._urls!r} image={self.config.image!r}>"

    @classmethod
    async def usable(cls) -> bool:
        return await docker_usable()

    async def start(self) -> Sequence[Host]:
        import aiodocker

        from ._runner import RUNNER_SOURCE

        self._runner = RUNNER_SOURCE
        hosts: list[Host] = []
        several = len(self._urls) > 1
        for index, url in enumerate(self._urls):
            client = aiodocker.Docker(url=url or None)
            try:
                info = await client.system.info()
            except Exception as exc:
                await client.close()
                raise SandboxError(
                    f"cannot reach the Docker daemon at {url or 'default'}: {exc}"
                ) from exc
            local = _is_local(url)
            count = int(info.get("NCPU", os.cpu_count() or 1))
            cores = tuple(self._cores.get(url, range(count)))
            nodes = numa_nodes(cores) if local else (cores,)
            name = f"h{index}" if several else "local" if local else "docker"
            resource = f"cpu@{name}" if several else "cpu"
            host = Host(name, cores, nodes, resource)
            cgroup_version = str(info.get("CgroupVersion", "1"))
            self._clients[name] = client
            self._hosts[name] = _HostInfo(host, client, local, cgroup_version)
            hosts.append(host)
        return hosts

    async def create(self, host: Host) -> SandboxHandle:
        info = self._hosts[host.name]
        name = f"tangram-{secrets.token_hex(6)}"
        spec = self.config.container_spec(
            name, format_cpu_list(host.cores), self.python, self._runner
        )
        client = info.client
        try:
            container = await client.containers.create(spec, name=name)
        except Exception as exc:
            raise SandboxError(
                f"cannot create a sandbox from {self.config.image!r}: {exc}"
            ) from exc
        handle = _DockerHandle(self, info, container)
        try:
            await handle._boot()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await handle.destroy()
            raise
        return handle

    async def aclose(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()


async def docker_usable(config: DockerConfig | None = None) -> bool:
    """Whether the default daemon answers and has ``config.image`` (no pull is tried)."""
    import aiodocker

    image = (config or DockerConfig()).image
    try:
        client = aiodocker.Docker()
    except Exception:
        return False
    try:
        await client.system.info()
        await client.images.inspect(image)
    except Exception:
        return False
    finally:
        await client.close()
    return True


def _is_local(url: str) -> bool:
    return not url or url.startswith(("unix://", "/"))


@attrs.define
class _HostInfo:
    host: Host
    client: Any
    local: bool
    cgroup_version: str


class _CgroupFiles:
    """The container's cgroup files on this machine, for the direct-write fast path."""

    def __init__(self, version: str, quota: Path, cpuset: Path) -> None:
        self.version = version
        self.quota = quota
        self.cpuset = cpuset

    @classmethod
    def find(cls, pid: int, version: str, root: Path = Path("/")) -> _CgroupFiles | None:
        """The files of ``pid``'s cgroup, or ``None`` when they are not writable here.

        ``root`` is where ``/proc`` and ``/sys`` are read from: ``/`` but in tests, which
        lay out a cgroup v2 tree on a host that mounts v1.
        """
        try:
            lines = (root / "proc" / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        if version == "2":
            for line in lines:
                if line.startswith("0::"):
                    base = root / "sys" / "fs" / "cgroup" / line[3:].lstrip("/")
                    files = cls(version, base / "cpu.max", base / "cpuset.cpus")
                    return files if files.usable() else None
            return None
        paths: dict[str, Path] = {}
        mounts = _v1_mounts(root)
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            for controller in controllers.split(","):
                if controller in ("cpu", "cpuset") and controller in mounts:
                    paths[controller] = mounts[controller] / rel.lstrip("/")
        if "cpu" not in paths or "cpuset" not in paths:
            return None
        files = cls(version, paths["cpu"] / "cpu.cfs_quota_us", paths["cpuset"] / "cpuset.cpus")
        return files if files.usable() else None

    def usable(self) -> bool:
        return os.access(self.quota, os.W_OK) and os.access(self.cpuset, os.W_OK)

    def read(self) -> tuple[str, int]:
        cpuset = self.cpuset.read_text().strip()
        raw = self.quota.read_text().split()
        quota = -1 if raw[0] == "max" else int(raw[0])
        return cpuset, quota

    def write(self, cpuset: str, quota_us: int, growing: bool) -> None:
        # Growing: widen the cpuset before raising the quota; shrinking: the reverse, so
        # the quota never exceeds what the cpuset can use.
        quota_text = f"{quota_us} {PERIOD_US}" if self.version == "2" else str(quota_us)
        steps = [(self.cpuset, cpuset), (self.quota, quota_text)]
        for path, value in steps if growing else reversed(steps):
            with open(path, "w") as handle:
                handle.write(value)


def _v1_mounts(root: Path) -> dict[str, Path]:
    mounts: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in (root / "proc" / "self" / "mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields = right.split()
            if not fields or fields[0] != "cgroup":
                continue
            point = root / left.split()[4].lstrip("/")
            for option in fields[2].split(","):
                mounts.setdefault(option, point)
    return mounts


class _DockerHandle(SandboxHandle):
    def __init__(self, backend: DockerBackend, info: _HostInfo, container: Any) -> None:
        self.host = info.host
        self._backend = backend
        self._info = info
        self.container = container
        self.id: str = container.id
        self._stream: Any = None
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._cgroup: _CgroupFiles | None = None
        self._parked = (format_cpu_list(info.host.cores), PARKED_QUOTA_US)
        self._wanted = self._parked
        self._docker_view = self._parked
        self._version = 0
        self._tasks: set[Any] = set()
        self._lock = anyio.Lock()
        self._destroyed = False

    def __repr__(self) -> str:
        return f"<tangram docker sandbox {self.id[:12]}>"

    @property
    def fast_path(self) -> bool:
        return self._cgroup is not None

    async def _boot(self) -> None:
        # Attached before it starts, as `docker run -i` does: attached after, the runner's
        # "ready" line could be written before anyone listened, and the wait for it would
        # never end.
        self._stream = self.container.attach(stdin=True, stdout=True, stderr=True)
        await self._stream._init()
        await self.container.start()
        try:
            with anyio.fail_after(BOOT_TIMEOUT):
                ready = await self._read_reply()
        except TimeoutError:
            raise SandboxBrokenError(
                f"the sandbox runner in {self.id[:12]} did not answer in {BOOT_TIMEOUT:g} s"
            ) from None
        if not ready.get("ready"):
            raise SandboxBrokenError(f"the sandbox runner did not start: {ready!r}")
        if self._backend.config.fast_path and self._info.local:
            details = await self.container.show()
            pid = int(details.get("State", {}).get("Pid") or 0)
            if pid > 0:
                files = await anyio.to_thread.run_sync(
                    _CgroupFiles.find, pid, self._info.cgroup_version
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

    # -- talking to the runner ----------------------------------------------------------

    async def _read_reply(self) -> dict[str, Any]:
        while True:
            line_end = self._buffer.find(b"\n")
            if line_end >= 0:
                line = bytes(self._buffer[:line_end])
                del self._buffer[: line_end + 1]
                reply: dict[str, Any] = json.loads(line)
                return reply
            try:
                message = await self._stream.read_out()
            except Exception as exc:
                raise SandboxBrokenError(f"lost the sandbox {self.id[:12]}: {exc}") from exc
            if message is None:
                raise SandboxBrokenError(
                    f"the sandbox container {self.id[:12]} stopped (its runner exited)"
                )
            if message.stream == 2:
                logger.warning(
                    "sandbox %s runner: %s", self.id[:12], message.data.decode(errors="replace")
                )
                continue
            self._buffer.extend(message.data)

    async def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        await self._send(request)
        return await self._reply()

    async def _send(self, request: dict[str, Any]) -> None:
        if self._destroyed:
            raise SandboxBrokenError("the sandbox was destroyed")
        request["id"] = next(self._ids)
        try:
            await self._stream.write_in(json.dumps(request).encode() + b"\n")
        except Exception as exc:
            raise SandboxBrokenError(f"lost the sandbox {self.id[:12]}: {exc}") from exc

    async def _reply(self) -> dict[str, Any]:
        reply = await self._read_reply()
        if not reply.get("ok"):
            error = reply.get("error")
            message = reply.get("message", "")
            if error == "FileNotFoundError":
                raise FileNotFoundError(message)
            if error in ("PermissionError", "IsADirectoryError"):
                raise PermissionError(message)
            raise SandboxError(f"the sandbox runner failed: {error}: {message}")
        return reply

    async def execute(self, request: ExecRequest) -> ExecResult:
        await self._send(
            {
                "op": "run",
                "argv": list(request.argv),
                "stdin": base64.b64encode(request.stdin).decode(),
                "env": dict(request.env),
                "timeout": request.timeout,
                "output_limit": request.output_limit,
            }
        )
        try:
            reply = await self._reply()
        except BaseException:
            # Cancelled (or the reply was lost): the runner is still running the command.
            # Ask it to stop and read its answer, so the next request does not get this
            # one's reply; a runner that does not answer cannot be trusted again.
            with anyio.CancelScope(shield=True):
                settled = False
                with anyio.move_on_after(10), contextlib.suppress(Exception):
                    await self._stream.write_in(b'{"op": "cancel"}\n')
                    await self._read_reply()
                    settled = True
                if not settled:
                    await self.destroy()
            raise
        return ExecResult(
            exit_code=reply.get("exit_code"),
            stdout=base64.b64decode(reply.get("stdout", "")),
            stderr=base64.b64decode(reply.get("stderr", "")),
            stdout_truncated=bool(reply.get("stdout_truncated")),
            stderr_truncated=bool(reply.get("stderr_truncated")),
            timed_out=bool(reply.get("timed_out")),
            signal=reply.get("signal"),
            cpu_seconds=float(reply.get("cpu_seconds", math.nan)),
            leftovers_killed=int(reply.get("leftovers", 0)),
        )

    async def put_file(self, path: str, data: bytes) -> None:
        await self._call({"op": "put", "path": path, "data": base64.b64encode(data).decode()})

    async def get_file(self, path: str) -> bytes:
        reply = await self._call({"op": "get", "path": path})
        return base64.b64decode(reply["data"])

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
                    if self._backend.config.sync_docker_view and self._docker_view != wanted:
                        self._later(self._sync(self._version))
                    return
            await self._update(wanted)
            self._docker_view = wanted

    async def _sync(self, version: int) -> None:
        """Tell Docker the directly written values once they have held for a while.

        Waiting first keeps API calls off the short actions and quick resizes that make
        up most changes; a change that comes while the call is in flight waits for it.
        """
        await anyio.sleep(self._backend.config.sync_after)
        async with self._lock:
            if version != self._version or self._destroyed or self._docker_view == self._wanted:
                return
            try:
                await self._update(self._wanted)
            except SandboxBrokenError:
                logger.debug("could not sync Docker's view of %s", self.id[:12], exc_info=True)
                return
            self._docker_view = self._wanted

    def _later(self, coro: Any) -> None:
        import asyncio

        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _update(self, values: tuple[str, int]) -> None:
        cpuset, quota_us = values
        try:
            await self._info.client._query_json(
                f"containers/{self.id}/update",
                method="POST",
                data={"CpusetCpus": cpuset, "CpuQuota": quota_us, "CpuPeriod": PERIOD_US},
            )
        except Exception as exc:
            raise SandboxBrokenError(f"cannot update the sandbox {self.id[:12]}: {exc}") from exc

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for task in list(self._tasks):
            task.cancel()
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.close()
        with contextlib.suppress(Exception):
            await self.container.delete(force=True, v=True)
