"""A node agent's shares of the job's API rates, and its workers' calls on them.

The job's actor lends each deciding agent a share of every API rate of the job's
capacity (:mod:`._rates`); the agent grants its node's workers' calls from it in its own
runtime, where the share is a rate kind of the node (``<kind>@<agent>``) under the job's
policy, so a call that needs nothing but API rates never messages the job's actor. The
agent asks for its share again every heartbeat while it holds or wants one, saying what
it used and what waits, and at once when a call waits with no share that could serve it.

A share is good for the lease timeout from when its ask was sent; the job's actor
forgets it a timeout after the ask arrived, later. An agent not answered in time stops
granting from it. One whose job's actor is gone fails its waiting and later calls with
:class:`~tangram.errors.SchedulerUnavailableError`, as the job actor's own leases do.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

from .._core._resources import Rate, Resource, Shape
from .._runtime._lease import Lease
from .._runtime._run import Runtime
from ..errors import SchedulerUnavailableError
from ._protocol import CANCELLED, COMPLETED, FAILED, died, logger, lost, task_failed

__all__ = ["NodeRates", "lent_kinds"]

Share = tuple[float, float]
# A share grows at most HEADROOM-fold per ask (see ._rates), so a node whose calls start
# from nothing needs a few asks to reach its part of a busy rate. While its share grew
# at the last ask and calls still wait, it asks again after a heartbeat / RAMP: sixteen
# times its first share within a heartbeat instead of four heartbeats, at RAMP asks a
# heartbeat only while it ramps (a steady share is asked for once a heartbeat).
RAMP = 4
# A ramp multiplies a share (up to HEADROOM-fold an ask); a saturated split moves it by
# a few percent an ask, and must not be asked for RAMP times a heartbeat forever.
RAMPING = 1.5


def lent_kinds(capacity: Mapping[str, Resource]) -> dict[str, Resource]:
    """The kinds of a job's capacity that are lent to its nodes: its rates."""
    return {name: res for name, res in capacity.items() if res.shape is Shape.RATE}


class _Take:
    """One worker call on this node's shares: waiting, then held until given back."""

    __slots__ = ("cid", "demand", "done", "granted", "outcome", "task")

    def __init__(self, cid: str, demand: dict[str, float]) -> None:
        self.cid = cid
        self.demand = demand
        self.granted: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()
        self.outcome = COMPLETED
        self.task: asyncio.Task[None] | None = None


