"""Every error tangram raises on purpose, in one place.

Each leaf is named for what happened and also subclasses the builtin a caller would
already catch, so ``except ValueError`` around a bad demand keeps working::

    TangramError
    ├── InvalidDemandError (ValueError)      the demand can never be served as written
    │   ├── DemandTypeError (TypeError)      a value of the wrong type
    │   ├── UnknownResourceError (LookupError)  names a resource the runtime lacks
    │   └── CapacityExceededError            asks for more than the whole capacity
    ├── InvalidSettingError (ValueError)     a policy, estimator or runtime setting out of range
    │   ├── SettingTypeError (TypeError)     a setting or argument of the wrong type
    │   ├── UnknownBackendError (LookupError)  no sandbox backend of that name (or none usable)
    │   ├── UnknownPolicyError (LookupError)  no policy of that name
    │   └── InvalidCapacityError             a capacity that makes no sense
    ├── ConfigError (ValueError)             a config file that cannot be read or is impossible
    ├── WaitTimeoutError (TimeoutError)      queued for longer than ``wait_timeout``
    ├── RuntimeClosedError (RuntimeError)    your code used a runtime that is not running
    ├── NoCurrentRuntimeError (RuntimeError) ``tangram.acquire`` outside ``async with runtime``
    ├── AcquireReusedError (RuntimeError)    your code entered one ``acquire(...)`` twice
    ├── SelfDeadlockError (RuntimeError)     the task's own leases keep its demand from fitting
    ├── PolicyError (RuntimeError)           your own policy's plan broke the ledger's rules
    ├── LeaseNotResizableError (RuntimeError)  ``wait_resized`` on a lease never resized
    ├── LeaseReleasedError (RuntimeError)    ``wait_resized`` on a lease no longer held
    ├── InstrumentNotAttachedError (KeyError)  removing an instrument that is not attached
    ├── GpuError                             a GPU model service could not serve the action
    │   ├── GpuOutOfMemoryError (MemoryError)  a restore or load ran out of device memory
    │   ├── GpuServiceError (RuntimeError)     the service failed (an outside cause)
    │   └── GpuPoolClosedError (RuntimeError)  your code used the pool outside its block
    ├── QuotaDeadlineError (TimeoutError)    an API request not answered before its deadline
    ├── TraceFormatError (ValueError)        a malformed tangram-trace/1 line (``.line``, ``.path``)
    ├── PlotUnavailableError (ImportError)   a plot was asked for without matplotlib
    ├── SandboxError                         a CPU sandbox could not run the action
    │   ├── SandboxBrokenError (RuntimeError)  it died (an outside cause, see ``__cause__``)
    │   └── SandboxClosedError (RuntimeError)  your code used it after it closed
    │       └── UnknownSandboxError (KeyError)  an id with no open sandbox (not opened, or closed)
    ├── SchedulerUnavailableError (RuntimeError)  the shared Ray scheduler cannot serve you
    ├── UnscoredSampleError (RuntimeError)   a tool call of the sample failed in tangram
    └── AsyncioRequiredError (RuntimeError)  ``tangram.ray`` on a loop other than asyncio

Bad arguments fail at the call that made them, before anything is queued: a demand that
cannot be served never waits in the queue to fail later.

One warning has a class of its own, so it can be filtered or turned into an error::

    TangramWarning (UserWarning)
    └── DeadlockRiskWarning                  a task waits for units while holding others
"""

from __future__ import annotations

from ._core._exports import publish as _publish

__all__ = [
    "AcquireReusedError",
    "AsyncioRequiredError",
    "CapacityExceededError",
    "ConfigError",
    "DemandTypeError",
    "GpuError",
    "GpuOutOfMemoryError",
    "GpuPoolClosedError",
    "DeadlockRiskWarning",
    "GpuServiceError",
    "InstrumentNotAttachedError",
    "InvalidCapacityError",
    "InvalidDemandError",
    "InvalidSettingError",
    "LeaseNotResizableError",
    "LeaseReleasedError",
    "NoCurrentRuntimeError",
    "PlotUnavailableError",
    "PolicyError",
    "QuotaDeadlineError",
    "RuntimeClosedError",
    "SandboxBrokenError",
    "SandboxClosedError",
    "SandboxError",
    "SchedulerUnavailableError",
    "SelfDeadlockError",
    "SettingTypeError",
    "TangramError",
    "TangramWarning",
    "TraceFormatError",
    "UnknownBackendError",
    "UnknownPolicyError",
    "UnknownResourceError",
    "UnknownSandboxError",
    "UnscoredSampleError",
    "WaitTimeoutError",
]


class TangramError(Exception):
    """Base of every error tangram raises on purpose."""


