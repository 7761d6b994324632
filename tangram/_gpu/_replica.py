"""What the pool keeps per service and per replica.

A *replica* is one copy of a service on its devices (an NVLink chunk of them for a
multi-GPU service). Its residency says whether its state is on the devices; ``alive``
whether a holder task waits for or holds its memory grant; ``users`` how many actions are
on it. The pool's other modules read and write these records; nothing here decides.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from typing import Any

import anyio
import attrs

from .._runtime._run import Runtime
from ._devices import Device
from ._service import ModelService

__all__ = [
    "DEFAULT_RESTORE_BANDWIDTH",
    "Call",
    "PoolReplica",
    "Residency",
    "ServiceState",
    "Waiter",
    "ewma",
]

#: Host-to-device bandwidth assumed for a restore before one was measured (bytes/s).
DEFAULT_RESTORE_BANDWIDTH = 20e9
_EWMA = 0.3


def ewma(old: float | None, new: float) -> float:
    """A learnt duration moved towards the latest measurement."""
    return new if old is None else old + _EWMA * (new - old)


class Residency(enum.Enum):
    EVICTED = "evicted"
    RESTORING = "restoring"
    RESIDENT = "resident"
    EVICTING = "evicting"


@attrs.define(eq=False)
class Call:
    """One batch an action handed to its replica, and what came of it."""

    batch: Any
    done: anyio.Event = attrs.field(factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None


@attrs.define(eq=False)
class Waiter:
    """An action in its service's line: it has no seat yet, and no replica.

    ``replica`` is set (and ``seated`` with it) when a seat is handed to it; ``seated``
    set with no replica means the pool closed.
    """

    arrival: float
    runtime: Runtime
    seated: anyio.Event = attrs.field(factory=anyio.Event)
    replica: PoolReplica | None = None


@attrs.define(eq=False)
class PoolReplica:
    """One copy of a service on its devices, as the live pool tracks it."""

    state: ServiceState
    index: int
    devices: tuple[Device, ...]
    residency: Residency = Residency.EVICTED
    alive: bool = False  # a holder task is waiting for or holding a memory grant
    leased: bool = False
    draining: bool = False  # takes no newcomer: its grant goes to a waiting replica
    granted_at: float = -math.inf
    users: int = 0
    last_used: float = -math.inf
    pending: list[Call] = attrs.field(factory=list)
    ready: anyio.Event = attrs.field(factory=anyio.Event)
    wake: anyio.Event = attrs.field(factory=anyio.Event)
    error: BaseException | None = None
    scope: anyio.CancelScope | None = None
    lock: anyio.Lock = attrs.field(factory=anyio.Lock)

    @property
    def memory(self) -> int:
        """Bytes it holds on each of its devices while resident."""
        memory = self.state.service.memory
        assert memory is not None  # known once the service loaded
        return memory


@attrs.define(eq=False)
class ServiceState:
    """A service's replicas, what the pool learnt about it, and its counters."""

    service: ModelService
    replicas: list[PoolReplica] = attrs.field(factory=list)
    restore_seconds: float | None = None
    run_seconds: float | None = None
    # Its actions that found no seat, first come first served: the pool knows one run
    # time per service, so the policy's shortest-first order is arrival order here.
    line: deque[Waiter] = attrs.field(factory=deque)
    restores: int = 0
    warmed: int = 0
    evictions: int = 0
    hits: int = 0
    runs: int = 0
    batched: int = 0

    def restore_estimate(self) -> float:
        """Seconds a restore of the service takes: learnt, else assumed from its size."""
        if self.restore_seconds is not None:
            return self.restore_seconds
        assert self.service.memory is not None
        return self.service.memory / DEFAULT_RESTORE_BANDWIDTH
