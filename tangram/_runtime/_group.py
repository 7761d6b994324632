"""A prompt's samples scored together: the group (GRPO) reward's one scheduling decision.

GRPO scores a prompt's ``n`` samples against each other, so a group is only useful once
its last sample is scored. Scored one by one as they come, the samples of every group of
a batch interleave in the scheduler's line, and every group finishes near the end of the
batch. :class:`Gate` holds each sample just before it asks the scheduler for its grant
until the other samples of its group in the gate have come that far too, then lets the
group go in one loop iteration: its demands reach the scheduler together (the runtime
decides once per iteration, the shared scheduler's proxy sends one iteration's demands in
one call), side by side in its line, and groups finish one after another.

A group is the samples of one key *in the gate at once*: verl hands a worker a batch's
samples in one go, so a prompt's samples enter together and wait for each other; where
samples come one at a time (verl's agent loop scoring each as its trajectory ends) a
sample finds no other of its group and goes at once, so the gate costs nothing there. No
sample waits longer than ``wait`` seconds (one whose group-mate is stuck before its grant).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

import anyio
import anyio.lowlevel
import attrs

from .._core._validate import seconds

__all__ = ["DEFAULT_GROUP_WAIT", "Gate", "GroupStats"]

DEFAULT_GROUP_WAIT = 2.0
"""Seconds a sample waits at most for the rest of its group."""

Arrive = Callable[[], Awaitable[None]]


@attrs.define
class _Group:
    entered: int = 0  # samples of the group in the gate
    arrived: int = 0  # of those, how many wait for the rest
    released: anyio.Event = attrs.field(factory=anyio.Event)


@attrs.define
class GroupStats:
    """What a gate did: groups let go, how many samples they held, and groups that were
    let go by ``wait`` before all their samples came."""

    groups: int = 0
    samples: int = 0
    timed_out: int = 0


class Gate:
    """Holds samples until their group has come (see the module). One per event loop."""

    def __init__(self, wait: float = DEFAULT_GROUP_WAIT) -> None:
        self._wait = seconds("group_wait", wait)
        self._open: dict[Hashable, _Group] = {}
        self.stats = GroupStats()

    @contextlib.asynccontextmanager
    async def sample(self, key: Hashable) -> AsyncIterator[Arrive]:
        """One sample of group ``key``, for the ``async with``'s span.

        Enter it as soon as the sample is handed over; the block calls the yielded
        ``arrive()`` right before it asks for its grant, which returns once the group
        goes. A block that ends without arriving (an answer with no code, an error) is
        no longer waited for.
        """
        group = self._open.get(key)
        if group is None:
            group = self._open[key] = _Group()
        group.entered += 1
        arrived = False

        async def arrive() -> None:
            nonlocal arrived
            if arrived:
                return
            arrived = True
            group.arrived += 1
            if group.arrived >= group.entered:
                self._release(key, group)
                # Let the others wake first: the group's samples then resume side by side
                # in one iteration, the last to come with the rest, not ahead of them.
                await anyio.lowlevel.checkpoint()
                return
            if not group.released.is_set():
                try:
                    with anyio.move_on_after(self._wait):
                        await group.released.wait()
                except BaseException:
                    self._leave(key, group)
                    raise
                if not group.released.is_set():
                    self.stats.timed_out += 1
                    self._release(key, group)
                    await anyio.lowlevel.checkpoint()

        try:
            yield arrive
        finally:
            if not arrived and not group.released.is_set():
                group.entered -= 1
                if group.entered == 0:
                    self._drop(key, group)
                elif group.arrived >= group.entered:
                    self._release(key, group)

    def _release(self, key: Hashable, group: _Group) -> None:
        if group.released.is_set():
            return
        self._drop(key, group)
        self.stats.groups += 1
        self.stats.samples += group.arrived
        group.released.set()

    def _drop(self, key: Hashable, group: _Group) -> None:
        if self._open.get(key) is group:
            del self._open[key]

    def _leave(self, key: Hashable, group: _Group) -> None:
        """A waiting sample was cancelled: the rest no longer wait for it."""
        if group.released.is_set():
            return
        group.arrived -= 1
        group.entered -= 1
        if group.entered == 0:
            self._drop(key, group)
        elif group.arrived >= group.entered:
            self._release(key, group)
