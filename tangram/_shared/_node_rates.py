"""A node agent's shares of the job's API rates, and its workers' calls on them.

The job's actor lends each deciding agent a share of every API rate of the job's
capacity (:mod:`._rates`); the agent grants its node's workers' calls from it in its own
runtime, where the share is a rate kind of the node (``<kind>@<agent>``) under the job's
policy, so a call that needs nothing but API rates never messages the job's actor. The
agent asks for its share again every heartbeat while it holds or wants one, saying what
it used and what waits, and at once when a call waits with no share that could serve it.

A node leases only while its calls outnumber its asks (the rule, :func:`._rates.leases`):
until then, and once its calls thin out, it sends each call on to the job's actor, and a
share it held is given back (cut to nothing, then said to be applied) and no longer
asked for. Calls that wait on the node when it stops leasing are sent on with it. A
node with no call for a heartbeat (its share would be cut to nothing for want of use)
stops leasing too, at its next ask or when it goes idle, until its calls come close
again.

A call larger than the node's burst (a share's burst is its rate's part of the job's) is
sent on to the job's actor through the agent's own proxy, where one line serves large
calls in turn; so is one larger than the job's burst as this node last heard it (the
job's actor judges it against the capacity as it is now).

A share is good for the lease timeout from when its ask was sent, and the node's
runtime stops granting from it then, at its next decision, even after a stall; the
job's actor forgets it a timeout after the ask arrived, later. An agent whose job's
actor is gone fails its waiting and later calls with
:class:`~tangram.errors.SchedulerUnavailableError`, as the job actor's own leases do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Mapping
from typing import Any

import anyio

from .._core._resources import Rate, Resource, Shape
from .._runtime._run import Runtime
from ..errors import SchedulerUnavailableError, TangramError
from ._protocol import CANCELLED, COMPLETED, FAILED, died, logger, lost, task_failed
from ._rates import LEASE_AT, leases

__all__ = ["NodeRates", "lent_kinds"]

Share = tuple[float, float]
# A share grows at most HEADROOM-fold per ask (see ._rates), so a node whose calls start
# from nothing needs a few asks to reach its part of a busy rate. While its share grew
# at the last ask and calls still wait, it asks again after a heartbeat / RAMP: sixteen
# times its first share within a heartbeat instead of four heartbeats, at RAMP asks a
# heartbeat only while it ramps (a steady share is asked for once a heartbeat).
RAMP = 4
# A ramp multiplies a share (up to HEADROOM-fold an ask); a saturated split moves it by
# a few percent an ask, and must not be asked for RAMP times a heartbeat forever. An ask
# sooner than half a ramp's pace (heartbeat / RAMP) after the one before, as when a call
# came while the share was still nothing, had no time to show a use to grow from or a
# queue to average: it does not end a ramp, and it sends the count of calls waiting now.
# (Half the pace: a ramp's own ask, at the pace, is never taken for one.)
RAMPING = 1.5
# Gives that came before their take, remembered; request ids are never reused, so the
# oldest can go (a take that late has a caller long gone).
_EARLY_KEPT = 1024


def lent_kinds(capacity: Mapping[str, Resource]) -> dict[str, Resource]:
    """The kinds of a job's capacity that are lent to its nodes: its rates."""
    return {name: res for name, res in capacity.items() if res.shape is Shape.RATE}


class _Take:
    """One worker call: waiting on this node's shares (or the job's actor), then held
    until the worker gives it back."""

    __slots__ = (
        "cid",
        "demand",
        "done",
        "forward",
        "granted",
        "local",
        "outcome",
        "scope",
        "since",
    )

    def __init__(self, cid: str, demand: dict[str, float], local: dict[str, float]) -> None:
        self.cid = cid
        self.demand = demand  # in the job's kinds
        self.local = local  # in this node's
        self.granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()
        self.outcome = COMPLETED
        self.forward = False  # sent on to the job's actor
        self.scope: anyio.CancelScope | None = None  # its wait, here or sent on
        self.since = asyncio.get_running_loop().time()  # when it began to wait


