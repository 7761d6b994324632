"""Observers of a runtime: the :class:`Instrument` base class and the list the runtime calls.

Modelled on trio's ``Instrument`` and ``add_instrument``: an observer subclasses
:class:`Instrument`, overrides the hooks it wants and is attached with
:meth:`tangram.Runtime.add_instrument`. Any number attach and detach in any order, because
each is one entry in a list the runtime owns; observers that replaced methods on the
runtime's bookkeeping instead unhooked each other when detached out of order.
"""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING

from ..errors import InstrumentNotAttachedError, SettingTypeError

if TYPE_CHECKING:
    from .._core._policy import Plan
    from .._core._resources import Capacity
    from .._core._stats import Outcome
    from ._lease import Lease

__all__ = ["Instrument", "Instruments"]

logger = logging.getLogger("tangram")

_HOOKS = (
    "action_queued",
    "action_granted",
    "action_resized",
    "action_finished",
    "after_plan",
    "capacity_changed",
)


class Instrument:
    """An observer of one :class:`tangram.Runtime`: override the hooks you need.

    ``runtime.add_instrument(instrument)`` attaches it and ``runtime.remove_instrument``
    detaches it, in any order with any number of others. Every hook does nothing here, and
    the runtime calls only the hooks a subclass overrides, so a hook left alone costs
    nothing. Hooks are plain functions called synchronously from inside the scheduler, at
    the moment the event happens: they observe (count, log, record, check), and must not
    block, await or change the runtime. One that raises is detached and its error logged
    on the ``tangram`` logger; the scheduler carries on, as trio does with its instruments.

    Times are those of the runtime's clock (the event loop's, as
    ``anyio.current_time()``). An instrument attached while actions are in flight hears
    only the rest of their story (a grant or an end without a queueing before it).

    :class:`tangram.TraceRecorder`, :class:`tangram.testing.InvariantChecker` and the
    runtime's own statistics are built on these hooks.
    """

    __slots__ = ()

    # Errors of a hook propagate out of the runtime call instead of detaching the
    # instrument: set by tangram.testing's checker with ``raise_immediately=True``, whose
    # whole point is a traceback through the call that broke an invariant.
    _raises: bool = False

    def action_queued(self, lease: Lease) -> None:
        """An action joined the queue at ``lease.queued_at``.

        Called in the task that acquires, before the scheduler decides on it.
        """

    def action_granted(self, lease: Lease) -> None:
        """The scheduler granted ``lease.grant`` (``lease.units`` elastic units) at
        ``lease.admitted_at``; the body starts next."""

    def action_resized(self, lease: Lease, now: float) -> None:
        """The scheduler moved a running action to ``lease.units`` elastic units at ``now``."""

    def action_finished(self, lease: Lease, outcome: Outcome) -> None:
        """An action's units went back, or its wait ended, at ``lease.finished_at``.

        Called once for every queued action, however it ended: ``outcome`` says whether
        its body returned, raised, or it was cancelled (a timeout, or a close or capacity
        cut while it waited). It ran when ``lease.admitted_at`` is a number, not NaN.
        """

    def after_plan(self, plan: Plan, now: float) -> None:
        """A planning pass at ``now`` decided ``plan``, now applied.

        The leases it admitted or resized have had their ``action_granted`` or
        ``action_resized`` call already.
        """

    def capacity_changed(self, capacity: Capacity) -> None:
        """:meth:`tangram.Runtime.set_capacity` installed ``capacity``.

        Called before waiting actions that can no longer fit are failed (each then has its
        ``action_finished``) and before the pass that follows the change.
        """


class Instruments:
    """The attached instruments, kept per hook: only those that override it.

    Each hook's instruments are a tuple, replaced (never changed) on attach and detach: a
    hook may detach an instrument while the runtime iterates, and the runtime's check for
    "anyone listening?" is the truth value of one attribute.
    """

    __slots__ = ("_all", *_HOOKS)

    action_queued: tuple[Instrument, ...]
    action_granted: tuple[Instrument, ...]
    action_resized: tuple[Instrument, ...]
    action_finished: tuple[Instrument, ...]
    after_plan: tuple[Instrument, ...]
    capacity_changed: tuple[Instrument, ...]

    def __init__(self) -> None:
        self._all: dict[Instrument, None] = {}
        for hook in _HOOKS:
            setattr(self, hook, ())

    def add(self, instrument: Instrument) -> None:
        """Attach ``instrument``; attaching one already attached does nothing.

        :raises SettingTypeError: ``instrument`` is not a :class:`tangram.Instrument`.
        """
        if not isinstance(instrument, Instrument):
            raise SettingTypeError(
                f"`instrument` must be a tangram.Instrument (got {instrument!r})"
            )
        if instrument in self._all:
            return
        self._all[instrument] = None
        for hook in _HOOKS:
            impl = getattr(instrument, hook)
            if isinstance(impl, types.MethodType) and impl.__func__ is getattr(Instrument, hook):
                continue  # inherited unchanged: a no-op not worth a call
            setattr(self, hook, (*getattr(self, hook), instrument))

    def remove(self, instrument: Instrument) -> None:
        """Detach ``instrument``.

        :raises InstrumentNotAttachedError: it is not attached (never was, was removed, or
            was detached for raising).
        """
        if instrument not in self._all:
            raise InstrumentNotAttachedError(
                f"{instrument!r} is not attached (never added, already removed, or detached "
                "because a hook raised)"
            )
        del self._all[instrument]
        for hook in _HOOKS:
            current: tuple[Instrument, ...] = getattr(self, hook)
            if instrument in current:
                setattr(self, hook, tuple(i for i in current if i is not instrument))

    def call(self, hook: str, *args: object) -> None:
        """Call ``hook(*args)`` on every instrument that overrides it; detach those that raise.

        Callers check the hook's tuple first, so an unobserved event costs one truth test.
        Cancellation and ``KeyboardInterrupt`` are not ordinary errors and pass through.
        """
        instruments: tuple[Instrument, ...] = getattr(self, hook)
        for instrument in instruments:
            try:
                getattr(instrument, hook)(*args)
            except Exception:
                if instrument._raises:
                    raise
                if instrument in self._all:
                    self.remove(instrument)
                logger.exception(
                    "instrument %r raised in %s and was detached", instrument, hook, stack_info=True
                )
