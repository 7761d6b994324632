"""tangram's own failures during a framework's call: told apart from the model's, and counted.

A command the model wrote that fails is a *result* (an exit code, a timeout) and goes back
to the model. A failure of tangram itself (the scheduler gone, a sandbox that died, a
config that cannot start) says nothing about the model's action: fed back as if it were
the tool's output, the model is trained on the infrastructure's noise, and the job goes
on with every call failing. So the adapters route these to the framework as exceptions,
and this module keeps the count per action kind, for the adapters' metrics and for tests.
"""

from __future__ import annotations

import collections
import logging
import threading

from ..errors import InvalidSettingError

__all__ = ["counts", "is_infrastructure", "record", "reset"]

logger = logging.getLogger("tangram.frameworks")

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by tangram's part of a call (its session, a grant, a
    sandbox, a grading), is tangram's (or its host's) failure rather than the model's.

    Every exception is, but a bad argument (:class:`~tangram.errors.InvalidSettingError`):
    it is the call's, and the arguments of a tool call are the model's (a NUL byte in its
    code, code that is not a string). As an infrastructure failure it would stop the
    training step, a stop the model could trigger at will; as the tool's error it is an
    answer the model sees, as any tool's. Adapters check their own settings where they
    are built, and the model's arguments before tangram runs them, so a bad argument that
    reaches a call is the model's. A demand that cannot be served
    (:class:`~tangram.errors.InvalidDemandError`: more cores than the node has, a resource
    the config lacks) is tangram's: an adapter's demands come from its config or code,
    never from the model. So is an exception tangram never meant to raise (an
    ``AttributeError`` of a bug in a backend): only ``TangramError`` and ``OSError``
    counted once, and a bug's text reached the model as its tool's output.

    Ask it of what tangram's part of a call raised, not of the exceptions of code the
    adapter wraps (a user's tool function), which are that code's own.
    """
    return isinstance(exc, Exception) and not isinstance(exc, InvalidSettingError)


def record(kind: str, exc: BaseException) -> None:
    """Count one infrastructure failure of ``kind`` and log it at ERROR with its cause.

    ERROR, because the frameworks log what they catch at WARNING (verl) or INFO (OpenRLHF)
    and carry on; this line is the one that says tangram, not the model, failed.
    """
    with _lock:
        _counts[kind] += 1
    logger.error("tangram infrastructure failure in %r: %s: %s", kind, type(exc).__name__, exc)


def counts() -> dict[str, int]:
    """Infrastructure failures of this process so far, per action kind."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Forget the counts (tests, or a trainer that reports them per step)."""
    with _lock:
        _counts.clear()
