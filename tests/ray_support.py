"""Helpers shared by the Ray test modules (Ray imported only where a helper needs it)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
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


@contextlib.contextmanager
def two_node_cluster(namespace: str) -> Iterator[dict[str, Any]]:
    """A head and two worker nodes (resources ``node_a``, ``node_b``), each its own
    raylet on this machine, with this process connected; all shut down after."""
    import ray
    import ray.cluster_utils

    started = time.monotonic()
    nodes = ray.cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        a = nodes.add_node(num_cpus=1, resources={"node_a": 1})
        b = nodes.add_node(num_cpus=1, resources={"node_b": 1})
        ray.init(
            address=nodes.address,
            log_to_driver=False,
            namespace=f"{namespace}-{uuid.uuid4().hex[:8]}",
        )
        nodes.wait_for_nodes()
        yield {
            "cluster": nodes,
            "head": ray.get_runtime_context().get_node_id(),
            "nodes": {"a": a, "b": b},
            "started": time.monotonic() - started,
        }
    finally:
        ray.shutdown()
        nodes.shutdown()
