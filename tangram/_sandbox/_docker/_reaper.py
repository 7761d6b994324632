"""Who owns a sandbox container, and removing those whose owner is gone.

Each container carries labels naming the process that made it: the host name, the pid,
and the process's start (the boot id and the start time in clock ticks, so a pid reused
after the owner died, or after a reboot, is not taken for it). A trainer killed with
SIGKILL runs no cleanup; the next pool started on the same host lists the containers of
owners on this host that no longer run and removes them, and ``tangram doctor --reap``
does the same on demand. Containers of other hosts are left alone: their owner cannot be
checked from here. Owners are checked by reading ``/proc``, which needs no privilege.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

__all__ = ["LABEL", "Orphan", "orphans", "owner_labels", "reap"]

LABEL = "tangram.sandbox"
"""Every sandbox container has it (its value is the container's name)."""
HOST = "tangram.owner.host"
PID = "tangram.owner.pid"
START = "tangram.owner.start"
REMOVALS = 8
"""Containers removed at once: a force delete costs the daemon a few hundred ms each."""

logger = logging.getLogger("tangram.sandbox.docker")

Orphan = dict[str, str]
"""One orphaned container: ``id``, ``name``, ``state`` and the owner's ``host``, ``pid``."""


def _start(pid: int | str) -> str | None:
    """``boot-id:start-ticks`` of a process, or None when it does not exist (or is hidden)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    ticks = stat.rpartition(b")")[2].split()[19].decode()
    return f"{_boot_id()}:{ticks}"


@functools.cache
def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "unknown"


def owner_labels() -> dict[str, str]:
    """The labels naming this process as a container's owner."""
    return {
        HOST: socket.gethostname(),
        PID: str(os.getpid()),
        START: _start("self") or "unknown",
    }


def owner_gone(labels: Mapping[str, str]) -> bool:
    """Whether the labels name a process of this host that no longer runs.

    False when they name another host, or name no owner at all (a container made before
    owners were labelled, or by hand): those are not this host's to judge.
    """
    pid = labels.get(PID, "")
    if labels.get(HOST) != socket.gethostname() or not pid.isdigit():
        return False
    return _start(pid) != labels.get(START)


async def orphans(client: Any) -> list[Orphan]:
    """The sandbox containers on ``client``'s daemon whose owner on this host is gone."""
    found: list[Orphan] = []
    for container in await client.containers.list(all=True, filters={"label": [LABEL]}):
        info = container._container
        labels = info.get("Labels") or {}
        if owner_gone(labels):
            found.append(
                {
                    "id": container.id,
                    "name": labels.get(LABEL, ""),
                    "state": str(info.get("State", "")),
                    "host": labels.get(HOST, ""),
                    "pid": labels.get(PID, ""),
                }
            )
    return found


async def reap(client: Any) -> list[str]:
    """Remove the containers :func:`orphans` lists; return the ids removed."""
    removed: list[str] = []
    limiter = anyio.CapacityLimiter(REMOVALS)

    async def remove(ident: str) -> None:
        async with limiter:
            try:
                await client.containers.container(ident).delete(force=True, v=True)
            except Exception as exc:
                # Removed meanwhile by someone else, or the daemon refused: reported, and
                # never a reason to fail the pool's start.
                if getattr(exc, "status", None) != 404:
                    logger.warning("could not remove the orphaned sandbox %s: %s", ident[:12], exc)
                return
            removed.append(ident)

    async with anyio.create_task_group() as tg:
        for orphan in await orphans(client):
            tg.start_soon(remove, orphan["id"])
    return removed
