"""Test support for suites that use tangram: an invariant checker and a pytest plugin.

:class:`InvariantChecker` watches a :class:`tangram.Runtime` from the inside: an
:class:`tangram.Instrument`, it follows every scheduling decision, every action's end and
every capacity change with the checks that make a scheduler trustworthy (units held equal the
sum of live grants, no kind over its capacity unless a capacity cut left it there, every
elastic grant within its range, no lease left behind by a task that ended). A violation is
recorded where it happened and raised by :meth:`InvariantChecker.verify`, so it is found
at the decision that caused it, not when a later test happens to trip over it.

:func:`check_idle` says a runtime is back at rest: nothing held, waiting or leased.

In-memory executors let a unit test drive rollout code written against the real pools
with no process, container, GPU or model: :class:`MemoryBackend` for
:class:`tangram.SandboxPool` and :class:`MemoryModelService` for ``tangram.gpu.GpuPool``.
They record what they were asked (cores applied, files, restores and evictions) for the
test to assert on; the scheduling path through the runtime is the real one.

The pytest plugin (this module; enable it with ``pytest_plugins = ["tangram.testing"]``
in a ``conftest.py``, or let the ``tangram`` entry point load it) gives async tests::

    async def test_rollout(tangram_runtime):
        async with tangram_runtime(capacity={"cpu": 4}) as runtime:
            ...  # every decision of this runtime is checked; at the end it must be idle

    async def test_tool(tangram_sandboxes):
        async with tangram_sandboxes(cores=4) as pool:   # a checked runtime around it
            async with pool.sandbox("traj-0") as sbx:
                await sbx.run("pytest -q", cpu=tangram.Elastic(1, 4))

pytest is imported only if it is installed: the checker works without it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._core._exports import publish as _publish
from ._core._ledger import held_matches_grants
from ._core._policy import RUNNING, WAITING
from ._runtime._instrument import Instrument
from ._runtime._run import Runtime
from ._sandbox._pool import SandboxPool
from ._testing._memory import Applied, Handler, MemoryBackend, MemoryModelService, MemorySandbox
from ._testing._quota_server import Limit, QuotaServer
from .errors import InstrumentNotAttachedError, SettingTypeError

if TYPE_CHECKING:
    from ._core._policy import Entry, Plan
    from ._core._resources import Capacity
    from ._core._stats import Outcome
    from ._runtime._lease import Lease

__all__ = [
    "Applied",
    "InvariantChecker",
    "InvariantViolation",
    "Limit",
    "MemoryBackend",
    "MemoryModelService",
    "MemorySandbox",
    "QuotaServer",
    "check_idle",
    "checked_runtime",
    "checker_of",
    "memory_sandboxes",
]

_EPS = 1e-6
_FULL_SCAN_EVERY = 64


class InvariantViolation(AssertionError):
    """A scheduler invariant did not hold; the message says which, and after what call.

    An ``AssertionError`` so that pytest shows it as a failed check, not a crash.
    """


def _task_finished(task: object) -> bool:
    """Whether the task that acquired a lease has ended (asyncio or trio task objects).

    Both keep their coroutine; a coroutine that has returned or raised has no frame.
    """
    done = getattr(task, "done", None)
    if callable(done):
        return bool(done())
    coro = getattr(task, "coro", None)
    return coro is not None and getattr(coro, "cr_frame", 1) is None


def _current_task() -> object | None:
    """The running task object of whichever event loop is running, or ``None``."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None:
        try:
            task: object = asyncio.current_task()
        except RuntimeError:
            pass
        else:
            return task
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio_task: object = trio.lowlevel.current_task()
        except RuntimeError:
            return None
        return trio_task
    return None