class InvalidDemandError(TangramError, ValueError):
    """A demand (or an efficiency model inside it) that no capacity could serve."""


class DemandTypeError(InvalidDemandError, TypeError):
    """A demand value of the wrong type, such as ``cpu="four"`` or ``cpu=True``."""


class UnknownResourceError(InvalidDemandError, LookupError):
    """The demand names a resource kind the runtime was not given."""


class CapacityExceededError(InvalidDemandError):
    """The demand needs more than the runtime's whole capacity of some kind.

    Raised at the call when the demand arrives, and given to actions still waiting when
    ``Runtime.set_capacity`` lowers a capacity below what they need.
    """


class InvalidSettingError(TangramError, ValueError):
    """A setting of a policy, estimator or runtime outside what it allows.

    Raised where the object is built (``FcfsPolicy(dop=0)``), naming the parameter, the
    value and the allowed range. A mistake in the calling code.
    """


class SettingTypeError(InvalidSettingError, TypeError):
    """A setting or argument of the wrong type: ``FcfsPolicy(dop="4")``, a policy without
    ``plan``, an instrument that is not a :class:`tangram.Instrument`, a ``fn`` that is
    not callable.

    Also a ``ValueError``, as these settings raised before they had a class of their own.
    """


class UnknownBackendError(InvalidSettingError, LookupError):
    """A sandbox backend name no backend is registered under, such as ``"podman"``.

    The message lists the names there are. Also raised when a pool left to choose its
    backend finds none usable here (no Docker, and no embedded backend on this platform):
    pass one as ``backend=``. Also a ``LookupError``, as the lookup raised one before it
    had a class of its own.
    """


class UnknownPolicyError(InvalidSettingError, LookupError):
    """A policy name no policy is registered under, such as ``"lottery"``.

    The message lists the names there are (``tangram.abc.POLICIES``).
    """


class InvalidCapacityError(InvalidSettingError):
    """A capacity that makes no sense: negative, NaN, of the wrong type or unit."""


class WaitTimeoutError(TangramError, TimeoutError):
    """The action waited in the queue longer than its ``wait_timeout``.

    Nothing was granted: the action left the queue and holds no units. Raised at once,
    with a :class:`SelfDeadlockError` as ``__cause__``, when the task's own leases mean
    no grant can come within the timeout.
    """


class RuntimeClosedError(TangramError, RuntimeError):
    """The runtime is not running: not entered yet, or already closed.

    This is a mistake in the calling code, as opposed to an outside failure.
    """


class NoCurrentRuntimeError(TangramError, RuntimeError):
    """``tangram.acquire`` was called outside ``async with runtime:``.

    The current runtime is a context variable; tasks started inside the ``async with``
    block inherit it, tasks started elsewhere do not.
    """


class AcquireReusedError(TangramError, RuntimeError):
    """An ``acquire(...)`` context was entered a second time.

    Each one stands for one action and its one lease; call ``acquire`` again for another.
    A mistake in the calling code.
    """


class SelfDeadlockError(TangramError, RuntimeError):
    """The demand can never be granted while this task holds the leases it holds.

    The task's own leases on the runtime plus the demand's minimum exceed the capacity of
    some resource, and the task cannot release them while it waits: the acquire would
    wait forever. Raised at the acquire, before anything is queued (or, for an action
    already waiting, when ``Runtime.set_capacity`` lowers the capacity below that sum).
    Ask for everything in one demand, or release the outer lease first.
    """


class PolicyError(TangramError, RuntimeError):
    """A scheduling policy's plan broke a rule the ledger keeps: it admitted an action
    twice or one not waiting, gave units outside an elastic range, or granted more than
    was free. Nothing of that plan was applied; the pass that asked for it fails.

    Raised only by a policy of one's own (tangram's are checked against these rules by
    the test suite). Where the runtime's own pass raised it, the runtime stops with it.
    """


class LeaseNotResizableError(TangramError, RuntimeError):
    """``wait_resized`` on a lease whose demand is not ``Elastic(..., resizable=True)``.

    The scheduler never resizes such a lease, so the wait would never end.
    """


class LeaseReleasedError(TangramError, RuntimeError):
    """``wait_resized`` on a lease that is no longer held: its block ended (or, on Ray,
    the scheduler reclaimed it), so no resize can come.

    Also raised in a task still waiting when the lease goes.
    """


