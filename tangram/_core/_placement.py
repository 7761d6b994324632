"""Where GPU replicas go, when a newcomer waits, which replica drains, which one is evicted.

The rules of evict-on-execution, once, for the live :class:`tangram.gpu.GpuPool` and the
simulator's pool model (``tangram/_sim/_simulate.py`` and ``tangram/_sim/_residency.py``).
The two keep different books (the live pool grants each device's memory in bytes, the
simulator a count of GPUs), so every rule takes what it weighs as plain numbers: loads,
free amounts per resource, learnt seconds, the time now. Nothing here reads a clock, awaits
or touches a device, so the same inputs give the same decisions live and simulated, and
the rules can be tested alone (``tests/test_placement.py``).

The rules, in the order an action meets them:

- :func:`seat`: a newcomer joins the least loaded live replica of its service while that
  one has a seat.
- :func:`targets`: when every one is full, how many replicas each service should have,
  from the work in its line against its restore: a service below its share starts
  another replica, even one that must wait for a drain, so devices move toward the
  services whose lines have waited longest; else the newcomer waits. :class:`Waiting` is
  a service's line, ordered by the policy's aging rule as the CPU admission is.
- :func:`replica_devices` (live, with :func:`place` for NVLink topology): the devices a new
  replica goes on.
- :func:`drains`: while replicas wait for their grant, which running replicas stop taking
  newcomers and hand their devices on, once they have held them for :data:`TENURE`, from
  the services above their share.
- :func:`evictions`: which idle resident replicas make room for a restore (LRU).
- :func:`fill`: which idle replicas are restored before the first action.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

from ._policy import ElasticPolicy

__all__ = [
    "HORIZON",
    "MOVE",
    "TENURE",
    "Holding",
    "Unserved",
    "Idle",
    "Backlog",
    "Wanted",
    "Waiting",
    "drains",
    "evictions",
    "fill",
    "fits",
    "linked",
    "nvlink_groups",
    "place",
    "replica_devices",
    "seat",
    "seats",
    "starvation_bound",
    "room",
    "targets",
    "wait_on",
]

K = TypeVar("K")
D = TypeVar("D")
T = TypeVar("T")

#: Restore times a running replica holds its grant before it may be drained for a waiter,
#: so a restore is at most a third of a replica's time on its devices. Measured in the
#: simulator on mopd-2048 at 10 GPUs, seeds 0 and 2: mean ACT 0.77 and 0.78 s with 0, 0.72
#: and 0.73 s with 2, 1.18 and 0.94 s with 4 (a popular service then waits too long).
TENURE = 2.0

#: Restore times by which the line a device would serve must have waited longer than the
#: one it serves before it changes service (:func:`targets`). A restore is device time no
#: line gets. Measured in the simulator on the contended MOPD trace (2,048 trajectories,
#: nine Zipf teachers on 10 GPUs, ``max_batch`` 1), seeds 0-5, with :data:`HORIZON` 8:
#: p95 ACT over ``pooled``'s 1.11-1.13x with 4 (57-77 restores), 1.11-1.16x with 8
#: (43-54), up to 1.22x with 16; over the full run's sizes and Zipf exponents too, worst
#: seed per variant: 1.11-1.21x with 4, 1.14-1.20x with 8, 1.18-1.41x with 16.
MOVE = 8.0

#: Restore times of a line each replica ahead of a service's next one serves in the
#: share (:func:`targets`): the next replica's score is the wait of the action that many
#: turns back. A device that moves keeps serving its new line for a while (a drain waits
#: out the tenure), so the share weighs what each replica serves over a stretch, not in
#: the next turn alone: one turn made every device follow whichever line's head was
#: oldest, and the share swung whole services at a time. Measured as :data:`MOVE`, seeds
#: 0-5 and the full run's sizes and Zipf exponents, worst p95 over ``pooled``'s per
#: variant: 1.18-1.32x with 1, 1.16-1.27x with 4, 1.14-1.20x with 8, 1.17-1.29x with 16,
#: and 1.25-1.69x with 0 (one turn of the seats, twice the restores).
HORIZON = 8.0

# Memory shares are GiB floats in the simulator: a replica that fits up to rounding fits.
_SLACK = 1e-9


def fits(free: float, need: float) -> bool:
    """Whether ``need`` fits in ``free`` (up to float rounding)."""
    return free >= need - _SLACK


# -- topology ------------------------------------------------------------------------------


def nvlink_groups(
    devices: Iterable[int], links: Iterable[tuple[int, int]]
) -> list[tuple[int, ...]]:
    """Split device indices into NVLink-connected groups (connected components, sorted).

    A device with no link is a group of its own. Pure, so a fake topology tests it.
    """
    parent = {d: d for d in devices}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for a, b in links:
        if a in parent and b in parent:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for d in parent:
        groups.setdefault(root(d), []).append(d)
    return sorted(tuple(sorted(g)) for g in groups.values())


def place(
    groups: Sequence[Sequence[int]], free: Mapping[int, float], count: int
) -> tuple[int, ...] | None:
    """Pick ``count`` devices among ``free`` (device -> score, higher is better) for one replica.

    Topology first, score second, as the paper's NVLink-local chunks of 1/2/4/8: an aligned
    chunk of a power-of-two size inside one NVLink group; else any ``count`` devices of one
    group; else (no group has room) ``count`` devices across groups, which still runs but
    talks over PCIe. Among equals, the set with the highest total score wins, so a replica
    lands where memory is freest. ``None`` when fewer than ``count`` devices are free.
    """
    if count < 1:
        raise ValueError(f"`count` must be >= 1 (got {count})")
    best: tuple[tuple[int, float], tuple[int, ...]] | None = None

    def consider(tier: int, chosen: Sequence[int]) -> None:
        nonlocal best
        key = (-tier, sum(free[d] for d in chosen))
        if best is None or key > best[0]:
            best = (key, tuple(sorted(chosen)))

    aligned = count & (count - 1) == 0
    for group in groups:
        members = sorted(group)
        if aligned:
            for start in range(0, len(members) - count + 1, count):
                chunk = members[start : start + count]
                if all(d in free for d in chunk):
                    consider(0, chunk)
        inside = sorted((d for d in members if d in free), key=lambda d: -free[d])
        if len(inside) >= count:
            consider(1, inside[:count])
    if best is None:
        anywhere = sorted(free, key=lambda d: -free[d])
        if len(anywhere) >= count:
            consider(2, anywhere[:count])
    return None if best is None else best[1]


def linked(groups: Sequence[Sequence[int]], devices: Sequence[int]) -> bool:
    """Whether ``devices`` lie in one NVLink group."""
    return any(set(devices) <= set(group) for group in groups)


def replica_devices(
    options: Sequence[tuple[int, ...]],
    *,
    groups: Sequence[Sequence[int]],
    count: int,
    need: float,
    free: Mapping[int, float],
    open_devices: Collection[int] | None,
    resident: Collection[tuple[int, ...]],
    room_now: bool,
) -> tuple[int, ...] | None:
    """The devices a new replica of a service goes on, or ``None`` when none will do.

    ``options`` are the places it may take as they are: a server's bound slots, or where an
    idle copy of the service is still resident. ``open_devices`` are the devices a search
    may pick from (``None``: search nothing, the options are all): not busy with the
    service's live replicas, and big enough. ``free`` is each device's memory neither
    granted nor asked for, ``resident`` the device sets holding a resident copy.

    With ``room_now`` (a newcomer weighing another replica beside full ones) only places
    with room now count: a copy that waits for memory serves no one sooner. Otherwise the
    search also takes devices that will have room, and a multi-GPU replica waits for room
    inside one NVLink group rather than talk over PCIe for as long as it stays resident.
    Among the options, room now first, then a resident copy, then the most free memory.
    """
    options = list(options)
    if open_devices is not None:
        capable = {i: free[i] for i in open_devices}
        pick = place(groups, {i: f for i, f in capable.items() if fits(f, need)}, count)
        if not room_now and (pick is None or not linked(groups, pick)):
            wider = place(groups, capable, count)
            if pick is None or (wider is not None and linked(groups, wider)):
                pick = wider
        if pick is not None:
            options.append(pick)

    def score(option: tuple[int, ...]) -> tuple[bool, bool, float]:
        room = min(free[i] for i in option)
        return (fits(room, need), option in resident, room)

    options = [o for o in options if not room_now or score(o)[0]]
    if not options:
        return None
    return max(options, key=score)


# -- newcomers -----------------------------------------------------------------------------


def seats(max_batch: int | None, batching: bool) -> int:
    """Actions one replica serves before it counts as full: a batching service's
    ``max_batch``, else one (``max_batch=None`` merges all that wait, but a second replica
    on a free device still serves the next action sooner)."""
    return max_batch if batching and max_batch else 1


def room(seats: int) -> int:
    """Actions the live pool seats on one replica at a time: its ``seats`` and, when a
    run takes several, as many again, forming the next run behind the one running.

    Seats are handed over when actions leave, and the actions handed them call one at a
    time: the replica would start its next run on the first call and split the batch.
    With the next run's actions seated already, their calls wait together and merge. One
    call per run merges nothing, so a service that runs one at a time hands its seat
    over when the last action ends. (The simulator runs seated actions side by side, not
    in runs, and needs no second set.)
    """
    return seats if seats == 1 else 2 * seats


def seat(loads: Sequence[int], *, seats: int, may_grow: bool) -> int | None:
    """The replica a newcomer joins at once: the index in ``loads`` (actions on each live
    replica that takes newcomers) of the least loaded one, when it has a seat or no other
    replica may start (``may_grow`` false). ``None``: weigh a new replica (:func:`targets`),
    or, with no live replica, start one."""
    if not loads:
        return None
    least = min(range(len(loads)), key=loads.__getitem__)
    if loads[least] < seats or not may_grow:
        return least
    return None


@attrs.frozen
class Backlog(Generic[K]):
    """One service's line as :func:`targets` weighs it.

    ``count``: its actions no seat took yet, with those seated on a replica still waiting
    for its grant; ``oldest``: how long the first of them has waited. ``queued_seconds``:
    the expected run seconds of those behind a seat (not the ones a waiting replica will
    serve first). ``replicas``: its granted replicas that take newcomers. ``size``: what
    one replica takes of the amount :func:`targets` shares out (a count of GPUs
    simulated, bytes live). ``restore_seconds``: what another replica would cost before
    it serves (0 when an idle copy is resident). ``unserved``: how long the service has
    had no replica taking newcomers (:class:`Unserved`; ``inf`` when not kept).
    """

    key: K
    queued_seconds: float
    oldest: float
    count: int
    replicas: int
    seats: int
    size: float
    restore_seconds: float
    unserved: float = math.inf


def starvation_bound(policy: object) -> float:
    """The seconds after which ``policy`` promises a waiting action is never passed, for
    :func:`targets`: its ``starvation_bound`` when that is a number, else none (``inf``).

    A policy of the user's own may have no bound, or an attribute of that name that is
    not a number of seconds; the pool then keeps the move hurdle, rather than fail in
    the middle of an action's release when a line first starves.
    """
    bound = getattr(policy, "starvation_bound", math.inf)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or math.isnan(bound):
        return math.inf
    return float(bound)


def targets(
    lines: Sequence[Backlog[K]], capacity: float, starved: float = math.inf
) -> dict[K, int]:
    """How many replicas each service should have, sharing ``capacity`` by its line.

    Replicas are handed out one at a time, highest score first, while they fit; the
    score of a service's ``k+1``-th replica is the wait so far of the action it would
    serve, once the ``k`` ahead of it have each served :data:`HORIZON` restores of the
    line (at least a turn of their seats): the line's oldest waited ``oldest``, the
    others came since, so the ``j``-th has waited about ``oldest x (1 - j / count)``.
    Served that way, the devices go where one first-come-first-served queue on every
    device would put them over the horizon, the simulator's ``pooled`` reference: a
    line's share grows with its work among the longest waiting, so a popular service
    with a long line gets several devices and a rare one with a short line a device for
    a stretch now and then. Two changes for what a move costs:

    - a replica the service has keeps its score, except that one nothing waits for
      scores below any that something waits for;
    - a new one scores that wait less :data:`MOVE` restores, so a device changes service
      only when the line it would serve has waited that much longer than the one it
      serves; but it scores at least 0 (it takes free room, or a replica nothing waits
      for) when the service has none, or when the line each replica has is at least a
      restore long, ``queued / (k x seats) >= restore`` (the test a newcomer used to make
      alone).

    A service with work has no replica of right (an earlier rule gave each one first):
    under contention that held a device for each rare service's short line while the
    popular ones' long lines waited, a p95 1.3-1.4x ``pooled``'s on the MOPD trace. Its
    line waits until it is the one that has waited longest by :data:`MOVE` restores (the
    others' heads move on as they are served, so it gets there), and a pool must then
    start a replica for it even when no newcomer comes.

    A line that no replica has served for ``starved`` seconds (the policy's starvation
    bound), and whose oldest action has waited as long, scores its first replica at its
    wait alone, without the hurdle. Under a sustained overload every line's head ages
    at nearly the pace of the clock, the served ones' too, so the gap the hurdle asks
    for grows only as fast as the served heads move on, which is slowly: in family seed
    2's f021 (a two-GPU service beside two one-GPU services never short of work, on two
    GPUs) its actions waited in line up to 1,012 s, and its p95 was 5.2x that of one
    first-come-first-served line for every device. A line that some replica serves
    keeps the hurdle however long its head has waited: that is its own overload, and
    moving devices among served lines costs restores and does not shorten the waits
    (on the contended MOPD trace, where every request waits past the bound, lifting it
    for all lines tripled the restores). The time unserved counts as well as the head's
    wait, so a service that lost its replica a moment ago waits for the hurdle as before:
    counted by the head's wait alone, a rare service whose head came early in a burst
    took a device back each time it lost one (MOPD restores 43-54 -> 72-83, p95 up to
    1.31x ``pooled``'s).

    Scores only fall as a service gains replicas, so the greedy walk is the best share of
    whole replicas for these scores; it runs at every arrival and completion, so a look at
    each service first tells when the share stays as it is.
    """
    counts: dict[K, int] = {line.key: 0 for line in lines}
    left = capacity

    def wait(line: Backlog[K], k: int) -> float:
        # The wait so far of the action a k+1-th replica would serve once the k ahead
        # served the horizon each: the oldest waited ``oldest``, the rest came since.
        if line.count == 0:
            return 0.0
        run = line.queued_seconds / line.count
        turns = max(1.0, HORIZON * line.restore_seconds / run) if run > 0 else 1.0
        return line.oldest * max(0.0, 1 - k * line.seats * turns / line.count)

    def moving(line: Backlog[K], k: int) -> float:
        if k < line.replicas:
            return wait(line, k) if line.count else -1.0
        if line.count == 0:
            return -math.inf
        if k == 0 and line.replicas == 0 and min(line.oldest, line.unserved) >= starved:
            return line.oldest
        grows = k == 0 or line.queued_seconds / (k * line.seats) >= line.restore_seconds
        return max(wait(line, k) - MOVE * line.restore_seconds, 0.0 if grows else -1.0)

    if _settled(lines, capacity, moving):
        return {line.key: line.replicas for line in lines}
    # Ties go to a replica the service has (moving one for no gain costs a restore),
    # then to the service with fewer so far.
    heap = [(-moving(line, 0), line.replicas == 0, 0, i) for i, line in enumerate(lines)]
    heapq.heapify(heap)
    while heap:
        negative, _, _, i = heapq.heappop(heap)
        line = lines[i]
        kept = counts[line.key] < line.replicas
        if (-negative < 0 and not kept) or not fits(left, line.size):
            continue  # scores only fall: this service gets no more
        left -= line.size
        k = counts[line.key] = counts[line.key] + 1
        heapq.heappush(heap, (-moving(line, k), k >= line.replicas, k, i))
    return counts


class Unserved(Generic[K]):
    """How long each service's line has had no replica taking newcomers, for
    :attr:`Backlog.unserved`: counted from when the pool first weighed the service, or
    last saw a replica take its newcomers. Pure (``now`` comes in).

    Both pools sample it each time they weigh their lines, so a service can read as
    unserved since the last look that saw it served, not since its replica stopped.
    That is never too late, and it is not too early where it matters: a line's last
    replica stops taking newcomers with actions still in line only by a drain, and a
    drain is decided just after a look at the same instant; a replica that ends on its
    own leaves an empty line, whose head's wait then bounds the rule.
    """

    def __init__(self) -> None:
        self._served: dict[K, float] = {}

    def seconds(self, key: K, serving: bool, now: float) -> float:
        if serving:
            self._served[key] = now
            return 0.0
        return now - self._served.setdefault(key, now)


class Waiting(Generic[T]):
    """A service's line: its actions that wait for a seat on any of its replicas.

    Ordered by the policy's own rule, so that seats and cores follow one policy: an
    action is *due* at ``due(arrival, seconds)`` (:meth:`tangram.ElasticPolicy.due`:
    ``aging`` times its expected run seconds after it arrived; for a first-come
    first-served policy, when it arrives). Due ones go first, earliest due first, then
    the shortest expected run (ties in arrival order).
    One line per service rather than one per replica, so a seat that frees anywhere, or a
    replica that starts, serves the next in line: a replica that joins a busy service takes
    its backlog, not only its newcomers. Pure (``now`` comes in); removal is lazy, so a
    push, a pop and a removal cost a heap operation each.
    """

    def __init__(self, due: Callable[[float, float], float] | None = None) -> None:
        self._due_at = due if due is not None else ElasticPolicy().due
        self._short: list[tuple[float, int, T]] = []
        self._due: list[tuple[float, int, T]] = []
        self._arrivals: list[tuple[float, int, T]] = []
        self._live: dict[int, tuple[T, float]] = {}
        self._ids: dict[int, int] = {}
        self._seq = 0
        self.seconds = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def push(self, item: T, arrival: float, seconds: float) -> None:
        """``item`` joins, arrived at ``arrival``, expected to run ``seconds``."""
        self._seq += 1
        seq = self._seq
        self._live[seq] = (item, seconds)
        self._ids[id(item)] = seq
        self.seconds += seconds
        heapq.heappush(self._short, (seconds, seq, item))
        heapq.heappush(self._due, (self._due_at(arrival, seconds), seq, item))
        heapq.heappush(self._arrivals, (arrival, seq, item))

    def remove(self, item: T) -> None:
        """Take ``item`` out (it left the line); an item not in the line is ignored."""
        seq = self._ids.pop(id(item), None)
        if seq is not None:
            _, seconds = self._live.pop(seq)
            self.seconds -= seconds

    def _top(self, heap: list[tuple[float, int, T]]) -> tuple[float, int, T] | None:
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def oldest(self) -> float | None:
        """When the action waiting longest arrived, or ``None`` when the line is empty."""
        top = self._top(self._arrivals)
        return None if top is None else top[0]

    def pop(self, now: float) -> T:
        """The next in line at ``now``, taken out.

        :raises IndexError: the line is empty.
        """
        due = self._top(self._due)
        if due is None:
            raise IndexError("the line is empty")
        top = due if due[0] <= now else self._top(self._short)
        assert top is not None
        _, seq, item = top
        self._ids.pop(id(item), None)
        _, seconds = self._live.pop(seq)
        self.seconds = self.seconds - seconds if self._live else 0.0
        return item


def _settled(
    lines: Sequence[Backlog[K]], capacity: float, score: Callable[[Backlog[K], int], float]
) -> bool:
    """Whether :func:`targets` would keep every service's replicas as they are, found in
    one look at each service instead of the greedy walk (it runs at every arrival and
    completion): the replicas fit and score 0 or more, and no new one scores 0 or more
    and either fits in the room left or beats the weakest kept one."""
    used = sum(line.replicas * line.size for line in lines)
    if not fits(capacity, used):
        return False
    left = capacity - used
    weakest = min(
        (score(line, line.replicas - 1) for line in lines if line.replicas > 0),
        default=math.inf,
    )
    for line in lines:
        if line.count == 0:
            continue
        new = score(line, line.replicas)
        if new >= 0 and (fits(left, line.size) or new > weakest):
            return False
    return True


# -- draining ------------------------------------------------------------------------------


@attrs.frozen
class Holding(Generic[K]):
    """A running replica, holding its grant, as :func:`drains` weighs it.

    ``holds``: what the grant is, per resource (each device's bytes live, GPUs simulated).
    ``restored``: its restore is done, so its restore time is known. ``service``: whose
    replica it is, for the ``surplus`` of :func:`drains`.
    """

    key: K
    holds: Mapping[str, float]
    users: int
    granted_at: float
    restore_seconds: float
    draining: bool = False
    restored: bool = True
    service: str = ""


def drains(
    running: Sequence[Holding[K]],
    *,
    wanted: Mapping[str, float],
    free: Mapping[str, float],
    now: float,
    surplus: Mapping[str, int] | None = None,
) -> list[K]:
    """The running replicas to drain now so the waiting ones' grants are on the way.

    ``wanted`` is what replicas waiting for their grant ask for, per resource; ``free`` what
    no grant holds. A busy service keeps joining its replica, which would hold its devices
    for as long as the service stays busy and starve one waiting for them. So the least
    loaded running replicas that hold what the waiters lack, and have held their grant for
    :data:`TENURE` restore times (then the longest held), stop taking newcomers, as many as
    the waiters need beyond the free amounts and what draining replicas will give back;
    every other replica keeps serving. Draining every replica whenever any waited (tried in
    the simulator) made each busy service ask for a new replica in turn, so one waiter
    rotated the whole pool.

    ``surplus`` (under contention): replicas each service has beyond its :func:`targets`;
    when given, only those drain, at most that many of a service, so the devices go from
    the services with the least queued work to those with the most, never the reverse.
    """
    deficit = {k: v - max(0, free.get(k, 0)) for k, v in wanted.items()}
    for holding in running:
        if holding.draining:
            for k, amount in holding.holds.items():
                deficit[k] = deficit.get(k, 0) - amount
    if all(v <= 0 for v in deficit.values()):
        return []
    candidates = sorted(
        (
            h
            for h in running
            if not h.draining and h.restored and now - h.granted_at >= TENURE * h.restore_seconds
        ),
        key=lambda h: (h.users, h.granted_at),
    )
    left = dict(surplus) if surplus is not None else None
    chosen: list[K] = []
    for holding in candidates:
        if left is not None and left.get(holding.service, 0) <= 0:
            continue
        if any(deficit.get(k, 0) > 0 for k in holding.holds):
            if left is not None:
                left[holding.service] -= 1
            chosen.append(holding.key)
            for k, amount in holding.holds.items():
                deficit[k] = deficit.get(k, 0) - amount
    return chosen


def wait_on(
    here: Sequence[str],
    options: Iterable[Sequence[str]],
    running: Sequence[Holding[K]],
    *,
    need: float,
    free: Mapping[str, float],
    surplus: Mapping[str, int],
) -> tuple[str, ...] | None:
    """Where a replica waiting for its grant should wait instead of ``here``, or ``None``.

    A waiting replica asks for its devices' memory, so only their holders drain for it
    (:func:`drains`); the simulator, which places a replica when its grant comes, has no
    such tie. Room now comes first: ``here`` if it has it, else the first of ``options``
    that does. Else ``here`` while something on it will give way (a replica draining,
    with no action left, or of a service above its share), else the first of
    ``options`` where something will. Holders of services at their share stay put:
    they are what the share keeps serving.
    """
    others = [tuple(o) for o in options if tuple(o) != tuple(here)]

    def roomy(devices: Sequence[str]) -> bool:
        return all(fits(free.get(device, 0.0), need) for device in devices)

    def coming(devices: Sequence[str]) -> bool:
        return all(
            fits(free.get(device, 0.0), need)
            or any(
                device in h.holds and (h.draining or h.users == 0 or surplus.get(h.service, 0) > 0)
                for h in running
            )
            for device in devices
        )

    if roomy(here):
        return None
    for devices in others:
        if roomy(devices):
            return devices
    if coming(here):
        return None
    for devices in others:
        if coming(devices):
            return devices
    return None


# -- eviction and warming ------------------------------------------------------------------


@attrs.frozen
class Idle(Generic[K]):
    """A resident replica no action uses, on the device a restore needs room on.

    ``going``: an eviction of it is under way already; waiting for that frees its memory
    soonest, and never evicts two replicas where one will do.
    """

    key: K
    size: float
    last_used: float
    going: bool = False


def evictions(idle: Iterable[Idle[K]], *, free: float, need: float) -> list[K]:
    """The idle replicas to evict, in order, until ``need`` fits in ``free``: the ones
    already going, then the least recently used. Fewer than needed when ``idle`` runs out."""
    chosen: list[K] = []
    for replica in sorted(idle, key=lambda r: (not r.going, r.last_used)):
        if fits(free, need):
            break
        chosen.append(replica.key)
        free += replica.size
    return chosen


@attrs.frozen
class Wanted:
    """A service :func:`fill` may warm: ``need`` on each device of a replica, at most
    ``most`` replicas (``None``: as many as fit)."""

    name: str
    need: float
    most: int | None = None


def fill(
    services: Sequence[Wanted],
    free: Mapping[D, float],
    where: Callable[[Wanted, Mapping[D, float], Collection[D]], tuple[D, ...] | None],
) -> list[tuple[str, tuple[D, ...]]]:
    """The idle replicas to restore before any action comes, as (service, devices).

    Nothing runs yet and an idle resident replica costs nothing (it is evicted the moment a
    granted replica needs its memory), so the devices start full rather than empty: one
    replica of each service in declared order, then a second of each while there is room,
    and so on, never two of a service on one device, evicting nothing. ``where`` picks the
    devices for one more replica given what is still free and the devices the service
    holds already, or ``None`` when none have room.
    """
    left = dict(free)
    taken: dict[str, set[D]] = {s.name: set() for s in services}
    counts = dict.fromkeys(taken, 0)
    plan: list[tuple[str, tuple[D, ...]]] = []
    placed = True
    while placed:
        placed = False
        for service in services:
            if service.most is not None and counts[service.name] >= service.most:
                continue
            devices = where(service, left, taken[service.name])
            if devices is None:
                continue
            for device in devices:
                left[device] -= service.need
            taken[service.name].update(devices)
            counts[service.name] += 1
            plan.append((service.name, devices))
            placed = True
    return plan