class InvariantChecker(Instrument):
    """Check a runtime's invariants after every decision, action's end and capacity change.

    ``checker = InvariantChecker(runtime)`` before or after ``async with runtime:``; run
    the workload; ``checker.verify()`` raises :class:`InvariantViolation` for the first
    violation seen (all of them are in :attr:`violations`). Checked after each event:

    - units held per kind equal the sum of the live grants, and none is negative;
    - no kind holds more than its capacity, unless a capacity cut left it there, and then
      the excess only shrinks (nothing is admitted or grown into a cut);
    - every running elastic grant lies within its ``[min, max]``;
    - no rate budget is overdrawn;
    - every running action has a registered lease, and every registered lease belongs to
      a waiting or running action whose acquiring task is still alive;
    - a lease is gone once its action has finished.

    Each check walks the running actions, O(running) per decision, and the whole lease
    registry (the queue too) every 64th decision and on :meth:`check`. It attaches as an
    instrument (:meth:`tangram.Runtime.add_instrument`), beside any others;
    :meth:`detach` removes it. ``submitted`` counts actions queued, ``released`` actions
    finished (their units back, or their wait over), both while attached.

    :param raise_immediately: raise from inside the runtime call that broke an invariant
        (the traceback then points at it) instead of only recording it. The runtime is
        left as the violation found it: for a test that is about to fail anyway.
    """

    def __init__(self, runtime: Runtime, *, raise_immediately: bool = False) -> None:
        _check_runtime(runtime)
        self.runtime = runtime
        self.raise_immediately = raise_immediately
        self._raises = raise_immediately
        self.violations: list[str] = []
        self.checks = 0
        self.submitted = 0
        self.released = 0
        self._decisions = 0
        self._ceiling: dict[str, float] = {}
        self._holders: dict[Entry, object] = {}
        runtime.add_instrument(self)

    def __repr__(self) -> str:
        return (
            f"<tangram.testing.InvariantChecker checks={self.checks} "
            f"violations={len(self.violations)}>"
        )

    def detach(self) -> None:
        """Stop checking (safe twice, and after the runtime detached a checker that raised)."""
        with contextlib.suppress(KeyError):
            self.runtime.remove_instrument(self)

    # -- hooks -------------------------------------------------------------------------

    def action_queued(self, lease: Lease) -> None:
        self.submitted += 1
        self._holders[lease._entry] = _current_task()

    def action_finished(self, lease: Lease, outcome: Outcome) -> None:
        self.released += 1
        entry = lease._entry
        self._holders.pop(entry, None)
        if entry in self.runtime._leases or entry.state == RUNNING:
            self._fail(f"lease of action #{entry.action.id} still registered after it finished")
        # A capacity change withdraws the entries that can no longer fit before the
        # runtime fails their leases: the lease registry is checked at decisions only,
        # when both are settled.
        self._check(f"after action #{entry.action.id} finished ({outcome.value})", leases=False)

    def after_plan(self, plan: Plan, now: float) -> None:
        self._check("after a planning pass", leases=True)

    def capacity_changed(self, capacity: Capacity) -> None:
        self._note_cut()
        self._check("after a capacity change", leases=False)

    # -- checks ------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.violations.append(message)
        if self.raise_immediately:
            raise InvariantViolation(message)

    def _note_cut(self) -> None:
        ledger = self.runtime._ledger
        for kind, held in ledger.held.items():
            total = ledger.totals[kind]
            if held > total + _EPS:
                # A cut below what is held: the excess may stay until it drains, and
                # only shrink meanwhile (held never changes inside a capacity change).
                self._ceiling[kind] = held

    def _check(self, where: str, *, leases: bool, full: bool = False) -> None:
        self.checks += 1
        ledger = self.runtime._ledger
        if not held_matches_grants(ledger):
            self._fail(f"{where}: units held {dict(ledger.held)!r} != sum of live grants")
        for kind, held in ledger.held.items():
            if held < -_EPS:
                self._fail(f"{where}: {kind!r} holds a negative {held:g} units")
            total = ledger.totals[kind]
            if held <= total + _EPS:
                self._ceiling.pop(kind, None)
                continue
            ceiling = self._ceiling.get(kind)
            if ceiling is None:
                self._fail(f"{where}: {kind!r} holds {held:g} > capacity {total:g}")
            elif held > ceiling + _EPS:
                self._fail(
                    f"{where}: {kind!r} grew to {held:g} above its cut capacity {total:g} "
                    f"(it held {ceiling:g} when cut)"
                )
            else:
                self._ceiling[kind] = held
        for kind, level in ledger.tokens.items():
            if level < -_EPS:
                self._fail(f"{where}: rate {kind!r} budget overdrawn to {level:g}")
        registry = self.runtime._leases
        for entry in ledger.running:
            if entry.state != RUNNING:
                self._fail(f"{where}: running action #{entry.action.id} in state {entry.state}")
            elastic = entry.action.demand.elastic
            if elastic is not None and not elastic.min <= entry.units <= elastic.max:
                self._fail(
                    f"{where}: action #{entry.action.id} granted {entry.units} units outside "
                    f"[{elastic.min}, {elastic.max}]"
                )
            if leases and entry not in registry:
                self._fail(f"{where}: running action #{entry.action.id} has no lease")
        if not leases:
            return
        self._decisions += 1
        # The registry holds the queue too: walk all of it every few decisions only, so a
        # check stays O(running) and a long queue does not make every decision O(queue).
        if not full and self._decisions % _FULL_SCAN_EVERY:
            scan: Iterable[Entry] = ledger.running
        else:
            scan = registry
        for entry in scan:
            if entry.state not in (WAITING, RUNNING):
                self._fail(
                    f"{where}: lease of action #{entry.action.id} registered in state {entry.state}"
                )
            holder = self._holders.get(entry)
            if holder is not None and _task_finished(holder):
                self._fail(
                    f"{where}: lease of action #{entry.action.id} outlived the task "
                    f"{holder!r} that acquired it"
                )

    def check(self) -> None:
        """Run every check now (the registry included) and :meth:`verify`."""
        self._check("on demand", leases=True, full=True)
        self.verify()

    def verify(self) -> None:
        """Raise :class:`InvariantViolation` for the first violation seen, if any."""
        if self.violations:
            more = len(self.violations) - 1
            tail = f" (and {more} more)" if more else ""
            raise InvariantViolation(self.violations[0] + tail)

    def accounted(self) -> int:
        """Actions that ended as completed, failed or cancelled, per the runtime's stats."""
        kinds = self.runtime.stats().kinds.values()
        return sum(k.completed + k.failed + k.cancelled for k in kinds)


