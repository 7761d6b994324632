"""The Docker sandbox backend: pre-created parked containers with allocate-on-execution.

Each sandbox is a container created ahead of demand and *parked*: its cpuset is the host's
whole core list and its CFS quota the smallest the kernel takes (1 ms per 100 ms), so it
holds memory and files but practically no CPU. When an action starts, the container's
cgroup gets the action's cores (cpuset) and their worth of CPU time (CFS quota); a resize
changes both while the command runs; the end parks it again. The container's main process
is a small runner (:mod:`tangram._sandbox._docker._runner`) that takes commands over the attached
stdin, so an action pays neither a container start (~2.6 s) nor a ``docker exec`` (~70 ms).

Grants are applied through the Engine API's update endpoint (``POST
/containers/{id}/update``, called with aiodocker's low-level request since aiodocker has
no wrapper for it) or, when the daemon is on this machine and its cgroup files are
writable here, by writing those files directly (:mod:`tangram._sandbox._docker._cgroupfs`).
Docker's view is kept consistent afterwards: once direct-written values have held for
``sync_after`` seconds they are sent to the API too (so ``docker inspect`` shows a long
action's grant, and the parked values again after it). Every write, direct or through the
API, happens under one lock per container, so a late API call can never put an older
value over a newer one.

Each live sandbox keeps its attach connection open, so those connections come from a
client of their own whose pool has no cap: aiohttp's default of 100 would otherwise be
taken by the 100th sandbox and every later API call would wait for good. Every API call
has a deadline (``api_timeout``), so a daemon that stalls is a :class:`SandboxBrokenError`
rather than a hang.

Hardened by default (each loosened only by an explicit :class:`DockerConfig` field): no
network, memory and pids limits, read-only root with a tmpfs work dir, every capability
dropped but the runner's three, ``no-new-privileges``, commands under an unprivileged user
that is not the runner's, and no container log (nothing a command writes reaches the
daemon's disk). Always: a descriptor limit per process derived from the daemon's host's
file table (:func:`tangram._sandbox._docker._engine.open_files_for`, measured at start), and SysV
shared memory that goes with the processes that hold it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from ...errors import SandboxBrokenError, SandboxError
from .._backend import Host, SandboxBackend, SandboxHandle
from .._cores import format_cpu_list, numa_nodes
from ._cgroupfs import PERIOD_US
from ._container import PARKED_QUOTA_US, DockerHandle
from ._engine import DockerConfig, HostInfo, open_files_for, stream_client
from ._reaper import LABEL, owner_labels, reap

__all__ = ["PARKED_QUOTA_US", "PERIOD_US", "DockerBackend", "DockerConfig", "docker_usable"]

logger = logging.getLogger("tangram.sandbox.docker")


class DockerBackend(SandboxBackend):
    """Sandboxes as containers on one or several Docker hosts.

    On start it removes the sandbox containers of owners on this host that are gone (a
    trainer killed before it could clean up): see :mod:`tangram._sandbox._docker._reaper`.

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
        self._hosts: dict[str, HostInfo] = {}

    def __repr__(self) -> str:
        return f"<tangram.DockerBackend hosts={self._urls!r} image={self.config.image!r}>"

    @classmethod
    async def usable(cls) -> bool:
        return await docker_usable()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DockerBackend:
        """``[sandbox]`` keys are :class:`DockerConfig` fields (``image``, ``memory``...)."""
        return cls(config=DockerConfig(**options))

    @classmethod
    def lending(cls, cores: Sequence[int]) -> DockerBackend:
        """``cores`` of the default daemon, taken to be this machine's (its core ids ours)."""
        return cls(cores={os.environ.get("DOCKER_HOST", ""): tuple(cores)})

    async def start(self) -> Sequence[Host]:
        from ._runner import RUNNER_SOURCE

        self._runner = RUNNER_SOURCE
        hosts: list[Host] = []
        daemons: dict[str, str] = {}
        try:
            await self._connect(hosts, daemons)
            await self._limit_files(daemons)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        return hosts

    async def _connect(self, hosts: list[Host], daemons: dict[str, str]) -> None:
        """Reach every daemon; ``daemons`` maps each host's name to its daemon's id."""
        import aiodocker

        several = len(self._urls) > 1
        for index, url in enumerate(self._urls):
            client = aiodocker.Docker(url=url or None)
            try:
                with anyio.fail_after(self.config.api_timeout):
                    info = await client.system.info()
                    reaped = await reap(client)
            except Exception as exc:
                await client.close()
                raise SandboxError(
                    f"cannot reach the Docker daemon at {url or 'default'}: {exc!r}"
                ) from exc
            try:
                with anyio.fail_after(self.config.api_timeout):
                    await client.images.inspect(self.config.image)
            except Exception as exc:
                # Checked here, where the pool (or an adapter, at worker start) starts the
                # backend: every sandbox would fail to be created from it later.
                await client.close()
                raise SandboxError(
                    f"the Docker daemon at {url or 'default'} has no image "
                    f"{self.config.image!r} (tangram never pulls: build or pull it there "
                    f"first): {exc!r}"
                ) from exc
            if reaped:
                logger.info(
                    "removed %d sandbox containers left by owners that are gone", len(reaped)
                )
            local = _is_local(url)
            count = int(info.get("NCPU", os.cpu_count() or 1))
            cores = tuple(self._cores.get(url, range(count)))
            nodes = numa_nodes(cores) if local else (cores,)
            name = f"h{index}" if several else "local" if local else "docker"
            resource = f"cpu@{name}" if several else "cpu"
            host = Host(name, cores, nodes, resource)
            streams, slots = stream_client(client)
            self._hosts[name] = HostInfo(
                host,
                client,
                streams,
                local,
                str(info.get("CgroupVersion", "1")),
                url or "the default daemon",
                slots,
            )
            daemons[name] = str(info.get("ID") or url)
            hosts.append(host)

    async def _limit_files(self, daemons: dict[str, str]) -> None:
        """Set each host's ``nofile`` limit from its daemon's file table.

        Hosts on one daemon (the same socket twice, or a daemon reached two ways) share
        its table, so their cores are counted together.
        """
        measured: dict[str, int] = {}
        for name, info in self._hosts.items():
            daemon = daemons[name]
            running = sum(
                len(other.host.cores)
                for key, other in self._hosts.items()
                if daemons[key] == daemon
            )
            if daemon not in measured:
                here = file_max_here() if info.local else None
                measured[daemon] = here if here is not None else await self._file_max_of(info)
            info.file_max, info.running = measured[daemon], running
            info.open_files, warning = open_files_for(self.config, info.file_max, running, info.url)
            if warning is not None:
                logger.warning("%s", warning)
            logger.info(
                "sandboxes on %s: %d open files per process (fs.file-max %d, %d cores)",
                info.url,
                info.open_files,
                info.file_max,
                running,
            )

    async def _file_max_of(self, info: HostInfo) -> int:
        """The ``fs.file-max`` of a daemon's host, read by a container of its own.

        The Engine API does not report it, and a remote host's table is not this one's.
        """
        name = f"tangram-probe-{secrets.token_hex(6)}"
        spec = {
            "Image": self.config.image,
            "Cmd": [self.python, "-c", "print(open('/proc/sys/fs/file-max').read().strip())"],
            "User": self.config.user,
            "NetworkDisabled": True,
            "Labels": {LABEL: name, **owner_labels()},
            "HostConfig": {
                "NetworkMode": "none",
                "ReadonlyRootfs": True,
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "LogConfig": {"Type": "json-file", "Config": {}},
            },
        }
        timeout = self.config.api_timeout
        container = await info.call(
            "to create a probe container",
            lambda: info.client.containers.create(spec, name=name),
            timeout,
        )
        try:
            await info.call("to start a probe container", container.start, timeout)
            await info.call("to run a probe container", container.wait, timeout)
            lines = await info.call(
                "to read a probe container's output",
                lambda: container.log(stdout=True),
                timeout,
            )
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError):
                await info.call(
                    "to remove a probe container",
                    lambda: container.delete(force=True, v=True),
                    timeout,
                )
        text = "".join(lines).strip()
        try:
            return int(text)
        except ValueError:
            raise SandboxError(
                f"could not read fs.file-max on {info.url} from {self.config.image!r} "
                f"(got {text[:200]!r})"
            ) from None

    async def create(self, host: Host) -> SandboxHandle:
        info = self._hosts[host.name]
        name = f"tangram-{secrets.token_hex(6)}"
        spec = self.config.container_spec(
            name, format_cpu_list(host.cores), self.python, self._runner, info.open_files
        )
        async with info.boots:
            try:
                container = await info.call(
                    "to create a sandbox",
                    lambda: info.client.containers.create(spec, name=name),
                    self.config.api_timeout,
                )
            except SandboxBrokenError:
                raise
            except SandboxError as exc:
                raise SandboxError(
                    f"cannot create a sandbox from {self.config.image!r}: {exc.__cause__}"
                ) from exc.__cause__
            handle = DockerHandle(self.config, info, container)
            try:
                await handle.boot()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await handle.destroy()
                raise
        return handle

    async def aclose(self) -> None:
        for info in self._hosts.values():
            with contextlib.suppress(Exception):
                await info.client.close()
            if info.streams is not info.client:
                with contextlib.suppress(Exception):
                    await info.streams.close()
                    await info.streams.connector.close()
        self._hosts.clear()


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


def file_max_here() -> int | None:
    """This machine's ``fs.file-max``, or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/sys/fs/file-max") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return None


def _is_local(url: str) -> bool:
    return not url or url.startswith(("unix://", "/"))
