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

Memory is reserved per daemon, not shared (:mod:`tangram._sandbox._budget`, as for local
sandboxes). Each container has its own limit, but all of a daemon's containers draw on one
host's memory, and a parked sandbox keeps its work dir's files, which no process owns and
no OOM kill frees: with nothing bounding their sum, one sample's parked files got another
sample's grading OOM-killed (a right answer scored 0). So at start each daemon gets a cap,
half the memory its containers may use together (the host's ``MemTotal``, or the limit of
the cgroup a local daemon puts them under where that is tighter), and one running action
per lent core at ``memory`` plus ``sandboxes`` live work dirs (bytes and inodes) and their
runners must fit under it: ``memory`` and ``work_size`` are lowered to their shares where
they do not (:attr:`DockerBackend.reservations` holds the config in force), and a sandbox
past ``sandboxes`` is refused. This leans on the runner: a parked sandbox holds only its
work dir (its action's processes, ``/tmp`` and ``/dev/shm`` end with the action).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from ..._core._units import format_size
from ..._core._validate import whole
from ...errors import InvalidSettingError, SandboxBrokenError, SandboxError
from .._backend import Host, SandboxBackend, SandboxHandle
from .._budget import MIN_DISK, MIN_MEMORY, MemoryPlan, Places, plan_memory
from .._cores import format_cpu_list, numa_nodes
from ._cgroupfs import PERIOD_US, _v1_mounts
from ._container import PARKED_QUOTA_US, DockerHandle
from ._engine import DockerConfig, HostInfo, open_files_for, stream_client
from ._reaper import LABEL, owner_labels, reap

__all__ = [
    "PARKED_QUOTA_US",
    "PARKED_RUNNER",
    "PERIOD_US",
    "DockerBackend",
    "DockerConfig",
    "Reservation",
    "docker_usable",
]

logger = logging.getLogger("tangram.sandbox.docker")

PARKED_RUNNER = 16 << 20
"""Memory a parked container holds beside its work dir, reserved for each live sandbox:
its runner (a Python interpreter) and the container's kernel memory, 10 MiB measured in
its cgroup. Each container's ``containerd-shim`` (about 13 MiB, in the daemon's cgroup,
not the container's) comes out of the half of the host's memory left outside the cap."""


@attrs.define(eq=False)
class Reservation:
    """One daemon's memory, reserved among the sandboxes that may live on it at once.

    ``cap`` is half the memory the daemon's containers may use together (``None``: not
    known, or ``memory=None``: nothing is reserved); ``running`` the actions that may run
    there at once (one per core lent on that daemon, by every host of the backend);
    ``config`` the settings its containers are made with, ``memory`` and ``work_size``
    lowered to their shares where the asked ones do not fit; ``limit`` the most live
    sandboxes (``None``: not limited); ``said`` the plan as logged at start. So
    ``running x memory + limit x (held(work_bytes) + PARKED_RUNNER) <= cap``.
    """

    cap: int | None
    running: int
    config: DockerConfig
    limit: int | None
    said: str
    lowered: bool = False
    places: Places = attrs.field(init=False)
    """The live sandboxes, and those being destroyed, against ``limit``."""

    def __attrs_post_init__(self) -> None:
        self.places = Places(self.limit)

    @property
    def live(self) -> int:
        """Sandboxes created on the daemon and not yet destroyed."""
        return self.places.live

    async def take(self, where: str) -> None:
        """Count one more live sandbox; past ``limit``, once one being destroyed is gone.

        :raises SandboxError: ``limit`` sandboxes are alive and none is being destroyed:
            one more would hold memory reserved for the others, and its files could cost
            them a command.
        """
        await self.places.take(f"on {where}", self.config.work_bytes, "DockerBackend(sandboxes=)")


class _ReservedHandle(DockerHandle):
    """A sandbox that gives its place in its daemon's :class:`Reservation` back once."""

    def __init__(
        self, config: DockerConfig, info: HostInfo, container: Any, reservation: Reservation
    ) -> None:
        super().__init__(config, info, container)
        self._reservation: Reservation | None = reservation

    async def destroy(self) -> None:
        reservation, self._reservation = self._reservation, None
        if reservation is None:
            await super().destroy()
            return
        with reservation.places.leave() as gone:
            try:
                await super().destroy()
            finally:
                # Given back even where the delete failed: the attach stream is closed, so
                # the runner reads EOF and exits, and the container's tmpfs mounts go with it.
                gone()


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
    :param sandboxes: sandboxes that may be alive at once on one daemon, each with memory
        reserved for its work dir's files; creating one more raises
        :class:`~tangram.errors.SandboxError`. ``config.memory`` and ``config.work_size``
        are ceilings: where one action per lent core at ``memory`` and ``sandboxes`` work
        dirs do not fit in half the memory the daemon's containers may use, each is lowered
        to its share (logged at start; :attr:`reservations`). More live sandboxes, smaller
        work dirs.
    :raises ImportError: aiodocker is missing (``pip install tangram[docker]``).
    """

    python = "python3"

    def __init__(
        self,
        hosts: Sequence[str] | None = None,
        *,
        config: DockerConfig | None = None,
        cores: Mapping[str, Sequence[int]] | None = None,
        sandboxes: int = 256,
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
        whole("sandboxes", sandboxes, minimum=1)
        self.sandboxes = sandboxes
        self._hosts: dict[str, HostInfo] = {}
        self._memory: dict[str, tuple[int | None, str]] = {}  # MemTotal, cgroup driver
        self.reservations: dict[str, Reservation] = {}
        """Per host name, its daemon's :class:`Reservation` (hosts of one daemon share
        one), set at start: the config its sandboxes are made with, and their count."""

    def __repr__(self) -> str:
        return f"<tangram.DockerBackend hosts={self._urls!r} image={self.config.image!r}>"

    @classmethod
    async def usable(cls) -> bool:
        return await docker_usable()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DockerBackend:
        """``[sandbox]`` keys are :class:`DockerConfig` fields (``image``, ``memory``...),
        and ``sandboxes``."""
        fields = dict(options)
        sandboxes = fields.pop("sandboxes", 256)
        return cls(config=DockerConfig(**fields), sandboxes=sandboxes)

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
            await self._reserve_memory(daemons)
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
            total = info.get("MemTotal")
            self._memory[name] = (
                int(total) if isinstance(total, int) and total > 0 else None,
                str(info.get("CgroupDriver", "cgroupfs")),
            )
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

    async def _reserve_memory(self, daemons: dict[str, str]) -> None:
        """Plan each daemon's :class:`Reservation`; log it, or refuse settings it cannot hold.

        Hosts on one daemon share its memory, so they share one reservation (and its
        ``running``, their cores together, as for the file table).

        :raises InvalidSettingError: the shares are too small to run anything, or too small
            for the files the container's own tmpfs mounts may hold.
        """
        made: dict[str, Reservation] = {}
        for name, info in self._hosts.items():
            daemon = daemons[name]
            if daemon not in made:
                total, driver = self._memory[name]
                parent = None
                if info.local:
                    parent = await anyio.to_thread.run_sync(
                        containers_memory_limit, driver, info.cgroup_version
                    )
                made[daemon] = self._reserve(info, total, parent)
            self.reservations[name] = made[daemon]

    def _reserve(
        self, info: HostInfo, total: int | None, parent: tuple[int, str] | None
    ) -> Reservation:
        """One daemon's reservation under half of ``total`` or ``parent``, the smaller."""
        config, running, where = self.config, info.running, info.url
        limits = [(total, "its host's MemTotal")] if total is not None else []
        if parent is not None:
            limits.append((parent[0], parent[1]))
        if config.memory is None or not limits:
            why = "memory=None" if config.memory is None else "the daemon reports no MemTotal"
            said = (
                f"not reserved on {where} ({why}): a sandbox's files and processes may use "
                "memory another sandbox's command needs, and get it OOM-killed"
            )
            logger.warning("%s", said)
            return Reservation(None, running, config, None, said)
        size, source = min(limits)
        cap = size // 2
        plan = plan_memory(
            cap=cap,
            cores=running,
            memory=config.memory_bytes,
            disk=config.work_bytes,
            sandboxes=self.sandboxes,
            files_in_memory=True,  # the work dir is always a tmpfs
            disk_name="work_size",
            overhead=PARKED_RUNNER,
        )
        said = f"{plan.said} on {where} (half of {format_size(size)}, {source})"
        if plan.problem is not None:
            raise InvalidSettingError(
                f"the memory of the Docker host cannot hold the sandboxes that may be alive "
                f"there at once: {said}, under the {format_size(MIN_MEMORY)} an action and "
                f"{format_size(MIN_DISK)} a work dir need at least; lend fewer cores "
                "(`cores`), allow fewer live sandboxes (`DockerBackend(sandboxes=)`), or give "
                "the daemon's containers more memory"
            )
        if plan.lowered:
            config = self._lowered(plan, said)
            if plan.disk is not None and config.work_bytes < plan.disk:
                # The config fits its mounts in ``memory`` (:attr:`DockerConfig.mounts`):
                # a smaller work dir holds less, so the reservation still holds.
                said += (
                    f"; /work {format_size(config.work_bytes)} so that the container's "
                    "own mounts fit in its memory"
                )
        logger.info("sandboxes' memory is %s", said)
        return Reservation(cap, running, config, self.sandboxes, said, plan.lowered)

    def _lowered(self, plan: MemoryPlan, said: str) -> DockerConfig:
        """The config with the plan's ``memory`` and ``work_size``.

        :raises InvalidSettingError: its container could not hold even the smallest
            mounts beside the runner's reserve (the config's own check).
        """
        work = plan.disk if plan.disk is not None else self.config.work_size
        try:
            return attrs.evolve(self.config, memory=plan.memory, work_size=work)
        except InvalidSettingError as exc:
            raise InvalidSettingError(
                f"the sandboxes' memory is {said}, too little for a container's own files "
                f"and runner ({exc}): lend fewer cores (`cores`), allow fewer live "
                "sandboxes (`DockerBackend(sandboxes=)`), or give the daemon's containers "
                "more memory"
            ) from exc

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
        reservation = self.reservations[host.name]
        config = reservation.config
        name = f"tangram-{secrets.token_hex(6)}"
        spec = config.container_spec(
            name, format_cpu_list(host.cores), self.python, self._runner, info.open_files
        )
        await reservation.take(info.url)  # before anything is made: a refusal leaves nothing
        handle: _ReservedHandle | None = None
        try:
            async with info.boots:
                try:
                    container = await info.call(
                        "to create a sandbox",
                        lambda: info.client.containers.create(spec, name=name),
                        config.api_timeout,
                    )
                except SandboxBrokenError:
                    raise
                except SandboxError as exc:
                    raise SandboxError(
                        f"cannot create a sandbox from {config.image!r}: {exc.__cause__}"
                    ) from exc.__cause__
                # From here the handle gives the reservation back, when it is destroyed.
                handle = _ReservedHandle(config, info, container, reservation)
                try:
                    await handle.boot()
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await handle.destroy()
                    raise
        except BaseException:
            if handle is None:
                reservation.places.give_back()
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
        self.reservations.clear()


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


