"""A lease: the units one action holds, how they change, and when things happened."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.lowlevel

from .._core._action import Action
from .._core._policy import RUNNING, Entry
from ..errors import LeaseNotResizableError, LeaseReleasedError

__all__ = ["Lease", "LeaseBase", "Waitable"]


class Waitable(Protocol):
    """What the runtime wakes a waiting lease with: ``anyio.Event``, or on asyncio a bare
    future (the runtime picks the cheaper for the running loop)."""

    def set(self) -> None: ...

    def wait(self) -> Awaitable[object]: ...


class LeaseBase:
    """What a local lease and a remote one share: the three parts of the action's
    completion time, from the four times a lease keeps, and waiting for a resize."""

    __slots__ = (
        "_finished_at",
        "_resized",
        "_seen",
        "admitted_at",
        "queued_at",
        "resizes",
        "started_at",
    )
    queued_at: float
    admitted_at: float
    started_at: float
    _finished_at: float
    resizes: int
    _seen: int
    _resized: anyio.Event | None

    if TYPE_CHECKING:  # each kind of lease says these its own way

        @property
        def action(self) -> Action: ...

        @property
        def active(self) -> bool: ...

    @property
    def finished_at(self) -> float:
        return self._finished_at

    @finished_at.setter
    def finished_at(self, value: float) -> None:
        # Whoever ends a lease sets this, so waking a task blocked in ``wait_resized``
        # here means no way of ending one (release, close, a remote reclaim) can leave
        # that task waiting for a resize that will never come.
        self._finished_at = value
        if not math.isnan(value):
            event, self._resized = self._resized, None
            if event is not None:
                event.set()

    async def _next_resize(self) -> None:
        """Return once ``resizes`` has moved past what the body last saw, and note it.

        :raises LeaseNotResizableError: the demand is not resizable elastic.
        :raises LeaseReleasedError: the lease is no longer held, or went while waiting.
        """
        elastic = self.action.demand.elastic
        if elastic is None or not elastic.resizable:
            raise LeaseNotResizableError(
                f"{self!r} is never resized: only a demand declared "
                "Elastic(min, max, resizable=True) is, so this wait would never end"
            )
        if not self.active:
            raise LeaseReleasedError(f"{self!r} is no longer held, so it is never resized")
        if self.resizes == self._seen:
            if self._resized is None:
                self._resized = anyio.Event()
            await self._resized.wait()
        else:
            await anyio.lowlevel.checkpoint()
        if not self.active:
            raise LeaseReleasedError(f"{self!r} was released while waiting for a resize")
        self._seen = self.resizes

    @property
    def queue_seconds(self) -> float:
        return self.admitted_at - self.queued_at

    @property
    def overhead_seconds(self) -> float:
        return self.started_at - self.admitted_at

    @property
    def exec_seconds(self) -> float:
        return self.finished_at - self.started_at


class Lease(LeaseBase):
    """What ``async with tangram.acquire(...) as lease:`` gives the body.

    ``grant`` is what the action holds now; for an elastic demand ``units`` is its share of
    the elastic kind. A resizable action learns of changes with :meth:`wait_resized`.
    Once the ``async with`` block has ended both keep what was held last, so the body's
    caller can still log what it ran with.
    Times come from the event loop's clock (``anyio.current_time()``): ``queued_at`` when
    the acquire arrived, ``admitted_at`` when the scheduler granted it, ``started_at`` when
    the body began (the gap is overhead: waking the task, applying the grant) and
    ``finished_at`` when the units went back.
    """

    __slots__ = ("_entry", "_error", "_final_units", "_holder", "_ready")

    def __init__(self, entry: Entry, now: float) -> None:
        self._entry = entry
        self._ready: Waitable | None = None
        self._resized: anyio.Event | None = None
        self._error: BaseException | None = None
        self._final_units: int | None = None
        # The task that entered the acquire, and what it counts as holding of each kind
        # once granted (see Runtime._holders); None until then.
        self._holder: object = None
        self._seen = 0
        self.queued_at = now
        self.admitted_at = math.nan
        self.started_at = math.nan
        self._finished_at = math.nan  # nobody waits on a resize yet: no setter needed
        self.resizes = 0

    def __repr__(self) -> str:
        action = self._entry.action
        return f"<tangram.Lease #{action.id} kind={action.kind!r} grant={dict(self.grant)!r}>"

    @property
    def action(self) -> Action:
        return self._entry.action

    @property
    def units(self) -> int | None:
        """Elastic units held now (last held, once released), or ``None`` if none is elastic."""
        if self._entry.action.demand.elastic is None:
            return None
        if self._final_units is not None:
            return self._final_units
        return self._entry.units

    @property
    def grant(self) -> Mapping[str, float]:
        """Amount held per resource kind now (rate kinds: what was taken at the start)."""
        demand = self._entry.action.demand
        grant = dict(demand.rigid)
        units = self.units
        if demand.elastic_kind is not None and units is not None:
            grant[demand.elastic_kind] = float(units)
        return MappingProxyType(grant)

    @property
    def active(self) -> bool:
        """Whether the units are still held."""
        return self._entry.state == RUNNING

    async def wait_resized(self) -> int:
        """Wait until the scheduler changes this action's elastic units; return the new count.

        Changes are counted, not just signalled: a resize that lands while the body is busy
        elsewhere (between two calls, or between the body starting and the first call)
        makes the next call return at once instead of being lost, so a body that does
        ``units = await lease.wait_resized()`` in a loop always ends up on the current
        grant.

        Only resizable elastic demands (``Elastic(..., resizable=True)``) are ever resized,
        and only while held: rather than wait forever, this raises at once for any other
        lease, and wakes a task still waiting when the lease goes.

        :raises LeaseNotResizableError: the demand is not ``Elastic(..., resizable=True)``.
        :raises LeaseReleasedError: the ``async with`` block has ended.
        """
        await self._next_resize()
        return self._entry.units

    # -- called by the runtime --------------------------------------------------------

    def _start(self, now: float) -> None:
        """The body begins: it sees the grant as it is now, resizes so far included."""
        self.started_at = now
        self._seen = self.resizes

    def _finish(self, now: float) -> None:
        """The units go back (or the wait ends); keep what was held for later reads."""
        self._final_units = self._entry.units
        self.finished_at = now
        if math.isnan(self.started_at):
            self.started_at = now

    def _admit(self, now: float) -> None:
        self.admitted_at = now
        if self._ready is not None:
            self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        if self._ready is not None:
            self._ready.set()

    def _notify_resize(self) -> None:
        self.resizes += 1
        event, self._resized = self._resized, None
        if event is not None:
            event.set()