_CHECKERS: weakref.WeakKeyDictionary[Runtime, InvariantChecker] = weakref.WeakKeyDictionary()


def _check_runtime(runtime: object) -> None:
    if not isinstance(runtime, Runtime):
        raise SettingTypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")


def checker_of(runtime: Runtime) -> InvariantChecker:
    """The checker :func:`checked_runtime` (the ``tangram_runtime`` fixture) attached.

    :raises SettingTypeError: ``runtime`` is not a :class:`tangram.Runtime`.
    :raises InstrumentNotAttachedError: no such checker is attached to it (also a
        ``LookupError``).
    """
    _check_runtime(runtime)
    try:
        return _CHECKERS[runtime]
    except KeyError:
        raise InstrumentNotAttachedError(
            f"no InvariantChecker attached to {runtime!r}: build it with checked_runtime() "
            "or the tangram_runtime fixture"
        ) from None


def check_idle(runtime: Runtime) -> None:
    """Raise :class:`InvariantViolation` unless ``runtime`` holds, queues and leases nothing.

    Rate kinds are budgets, not holdings, and are not checked.

    :raises SettingTypeError: ``runtime`` is not a :class:`tangram.Runtime`.
    """
    _check_runtime(runtime)
    ledger = runtime._ledger
    problems: list[str] = []
    for kind, held in ledger.held.items():
        if abs(held) > _EPS:
            problems.append(f"{kind!r} still holds {held:g} units")
    if ledger.waiting_count:
        problems.append(f"{ledger.waiting_count} actions still waiting")
    if ledger.running:
        problems.append(f"{len(ledger.running)} actions still running")
    if runtime._leases:
        problems.append(f"{len(runtime._leases)} leases still registered")
    if not held_matches_grants(ledger):
        problems.append("units held differ from the sum of live grants")
    if problems:
        raise InvariantViolation("runtime not idle: " + "; ".join(problems))


# -- the pytest plugin ------------------------------------------------------------------

RuntimeFactory = Callable[..., contextlib.AbstractAsyncContextManager[Runtime]]


@contextlib.asynccontextmanager
async def checked_runtime(capacity: Mapping[str, object], **kwargs: Any) -> AsyncIterator[Runtime]:
    """``async with checked_runtime(capacity) as rt:``: a running runtime under a checker.

    At the end of the block (when it ended without an exception) the runtime must be idle
    and no invariant may have been broken; the runtime is closed either way.
    """
    runtime = Runtime(capacity, **kwargs)
    checker = InvariantChecker(runtime)
    _CHECKERS[runtime] = checker
    async with runtime:
        yield runtime
        check_idle(runtime)
    checker.verify()


@contextlib.asynccontextmanager
async def memory_sandboxes(
    handler: Handler | None = None, *, cores: int = 4, **kwargs: Any
) -> AsyncIterator[SandboxPool]:
    """A :class:`tangram.SandboxPool` over a :class:`MemoryBackend`, in a checked runtime.

    The runtime gets the pool's capacity (and ``kwargs``); the backend is
    ``pool.backend``, its sandboxes ``pool.backend.sandboxes``.
    """
    async with (
        SandboxPool(MemoryBackend(handler, cores=cores)) as pool,
        checked_runtime(pool.capacity(), **kwargs),
    ):
        yield pool


try:
    import pytest as _pytest
except ImportError:  # pragma: no cover - the checker works without pytest
    _pytest = None  # type: ignore[assignment]

if _pytest is not None:

    @_pytest.fixture
    def tangram_runtime() -> RuntimeFactory:
        """A factory of checked runtimes: ``async with tangram_runtime(capacity={...}) as rt``.

        Keyword arguments go to :class:`tangram.Runtime`; :func:`checker_of` finds its
        :class:`InvariantChecker`. Needs an async test (anyio's or pytest-asyncio's).
        """

        def factory(
            capacity: Mapping[str, object], **kwargs: Any
        ) -> contextlib.AbstractAsyncContextManager[Runtime]:
            return checked_runtime(capacity, **kwargs)

        return factory

    @_pytest.fixture
    def tangram_sandboxes() -> Callable[..., contextlib.AbstractAsyncContextManager[SandboxPool]]:
        """A factory of in-memory sandbox pools in checked runtimes: see
        :func:`memory_sandboxes`."""
        return memory_sandboxes

    @_pytest.fixture
    def tangram_invariants() -> Iterator[Callable[[Runtime], InvariantChecker]]:
        """``tangram_invariants(runtime)`` attaches a checker; all are verified at teardown."""
        checkers: list[InvariantChecker] = []

        def attach(runtime: Runtime) -> InvariantChecker:
            checker = InvariantChecker(runtime)
            checkers.append(checker)
            return checker

        yield attach
        for checker in checkers:
            checker.verify()


_publish("tangram.testing", globals())
