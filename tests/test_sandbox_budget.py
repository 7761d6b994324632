"""The count of live sandboxes a backend reserves memory for (``tangram/_sandbox/_budget.py``).

Both backends take a place before a sandbox is made and free it once its files are gone.
A sandbox asked for while one is being destroyed waits for that place instead of being
refused: a broken sandbox is destroyed in the background while rollout code goes on, and
at exactly the reserved count its successor was refused, a tangram failure in the step.
"""

from __future__ import annotations

import anyio
import pytest

from tangram._sandbox._budget import Places
from tangram.errors import SandboxError

pytestmark = pytest.mark.anyio


async def take(places: Places) -> None:
    await places.take("here", 1 << 20, "sandboxes")


async def test_a_place_being_freed_is_waited_for_not_refused() -> None:
    places = Places(2)
    await take(places)
    await take(places)
    taken = anyio.Event()

    async def successor() -> None:
        await take(places)
        taken.set()

    async with anyio.create_task_group() as tg:
        with places.leave() as gone:
            tg.start_soon(successor)
            await anyio.wait_all_tasks_blocked()
            assert not taken.is_set() and places.live == 2
            gone()
        await taken.wait()
    assert (places.live, places.leaving) == (2, 0)


async def test_a_removal_that_keeps_its_files_keeps_its_place() -> None:
    """A box still mounted after its removal still holds its files: the sandbox waiting
    for its place is refused then, typed, and nothing is counted for it."""
    places = Places(1)
    await take(places)
    async with anyio.create_task_group() as tg:
        with places.leave():
            refused: list[BaseException] = []

            async def successor() -> None:
                try:
                    await take(places)
                except SandboxError as exc:
                    refused.append(exc)

            tg.start_soon(successor)
            await anyio.wait_all_tasks_blocked()
            assert not refused
    assert len(refused) == 1 and (places.live, places.leaving) == (1, 0)


async def test_past_the_count_with_none_leaving_is_refused_at_once() -> None:
    places = Places(1)
    await take(places)
    with pytest.raises(SandboxError, match="1 sandboxes are alive here"):
        await take(places)
    places.give_back()
    await take(places)
    assert places.live == 1
    unlimited = Places(None)
    for _ in range(1000):
        await take(unlimited)
    assert unlimited.live == 1000