def containers_memory_limit(
    driver: str, version: str, root: Path = Path("/")
) -> tuple[int, str] | None:
    """The tightest memory limit over the cgroup a local daemon makes containers under.

    That is Docker's default parent, ``docker`` (the cgroupfs driver) or ``system.slice``
    (systemd), and every cgroup above it: all the daemon's containers together cannot use
    more (a memory-limited Docker-in-Docker pod, a capped ``docker.service``). ``None``
    where it is not there or not readable (a daemon started with another
    ``--cgroup-parent``, or outside this process's cgroup namespace): then the host's
    ``MemTotal`` alone counts. ``root`` is where ``/proc`` and ``/sys`` are read from.
    """
    parent = "system.slice" if driver == "systemd" else "docker"
    if version == "2":
        base: Path | None = root / "sys" / "fs" / "cgroup"
        limit_file = "memory.max"
    else:
        base = _v1_mounts(root).get("memory")
        limit_file = "memory.limit_in_bytes"
    if base is None or not (base / parent).is_dir():
        return None
    tightest: tuple[int, str] | None = None
    directory = base / parent
    while True:
        try:
            text = (directory / limit_file).read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit() and (tightest is None or int(text) < tightest[0]):
            tightest = (int(text), f"the limit of {directory / limit_file}")
        if directory == base:
            return tightest
        directory = directory.parent


def _is_local(url: str) -> bool:
    return not url or url.startswith(("unix://", "/"))
