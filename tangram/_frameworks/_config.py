"""One file that says how a process gets its scheduler: the adapters' configuration.

RL frameworks build tools, reward managers and agent executors themselves, in many worker
processes, with no arguments tangram could add. What they can pass is a path (in a tool's
YAML, or the ``TANGRAM_CONFIG`` environment variable every worker inherits), so the whole
set-up (capacities, policy, sandboxes, GPU services, API quotas, and whether the scheduler
is this process's own or one shared on Ray) is written once, in a file::

    mode = "shared"           # the default: one scheduler per Ray job (see below);
                              # "local": this process's own; "ray": the driver's actor
    [capacity]                # exactly what tangram.Runtime(capacity=...) takes
    cpu = 8
    search = "5/s"
    [policy]                  # optional
    name = "elastic"          # or "fcfs" with dop = N
    [sandbox]                 # optional: a SandboxPool
    backend = "local"         # or "docker"
    warm = 4
    [ray]                     # name .. detached: used when mode = "ray"
    name = "tangram"
    namespace = "my-job"
    detached = false          # create = false: only look the driver's actor up
    lease_timeout = 10        # shared and ray modes: seconds before a silent worker's
                              # grants come back (heartbeat = 1: seconds between beats)
    [adapters.verl]           # settings of one framework's adapter, read by it
    record = "traces/"        # optional, local mode: each scheduler writes what it
                              # served there as a tangram-trace/1 file when it stops

Beyond these, ``[gpu]`` declares torch model services (``[[gpu.services]]``) and
``[quota.NAME]`` the keys of a rate-limited API; their resources join the capacity.

``mode = "shared"`` (the default) gives every worker process of a Ray job (verl's and
OpenRLHF's workers all are Ray actors) one scheduler, created by whichever worker comes
first, and each node one host agent that owns its sandboxes (``[sandbox]``, its cores
as ``cpu@<node>``) and GPU services (``[gpu]``, loaded once per node); ``[capacity]``
and quotas are the job's, not a node's (:mod:`tangram._shared._on_ray`). A process outside
Ray falls back to a scheduler of its own, with a WARNING that its limits are per process.

The file is read and checked whole when it is loaded, so a typo fails in the process that
read it, naming the key, instead of as a scheduler that never admits anything.

This module only reads and checks: nothing here starts a scheduler, a pool or a backend,
so a process can load a config (a CLI, a driver that only passes the path on) without
paying for what the config would open. :mod:`._open` opens the scheduler a config names,
:mod:`._session` the pools beside it; both import this module, never the reverse. Policy
and sandbox backend names are the registries' (:data:`tangram._core._policies.POLICIES`,
:data:`tangram._sandbox._backend.BACKENDS`), so a policy or backend added there is a
config value at once.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .._core._policies import DEFAULT_POLICY, POLICIES, policy_class
from .._core._policy import Policy
from .._core._resources import parse_capacity
from .._core._units import parse_size
from .._core._validate import seconds, whole
from .._sandbox._backend import BACKENDS, EMBEDDED_BACKEND, SandboxBackend, backend_class
from ..errors import ConfigError, InvalidCapacityError

# The same numbers as tangram.ray's, repeated so that reading a config never imports Ray.
DEFAULT_HEARTBEAT = 1.0
DEFAULT_TIMEOUT = 10.0

__all__ = [
    "ENV_VAR",
    "Config",
    "ConfigError",
    "GpuConfig",
    "GpuServiceConfig",
    "PolicyConfig",
    "QuotaConfig",
    "RayConfig",
    "SandboxConfig",
    "load",
    "parse",
]

#: The environment variable naming the config file when no path is given.
ENV_VAR = "TANGRAM_CONFIG"

MODES = ("shared", "local", "ray")
#: The backend a ``[sandbox]`` table without ``backend`` gets: one that needs no daemon.
DEFAULT_BACKEND = EMBEDDED_BACKEND


def _frozen_mapping(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


@attrs.frozen(kw_only=True)
class PolicyConfig:
    """``[policy]``: which policy, and the keyword arguments it is built with."""

    name: str = DEFAULT_POLICY
    options: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def build(self) -> Policy:
        """The policy object; a bad option (or a name no policy has) is a :class:`ConfigError`."""
        try:
            return policy_class(self.name)(**self.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[policy] {self.name}: {exc}") from exc


@attrs.frozen(kw_only=True)
class SandboxConfig:
    """``[sandbox]``: a :class:`tangram.SandboxPool` per process.

    ``options`` (with ``image``, when given) go to the backend registered as ``backend``,
    through the backend class's ``from_options``.
    """

    backend: str = DEFAULT_BACKEND
    image: str | None = None
    warm: int = 0
    timeout: float | None = None
    options: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)


@attrs.frozen(kw_only=True)
class GpuServiceConfig:
    """One ``[[gpu.services]]`` entry: a torch module built by ``factory`` (``"pkg.mod:fn"``)."""

    name: str
    factory: str
    memory: str | int | None = None
    options: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)


@attrs.frozen(kw_only=True)
class GpuConfig:
    """``[gpu]``: the devices (name to memory) and the torch services placed on them."""

    devices: dict[str, str | int] = attrs.field(factory=dict, converter=_frozen_mapping)
    services: tuple[GpuServiceConfig, ...] = ()


@attrs.frozen(kw_only=True)
class QuotaConfig:
    """One ``[quota.NAME]`` table: the keys of one API (see :class:`tangram.quota.ApiKey`)."""

    name: str
    keys: tuple[dict[str, Any], ...]
    options: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)


@attrs.frozen(kw_only=True)
class RayConfig:
    """``[ray]``: where the shared scheduler lives when ``mode = "ray"``.

    ``create = false`` only looks the actor up (the driver created it); ``detached = true``
    lets an actor created by one worker outlive that worker (kill it when the job ends).
    A non-detached actor shares the fate of the process that created it, so in a job of
    many workers either the driver creates it or it is detached. ``heartbeat`` and
    ``lease_timeout`` (seconds) serve both shared modes: a worker silent for
    ``lease_timeout`` loses its grants, and in ``mode = "shared"`` the job's actors end
    that long after the last worker's went.
    """

    name: str = "tangram"
    namespace: str | None = None
    address: str | None = None
    create: bool = True
    detached: bool = False
    heartbeat: float = DEFAULT_HEARTBEAT
    lease_timeout: float = DEFAULT_TIMEOUT


@attrs.frozen(kw_only=True)
class Config:
    """A checked tangram config (see :func:`load`); built from a file or with :func:`parse`."""

    mode: str = "shared"
    capacity: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    policy: PolicyConfig | None = None
    sandbox: SandboxConfig | None = None
    gpu: GpuConfig | None = None
    quotas: tuple[QuotaConfig, ...] = ()
    ray: RayConfig = attrs.field(factory=RayConfig)
    adapters: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    record: str | None = None
    source: str | None = None


# -- reading -------------------------------------------------------------------------------


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and check a config file (TOML, or JSON with the same structure).

    With no ``path``, the file named by ``$TANGRAM_CONFIG``.

    :raises ConfigError: no path and no ``$TANGRAM_CONFIG``, a missing or unreadable file,
        a syntax error, an unknown key, or a value of the wrong type or range.
    """
    if path is None:
        named = os.environ.get(ENV_VAR)
        if not named:
            raise ConfigError(f"no config path given and ${ENV_VAR} is not set")
        path = named
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read tangram config {str(file)!r}: {exc}") from exc
    data = _decode(file, text)
    return parse(data, source=str(file))


