"""``tangram doctor``: what this host offers tangram, and what ``tangram bench`` will use.

Every probe is guarded: a missing optional piece (Docker, NVML, Ray, torch) is reported
as missing, never raised, because the command exists to tell a newcomer what is there
before anything fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

__all__ = ["diagnose", "format_diagnosis", "orphaned_sandboxes", "reap_orphaned_sandboxes"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _guard(probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def _cores() -> dict[str, int]:
    return {"usable": len(os.sched_getaffinity(0)), "online": os.cpu_count() or 0}


def _memory() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    return "unknown"


def _cgroup() -> str:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return "v2"
    if (CGROUP_ROOT / "cpu").exists() or (CGROUP_ROOT / "cpuset").exists():
        return "v1"
    return "none found"


def _version(module: str) -> str | None:
    """The installed version of ``module``, or None when it cannot be imported.

    Found without importing it: importing Ray alone takes seconds.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        return None
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def _docker() -> str:
    try:
        from .._sandbox._docker._backend import DockerConfig, docker_usable
    except ImportError:
        return "not usable: aiodocker is not installed (pip install 'tangram[docker]')"

    async def probe() -> bool:
        with anyio.move_on_after(5):
            return await docker_usable()
        return False

    if anyio.run(probe):
        try:
            orphans = len(orphaned_sandboxes())
        except Exception:  # the daemon went away since the probe: reachability says it
            orphans = 0
        left = f"; {orphans} orphaned sandboxes (tangram doctor --reap)" if orphans else ""
        return f"reachable, image {DockerConfig().image} present{left}"
    return "not reachable (no daemon answers, or the sandbox image is missing)"


def orphaned_sandboxes() -> list[dict[str, str]]:
    """Sandbox containers on the default daemon left by owners on this host that are gone.

    A pool removes them when it starts; this lists them without starting one.
    """
    from .._sandbox._docker._reaper import orphans

    found: list[dict[str, str]] = anyio.run(_on_docker, orphans)
    return found


def reap_orphaned_sandboxes() -> list[str]:
    """Remove what :func:`orphaned_sandboxes` lists; the ids removed."""
    from .._sandbox._docker._reaper import reap

    removed: list[str] = anyio.run(_on_docker, reap)
    return removed


async def _on_docker(call: Callable[[Any], Awaitable[Any]]) -> Any:
    import aiodocker

    client = aiodocker.Docker()
    try:
        with anyio.fail_after(60):
            return await call(client)
    finally:
        await client.close()


def _local_isolation() -> dict[str, Any]:
    """What the embedded local backend isolates here, as a pool would start it.

    The same survey the pool does at start (and warns from), so this says exactly which
    protection is off and why, before a rollout runs hostile code under it.
    """
    from .._sandbox._local._backend import LocalBackend

    backend = LocalBackend()
    try:
        protections = backend.protections
    finally:
        anyio.run(backend.aclose)
    return {
        "identity": protections.identity,
        "namespaces": protections.namespaces,
        "memory": protections.memory,
        "processes": protections.processes,
        "disk": protections.disk,
        "cores": protections.cores,
        "files": protections.files,
        "syscalls": protections.syscalls,
        "off": list(protections.missing),
    }


def _gpus() -> str:
    try:
        import pynvml
    except ImportError:
        return "NVML not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return f"none (NVML: {exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            names.append(
                f"{name if isinstance(name, str) else name.decode()} ({memory / 2**30:.0f} GiB)"
            )
        return f"{count}: " + ", ".join(names) if count else "none"
    finally:
        pynvml.nvmlShutdown()


def _torch() -> str:
    version = _version("torch")
    if version is None:
        return "not installed (pip install 'tangram[gpu]')"
    import torch

    cuda = "CUDA available" if torch.cuda.is_available() else "CPU only"
    return f"{version}, {cuda}"


def diagnose() -> dict[str, Any]:
    """Facts about this host; each value a string or number, never an exception."""
    from ._bench import default_config

    facts: dict[str, Any] = {
        "cores": _guard(_cores),
        "memory": _guard(_memory),
        "cgroup": _guard(_cgroup),
        "docker": _guard(_docker),
        "local sandbox": _guard(_local_isolation),
        "gpus": _guard(_gpus),
        "ray": _guard(lambda: _version("ray") or "not installed (pip install ray)"),
        "torch": _guard(_torch),
        "matplotlib": _guard(lambda: _version("matplotlib") or "not installed (the plot extra)"),
        "rich": _guard(lambda: _version("rich") or "not installed"),
    }
    config = _guard(default_config)
    if isinstance(config, str):
        facts["bench"] = config
    else:
        facts["bench"] = {
            "trajectories": config.trajectories,
            "turns": config.turns,
            "cores": config.cores,
            "sandbox": f"{config.sandbox} (pass --sandbox docker to use the daemon)"
            if str(facts["docker"]).startswith("reachable")
            else config.sandbox,
            "reward models": f"{config.reward_models} torch models on the CPU device, "
            "memory budget for 2 (evict-on-execution)",
            "search": f"loopback rate-limited server, {config.search_rate:g} requests/s",
        }
    return facts


def format_diagnosis(facts: dict[str, Any]) -> str:
    lines = ["This host offers:"]
    cores = facts["cores"]
    if isinstance(cores, dict):
        cores = f"{cores['usable']} usable of {cores['online']} online"
    lines.append(f"  {'cores':<11} {cores}")
    for name in ("memory", "cgroup", "docker", "gpus", "ray", "torch", "matplotlib", "rich"):
        lines.append(f"  {name:<11} {facts[name]}")
    local = facts["local sandbox"]
    if isinstance(local, dict):
        lines.append("local sandboxes isolate:")
        for name in ("identity", "namespaces", "memory", "processes", "disk", "cores", "files"):
            lines.append(f"  {name:<11} {local[name]}")
        if local["off"]:
            lines.append("local sandboxes are NOT isolated in:")
            lines.extend(f"  {sentence}" for sentence in local["off"])
    else:
        lines.append(f"local sandboxes: {local}")
    lines.append("tangram bench will use:")
    bench = facts["bench"]
    if isinstance(bench, dict):
        for name, value in bench.items():
            lines.append(f"  {name:<14} {value}")
    else:
        lines.append(f"  {bench}")
    return "\n".join(lines)
