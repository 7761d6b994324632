"""The seam between the sandbox pool and where sandboxes live, and how backends are found.

A backend turns core ids into effects (a cgroup cpuset and CFS quota for Docker, CPU
affinity for the embedded local backend) behind :class:`SandboxBackend`; the pool never
imports one. Backends are looked up by name, lazily (as anyio finds its async backends):
the pool, the config file and the CLI read the names from :data:`BACKENDS`, the one place
a backend is named, and only the backend asked for is imported, so Docker's client is not
loaded where it is not used. Adding a backend is a folder below this package and one entry
there (docs/sandboxes.md, "Adding a backend").
"""

from __future__ import annotations

import abc
import importlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import SettingTypeError, UnknownBackendError

__all__ = [
    "BACKENDS",
    "CPUS_ENV",
    "DEFAULT_OUTPUT_LIMIT",
    "DEFAULT_TIMEOUT",
    "EMBEDDED_BACKEND",
    "ExecRequest",
    "ExecResult",
    "Host",
    "RunResult",
    "SandboxBackend",
    "SandboxHandle",
    "backend_class",
    "default_backend",
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

    @classmethod
    async def usable(cls) -> bool:
        """Whether this backend can start here with its defaults (for the default choice)."""
        return True

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SandboxBackend:
        """The backend a config file's ``[sandbox]`` table describes, from its own keys.

        The pool's keys (``backend``, ``warm``, ``timeout``) are taken out before; the rest
        are this backend's. The default passes them as keyword arguments; a backend whose
        constructor takes them grouped (Docker's ``DockerConfig``) overrides this.

        :raises TypeError: a key this backend does not take.
        :raises ValueError: a value it refuses (``InvalidSettingError`` is one).
        """
        return cls(**options)

    @classmethod
    def lending(cls, cores: Sequence[int]) -> SandboxBackend:
        """This backend with its defaults, lending only ``cores`` of this machine.

        For tools that size a run to part of the machine (``tangram bench --cores``) and
        build whichever backend was named, without knowing its constructor. The default
        passes ``cores`` through :meth:`from_options`; a backend that keys its cores
        otherwise (Docker's, per daemon) overrides this.
        """
        return cls.from_options({"cores": tuple(cores)})

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections; sandboxes were destroyed by the pool before this."""


# -- finding backends -----------------------------------------------------------------

EMBEDDED_BACKEND = "local"
"""The backend that needs nothing but this host: what a config file's ``[sandbox]`` and
``tangram bench`` use when they name none, and :func:`default_backend`'s last resort."""

BACKENDS: Mapping[str, str] = {
    "docker": "._docker:DockerBackend",
    EMBEDDED_BACKEND: "._local:LocalBackend",
}
"""Backend name -> ``module:class`` below this package, imported only when asked for.

The order is :func:`default_backend`'s preference: the first one usable here is the
default, so a backend that needs more than this host (a daemon) comes before the embedded
one, which always starts.
"""


def backend_class(name: str) -> type[SandboxBackend]:
    """The backend class registered as ``name``.

    :raises SettingTypeError: ``name`` is not a string.
    :raises UnknownBackendError: no backend has that name (also a ``LookupError``).
    :raises ImportError: its optional dependency is missing (``tangram[docker]``).
    """
    if not isinstance(name, str):
        raise SettingTypeError(f"a sandbox backend name must be a string (got {name!r})")
    try:
        where = BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"no sandbox backend named {name!r} (known: {sorted(BACKENDS)})"
        ) from None
    module, _, attribute = where.partition(":")
    found: type[SandboxBackend] = getattr(importlib.import_module(module, __package__), attribute)
    return found


async def default_backend() -> SandboxBackend:
    """The first backend of :data:`BACKENDS` usable here (logged either way).

    Docker when aiodocker is installed, a daemon answers and its image is present, else
    the embedded local backend.

    :raises UnknownBackendError: none is usable here (also a ``LookupError``).
    """
    for name in BACKENDS:
        try:
            cls = backend_class(name)
        except ImportError:
            continue
        if await cls.usable():
            logger.info("sandbox pool: using the %s backend", name)
            return cls()
        logger.info("sandbox pool: the %s backend is not usable here", name)
    raise UnknownBackendError(
        f"no sandbox backend is usable here (tried: {', '.join(BACKENDS)}): pass "
        "`backend=` a tangram.abc.SandboxBackend"
    )
