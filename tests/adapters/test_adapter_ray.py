"""``mode = "ray"``: every loop and process of a job reaches one scheduler, on a real Ray.

In local mode each event loop has its own scheduler, so a limit holds per loop (per
worker process, in verl and OpenRLHF). The same config with ``mode = "ray"`` makes the
adapters use the shared scheduler actor (:mod:`tangram.ray`) instead, sandbox cores and
API limits included. Two threads with loops of their own stand for two worker processes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

from tangram._frameworks import _session  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # A cluster of its own (address="local"), never one another run left running.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _hold_in_two_loops(path: Path) -> tuple[list[tuple[float, float]], list[str]]:
    """Two threads, each its own loop, each holding the one `conn` for 0.3 s.

    Returns when each hold began and ended (one clock for both threads) and the cores
    each loop's sandbox action was granted.
    """
    holds: list[tuple[float, float]] = []
    cores: list[str] = []
    both_started = threading.Barrier(2)

    async def hold() -> None:
        async with _session.session(path) as resources:
            # Both schedulers (or proxies) are up before either asks: the asks coincide.
            await asyncio.to_thread(both_started.wait, 30)
            async with resources.scheduler.acquire(conn=1, kind="call"):
                began = time.monotonic()
                await asyncio.sleep(0.3)
                holds.append((began, time.monotonic()))
            async with resources.sandbox_pool().sandbox(uuid.uuid4().hex) as sandbox:
                result = await sandbox.run(code="import os; print(os.environ['TANGRAM_CPUS'])")
                cores.append(result.stdout.decode().strip())
        await _session.aclose(path)

    threads = [threading.Thread(target=asyncio.run, args=(hold(),)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return sorted(holds), cores


def _config(tmp_path: Path, mode: str) -> Path:
    path = tmp_path / f"{mode}.toml"
    path.write_text(
        f'mode = "{mode}"\n[capacity]\nconn = 1\n[sandbox]\nbackend = "local"\n'
        f'[ray]\nname = "adapters-{uuid.uuid4().hex[:8]}"\nnamespace = "tangram-adapters-test"\n'
        # Either loop may create the actor and end first: it must not take it along.
        "detached = true\n"
    )
    return path


def test_ray_mode_shares_one_limit_between_loops(cluster: None, tmp_path: Path) -> None:
    local, local_cores = _hold_in_two_loops(_config(tmp_path, "local"))
    shared, shared_cores = _hold_in_two_loops(_config(tmp_path, "ray"))
    # Local: one `conn` per loop, so the holds overlap. Ray: one `conn` for both loops,
    # so the second hold begins only after the first ended.
    assert len(local) == len(shared) == 2
    assert local[1][0] < local[0][1]
    assert shared[1][0] >= shared[0][1]
    # Sandbox cores were granted in both modes (through the actor in ray mode).
    assert local_cores == ["1", "1"]
    assert shared_cores == ["1", "1"]
