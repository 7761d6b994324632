"""The adapters' per-process scheduler: one per event loop, started on first use, from a file.

No framework is needed here: these are the rules verl's and OpenRLHF's workers rely on
(several loops and threads per process, tools built before any loop runs).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram._frameworks import _session
from tangram.config import ConfigError


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tangram.toml"
    path.write_text('mode = "local"\n[capacity]\ncpu = 3\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    return path


async def _scheduler() -> Any:
    async with _session.session() as resources:
        assert tangram.current_runtime() is resources.scheduler
        return resources.scheduler


def test_one_scheduler_per_loop_shared_by_its_calls(config: Path) -> None:
    async def main() -> tuple[Any, ...]:
        # Five first calls at once start one scheduler, not five.
        found = await asyncio.gather(*(_scheduler() for _ in range(5)))
        again = await _scheduler()
        await _session.aclose()
        return (*found, again)

    first = asyncio.run(main())
    assert len({id(s) for s in first}) == 1
    assert isinstance(first[0], tangram.Runtime)
    assert repr(first[0]).startswith("<tangram.Runtime closed")  # aclose stopped it
    # A new loop gets a new scheduler: a runtime belongs to the loop that entered it.
    second = asyncio.run(main())
    assert second[0] is not first[0]


def test_a_loop_in_another_thread_gets_its_own(config: Path) -> None:
    found: list[Any] = []

    def worker() -> None:
        found.append(asyncio.run(_scheduler()))

    async def main() -> None:
        found.append(await _scheduler())
        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(thread.join)
        await _session.aclose()

    asyncio.run(main())
    here, there = found
    assert here is not there
    # The thread's loop ended with asyncio.run, which cancelled its scheduler task.
    assert repr(there).startswith("<tangram.Runtime closed")


def test_the_scheduler_is_current_only_inside_the_session(config: Path) -> None:
    async def main() -> None:
        async with _session.session(), tangram.acquire(cpu=3) as lease:
            assert lease.grant["cpu"] == 3
        with pytest.raises(tangram.errors.NoCurrentRuntimeError):
            tangram.current_runtime()
        await _session.aclose()

    asyncio.run(main())


def test_a_recording_config_writes_each_schedulers_trace_when_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a verl or OpenRLHF worker does with `record` in its file and no code change.
    folder = tmp_path / "traces"
    path = tmp_path / "tangram.toml"
    path.write_text(f"mode = 'local'\nrecord = {str(folder)!r}\n[capacity]\ncpu = 3\n")
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))

    async def main() -> None:
        for turn in range(4):
            async with _session.session(), tangram.acquire(cpu=1, trajectory="t1"):
                await asyncio.sleep(0.001 * turn)
        await _session.aclose()

    asyncio.run(main())
    (trace_file,) = folder.iterdir()
    trace = tangram.read_trace(trace_file)
    assert trace.actions == 4 and trace.capacity == {"cpu": 3.0}


def test_without_a_config_the_call_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANGRAM_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="TANGRAM_CONFIG"):
        asyncio.run(_scheduler())


def test_a_failed_start_reaches_every_caller_and_is_retried(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[capacity]\ncpu = 1\n[[gpu.services]]\nname = 'j'\nfactory = 'nowhere:f'\n")

    async def main() -> list[BaseException | Any]:
        async def one() -> Any:
            async with _session.session(path) as resources:
                return resources

        first = await asyncio.gather(one(), one(), return_exceptions=True)
        second = await asyncio.gather(one(), return_exceptions=True)
        return [*first, *second]

    results = asyncio.run(main())
    assert all(isinstance(r, ConfigError) for r in results)
    assert "cannot load 'nowhere:f'" in str(results[0])
    assert results[2] is not results[0]  # the third call tried again


def test_sync_callers_reach_a_loop_of_their_own(config: Path) -> None:
    async def grant() -> float:
        async with _session.session(), tangram.acquire(cpu=2) as lease:
            return float(lease.grant["cpu"])

    assert _session.portal_call(grant) == 2.0
    with pytest.raises(RuntimeError, match="blocks"):
        asyncio.run(_call_in_loop(grant))


async def _call_in_loop(fn: Any) -> Any:
    return _session.portal_call(fn)


def test_factories_are_named_module_colon_name() -> None:
    assert _session.load_object("tangram:Runtime") is tangram.Runtime
    with pytest.raises(ConfigError, match="module:name"):
        _session.load_object("tangram.Runtime")
    with pytest.raises(ConfigError, match="cannot load"):
        _session.load_object("tangram:Nope")


def test_importing_tangram_or_what_the_adapters_share_imports_no_framework() -> None:
    code = (
        "import sys, tangram, tangram.config\n"
        "import tangram._frameworks._session, tangram._frameworks._convert\n"
        "heavy = {'verl', 'openrlhf', 'ray', 'torch', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
