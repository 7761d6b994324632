"""One Docker daemon as the sandboxes see it: the container spec and the host's clients.

:class:`DockerConfig` turns settings into the Engine API's container spec; :class:`HostInfo`
holds one daemon's two clients (API calls, and the attach streams each live sandbox keeps
open, from a pool without aiohttp's cap of 100) and gives every API call a deadline, so a
daemon that stalls is a :class:`SandboxBrokenError` rather than a hang.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import attrs

from ..._core._units import parse_size
from ..._core._validate import byte_size, non_negative, positive, whole
from ...errors import InvalidSettingError, SandboxBrokenError, SandboxError, SettingTypeError
from .._backend import Host
from .._budget import held, inodes_for
from ._cgroupfs import PERIOD_US
from ._reaper import LABEL, owner_labels

__all__ = ["DockerConfig", "HostInfo", "open_files_for", "stream_client"]

BOOTS = 8
"""Containers created and started at once per host: a burst of 512 warm sandboxes would
otherwise queue hundreds of requests in the daemon and each could pass its deadline."""
RUNNER_CAPS = ("SETUID", "SETGID", "KILL")
"""What the runner keeps: switching to the sandbox user, and killing its leftovers."""
STREAM_HEADROOM = 16
"""Connections kept for API calls where attach streams must share the client's pool."""
DEFAULT_OPEN_FILES = 1024
"""Descriptors per process when the host's table allows it: the usual soft limit. Not
more where more would fit: some programs size tables by the limit or close every possible
descriptor before an exec, and are slow under a limit of a million."""
MIN_OPEN_FILES = 256
"""The least a derived limit may be before the pool refuses to start: macOS's default soft
limit, under which common build, test and install tools work."""
SHM_SIZE = 64 << 20
"""``/dev/shm``'s size, Docker's own default; mounted by tangram so its inodes are bounded."""
RUNNER_RESERVE = 64 << 20
"""Memory kept beside what the tmpfs mounts may hold, for the runner and the next action's
prepared process: were files alone able to fill the container's limit, the kernel would
kill the runner once no command is left to kill, and a tool call would fail the step."""
SHM_SEGMENTS = 4096
"""SysV shared memory segments an IPC namespace may hold (the kernel's ``SHMMNI`` for a new
one; a container cannot change it): each is a file of the host's table while it exists."""

T = TypeVar("T")


def _size(value: str | int) -> int:
    return int(parse_size(value)) if isinstance(value, str) else int(value)


def _size_field(instance: object, attribute: Any, value: object) -> None:
    if value is not None or attribute.name != "memory":
        byte_size(attribute.name, value)


def _text(instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, str):
        raise SettingTypeError(f"`{attribute.name}` must be a string (got {value!r})")
    if not value:
        raise InvalidSettingError(f"`{attribute.name}` must be a non-empty string (got '')")


def _flag(instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, bool):
        raise SettingTypeError(f"`{attribute.name}` must be True or False (got {value!r})")


def _names(instance: object, attribute: Any, value: object) -> None:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise SettingTypeError(f"`{attribute.name}` must be a tuple of names (got {value!r})")
    for name in value:
        _text(instance, attribute, name)