def _decode(file: Path, text: str) -> Mapping[str, Any]:
    where = f"tangram config {str(file)!r}"
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # a number past 4,300 digits, or nesting
            raise ConfigError(f"{where}: invalid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be an object")
        return data
    if file.suffix != ".toml":
        raise ConfigError(f"{where}: the file must end in .toml or .json")
    if sys.version_info >= (3, 11):
        import tomllib

        try:
            return tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as exc:
            raise ConfigError(f"{where}: invalid TOML: {exc}") from exc
    raise ConfigError(  # pragma: no cover - Python 3.10 only
        f"{where}: reading TOML needs Python 3.11 or later; write the same structure as JSON"
    )


_TOP = {"mode", "capacity", "policy", "sandbox", "gpu", "quota", "ray", "adapters", "record"}


def parse(data: Mapping[str, Any], *, source: str | None = None) -> Config:
    """Check an already decoded config (a dict shaped like the file).

    :raises ConfigError: an unknown key, or a value of the wrong type or range.
    """
    where = f"tangram config {source!r}" if source else "tangram config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: must be a table (got {type(data).__name__})")
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(_TOP)}")
    mode = data.get("mode", "shared")
    if mode not in MODES:
        raise ConfigError(f"{where}: `mode` must be one of {list(MODES)} (got {mode!r})")
    capacity = _table(data, "capacity", where)
    try:
        if capacity:  # pools may bring every resource; their own are added at start
            parse_capacity(capacity)
    except (InvalidCapacityError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: [capacity]: {exc}") from exc
    policy = _policy(data, where)
    sandbox = _sandbox(data, where)
    gpu = _gpu(data, where)
    quotas = _quotas(data, where)
    ray_table = _table(data, "ray", where)
    here = f"{where}: [ray]"
    _keys(
        ray_table,
        {"name", "namespace", "address", "create", "detached", "heartbeat", "lease_timeout"},
        here,
    )
    for flag in ("create", "detached"):
        if not isinstance(ray_table.get(flag, False), bool):
            raise ConfigError(f"{here} `{flag}` must be true or false")
    error = _error_at(here)
    heartbeat = seconds(
        "heartbeat",
        ray_table.get("heartbeat", DEFAULT_HEARTBEAT),
        strict=True,
        type_error=error,
        value_error=error,
    )
    lease_timeout = seconds(
        "lease_timeout",
        ray_table.get("lease_timeout", DEFAULT_TIMEOUT),
        strict=True,
        type_error=error,
        value_error=error,
    )
    if lease_timeout < 2 * heartbeat:
        raise ConfigError(
            f"{here} `lease_timeout` must be at least twice `heartbeat` "
            f"(got {lease_timeout:g} s < 2 x {heartbeat:g} s)"
        )
    ray = RayConfig(
        name=_str(ray_table, "name", "tangram", here),
        namespace=_opt_str(ray_table, "namespace", here),
        address=_opt_str(ray_table, "address", here),
        create=ray_table.get("create", True),
        detached=ray_table.get("detached", False),
        heartbeat=heartbeat,
        lease_timeout=lease_timeout,
    )
    record = data.get("record")
    if record is not None:
        if not isinstance(record, str) or not record:
            raise ConfigError(f"{where}: `record` must be a directory path (got {record!r})")
        if mode == "ray":
            # The shared actor's runtime serves every worker; a per-process recorder
            # would see none of it. (Shared mode records only where it falls back to a
            # scheduler of this process's own, and refuses to start on Ray.)
            raise ConfigError(f"{where}: `record` needs mode = 'local'")
    if mode != "ray" and not capacity and sandbox is None and gpu is None and not quotas:
        raise ConfigError(
            f"{where}: nothing to schedule: give [capacity] (or [sandbox], [gpu], [quota.NAME])"
        )
    return Config(
        mode=mode,
        capacity=capacity,
        policy=policy,
        sandbox=sandbox,
        gpu=gpu,
        quotas=quotas,
        ray=ray,
        adapters=_table(data, "adapters", where),
        record=record,
        source=source,
    )


def _table(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: [{key}] must be a table (got {value!r})")
    return dict(value)


def _keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(allowed)}")


def _str(table: Mapping[str, Any], key: str, default: str, where: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: `{key}` must be a non-empty string (got {value!r})")
    return value


def _opt_str(table: Mapping[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    return _str(table, key, "", where)


def _error_at(where: str) -> Callable[[str], ConfigError]:
    """The shared checks' errors as :class:`ConfigError`, saying where in the file."""

    def error(message: str) -> ConfigError:
        return ConfigError(f"{where} {message}")

    return error


def _count(table: Mapping[str, Any], key: str, default: int, where: str) -> int:
    error = _error_at(f"{where}:")
    return whole(key, table.get(key, default), type_error=error, value_error=error)


def _policy(data: Mapping[str, Any], where: str) -> PolicyConfig | None:
    if "policy" not in data:
        return None
    table = _table(data, "policy", where)
    name = table.pop("name", DEFAULT_POLICY)
    if not isinstance(name, str) or name not in POLICIES:
        raise ConfigError(
            f"{where}: [policy] `name` must be {_one_of(sorted(POLICIES))} (got {name!r})"
        )
    config = PolicyConfig(name=name, options=table)
    try:
        config.build()  # every option checked now, not in a worker later
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return config


def _sandbox(data: Mapping[str, Any], where: str) -> SandboxConfig | None:
    if "sandbox" not in data:
        return None
    table = _table(data, "sandbox", where)
    here = f"{where}: [sandbox]"
    backend = table.pop("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(f"{here} `backend` must be one of {sorted(BACKENDS)} (got {backend!r})")
    warm = _count(table, "warm", 0, here)
    table.pop("warm", None)
    image = _opt_str(table, "image", here)
    table.pop("image", None)
    if image is not None and not _takes(backend, "image"):
        takers = [name for name in sorted(BACKENDS) if _takes(name, "image")]
        whose = f"the {_one_of(takers, quote=False)} backend" if takers else "no registered backend"
        raise ConfigError(f"{here} `image` is for {whose} (backend is {backend!r})")
    timeout = table.pop("timeout", None)
    if timeout is not None:
        error = _error_at(here)
        timeout = seconds("timeout", timeout, strict=True, type_error=error, value_error=error)
    return SandboxConfig(
        backend=backend,
        image=image,
        warm=warm,
        timeout=timeout,
        options=table,
    )


def _takes(backend: str, key: str) -> bool:
    """Whether the backend registered as ``backend`` may take the ``[sandbox]`` key ``key``.

    Asked of the class without building a backend (building one is :func:`check`'s, in
    the process that will use it): a backend that reads its options with the default
    ``SandboxBackend.from_options`` takes its constructor's keywords; one
    that reads them its own way is taken at its word until it is built. A backend whose
    optional dependency is missing cannot be asked, and is not refused here either.
    """
    try:
        cls = backend_class(backend)
    except ImportError:
        return True
    below = cls.__mro__[: cls.__mro__.index(SandboxBackend)]
    if any("from_options" in vars(c) for c in below):
        return True
    parameters = inspect.signature(cls).parameters.values()
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == key and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def _one_of(names: Iterable[str], *, quote: bool = True) -> str:
    """``'a', 'b' or 'c'``: the known names, as a message lists them."""
    shown = [repr(name) if quote else name for name in names]
    if len(shown) < 2:
        return "".join(shown)
    return f"{', '.join(shown[:-1])} or {shown[-1]}"


def _gpu(data: Mapping[str, Any], where: str) -> GpuConfig | None:
    if "gpu" not in data:
        return None
    table = _table(data, "gpu", where)
    here = f"{where}: [gpu]"
    _keys(table, {"devices", "services"}, here)
    devices = table.get("devices", {})
    if not isinstance(devices, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (str, int)) and not isinstance(v, bool)
        for k, v in devices.items()
    ):
        raise ConfigError(f"{here} `devices` must map device names to memory (got {devices!r})")
    for device, size in devices.items():
        _size(size, f"{here} `devices` {device!r}")
    raw = table.get("services", [])
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{here} needs at least one [[gpu.services]] entry")
    services = []
    for i, entry in enumerate(raw):
        at = f"{here} services[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at} must be a table (got {entry!r})")
        entry = dict(entry)
        name = _str(entry, "name", "", at)
        factory = _str(entry, "factory", "", at)
        if ":" not in factory:
            raise ConfigError(f"{at} `factory` must be 'module:function' (got {factory!r})")
        memory = entry.pop("memory", None)
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (str, int))):
            raise ConfigError(f"{at} `memory` must be bytes or a size like '2GiB' (got {memory!r})")
        if memory is not None:
            _size(memory, f"{at} `memory`")
        del entry["name"], entry["factory"]
        services.append(GpuServiceConfig(name=name, factory=factory, memory=memory, options=entry))
    if len({s.name for s in services}) != len(services):
        raise ConfigError(f"{here} two services share a name")
    return GpuConfig(devices=dict(devices), services=tuple(services))


def _quotas(data: Mapping[str, Any], where: str) -> tuple[QuotaConfig, ...]:
    table = _table(data, "quota", where)
    quotas = []
    for name, body in table.items():
        at = f"{where}: [quota.{name}]"
        if not isinstance(body, Mapping):
            raise ConfigError(f"{at} must be a table (got {body!r})")
        body = dict(body)
        keys = body.pop("keys", None)
        if not isinstance(keys, list) or not keys or not all(isinstance(k, Mapping) for k in keys):
            raise ConfigError(f"{at} `keys` must be a non-empty list of tables")
        quotas.append(QuotaConfig(name=name, keys=tuple(dict(k) for k in keys), options=body))
    return tuple(quotas)


def _size(value: object, at: str) -> None:
    if isinstance(value, str):
        try:
            parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{at}: {exc}") from exc
