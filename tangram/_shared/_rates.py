"""A job's API rates lent to its nodes, in shares that follow each node's demand.

An API rate (a :class:`tangram.Rate` kind of the job's capacity) is one budget for the
whole job, but asking the job's actor for every call would put one message per API call
on the one actor. So, as rate limiters at scale shard a token bucket (Google's Doorman:
leases of capacity that clients refresh, sized from what each says it wants), the job's
actor lends each node's agent a *share*, a refill rate and a burst of its own, and the
node grants its workers' calls from it. A node asks again every heartbeat while it holds
or wants a share, saying what it wants (the rate it used since its last ask plus its
backlog spread over one heartbeat), and at once when a call waits with no share to
serve it.

The rules, kept here so the book is the one place they live (pure: times are passed in):

- **Never more than the job's budget.** A share grows only out of what no other node may
  still be using: the book counts for each node the larger of what it was lent and what
  it last said it runs on, so a cut frees its units only once the node has applied it.
  Summed over the nodes and the job's actor, refill rates never pass the job's rate and
  bursts never pass its burst, so calls in any window stay within burst + rate x window.
- **Shares follow demand.** A member wants what it used since its last ask plus its
  waiting calls spread over one heartbeat. While the job's rate covers every want, a
  node is lent its want with room to double (``HEADROOM``), from at most half the
  rate nobody wants (``SLACK_LENT``; the job's actor keeps the rest). Past that, the
  rate is split as one first-come-first-served line for the whole job would split it,
  where every call waits alike. A member's weight is its use plus its waiting calls
  (its mean queue, :mod:`._node_rates`) over the job's mean wait, W = the calls
  waiting / the use of the members they wait on (Little's law; at most a heartbeat).
  A member whose calls wait W has twice its use as weight, and the split leaves it
  where it is; one whose calls wait longer gains, one whose calls wait less (or not at
  all: its use alone) loses, until every call waits alike. So a member whose calls are
  all served keeps less than its use while others' wait, as its calls would wait in
  the one line; counted at its use alone (its calls wait for nothing), it would keep
  all of it, and a node whose workers pause between calls could stay far below its
  part of the line for good. The job's actor (``POOL``: workers with no deciding
  agent, and calls that need another kind too) is a member like any node; it keeps
  what the nodes are not lent, and its own share is applied at once, in process.
- **A burst reaches the largest call waiting, when every member's can at once.** A
  member's burst is its rate's part of the job's burst, raised to its largest waiting
  call only while the largest calls of all members fit in the job's burst together: a
  raise that left another member's call no room would let one node hold the burst and
  starve the other for good. Past that, a node sends a call larger than its burst to
  the job's actor (:mod:`._node_rates`), whose own burst always reaches its largest
  waiting call: one line there serves the large calls in turn.
- **Silence frees a share.** A node not heard for the lease timeout is dropped and its
  share goes back; the node stops granting from it before then (:mod:`._node_rates`).
- **A node leases only where its calls come close together** (:func:`leases`). A share
  costs the job's actor an ask every heartbeat while it is used (more while it grows
  from nothing), and a call sent to the job's actor costs it about two messages (its
  acquire, its release). At 1,000 nodes sharing an API of 100 calls a second, asks
  every heartbeat would be ten times the calls. So a node sends its calls to the job's
  actor until ``LEASE_AT`` come within one heartbeat, and gives its share back once
  its last ``LEASE_AT`` calls span more than ``GIVE_BACK_AFTER`` heartbeats (half a
  call a heartbeat, where an ask and a call's messages cost alike); between the two a
  node stays as it is, so a node near the line does not flip at every call. A node
  also stops leasing a heartbeat after its last call if none waits (its share would be
  cut to nothing for want of use), and when idle (:mod:`._node_rates`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import attrs

__all__ = ["GIVE_BACK_AFTER", "HEADROOM", "LEASE_AT", "POOL", "RateBook", "Share", "leases"]

# The job's actor's own member of every book.
POOL = ""
# A node's share while the job's rate covers every want: what it wants and up to as
# much again (HEADROOM = 2), so its calls can double between two asks (one heartbeat)
# before they wait for the book, taken from at most half the rate nobody wants
# (SLACK_LENT): the other half stays with the job's actor, whose own callers and
# newcomers then start at once, not after the nodes' next asks.
HEADROOM = 2.0
SLACK_LENT = 0.5
# A node leases once LEASE_AT calls come within a heartbeat (sent to the job's actor they
# would cost it about 2 x LEASE_AT messages then, against one ask), and gives its share
# back once its last LEASE_AT calls span more than GIVE_BACK_AFTER heartbeats.
LEASE_AT = 4
GIVE_BACK_AFTER = 8.0
# Sums kept as members come and go are summed afresh this often, so float drift from
# many small updates never grows (a full pass is O(members): one per this many asks).
_RESUM = 1024

Share = tuple[float, float]  # (units a second, burst)


@attrs.define
class _Member:
    used: float = 0.0  # units a second since its last ask
    waiting: float = 0.0  # units its waiting calls ask for
    largest: float = 0.0  # its largest waiting call: its burst should reach it
    granted: Share = (0.0, 0.0)  # what it was last lent
    applied: Share = (0.0, 0.0)  # what it last said it runs on
    heard: float = 0.0

    def held(self) -> Share:
        """What the member may be granting from: the larger of lent and applied."""
        return (
            max(self.granted[0], self.applied[0]),
            max(self.granted[1], self.applied[1]),
        )


@attrs.define
class _Sums:
    """What the split reads of all members, kept as they change (an ask is O(1))."""

    want: float = 0.0  # every member's want
    waiting: float = 0.0  # every member's waiting units
    calm: float = 0.0  # the use of the members with nothing waiting
    largest: float = 0.0  # every member's largest waiting call
    rate: float = 0.0  # the nodes' held rates (not the job's actor's)
    burst: float = 0.0  # the nodes' held bursts

    def add(self, member: _Member, pool: bool, period: float, sign: float) -> None:
        self.want += sign * (member.used + member.waiting / period)
        self.waiting += sign * member.waiting
        self.largest += sign * member.largest
        if member.waiting <= 0:
            self.calm += sign * member.used
        if not pool:
            rate, burst = member.held()
            self.rate += sign * rate
            self.burst += sign * burst


class RateBook:
    """The shares of one rate kind: each node's and the job actor's (``POOL``).

    ``period`` is the nodes' heartbeat: what a backlog is spread over in a want.
    """

    def __init__(self, rate: float, burst: float, period: float) -> None:
        self.rate = rate
        self.burst = burst
        self.period = period
        self._members: dict[str, _Member] = {POOL: _Member()}
        self._sums = _Sums()
        self._changes = 0

    def __contains__(self, member: str) -> bool:
        return member in self._members

    def nodes(self) -> Iterator[str]:
        return (name for name in self._members if name != POOL)

    def ask(
        self,
        member: str,
        used: float,
        waiting: float,
        largest: float,
        applied: Share,
        now: float,
    ) -> Share:
        """A node's ask: its use, its waiting units and the share it runs on; answers
        its new share. Only what no other member may be using is lent; call
        :meth:`pool` after, to give the job's actor what the nodes are not lent."""
        node = self._members.get(member)
        if node is None:
            node = self._members[member] = _Member()
        else:
            self._sums.add(node, False, self.period, -1.0)
        node.used, node.waiting, node.largest = _amount(used), _amount(waiting), _amount(largest)
        node.applied = (_amount(applied[0]), _amount(applied[1]))
        node.heard = now
        self._sums.add(node, False, self.period, 1.0)
        rate, burst = self._target(node)
        # The actor's own part of the split is not lent away: its share is cut at once
        # (it is in process), but not below what its callers want of the split.
        keep_rate, keep_burst = self._target(self._members[POOL], floor=True)
        others_rate = self._sums.rate - node.held()[0]
        others_burst = self._sums.burst - node.held()[1]
        self._sums.add(node, False, self.period, -1.0)
        node.granted = (
            max(0.0, min(rate, self.rate - others_rate - keep_rate)),
            max(0.0, min(burst, self.burst - others_burst - keep_burst)),
        )
        self._sums.add(node, False, self.period, 1.0)
        self._changed()
        return node.granted

    def pool(self, used: float, waiting: float, largest: float) -> Share:
        """The job actor's own share, given its callers' use and waiting units: all that
        the nodes are not lent."""
        pool = self._members[POOL]
        self._sums.add(pool, True, self.period, -1.0)
        pool.used, pool.waiting, pool.largest = _amount(used), _amount(waiting), _amount(largest)
        self._sums.add(pool, True, self.period, 1.0)
        pool.granted = pool.applied = (
            max(0.0, self.rate - self._sums.rate),
            max(0.0, self.burst - self._sums.burst),
        )
        return pool.granted

    def drop(self, member: str) -> None:
        """Forget a node (gone, or silent past the timeout): its share comes back."""
        if member != POOL and member in self._members:
            self._sums.add(self._members.pop(member), False, self.period, -1.0)
            self._changed()

    def silent(self, now: float, timeout: float) -> list[str]:
        """The nodes not heard from for ``timeout`` seconds."""
        return [
            name
            for name, node in self._members.items()
            if name != POOL and now - node.heard > timeout
        ]

    # -- rules ---------------------------------------------------------------------

    def _changed(self) -> None:
        self._changes += 1
        if self._changes >= _RESUM:
            self._changes = 0
            self._sums = _Sums()
            for name, member in self._members.items():
                self._sums.add(member, name == POOL, self.period, 1.0)

    def _target(self, member: _Member, *, floor: bool = False) -> Share:
        """``member``'s share of the split (see the module's rules).

        With ``floor``, no headroom: what the member must keep of the split.
        """
        sums = self._sums
        want = member.used + member.waiting / self.period
        if want <= 0 or sums.want <= 0:
            return 0.0, 0.0
        if sums.want <= self.rate:  # every want fits: each with room to grow
            spare = SLACK_LENT * (self.rate - sums.want) * want / sums.want
            rate = want if floor else want + min((HEADROOM - 1) * want, spare)
        else:  # saturated: as one line for the job would split it (the module's rules)
            used = max(0.0, sums.want - sums.waiting / self.period)  # every member's use
            waited_on = used - sums.calm  # the use of the members with calls waiting
            wait = self.period
            if waited_on > 0 and sums.waiting > 0:  # (sums kept as members change drift)
                wait = min(self.period, sums.waiting / waited_on) or self.period
            weight = member.used + member.waiting / wait
            rate = self.rate * weight / max(used + sums.waiting / wait, 1e-12)
        burst = self.burst * rate / self.rate
        fits = member is self._members[POOL] or sums.largest <= self.burst
        if member.largest > burst and rate > 0 and fits:
            burst = min(member.largest, self.burst)
        return rate, burst


def leases(
    calls: Sequence[float], now: float, period: float, leasing: bool, waiting: bool = False
) -> bool:
    """Whether a node should hold shares, from when its last ``LEASE_AT`` calls came
    (oldest first), whether it holds them now (the rule's hysteresis) and whether calls
    wait on them.

    A leasing node with no call for a heartbeat and none waiting gives its share back
    however close its last calls came: the book would cut the share to nothing for want
    of use, and its next call would wait for one to grow again, where sent on it starts
    at once."""
    if len(calls) < LEASE_AT:
        return False
    if leasing and not waiting and now - calls[-1] >= period:
        return False
    span = now - calls[-LEASE_AT]
    return span <= (GIVE_BACK_AFTER if leasing else 1.0) * period


def _amount(value: float) -> float:
    """A count the book can sum: a negative, NaN or infinite one is read as nothing."""
    return value if math.isfinite(value) and value > 0 else 0.0