class NodeRates:
    """The agent's side of rate leases: its shares, its asks and its workers' calls."""

    def __init__(
        self,
        runtime: Runtime,
        agent: str,
        scheduler: Any,
        cid: str,
        kinds: Mapping[str, Resource],
        period: float,
        timeout: float,
    ) -> None:
        self._runtime = runtime
        self._scheduler = scheduler
        self._cid = cid
        self._period = period
        self._timeout = timeout
        self._local = {kind: f"{kind}@{agent}" for kind in kinds}
        self._kinds = {local: kind for kind, local in self._local.items()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._applied: dict[str, Share] = dict.fromkeys(kinds, (0.0, 0.0))
        self._reported: dict[str, Share] = dict(self._applied)  # in the last ask
        self._grew = False  # the last answer raised a share
        self._spent: dict[str, float] = dict.fromkeys(kinds, 0.0)
        self._asked_at = time.monotonic()
        self._good_until = -math.inf
        self._takes: dict[tuple[str, int], _Take] = {}
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self.asks = 0
        # Installed empty: a share grows from nothing as it is lent, never from a full
        # bucket, so a node's first grant cannot pass what the book counted.
        for local in self._kinds:
            runtime._limit_rate(local, 0.0, 0.0)
        runtime.set_capacity(
            {self._local[kind]: Rate(res.total, burst=res.burst) for kind, res in kinds.items()}
        )

    # -- workers' calls ----------------------------------------------------------------

    async def take(
        self,
        cid: str,
        request: int,
        demand: Mapping[str, float],
        kind: str,
        trajectory: str | None,
        estimate: float | None,
        wait_timeout: float | None,
    ) -> dict[str, float] | None:
        """Grant a worker's call from this node's shares; ``None`` if not all are lent."""
        if not demand or any(name not in self._local for name in demand):
            return None
        if self._error is not None:
            raise SchedulerUnavailableError(
                f"the job's scheduler is gone; its API rates are no longer lent: {self._error}"
            )
        local = {self._local[name]: float(amount) for name, amount in demand.items()}
        take = _Take(cid, local)
        key = (cid, request)
        self._takes[key] = take
        task = asyncio.ensure_future(self._hold(take, kind, trajectory, estimate, wait_timeout))
        take.task = task
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        if any(
            self._applied[name][0] <= 0 or self._applied[name][1] < amount
            for name, amount in demand.items()
        ):
            self._wake.set()  # no share could serve it: ask now, not at the next beat
        try:
            await asyncio.shield(take.granted)
        except BaseException:
            self._end(key, CANCELLED)
            raise
        return {name: float(amount) for name, amount in demand.items()}

    async def _hold(
        self,
        take: _Take,
        kind: str,
        trajectory: str | None,
        estimate: float | None,
        wait_timeout: float | None,
    ) -> None:
        """Hold the node runtime's lease until the worker gives it back, with its outcome."""
        try:
            async with self._runtime.acquire(
                take.demand,
                kind=kind,
                trajectory=trajectory,
                estimate=estimate,
                wait_timeout=wait_timeout,
            ) as lease:
                take.granted.set_result(lease)
                await take.done.wait()
                if take.outcome == FAILED:
                    raise _Failed
                if take.outcome == CANCELLED:
                    raise asyncio.CancelledError
        except (_Failed, asyncio.CancelledError):
            if not take.granted.done():
                take.granted.cancel()
        except Exception as exc:  # the wait failed (timed out, capacity changed): say so
            if not take.granted.done():
                take.granted.set_exception(exc)

    def give(self, cid: str, request: int, outcome: int) -> None:
        """A worker's call ended (or its wait was given up): its grant goes back."""
        self._end((cid, request), outcome)

    def _end(self, key: tuple[str, int], outcome: int) -> None:
        take = self._takes.pop(key, None)
        if take is None:
            return
        take.outcome = outcome
        take.done.set()
        if not take.granted.done() and take.task is not None:
            take.task.cancel()

    def forget(self, cid: str) -> None:
        """Worker ``cid`` is gone: end its calls, waiting or held."""
        for key in [key for key in self._takes if key[0] == cid]:
            self._end(key, CANCELLED)

    # -- asking the job's actor -----------------------------------------------------------

    def _wants(self, now: float) -> dict[str, tuple[float, float, float, Share]]:
        """Per kind: units a second used since the last ask, units waiting, the largest
        waiting call, and the share run on now."""
        elapsed = max(now - self._asked_at, self._period / RAMP)
        largest: dict[str, float] = dict.fromkeys(self._local, 0.0)
        for take in self._takes.values():
            if not take.granted.done():
                for local, amount in take.demand.items():
                    name = self._kinds[local]
                    largest[name] = max(largest[name], amount)
        wants = {}
        for name, local in self._local.items():
            spent, wanted = self._runtime._rate_use(local)
            used = (spent - self._spent[name]) / elapsed
            wants[name] = (used, wanted, largest[name], self._applied[name])
        return wants

    def _idle(self) -> bool:
        """Nothing held, wanted, or owed to the book: a share cut to nothing counts at
        the job's actor until an ask says it is applied."""
        return (
            not self._takes
            and all(rate <= 0 for rate, _ in self._applied.values())
            and all(rate <= 0 for rate, _ in self._reported.values())
        )

    def _waiting(self) -> bool:
        return any(not take.granted.done() for take in self._takes.values())

    async def run(self) -> None:
        """Ask every heartbeat while a share is held or wanted, and when a call waits."""
        while self._error is None:
            with contextlib.suppress(TimeoutError):
                if self._idle():
                    await self._wake.wait()
                else:
                    ramping = self._grew and self._waiting()
                    wait = self._period / RAMP if ramping else self._period
                    await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.clear()
            try:
                await self._ask()
            except Exception:
                logger.exception("the job's actor failed to lend this node its API rates")

    async def _ask(self) -> None:
        sent = time.monotonic()
        if sent > self._good_until:
            self._apply(dict.fromkeys(self._local, (0.0, 0.0)))
        wants = self._wants(sent)
        self._reported = dict(self._applied)
        for name in self._local:
            self._spent[name] = self._runtime._rate_use(self._local[name])[0]
        self._asked_at = sent
        self.asks += 1
        call = self._scheduler.lend_rates.remote(self._cid, wants)
        # A share is good until a timeout after the ask that lent it was sent: stop
        # granting from it then, answered or not (the job's actor may be stuck).
        left = self._good_until - sent if self._good_until > sent else None
        try:
            shares = await asyncio.wait_for(_answer(call), left)
        except TimeoutError:
            self._apply(dict.fromkeys(self._local, (0.0, 0.0)))
            return
        except task_failed() as exc:
            raise exc.cause from exc
        except lost() as exc:
            if died(exc):
                self._lose(exc)
            return
        self._good_until = sent + self._timeout
        self._apply({name: (float(r), float(b)) for name, (r, b) in shares.items()})

    def _apply(self, shares: Mapping[str, Share]) -> None:
        self._grew = any(
            rate > RAMPING * self._applied[name][0] for name, (rate, _) in shares.items()
        )
        for name, (rate, burst) in shares.items():
            if (rate, burst) != self._applied[name]:
                self._runtime._limit_rate(self._local[name], rate, burst)
                self._applied[name] = (rate, burst)

    def _lose(self, exc: BaseException) -> None:
        """The job's actor is gone: nothing is lent any more; fail what waits."""
        self._error = exc
        self._apply(dict.fromkeys(self._local, (0.0, 0.0)))
        error = SchedulerUnavailableError(
            f"the job's scheduler is gone; its API rates are no longer lent: {exc}"
        )
        for key, take in list(self._takes.items()):
            if not take.granted.done():
                take.granted.set_exception(error)
                self._end(key, CANCELLED)

    def lost(self, exc: BaseException) -> None:
        """Called by the agent when its proxy on the job's actor failed."""
        if self._error is None:
            self._lose(exc)


async def _answer(call: Any) -> Any:
    return await call


class _Failed(Exception):
    """A worker's call raised: its block ends as failed in the node's books."""
