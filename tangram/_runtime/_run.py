"""The live scheduler: ``Runtime``, ``acquire`` and the current-runtime context variable.

Decisions are made synchronously inside ``acquire`` and ``release`` (a pure policy pass
over bounded state), so a release wakes the next action in the same loop iteration, the
way a bare ``anyio.CapacityLimiter`` does. The one background task only handles time:
it wakes the scheduler when a rate budget has refilled enough for the blocked head.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

try:  # see _checkpoints
    from anyio._core._eventloop import get_async_backend as _get_async_backend
except ImportError:  # pragma: no cover - depends on the anyio release
    _get_async_backend = None  # type: ignore[assignment]

from .._core._action import Action
from .._core._demand import describe
from .._core._estimator import Estimator
from .._core._ledger import Ledger
from .._core._policy import RUNNING, WAITING, ElasticPolicy, Entry, Policy
from .._core._resources import Capacity, Resource, parse_capacity
from .._core._stats import CANCELLED, COMPLETED, FAILED, Outcome, Recorder, ResourceStats, Stats
from ..errors import (
    AcquireReusedError,
    CapacityExceededError,
    InvalidCapacityError,
    NoCurrentRuntimeError,
    PolicyError,
    RuntimeClosedError,
    SelfDeadlockError,
    SettingTypeError,
    WaitTimeoutError,
)
from ._actions import Actions, duration
from ._instrument import Instrument, Instruments
from ._lease import Lease, Waitable
from ._own import check_own, self_deadlock, timed_out
from ._scheduler import LeaseLike, Scheduler

__all__ = ["AcquireContext", "Runtime", "acquire", "current_runtime"]

logger = logging.getLogger("tangram")
T = TypeVar("T")

_current: contextvars.ContextVar[Scheduler] = contextvars.ContextVar("tangram.runtime")


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


# Read on every acquire and release: an enum member read off its class costs five plain
# reads (with the outcomes of ``_core._stats``).
_RUNNING = _State.RUNNING


class RunMixin:
    """``run`` for anything with :meth:`Runtime.acquire` (the runtime and its proxies)."""

    async def run(
        self: Scheduler,
        demand: Mapping[str, object],
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        kind: str = "action",
        trajectory: str | None = None,
        estimate: float | None = None,
        wait_timeout: float | None = None,
    ) -> T:
        """``await fn(*args)`` holding ``demand``: ``acquire`` without ``async with``."""
        if not callable(fn):
            raise SettingTypeError(f"`fn` must be an async callable (got {fn!r})")
        context = self.acquire(
            demand, kind=kind, trajectory=trajectory, estimate=estimate, wait_timeout=wait_timeout
        )
        async with context:
            return await fn(*args)


class Runtime(RunMixin):
    """A scheduler for one event loop: capacities, a policy and the actions in flight.

    ``async with Runtime(capacity={"cpu": 64, "mem": "256GiB", "search": "50/s"}):``
    starts it and makes it current, so ``tangram.acquire(...)`` anywhere below (in this
    task and the tasks it starts) reaches it. A runtime is entered once; actions still
    waiting when it closes fail with :class:`~tangram.errors.RuntimeClosedError`, while
    actions already running keep their units until their ``async with`` block ends.

    :param capacity: units per resource kind: numbers for counts, ``"16GiB"`` for sizes,
        ``"50/s"`` or :class:`tangram.Rate` for refilling budgets. The unit declares the
        shape: ``{"mem": 16}`` is a count of 16 in whatever unit the caller's demands use
        (``mem=2``), while ``{"mem": "16GiB"}`` is a size, whose demands are written
        ``mem="2GiB"`` (a bare number there is bytes). A size demand against a count
        capacity is refused at the acquire, saying so.
    :param policy: the scheduling policy (default :class:`tangram.ElasticPolicy`).
    :param estimator: learns durations online (default :class:`tangram.Estimator`).
    :raises InvalidCapacityError: a capacity that makes no sense.
    :raises SettingTypeError: ``policy`` has no ``plan`` method, or ``estimator`` is not
        a :class:`tangram.Estimator`.
    """

    def __init__(
        self,
        capacity: Mapping[str, object] | Capacity,
        *,
        policy: Policy | None = None,
        estimator: Estimator | None = None,
    ) -> None:
        self._capacity = parse_capacity(capacity)
        self._policy = policy if policy is not None else ElasticPolicy()
        if not callable(getattr(self._policy, "plan", None)):
            raise SettingTypeError(f"`policy` must have a plan(state) method (got {policy!r})")
        if estimator is not None and not isinstance(estimator, Estimator):
            raise SettingTypeError(
                f"`estimator` must be a tangram.Estimator or None (got {estimator!r})"
            )
        self._estimator = estimator if estimator is not None else Estimator()
        self._ledger = Ledger(self._capacity, self._policy, self._estimator)
        self._actions = Actions(self._capacity, self._estimator)
        self._recorder = Recorder()
        self._instruments = Instruments()
        self._state = _State.NEW
        self._leases: dict[Entry, Lease] = {}
        # The granted leases of each task (asyncio task, trio task) that holds any: what
        # an acquire checks its own task's holdings against. One dict lookup per acquire
        # and release; only a task that already holds something pays for the check.
        self._holders: dict[object, list[Lease]] = {}
        self._task_of: Callable[[], object] = asyncio.current_task
        self._planning = False
        self._stopped_by: PolicyError | None = None  # the policy's fault that closed it
        self._decisions = 0
        self._decision_seconds = 0.0
        self._wake_at: float | None = None
        self._poke: anyio.Event | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._token: contextvars.Token[Scheduler] | None = None
        self._now: Callable[[], float] = anyio.current_time
        self._new_event: Callable[[], Waitable] = anyio.Event
        self._cancelled: type[BaseException] = BaseException
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]]
        self._shielded_checkpoint: Callable[[], Awaitable[None]]
        self._checkpoint_if_cancelled, self._shielded_checkpoint = _checkpoints_of_anyio()
        self._deferred = False
        self._epoch = 0  # bumped by set_capacity: demands built before may no longer fit

    def __repr__(self) -> str:
        totals = {name: res.total for name, res in self._capacity.items()}
        return f"<tangram.Runtime {self._state.value} capacity={totals!r}>"

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        if self._state is not _State.NEW:
            raise RuntimeClosedError(
                f"a Runtime can be entered once (this one is {self._state.value})"
            )
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._state = _State.RUNNING
        self._now, self._cancelled, self._new_event = _loop_clock()
        self._task_of = _task_lookup(self._cancelled)
        self._checkpoint_if_cancelled, self._shielded_checkpoint = _checkpoints()
        self._ledger.now = self._now()
        self._poke = anyio.Event()
        task_group.start_soon(self._timer)
        self._token = _current.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()
        if self._token is not None:
            # Exited from another context: leave that context's value alone.
            with contextlib.suppress(ValueError):
                _current.reset(self._token)
            self._token = None
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return
        task_group.cancel_scope.cancel()
        # The task group holds only the timer. The body's exception is not handed to it:
        # a task group would wrap it in an ExceptionGroup, and ``except ValueError`` around
        # ``async with Runtime(...)`` would stop catching a ValueError raised inside.
        await task_group.__aexit__(None, None, None)

    def _close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        now = self._now()
        for entry, lease in list(self._leases.items()):
            if entry.state == WAITING:
                error = RuntimeClosedError("the runtime closed while this action was waiting")
                self._fail_waiting(lease, error, now)

    def _stop(self, fault: Exception) -> None:
        """Close the runtime on a pass its policy failed, waking every waiter with why.

        The policy would fail the next pass the same way, and a waiter left waiting for
        it would wait forever; a fault raised from the timer's pass would instead cancel
        the body of ``async with runtime``. Running actions keep their grants and give
        them back as they end; new acquires raise :class:`RuntimeClosedError`.
        """
        if isinstance(fault, PolicyError):
            why = str(fault)
        else:
            name = type(self._policy).__name__
            why = f"policy {name} raised {fault!r}; nothing of its plan was applied"
        logger.error("the runtime stopped: %s", why, exc_info=fault)
        self._stopped_by = PolicyError(why)
        self._state = _State.CLOSED
        now = self._ledger.now
        for entry, lease in list(self._leases.items()):
            if entry.state == WAITING:
                error = PolicyError(why)
                error.__cause__ = fault
                self._fail_waiting(lease, error, now)

    def _fail_waiting(self, lease: Lease, error: BaseException, now: float) -> None:
        """Take a waiting action out of the queue and wake it with ``error``."""
        entry = lease._entry
        del self._leases[entry]
        self._ledger.withdraw(entry, now)
        lease._finish(now)
        self._recorder.action_finished(lease, Outcome.CANCELLED)
        lease._fail(error)
        if self._instruments.action_finished:
            self._instruments.call("action_finished", lease, Outcome.CANCELLED)

    async def _timer(self) -> None:
        """Wake the scheduler when a rate budget refills or a deferred pass is due."""
        while True:
            wake = self._wake_at
            assert self._poke is not None
            with anyio.CancelScope(deadline=math.inf if wake is None else wake):
                await self._poke.wait()
            self._wake_at = None
            self._deferred = False
            self._reschedule()
            # A fresh event only now: the pass above may book a wake-up, which the loop
            # reads anyway; a poke left set by it would spin this loop.
            self._poke = anyio.Event()

    # -- instruments -------------------------------------------------------------------

    def add_instrument(self, instrument: Instrument) -> None:
        """Attach an observer: its hooks hear every event from now on.

        Any number may be attached and removed in any order; attaching one already attached
        does nothing. A hook that raises detaches its instrument (the error is logged on
        the ``tangram`` logger) and the scheduler carries on.

        :raises TypeError: ``instrument`` is not a :class:`tangram.Instrument`.
        """
        self._instruments.add(instrument)

    def remove_instrument(self, instrument: Instrument) -> None:
        """Detach an observer attached with :meth:`add_instrument`.

        :raises InstrumentNotAttachedError: it is not attached: never was, already
            removed, or detached because a hook raised.
        """
        self._instruments.remove(instrument)

    # -- acquiring ---------------------------------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    @property
    def policy(self) -> Policy:
        """The policy this runtime plans with (a host agent's runtime takes the job's)."""
        return self._policy

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
    ) -> AcquireContext:
        """Ask for ``demand`` (or keyword amounts) for the duration of an ``async with``.

        ``async with runtime.acquire(cpu=tangram.Elastic(1, 16), mem="2GiB",
        kind="run_tests") as lease:`` waits until the scheduler grants it, then holds the
        grant until the block ends, however it ends: return, exception or cancellation.

        :param kind: groups actions of alike duration; the estimator learns per kind.
        :param trajectory: the rollout this action belongs to.
        :param estimate: seconds the action takes on one unit, when the caller knows
            better than the estimator.
        :param wait_timeout: seconds to wait in the queue before failing with
            :class:`~tangram.errors.WaitTimeoutError`.
        :raises InvalidDemandError: (and its subclasses) for a demand that cannot be
            served, raised here, before anything is queued.
        :raises SelfDeadlockError: (on entering) the task entering it already holds
            leases on this runtime that, with this demand, exceed some capacity: it would
            wait forever for units only it can give back. An entering task that holds
            some and must wait gets a :class:`~tangram.errors.DeadlockRiskWarning`.
        """
        action = self._actions.build(demand, amounts, kind, trajectory, estimate)
        timeout = (
            None if wait_timeout is None else duration("wait_timeout", wait_timeout, finite=False)
        )
        return AcquireContext(self, action, timeout)

    async def _enter(self, action: Action, wait_timeout: float | None, epoch: int) -> Lease:
        await self._checkpoint_if_cancelled()
        if self._state is not _RUNNING:
            raise RuntimeClosedError(
                f"the runtime is {self._state.value}, not running"
            ) from self._stopped_by
        task = self._task_of()
        own = self._holders.get(task)
        if own:
            check_own(own, action, wait_timeout, self._ledger, self._capacity)
        now = self._now()
        entry = self._ledger.submit(action, now)
        if own:
            entry.holding = frozenset(kind for held in own for kind in held.grant)
        lease = Lease(entry, now)
        lease._holder = task
        self._leases[entry] = lease
        if self._instruments.action_queued:
            self._instruments.call("action_queued", lease)
        # Checked against the capacity when the demand was built; again only if the
        # capacity changed since (a set_capacity between acquire() and entering).
        if epoch != self._epoch and not self._ledger.could_ever_fit(entry):
            self._drop(lease, Outcome.CANCELLED)
            need = describe(action.demand.minimum, self._capacity)
            raise CapacityExceededError(f"demand no longer fits the lowered capacity: {need}")
        # ``wait_timeout=0`` is "only if free now": decided at once, as the pass deferred
        # to the end of this loop iteration would come after its wait had run out.
        if self._deferred and wait_timeout != 0:
            pass  # a pass is already due in this loop iteration, and will see it
        elif not self._ledger.may_admit(entry):
            pass  # it cannot start now, and its arrival changes no other decision
        elif wait_timeout != 0 and (
            self._ledger.waiting_count > 1
            or ((elastic := action.demand.elastic) is not None and not elastic.resizable)
        ):
            # Decide once, after every action that arrives or leaves in this loop
            # iteration: a burst of elastic demands is split instead of going to its first
            # asker for life, and a queue that is already waiting gains nothing from one
            # pass per event (each pass walks the window and the running actions).
            self._defer()
        else:
            self._reschedule(now)  # nobody ahead: an uncontended acquire starts at once
        if lease._error is not None:  # that pass stopped the runtime (its policy's fault)
            raise lease._error
        if entry.state == RUNNING:
            try:
                await self._shielded_checkpoint()
            except BaseException:
                # A shield keeps out anyio cancellation, not a native ``Task.cancel()``
                # (``asyncio.timeout``, ``wait_for``): give the grant back before leaving.
                self._drop(lease, Outcome.CANCELLED)
                raise
        else:
            lease._ready = self._new_event()
            try:
                if wait_timeout is None:
                    await lease._ready.wait()
                else:
                    with anyio.fail_after(wait_timeout):
                        await lease._ready.wait()
            except BaseException as exc:
                self._drop(lease, Outcome.CANCELLED)
                if isinstance(exc, TimeoutError) and wait_timeout is not None:
                    need = describe(action.demand.minimum, self._capacity)
                    raise WaitTimeoutError(
                        f"waited {wait_timeout:g} s for {need} (kind {action.kind!r}) "
                        "without a grant"
                    ) from exc
                raise
            if lease._error is not None:
                if isinstance(lease._error, SelfDeadlockError) and wait_timeout is not None:
                    raise timed_out(lease._error, wait_timeout) from lease._error
                raise lease._error
        lease._start(self._now())
        if own is None:
            self._holders[task] = [lease]
        else:
            own.append(lease)
            if len(own) == 1:  # emptied and still referenced: it left the dict on release
                self._holders[task] = own
        return lease

    def _release(self, lease: Lease, exc_type: type[BaseException] | None) -> None:
        if exc_type is None:
            outcome = COMPLETED
        elif issubclass(exc_type, Exception) and not issubclass(exc_type, self._cancelled):
            outcome = FAILED
        else:
            outcome = CANCELLED
        self._drop(lease, outcome)

    def _drop(self, lease: Lease, outcome: Outcome) -> None:
        """Give back whatever ``lease`` holds or stop it waiting; record how it ended."""
        entry = lease._entry
        if self._leases.pop(entry, None) is None:
            return
        own = self._holders.get(lease._holder)  # it no longer counts as its task's
        if own is not None and lease in own:
            own.remove(lease)
            if not own:
                del self._holders[lease._holder]
        now = self._now()
        lease._finish(now)
        if entry.state == RUNNING:
            exec_seconds = now - lease.started_at
            self._ledger.finish(entry, now, exec_seconds, outcome is COMPLETED)
            if math.isnan(lease.admitted_at):
                lease.admitted_at = entry.admitted_at
        else:
            self._ledger.withdraw(entry, now)
        self._recorder.action_finished(lease, outcome)
        if not self._deferred and (self._ledger.waiting_count or self._ledger.resizing):
            self._defer()
        if self._instruments.action_finished:
            self._instruments.call("action_finished", lease, outcome)

    def _defer(self) -> None:
        """Run the next pass from the timer task, after the tasks already ready to run."""
        if not self._deferred and self._poke is not None:
            self._deferred = True
            self._poke.set()

    def _reschedule(self, now: float | None = None) -> None:
        if self._state is not _RUNNING or self._planning:
            return
        self._planning = True
        try:
            started = time.perf_counter()
            plan = self._ledger.step(self._now() if now is None else now)
            self._decisions += 1
            self._decision_seconds += time.perf_counter() - started
        except Exception as exc:
            self._stop(exc)
            return
        finally:
            self._planning = False
        leases = self._leases
        now = self._ledger.now
        instruments = self._instruments
        for entry, _ in plan.admits:
            lease = leases[entry]
            lease._admit(now)
            if instruments.action_granted:
                instruments.call("action_granted", lease)
        for entry, units in plan.resizes:
            logger.debug("resized action %d to %d units", entry.action.id, units)
            lease = leases[entry]
            lease._notify_resize()
            if instruments.action_resized:
                instruments.call("action_resized", lease, now)
        if plan.wake_at != self._wake_at:
            self._wake_at = plan.wake_at
            if self._poke is not None:
                self._poke.set()
        if instruments.after_plan:
            instruments.call("after_plan", plan, now)

    # -- run-time changes and introspection --------------------------------------------

    def set_capacity(
        self, capacity: Mapping[str, object] | None = None, /, **amounts: object
    ) -> None:
        """Change capacities while running (a node joined or left).

        Kinds not named keep their capacity. Running resizable actions above a lowered
        capacity are shrunk; rigid grants finish normally and nothing new is admitted
        until use is back under the capacity. Waiting actions that can no longer fit
        fail with :class:`~tangram.errors.CapacityExceededError`.
        """
        if capacity is not None and not isinstance(capacity, Mapping):
            raise InvalidCapacityError(
                f"capacity must be a mapping of name to amount (got {capacity!r})"
            )
        updates = dict(capacity or {}, **amounts)
        self._capacity = self._capacity.with_updates(updates)
        self._actions.capacity = self._capacity
        self._epoch += 1
        now = self._now() if self._state is _State.RUNNING else self._ledger.now
        impossible = self._ledger.set_capacity(self._capacity, now)
        if self._instruments.capacity_changed:
            self._instruments.call("capacity_changed", self._capacity)
        for entry in impossible:
            need = describe(entry.action.demand.minimum, self._capacity)
            error = CapacityExceededError(f"capacity lowered below this demand: {need}")
            self._fail_waiting(self._leases[entry], error, now)
        if self._holders:
            # A waiting task's own leases never shrink below what the check at its
            # acquire counted, so only a lowered capacity can make its wait endless.
            for entry, lease in list(self._leases.items()):
                own = self._holders.get(lease._holder)
                if own and entry.state == WAITING:
                    deadlock = self_deadlock(own, entry.action, self._ledger, self._capacity)
                    if deadlock is not None:
                        self._fail_waiting(lease, deadlock, now)
        for name, held in self._ledger.held.items():
            if held > self._ledger.totals[name] + 1e-9:
                logger.warning(
                    "capacity of %r lowered to %g below the %g units held; admitting nothing "
                    "of it until running actions finish",
                    name,
                    self._ledger.totals[name],
                    held,
                )
        self._reschedule()

    def _limit_rate(
        self, kind: str, per_second: float, burst: float, until: float = math.inf
    ) -> None:
        """Refill rate budget ``kind`` at ``per_second`` up to ``burst`` until ``until``
        (this loop's clock), the rest being lent elsewhere.

        For the shared layer, which lends a job's API rate to its nodes
        (:mod:`tangram._shared._rates`); see :meth:`Ledger.limit_rate`.
        """
        now = self._now() if self._state is _State.RUNNING else self._ledger.now
        self._ledger.limit_rate(kind, per_second, burst, now, until)
        self._reschedule()

    def _rate_use(self, kind: str) -> tuple[float, float, float]:
        """Units of rate budget ``kind`` taken so far, those its waiters ask for, and the
        unit-seconds they waited so far (:meth:`Ledger.waited`)."""
        ledger = self._ledger
        now = self._now() if self._state is _State.RUNNING else ledger.now
        return ledger.spent[kind], ledger.wanted[kind], ledger.waited(kind, now)

    def stats(self) -> Stats:
        """Utilisation per kind, queue lengths and per-kind time splits, as of now."""
        ledger = self._ledger
        now = ledger.now
        if self._state is _State.RUNNING:
            now = self._now()
            ledger._account(now)
        resources: dict[str, ResourceStats] = {}
        for name, res in self._capacity.items():
            resources[name] = _resource_stats(ledger, name, res, now)
        return Stats(
            resources=resources,
            waiting=ledger.waiting_count,
            running=len(ledger.running),
            kinds=self._recorder.kinds(),
            decisions=self._decisions,
            decision_seconds=self._decision_seconds,
            resizes=ledger.resizes,
            evictions=ledger.evictions,
        )


def _resource_stats(ledger: Ledger, name: str, res: Resource, now: float) -> ResourceStats:
    if name in ledger.rates:
        level = ledger.level(name, now)
        return ResourceStats(res.total, res.burst - level, 1.0 - level / res.burst, 0.0, 0.0)
    held = ledger.held[name]
    return ResourceStats(
        total=res.total,
        held=held,
        utilisation=held / res.total if res.total > 0 else 0.0,
        unit_seconds=ledger.unit_seconds[name],
        peak=ledger.peak[name],
    )


class AcquireContext:
    """The async context manager ``acquire`` returns; enter it once."""

    __slots__ = ("_action", "_epoch", "_lease", "_runtime", "_wait_timeout")

    def __init__(self, runtime: Runtime, action: Action, wait_timeout: float | None) -> None:
        self._runtime = runtime
        self._action = action
        self._wait_timeout = wait_timeout
        self._epoch = runtime._epoch
        self._lease: Lease | None = None

    @property
    def action(self) -> Action:
        return self._action

    async def __aenter__(self) -> Lease:
        if self._lease is not None:
            raise AcquireReusedError("an acquire context can be entered only once")
        self._lease = await self._runtime._enter(self._action, self._wait_timeout, self._epoch)
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._lease is not None
        self._runtime._release(self._lease, exc_type)


def _loop_clock() -> tuple[Callable[[], float], type[BaseException], Callable[[], Waitable]]:
    """The running loop's clock, cancellation class and event type, looked up once.

    ``anyio.current_time()`` and ``anyio.Event()`` find the async library on every call;
    at five lookups per acquire/release cycle that was a tenth of the cycle on asyncio.
    A bare ``asyncio.Event`` is what ``anyio.Event`` wraps there, and anyio's cancel
    scopes cancel a task waiting on it like any other.
    """
    cancelled = anyio.get_cancelled_exc_class()
    if cancelled is asyncio.CancelledError:
        loop = asyncio.get_running_loop()
        future = loop.create_future

        def wake() -> Waitable:
            return _Wake(future())

        # asyncio's own loops tell the time with ``time.monotonic()``; read it directly
        # unless the loop keeps a clock of its own (a test's virtual clock, uvloop).
        custom = getattr(loop.time, "__func__", None) is not asyncio.BaseEventLoop.time
        return loop.time if custom else time.monotonic, cancelled, wake
    return anyio.current_time, cancelled, anyio.Event


class _Wake:
    """A waiting lease's wake-up on asyncio: one future, set at most once.

    What ``asyncio.Event`` does for one waiter, without its list of waiters, the coroutine
    of each ``wait()`` and the loop check under a lock of its first: 7k of the 191k
    instructions of an acquire/release cycle behind 1k waiters
    (``benchmarks/overhead.py``). A task cancelled while it waits cancels the future,
    and a later ``set`` leaves it so.
    """

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future

    def set(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        return self._future


def _task_lookup(cancelled: type[BaseException]) -> Callable[[], object]:
    """How to find the running task, as an object that lives as long as it does.

    Not ``anyio.get_current_task().id``: that is ``id(task)``, which a new task may reuse
    once the old one is gone, and a lease leaked by a dead task (entered, never exited)
    would then count against the newcomer.
    """
    if cancelled is asyncio.CancelledError:
        return asyncio.current_task
    import trio.lowlevel  # anyio's only other backend: trio is what runs this loop

    return trio.lowlevel.current_task


def _checkpoints_of_anyio() -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    return anyio.lowlevel.checkpoint_if_cancelled, anyio.lowlevel.cancel_shielded_checkpoint


def _checkpoints() -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """anyio's two checkpoints for the running library, looked up once.

    ``anyio.lowlevel.checkpoint_if_cancelled()`` finds the backend class at every call
    (2.4 of its 3.9 us on asyncio here, 5% of an acquire/release cycle); these are the
    methods it then calls. anyio keeps the lookup in a private module: should a release
    move it, the public functions serve, only slower.
    """
    if _get_async_backend is None:  # pragma: no cover - depends on the anyio release
        return _checkpoints_of_anyio()
    backend = _get_async_backend()
    return backend.checkpoint_if_cancelled, backend.cancel_shielded_checkpoint


def _enter_current(scheduler: Scheduler) -> contextvars.Token[Scheduler]:
    """Make ``scheduler`` what ``tangram.acquire`` reaches in this context.

    For the other :class:`Scheduler` (``tangram.ray``'s remote runtime): user code written
    against ``tangram.acquire`` then runs unchanged.
    """
    return _current.set(scheduler)


def _exit_current(token: contextvars.Token[Scheduler]) -> None:
    with contextlib.suppress(ValueError):  # exited from another context: leave it alone
        _current.reset(token)


def current_runtime() -> Scheduler:
    """The scheduler of the innermost ``async with Runtime(...)`` around this task.

    A :class:`Runtime`, or inside a shared scheduler's session its ``RemoteRuntime``: both
    are a :class:`tangram.abc.Scheduler`.

    :raises NoCurrentRuntimeError: there is none.
    """
    try:
        return _current.get()
    except LookupError:
        raise NoCurrentRuntimeError(
            "tangram.acquire needs a running runtime: wrap the rollout in "
            "`async with tangram.Runtime(capacity={...}):`"
        ) from None


def current_local_runtime(what: str) -> Runtime:
    """The current scheduler, which ``what`` needs to be a :class:`Runtime` of this process.

    GPU pools and quotas change the capacity as they go (a replica's memory, a key's
    budget) and hold units across tasks, which a shared scheduler's proxy does not offer.

    :raises NoCurrentRuntimeError: there is none.
    :raises SettingTypeError: the current one is a shared scheduler's proxy: pass
        ``runtime=`` a :class:`Runtime` of this process.
    """
    scheduler = current_runtime()
    if not isinstance(scheduler, Runtime):
        raise SettingTypeError(
            f"{what} needs a tangram.Runtime of this process, and the current scheduler is "
            f"{scheduler!r}: pass `runtime=` one"
        )
    return scheduler


def acquire(
    demand: Mapping[str, object] | None = None,
    /,
    *,
    kind: str = "action",
    trajectory: str | None = None,
    estimate: float | None = None,
    wait_timeout: float | None = None,
    **amounts: object,
) -> contextlib.AbstractAsyncContextManager[LeaseLike]:
    """``current_runtime().acquire(...)``: see :meth:`Runtime.acquire`."""
    runtime = _current.get(None)
    if runtime is None:
        runtime = current_runtime()  # raises the explanation
    return runtime.acquire(
        demand,
        kind=kind,
        trajectory=trajectory,
        estimate=estimate,
        wait_timeout=wait_timeout,
        **amounts,
    )