def _environment(instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SettingTypeError(f"`env` must map names to strings (got {value!r})")


def _pids(instance: object, attribute: Any, value: object) -> None:
    if value is not None:
        whole(attribute.name, value, minimum=1)


def _open_files(instance: object, attribute: Any, value: object) -> None:
    if value is not None:
        whole(attribute.name, value, minimum=16)


def _sandbox_user(instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, str):
        raise SettingTypeError(f"`user` must be a string 'UID' or 'UID:GID' (got {value!r})")
    uid, _, gid = value.partition(":")
    if not uid.isdigit() or not (gid.isdigit() or not gid):
        raise InvalidSettingError(f"`user` must be numeric, 'UID' or 'UID:GID' (got {value!r})")
    if int(uid) == 0 or (gid and int(gid) == 0):
        raise InvalidSettingError(
            f"`user` must not be root (got {value!r}): commands run under a user other than "
            "the runner's, so they can neither write on its channel nor trace it"
        )


@attrs.frozen(kw_only=True)
class DockerConfig:
    """How sandbox containers are made. Defaults are the hardened ones.

    :param image: any image with ``python3`` (and its ``ctypes``) on its ``PATH``.
    :param memory: memory limit (swap included), ``None`` for none.
    :param pids: most processes (threads count too) in the container, ``None`` for none
        (which leaves the files a sandbox may open unbounded too: warned at start).
    :param open_files: descriptors each process may hold (``nofile``, soft = hard, which
        no command can raise). Default: 1024, or less where the host's file table is
        small (see :func:`open_files_for`); the pool refuses to start where that is under
        256, or where a value given here would let sandboxes fill the table.
    :param network: ``"none"`` (default) or a Docker network name to allow network.
    :param read_only: read-only root file system (the work dir and ``/tmp`` are tmpfs).
    :param work_size: size of the tmpfs work dir (``/work``), also the most one ``get``
        returns.
    :param tmp_size: size of ``/tmp`` (``/dev/shm`` is 64 MiB). The three mounts, their
        inodes and a reserve for the runner must fit in ``memory``: where they do not,
        each is lowered by the same factor (:attr:`mounts`), so no command's files can
        leave the runner nothing and fail the sandbox.
    :param user: the numeric ``"UID:GID"`` commands run as (never root). The runner runs
        as root inside the container with only the capabilities to switch to this user
        and to kill what it leaves behind, so no command can reach the runner's channel.
    :param cap_drop: capabilities dropped (default all); ``cap_add`` puts some back.
    :param no_new_privileges: forbid setuid gains for the runner (commands never get any).
    :param fast_path: write cgroup files directly when the daemon is local.
    :param sync_docker_view: after a direct write, also send the values to the API once
        they have held ``sync_after`` seconds, so ``docker inspect`` shows the grant.
    :param api_timeout: seconds any one Engine API call may take before the daemon is
        taken as stalled (:class:`SandboxBrokenError`).
    :param io_timeout: seconds a file move (or stopping a cancelled action) may go without
        progress on the runner's channel before the sandbox is taken as broken.
    """

    image: str = attrs.field(default="tangram-sandbox-test:latest", validator=_text)
    memory: str | int | None = attrs.field(default="1GiB", validator=_size_field)
    pids: int | None = attrs.field(default=256, validator=_pids)
    open_files: int | None = attrs.field(default=None, validator=_open_files)
    network: str = attrs.field(default="none", validator=_text)
    read_only: bool = attrs.field(default=True, validator=_flag)
    work_size: str | int = attrs.field(default="512MiB", validator=_size_field)
    tmp_size: str | int = attrs.field(default="64MiB", validator=_size_field)
    user: str = attrs.field(default="65534:65534", validator=_sandbox_user)
    cap_drop: tuple[str, ...] = attrs.field(default=("ALL",), validator=_names)
    cap_add: tuple[str, ...] = attrs.field(default=(), validator=_names)
    no_new_privileges: bool = attrs.field(default=True, validator=_flag)
    fast_path: bool = attrs.field(default=True, validator=_flag)
    sync_docker_view: bool = attrs.field(default=True, validator=_flag)
    sync_after: float = attrs.field(default=1.0, validator=non_negative)
    api_timeout: float = attrs.field(default=30.0, validator=positive)
    io_timeout: float = attrs.field(default=30.0, validator=positive)
    env: Mapping[str, str] = attrs.field(factory=dict, validator=_environment)

    def __attrs_post_init__(self) -> None:
        self.mounts  # noqa: B018 -- a memory too small for any files fails here, at the call

    @property
    def memory_bytes(self) -> int | None:
        """``memory`` in bytes, ``None`` for no limit."""
        return None if self.memory is None else _size(self.memory)

    @functools.cached_property
    def mounts(self) -> tuple[int, int, int]:
        """The sizes of ``/work``, ``/tmp`` and ``/dev/shm``: as asked, or lowered by one
        factor until their bytes and inodes fit in ``memory`` beside the runner's reserve.

        :raises InvalidSettingError: ``memory`` leaves under 1 MiB per mount.
        """
        asked = (_size(self.work_size), _size(self.tmp_size), SHM_SIZE)
        if self.memory_bytes is None:
            return asked
        room = self.memory_bytes - RUNNER_RESERVE
        if sum(held(size) for size in asked) <= room:
            return asked
        low, high = 0.0, 1.0  # held() grows with the size: bisect the common factor
        for _ in range(50):
            middle = (low + high) / 2
            if sum(held(int(size * middle)) for size in asked) <= room:
                low = middle
            else:
                high = middle
        fitted = tuple(int(size * low) // 4096 * 4096 for size in asked)
        if min(fitted) < 1 << 20:
            raise InvalidSettingError(
                f"`memory={self.memory!r}` cannot hold a sandbox's files (/work, /tmp and "
                f"/dev/shm, 1 MiB each at least, and their inodes) beside the runner's "
                f"{RUNNER_RESERVE >> 20} MiB: give it more memory"
            )
        return fitted[0], fitted[1], fitted[2]

    @property
    def work_bytes(self) -> int:
        """The work dir's size in bytes: no file in it can be larger."""
        return self.mounts[0]

    @property
    def ids(self) -> tuple[int, int]:
        """The sandbox user's uid and gid."""
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid or uid)

    def container_spec(
        self, name: str, cores: str, python: str, runner: str, open_files: int
    ) -> dict[str, Any]:
        uid, gid = self.ids
        # Every mount bounds its inodes too: an empty file is about 1.2 KiB of kernel
        # memory that ``size=`` does not count, and 843k of them in /tmp filled the
        # container's limit with no process to kill but the runner. /dev/shm is mounted
        # here (Docker then skips its own, which bounds only its bytes).
        work, tmp, shm = self.mounts
        tmpfs = {
            "/work": f"rw,exec,{_bounded(work)},mode=0700,uid={uid},gid={gid}",
            "/tmp": f"rw,nosuid,{_bounded(tmp)},mode=1777",
            "/dev/shm": f"rw,nosuid,nodev,noexec,{_bounded(shm)},mode=1777",
            # No pseudo-terminals: the kernel's `pty.max` is one count for the whole host
            # (every container's devpts instance draws on it), so one sandbox holding
            # 3,072 of them made another's `openpty` fail, and the host's own logins.
            "/dev/pts": "ro,nosuid,noexec,size=4k,mode=0755",
        }
        host: dict[str, Any] = {
            "NetworkMode": self.network,
            "ReadonlyRootfs": self.read_only,
            "Tmpfs": tmpfs,
            "CapDrop": list(self.cap_drop),
            "CapAdd": [*RUNNER_CAPS, *(cap for cap in self.cap_add if cap not in RUNNER_CAPS)],
            "SecurityOpt": ["no-new-privileges"] if self.no_new_privileges else [],
            "CpusetCpus": cores,
            "CpuPeriod": PERIOD_US,
            # Booted with one core's quota (the runner's start at the parked 1% would take
            # seconds), parked as soon as it answers.
            "CpuQuota": PERIOD_US,
            "AutoRemove": False,
            # The channel carries every reply; a log would copy each one to the daemon's
            # disk, without a bound. Attaching works without a log.
            "LogConfig": {"Type": "none", "Config": {}},
            # Soft = hard: without CAP_SYS_RESOURCE no process here can raise it.
            # A POSIX message queue is charged to its owner's uid across the host (every
            # sandbox's commands share one) and outlives the action in its IPC namespace:
            # one sandbox's queues made another's `mq_open` fail. None may be made.
            "Ulimits": [
                {"Name": "nofile", "Soft": open_files, "Hard": open_files},
                {"Name": "msgqueue", "Soft": 0, "Hard": 0},
            ],
            # A SysV segment lives in the IPC namespace, not in a process: without this a
            # parked sandbox kept up to SHM_SEGMENTS files of the host's table, and about
            # 600 parked sandboxes filled a 24 GiB host's with no command running. Forced,
            # a segment goes with the last process that created or attached it, so with
            # the action's leftovers; nothing between actions could have used it.
            "IpcMode": "private",
            # SysV semaphores and message queues are not forced away with their processes:
            # they stayed in the IPC namespace after the action, charged to the container
            # and owned by nothing, and a parked sandbox held 981 MiB of them against the
            # tens its reservation counts. None may be made (POSIX semaphores, which
            # Python's multiprocessing uses, live in /dev/shm and go with the action).
            "Sysctls": {
                "kernel.shm_rmid_forced": "1",
                "kernel.sem": "0 0 0 0",
                "kernel.msgmni": "0",
            },
        }
        if self.memory_bytes is not None:
            host["Memory"] = host["MemorySwap"] = self.memory_bytes
        if self.pids is not None:
            host["PidsLimit"] = self.pids
        return {
            "Image": self.image,
            "Cmd": [python, "-c", runner, str(uid), str(gid)],
            "User": "0:0",
            "WorkingDir": "/",
            "Env": [f"{k}={v}" for k, v in self.env.items()],
            "OpenStdin": True,
            "StdinOnce": False,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
            "NetworkDisabled": self.network == "none",
            "Labels": {LABEL: name, **owner_labels()},
            "HostConfig": host,
        }


def _bounded(size: int) -> str:
    return f"size={size},nr_inodes={inodes_for(size)}"


def open_files_for(
    config: DockerConfig, file_max: int, running: int, where: str
) -> tuple[int, str | None]:
    """The ``nofile`` limit for sandboxes on a daemon, and a warning to log, if any.

    Every open file is one entry of the host's table (``fs.file-max``); when it is full,
    no process without ``CAP_SYS_ADMIN`` can open anything, another trajectory's action
    and the trainer's own files included. The count that must stay under it is what the
    sandboxes that may *run* at once can hold: at most one per core lent on the daemon
    (``running``; an action holds at least one whole core, never shared), since the runner
    kills every process an action left before it answers, and a parked sandbox holds only
    the runner's few files. One running sandbox holds at most ``open_files`` in each of
    its ``pids`` processes, and one file per SysV segment. Half the table is left to the
    host (its daemons, the trainer, the daemon's own streams for every live sandbox).

    This bounds descriptors, the way the issue's attack used. A file can also be held
    without one (a mapping of it, an io_uring registered file where the daemon's seccomp
    profile allows io_uring, as before Docker 25); those are bounded per sandbox by its
    memory limit only, about 400 bytes of kernel memory each (see docs/threat-model.md).

    :raises InvalidSettingError: the limit that keeps the table safe is under
        ``MIN_OPEN_FILES`` (with the default), or under ``config.open_files`` (given).
    """
    asked = config.open_files
    if config.pids is None:
        return asked or DEFAULT_OPEN_FILES, (
            f"pids=None on {where}: a sandbox may start any number of processes, so the "
            f"files its running sandboxes may hold are unbounded (fs.file-max {file_max})"
        )
    share = file_max // 2 // max(1, running)
    fits = max(0, (share - SHM_SEGMENTS) // config.pids)
    said = (
        f"half of fs.file-max ({file_max}) on {where} over the {running} sandboxes that "
        f"may run there at once (one per core lent) leaves {share} files each: "
        f"{fits} open files in each of pids={config.pids} processes"
    )
    if asked is not None and asked > fits:
        raise InvalidSettingError(
            f"`open_files={asked}` is over what the host's file table allows: {said}; "
            "lower open_files or pids, lend fewer cores, or raise fs.file-max"
        )
    if asked is None and fits < MIN_OPEN_FILES:
        raise InvalidSettingError(
            f"the host's file table is too small for these settings: {said}, under the "
            f"{MIN_OPEN_FILES} programs are given at least; lower pids, lend fewer cores, "
            "raise fs.file-max, or set open_files to accept fewer"
        )
    return asked if asked is not None else min(DEFAULT_OPEN_FILES, fits), None


def stream_client(client: Any) -> tuple[Any, int | None]:
    """A client for the attach streams whose pool has no cap, and the cap where it must.

    Made for the connections aiodocker makes itself (a Unix socket, plain TCP) from the
    API client's own settings, so both reach the same daemon. Over TLS or SSH the streams
    share the API client's pool: then the live sandboxes on that host are capped below its
    size (the cap is returned) so that API calls always find a connection.
    """
    import aiodocker
    import aiohttp

    connector = client.connector
    if isinstance(connector, aiohttp.UnixConnector):
        unbounded: aiohttp.BaseConnector = aiohttp.UnixConnector(connector.path, limit=0)
    elif isinstance(connector, aiohttp.TCPConnector) and client.docker_host.startswith(
        ("tcp://", "http://")
    ):
        unbounded = aiohttp.TCPConnector(limit=0)
    else:
        return client, max(1, connector.limit - STREAM_HEADROOM) if connector.limit else None
    return aiodocker.Docker(url=client.docker_host, connector=unbounded), None


@attrs.define(eq=False)
class HostInfo:
    host: Host
    client: Any
    streams: Any
    local: bool
    cgroup_version: str
    url: str
    stream_limit: int | None
    streams_open: int = 0
    open_files: int = DEFAULT_OPEN_FILES
    """The ``nofile`` limit of its sandboxes (:func:`open_files_for`), set at start."""
    file_max: int = 0
    """The daemon's host's ``fs.file-max``, measured at start."""
    running: int = 0
    """Cores lent on that daemon by every host of the backend: the most sandboxes running."""
    boots: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(BOOTS))

    async def call(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        timeout: float,  # noqa: ASYNC109 - each call's own deadline, not the caller's
    ) -> T:
        """One Engine API call with a deadline; its failure as a typed error.

        :raises SandboxBrokenError: the daemon did not answer within ``timeout``.
        :raises SandboxError: the daemon answered with an error (the cause attached).
        """
        try:
            with anyio.fail_after(timeout):
                return await call()
        except TimeoutError as exc:
            raise SandboxBrokenError(
                f"the Docker daemon at {self.url} did not answer {what} within {timeout:g} s"
            ) from exc
        except Exception as exc:
            raise SandboxError(f"the Docker daemon at {self.url} failed {what}: {exc}") from exc

    def take_stream(self) -> None:
        """Count one more attach connection held by a sandbox of this host.

        :raises SandboxError: all are taken (only where streams share the API's pool).
        """
        if self.stream_limit is not None and self.streams_open >= self.stream_limit:
            raise SandboxError(
                f"at most {self.stream_limit} live sandboxes on {self.url}: the attach "
                "connections share the HTTP client's pool there (TLS or SSH)"
            )
        self.streams_open += 1
