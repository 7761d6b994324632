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

from ..errors import InvalidDemandError, InvalidSettingError, TangramError

__all__ = ["counts", "is_infrastructure", "record", "reset"]

logger = logging.getLogger("tangram.frameworks")

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` is tangram's (or its host's) failure rather than the model's.

    Everything tangram raises on purpose is a :class:`~tangram.errors.TangramError`; an
    ``OSError`` reaching an adapter from a sandbox operation is the host failing (a full
    disk, a vanished daemon socket), since the model's code runs in a process of its own.
    A bad argument (:class:`~tangram.errors.InvalidSettingError`) is not: it is the
    call's, and the arguments of a tool call are the model's (a NUL byte in its code, code
    that is not a string). As an infrastructure failure it would stop the training step, a
    stop the model could trigger at will; as the tool's error it is an answer the model
    sees, as any tool's. Adapters check their own settings where they are built, so what
    reaches a call is the model's. A demand that cannot be served
    (:class:`~tangram.errors.InvalidDemandError`: more cores than the node has, a resource
    the config lacks) is tangram's: an adapter's demands come from its config or code,
    never from the model, and shown to the model it trained the policy on a set-up
    mistake while every call failed.
    """
    if isinstance(exc, InvalidDemandError):
        return True
    if isinstance(exc, InvalidSettingError):
        return False
    return isinstance(exc, (TangramError, OSError))


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
