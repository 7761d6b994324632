"""Helpers shared by the Ray test modules (no Ray import: they take a proxy)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio


async def held(remote: Any, kind: str = "cpu") -> float:
    """Units of ``kind`` the shared scheduler holds now, through a ``RemoteRuntime``."""
    stats = await remote.stats()
    units: float = stats.resources[kind].held
    return units


async def wait_for(predicate: Callable[[], Awaitable[bool]], seconds: float) -> float:
    """Poll an async predicate until it holds; return the seconds it took."""
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > seconds:
            raise AssertionError(f"condition never held within {seconds:g} s")
        await anyio.sleep(0.05)
    return time.monotonic() - started


def work_dir_holding(root: str, text: str) -> str:
    """The one work dir under ``root`` whose ``mine.txt`` says ``text``.

    Sandboxed commands run in namespaces of their own, so neither the pids nor the paths
    a command sees tell which host agent ran it; the file it left on the host does.
    """
    found = [
        str(path.parent)
        for path in Path(root).rglob("mine.txt")
        if path.read_text().strip() == text
    ]
    assert len(found) == 1, (root, text, found)
    return found[0]
