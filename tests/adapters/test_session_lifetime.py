"""A session's scheduler, pools and step totals go with the loop that opened them.

A process that runs a loop per batch (``asyncio.run`` per step, a worker thread per
call) grew by one stopped scheduler per loop, forever: the per-loop entry held its loop
through its task and future, so the weak key never let it go, and ``step_logs`` kept its
totals in a cache keyed by the scheduler whose values held it (a review).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest

from tangram import integrations


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tangram.toml"
    path.write_text('mode = "local"\n[capacity]\nsearch = 2\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    return path


@pytest.mark.parametrize("logs", [False, True], ids=["session", "with-step-logs"])
def test_a_finished_loops_scheduler_is_freed(config: Path, logs: bool) -> None:
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    schedulers: list[weakref.ref[object]] = []

    async def step() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        async with integrations.session() as resources:
            schedulers.append(weakref.ref(resources.scheduler))
            async with resources.scheduler.acquire(search=1, kind="search"):
                pass
            if logs:
                change = await integrations.step_logs(resources.scheduler, resources, ["search"])
                assert change["tangram/actions/search"] == 1
        # no aclose: a framework's loop just ends

    for _ in range(5):
        asyncio.run(step())
    gc.collect()
    assert [r for r in schedulers if r() is not None] == []
    assert [r for r in loops if r() is not None] == []


def test_one_loops_session_is_still_served_until_it_ends(config: Path) -> None:
    async def main() -> None:
        async with integrations.session() as first:
            pass
        async with integrations.session() as again:
            assert again.scheduler is first.scheduler
        await integrations.aclose()

    asyncio.run(main())