class InstrumentNotAttachedError(TangramError, KeyError):
    """``Runtime.remove_instrument`` of an instrument that is not attached: never was,
    already removed, or detached because one of its hooks raised."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the message's repr, quotes and all.
        return str(self.args[0]) if self.args else ""


class QuotaDeadlineError(TangramError, TimeoutError):
    """The request was not answered before its deadline.

    The deadline bounds the whole call: waiting for a key's budget, every attempt and the
    pauses between retries. Raised as soon as a miss is certain (the key's budget refills
    too late, every key is set aside, or the provider's ``Retry-After`` reaches past it),
    otherwise when the deadline passes with the reply still outstanding. Nothing is held
    when it is raised.
    """


class GpuError(TangramError):
    """A GPU model service could not serve the action."""


class GpuOutOfMemoryError(GpuError, MemoryError):
    """A restore or cold load ran out of device memory, or the service fits no device.

    The replica went back to evicted (nothing of it stays on the device), its memory grant
    went back to the runtime and the pool's books are as before the attempt; a later action
    tries again.
    """


class GpuServiceError(GpuError, RuntimeError):
    """The service failed to load, restore, evict or run (an outside cause: ``__cause__``)."""


class GpuPoolClosedError(GpuError, RuntimeError):
    """The pool was used before ``async with pool:`` or after it closed."""


class TraceFormatError(TangramError, ValueError):
    """A trace line that is not valid tangram-trace/1; ``line`` is its 1-based number.

    Line 0 stands for the whole file (an empty trace). ``path`` is the file it was read
    from, or None for lines given directly, so a tool that reads many traces can say which
    one failed without parsing the message (which ends with ``(in PATH)`` all the same).
    """

    def __init__(self, reason: str, line: int = 0, path: str | None = None) -> None:
        super().__init__(reason, line, path)
        self.reason = reason
        self.line = line
        self.path = path

    def __str__(self) -> str:
        text = f"line {self.line}: {self.reason}" if self.line else self.reason
        return f"{text} (in {self.path})" if self.path is not None else text


class PlotUnavailableError(TangramError, ImportError):
    """A plot was asked for (``--plot``, ``--out``) but matplotlib is not installed."""


class SandboxError(TangramError):
    """A CPU sandbox could not run the action (a failing command is a result, not this)."""


class SandboxBrokenError(SandboxError, RuntimeError):
    """The sandbox died or stopped answering (an outside cause; detail in ``__cause__``).

    Its units went back to the runtime and the pool replaced it with a fresh one; the
    trajectory's files in it are gone, so the sandbox refuses further actions.
    """


class SandboxClosedError(SandboxError, RuntimeError):
    """The sandbox or pool was used after it closed (a mistake in the calling code)."""


class UnknownSandboxError(SandboxClosedError, KeyError):
    """An id that names no open sandbox: never opened, or already closed.

    Raised by an adapter's tool (verl's ``execute``) given an instance id it has no
    sandbox for: ``create`` was never called for it, or ``release`` already was. Also a
    ``KeyError``, as the lookup raised one before it had a class of its own.
    """

    def __str__(self) -> str:
        # KeyError's own __str__ shows the message's repr, quotes and all.
        return str(self.args[0]) if self.args else ""


class SchedulerUnavailableError(TangramError, RuntimeError):
    """The shared scheduler could not serve this process: not created yet, it died, or
    it dropped this process's waiting request after heartbeats stopped for longer than
    the lease timeout.

    An outside cause (detail in ``__cause__`` when Ray raised one). Leases held when it
    happened stay usable until their block ends; their releases change nothing.
    """


class UnscoredSampleError(TangramError, RuntimeError):
    """A reward asked for a sample whose trajectory met a tangram failure in a tool call.

    Where a framework needs an observation whatever happens (verl's function tools), the
    adapter hands the model a fixed text in place of the tool's output and marks the call;
    scoring the sample would train the model on that, so tangram's reward entries raise
    this instead, and the step fails as it does when a tool raises.
    """


class AsyncioRequiredError(TangramError, RuntimeError):
    """``tangram.ray`` was used on an event loop other than asyncio, such as trio.

    A Ray call is awaited only on asyncio (trio would pay a thread per call), so the
    shared scheduler is refused at ``connect``, before anything reaches Ray. A mistake in
    the calling code: run the worker's loop on asyncio.
    """


class ConfigError(TangramError, ValueError):
    """A tangram config file that cannot be read or says something impossible.

    The message names the file and the key, so the worker process that failed says why.
    """


class TangramWarning(UserWarning):
    """Base of every warning tangram gives."""


class DeadlockRiskWarning(TangramWarning):
    """A task waits for units while it holds a lease on the same runtime.

    It may be served once others release, or wait forever if those others wait for this
    task (a parent in a task group waiting for the child that holds them, say). The case
    that is certain, the task's own leases making the demand impossible, is
    :class:`SelfDeadlockError` instead. Silence it with
    ``warnings.filterwarnings("ignore", category=tangram.errors.DeadlockRiskWarning)``.
    """


_publish("tangram.errors", globals())
