"""What every scheduler offers its users: the local runtime and a shared one's proxy alike.

``tangram.acquire`` reaches whichever scheduler is current: a :class:`~._run.Runtime` of
this event loop, or (``tangram.ray``, ``mode = "shared"``) a ``RemoteRuntime`` that asks a
scheduler in another process. Pools, quotas and user code are written against this
protocol, so they run unchanged on either; it is structural (as ``anyio.abc``'s streams
are), so neither class inherits from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from .._core._action import Action
    from .._core._resources import Capacity

__all__ = ["LeaseLike", "Scheduler"]

T = TypeVar("T")


@runtime_checkable
class LeaseLike(Protocol):
    """What ``async with scheduler.acquire(...) as lease`` holds, wherever it was granted."""

    started_at: float
    """When the work began; an executor that sets up before it (a pool applying cores)
    moves it to the real start, so set-up counts as overhead, not execution."""

    @property
    def action(self) -> Action:
        """The action the lease was granted for (its demand, kind and trajectory)."""

    @property
    def grant(self) -> Mapping[str, float]:
        """Units held now per resource kind; an elastic action's changes on a resize."""

    @property
    def units(self) -> int | None:
        """The elastic units held now (``None`` for an action with no elastic part)."""

    @property
    def active(self) -> bool:
        """Whether the units are still held (the ``async with`` block has not ended)."""

    @property
    def resizes(self) -> int:
        """How many times the grant changed while the action ran."""

    @property
    def queue_seconds(self) -> float:
        """Seconds from asking to being granted."""

    @property
    def overhead_seconds(self) -> float:
        """Seconds from the grant to the action's start (placing it, applying cores)."""

    @property
    def exec_seconds(self) -> float:
        """Seconds the action ran, so far or in all."""

    async def wait_resized(self) -> int:
        """Wait until the grant next changes; return the elastic units then held."""


@runtime_checkable
class Scheduler(Protocol):
    """A scheduler that lends units to actions: ``acquire`` and ``run``, and its capacity."""

    @property
    def capacity(self) -> Capacity:
        """What the scheduler lends, per resource kind."""

    def acquire(
        self,
        demand: Mapping[str, object] | None = None,
        /,
        *,
        kind: str = "action",
        trajectory: str | None = None,
        estimate: float | None = None,
        wait_timeout: float | None = None,
        **amounts: object,
    ) -> contextlib.AbstractAsyncContextManager[LeaseLike]:
        """Ask for ``demand`` for the duration of an ``async with`` (``Runtime.acquire``)."""

    async def run(
        self,
        demand: Mapping[str, object],
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        kind: str = "action",
        trajectory: str | None = None,
        estimate: float | None = None,
        wait_timeout: float | None = None,
    ) -> T:
        """``await fn(*args)`` holding ``demand``: ``acquire`` without ``async with``."""