class NodeRates:
    """The agent's side of rate leases: its shares, its asks and its workers' calls."""

    def __init__(
        self,
        runtime: Runtime,
        remote: Any,
        agent: str,
        kinds: Mapping[str, Resource],
        period: float,
        timeout: float,
    ) -> None:
        self._runtime = runtime
        self._remote = remote  # the agent's proxy on the job's actor
        self._period = period
        self._timeout = timeout
        self._local = {kind: f"{kind}@{agent}" for kind in kinds}
        self._kinds = {local: kind for kind, local in self._local.items()}
        self._capacity = {kind: (res.total, res.burst) for kind, res in kinds.items()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._applied: dict[str, Share] = dict.fromkeys(kinds, (0.0, 0.0))
        self._reported: dict[str, Share] = dict(self._applied)  # in the last ask
        self._grew = False  # the last answer raised a share
        self._spent: dict[str, float] = dict.fromkeys(kinds, 0.0)
        # Unit-seconds waited in the node's runtime as of the last ask, and when the node
        # last had a call after none (its mean queue is taken from then, if later).
        self._waited: dict[str, float] = dict.fromkeys(kinds, 0.0)
        self._loop = asyncio.get_running_loop()  # the runtime's clock
        self._busy_from = self._loop.time()
        self._asked_at = self._loop.time()
        self._takes: dict[tuple[str, int], _Take] = {}
        # When the last LEASE_AT calls came, and whether the node leases (else its calls
        # go on to the job's actor): see ._rates.leases.
        self._calls: collections.deque[float] = collections.deque(maxlen=LEASE_AT)
        self._leasing = False
        self._early: dict[tuple[str, int], None] = {}  # given back before their take came
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
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
            raise self._gone()
        if (cid, request) in self._early:
            del self._early[(cid, request)]
            return None  # given back before it came: its caller is gone
        wanted = {name: float(amount) for name, amount in demand.items()}
        take = _Take(cid, wanted, {self._local[name]: a for name, a in wanted.items()})
        self._calls.append(take.since)
        leasing = leases(self._calls, take.since, self._period, self._leasing)
        if leasing != self._leasing:
            self._leasing = leasing
            if leasing:
                self._busy_from = take.since  # its queue is measured from now
            else:
                self._send_on()  # what waits here goes on with this call
        take.forward = not leasing or any(
            amount > self._capacity[name][1] or self._too_big(name, amount)
            for name, amount in wanted.items()
        )
        key = (cid, request)
        if not self._takes:
            self._busy_from = take.since
        self._takes[key] = take
        task = asyncio.ensure_future(self._hold(take, kind, trajectory, estimate, wait_timeout))
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        if not take.forward and any(self._applied[name][0] <= 0 for name in wanted):
            self._wake.set()  # no share to serve it: ask now, not at the next beat
        try:
            await asyncio.shield(take.granted)
        except TangramError as exc:
            self._end(key, CANCELLED)
            raise self._named(exc) from None
        except BaseException:
            self._end(key, CANCELLED)
            raise
        return wanted

    def _too_big(self, name: str, amount: float) -> bool:
        """Whether this node's share has a rate but a burst too small for ``amount``."""
        rate, burst = self._applied[name]
        return rate > 0 and amount > burst

    def _named(self, exc: TangramError) -> TangramError:
        """The error as the job's actor would word it: the job's kinds, not the node's."""
        text = str(exc)
        for local, name in self._kinds.items():
            text = text.replace(f"'{local}'", f"'{name}'").replace(local, name)
        exc.args = (text,)
        return exc

    async def _hold(
        self,
        take: _Take,
        kind: str,
        trajectory: str | None,
        estimate: float | None,
        wait_timeout: float | None,
    ) -> None:
        """Wait for the call's grant, here or at the job's actor, and hold it until the
        worker gives it back, ending with the worker's outcome."""
        options: dict[str, Any] = {
            "kind": kind,
            "trajectory": trajectory,
            "estimate": estimate,
            "wait_timeout": wait_timeout,
        }
        if take.done.is_set():
            return  # given back (or its worker gone) before this task first ran
        try:
            if not take.forward:
                with anyio.CancelScope() as scope:
                    take.scope = scope
                    async with self._runtime.acquire(take.local, **options):
                        take.scope = None
                        await self._held(take)
                if not take.forward or take.granted.done():
                    return  # held and given back, or given up while it waited
            # Sent on: too large for this node's share, or cut below it while it waited;
            # with what is left of its wait, which began here.
            if wait_timeout is not None:
                waited = self._loop.time() - take.since
                options["wait_timeout"] = max(0.0, wait_timeout - waited)
            with anyio.CancelScope() as scope:
                take.scope = scope  # given up meanwhile, it is cancelled here too
                known = self._remote.capacity
                if any(amount > known[name].burst for name, amount in take.demand.items()):
                    await self._refresh()  # over the job's burst as its proxy heard it
                async with self._remote.acquire(take.demand, **options):
                    take.scope = None
                    await self._held(take)
        except (_Failed, asyncio.CancelledError):
            if not take.granted.done():
                take.granted.cancel()
        except Exception as exc:  # the wait failed (timed out, capacity changed): say so
            if not take.granted.done():
                take.granted.set_exception(exc)

    async def _refresh(self) -> None:
        """Learn the job's rates as they are now (a rate changed at the job's actor)."""
        await self._remote._refresh()
        self._learn(
            {
                name: (res.total, res.burst)
                for name, res in self._remote.capacity.items()
                if name in self._capacity and res.shape is Shape.RATE
            }
        )

    def _learn(self, capacity: Mapping[str, tuple[float, float]]) -> None:
        for name, (total, burst) in capacity.items():
            if (total, burst) != self._capacity[name]:
                self._capacity[name] = (total, burst)
                self._runtime.set_capacity({self._local[name]: Rate(total, burst=burst)})

    @staticmethod
    async def _held(take: _Take) -> None:
        if not take.granted.done():
            take.granted.set_result(None)
        await take.done.wait()
        if take.outcome == FAILED:
            raise _Failed
        if take.outcome == CANCELLED:
            raise asyncio.CancelledError

    def give(self, cid: str, request: int, outcome: int) -> None:
        """A worker's call ended (or its wait was given up): its grant goes back.

        A give can pass its own take on the way (an async actor runs a caller's calls
        in no set order): one for a call not seen yet is kept, and the take, when it
        comes, is not served.
        """
        key = (cid, request)
        if key in self._takes:
            self._end(key, outcome)
            return
        self._early[key] = None
        if len(self._early) > _EARLY_KEPT:
            self._early.pop(next(iter(self._early)))

    def _end(self, key: tuple[str, int], outcome: int) -> None:
        take = self._takes.pop(key, None)
        if take is None:
            return
        take.outcome = outcome
        take.done.set()
        if not take.granted.done():
            take.granted.cancel()
            if take.scope is not None:
                take.scope.cancel()

    def forget(self, cid: str) -> None:
        """Worker ``cid`` is gone: end its calls, waiting or held."""
        for key in [key for key in self._takes if key[0] == cid]:
            self._end(key, CANCELLED)

    def _send_on(self) -> None:
        """Send calls waiting here that the node's share can no longer hold to the job's
        actor: a cut burst, or a share given back, would leave them waiting for good."""
        for take in self._takes.values():
            if take.granted.done() or take.forward:
                continue
            if not self._leasing or any(
                self._too_big(name, amount) for name, amount in take.demand.items()
            ):
                take.forward = True  # one whose wait has not begun begins it there
                if take.scope is not None:
                    take.scope.cancel()

    # -- asking the job's actor -----------------------------------------------------------

    def _wants(self, now: float) -> dict[str, tuple[float, float, float, Share]]:
        """Per kind: units a second used since the last ask, units waiting, the largest
        waiting call, and the share run on now.

        The units waiting are a mean over the time since the last ask, or since the node
        had a call again after none, if later: the node's runtime sums its waiting units
        over time, and a call granted as it came adds nothing. Over less than half a
        ramp's pace (see ``RAMPING``) a mean says little, and the count now is sent.
        The book weighs a node's mean queue against the job's mean wait to split a
        saturated rate as one line for the job would (its rules, :mod:`._rates`). A
        count at the moment of the ask is no such measure: of 8 loops, 7 wait at one ask
        and 8 at the next, or none just as all were granted, which made a node with a
        queue all heartbeat look calm; every such jump moved a share, and a cut frees
        its units only an ask later."""
        elapsed = max(now - self._asked_at, self._period / RAMP)
        largest: dict[str, float] = dict.fromkeys(self._local, 0.0)
        for take in self._takes.values():
            if not take.granted.done() and not take.forward:
                for name, amount in take.demand.items():
                    largest[name] = max(largest[name], amount)
        span = now - max(self._asked_at, self._busy_from)
        wants = {}
        for name, local in self._local.items():
            spent, wanted, waited = self._runtime._rate_use(local)
            used = (spent - self._spent[name]) / elapsed
            queued = (waited - self._waited[name]) / span if not self._quick(span) else wanted
            wants[name] = (used, queued, largest[name], self._applied[name])
        return wants

    def _quick(self, seconds: float) -> bool:
        """Too soon after the last ask to read a use or a queue (see ``RAMPING``)."""
        return seconds < self._period / (2 * RAMP)

    def _idle(self) -> bool:
        """No share held, wanted, or owed to the book: a share cut to nothing counts at
        the job's actor until an ask says it is applied. Calls sent on to the job's
        actor want nothing of this node's share."""
        return (
            (not self._takes or not self._leasing)
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
                    # Nothing lent: a share would grow from nothing, its first call
                    # waiting an ask and a token (half a second at a call a heartbeat),
                    # so the node's next calls go on to the job's actor until they
                    # come close again.
                    self._leasing = False
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
        sent = self._loop.time()
        quick = self._quick(sent - self._asked_at)
        if self._leasing and not leases(self._calls, sent, self._period, True, self._waiting()):
            # Its calls thinned out, or none came for a heartbeat and none waits.
            self._leasing = False
            self._send_on()
        wants = self._wants(sent)
        if not self._leasing:  # giving its share back: it wants none
            wants = {name: (0.0, 0.0, 0.0, share) for name, (*_, share) in wants.items()}
        self._reported = dict(self._applied)
        for name, local in self._local.items():
            self._spent[name], _, self._waited[name] = self._runtime._rate_use(local)
        self._asked_at = sent
        until = sent + self._timeout  # what it lends is good so long, answered or not
        call = self._remote.actor.lend_rates.remote(self._remote.client_id, wants)
        try:
            shares = await asyncio.wait_for(_answer(call), self._timeout)
        except TimeoutError:
            return  # the shares lapse in the node's runtime at their time
        except task_failed() as exc:
            raise exc.cause from exc
        except lost() as exc:
            if died(exc):
                self._lose(exc)
            return
        if self._loop.time() >= until:
            return  # answered too late to be used
        self._learn({name: (total, burst) for name, (_, _, total, burst) in shares.items()})
        shares_now = {name: (float(r), float(b)) for name, (r, b, _, _) in shares.items()}
        grew = any(
            rate > RAMPING * self._applied[name][0] for name, (rate, _) in shares_now.items()
        )
        self._grew = grew or (quick and self._grew)
        self._apply(shares_now, until)

    def _apply(self, shares: Mapping[str, Share], until: float = math.inf) -> None:
        for name, (rate, burst) in shares.items():
            self._runtime._limit_rate(self._local[name], rate, burst, until)
            self._applied[name] = (rate, burst)
        self._send_on()

    def _gone(self) -> SchedulerUnavailableError:
        return SchedulerUnavailableError(
            f"the job's scheduler is gone; its API rates are no longer lent: {self._error}"
        )

    def _lose(self, exc: BaseException) -> None:
        """The job's actor is gone: nothing is lent any more; fail what waits."""
        self._error = exc
        self._apply(dict.fromkeys(self._local, (0.0, 0.0)))
        for key, take in list(self._takes.items()):
            if not take.granted.done():
                take.granted.set_exception(self._gone())
                self._end(key, CANCELLED)


async def _answer(call: Any) -> Any:
    return await call


class _Failed(Exception):
    """A worker's call raised: its block ends as failed in the node's books."""
