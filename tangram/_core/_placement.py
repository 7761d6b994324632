"""Where GPU replicas go, when a newcomer waits, which replica drains, which one is evicted.

The rules of evict-on-execution, once, for the live :class:`tangram.gpu.GpuPool` and the
simulator's pool model (``tangram/_sim/_simulate.py`` and ``tangram/_sim/_residency.py``).
The two keep different books (the live pool grants each device's memory in bytes, the
simulator a count of GPUs), so every rule takes what it weighs as plain numbers: loads,
free amounts per resource, learnt seconds, the time now. Nothing here reads a clock, awaits
or touches a device, so the same inputs give the same decisions live and simulated, and
the rules can be tested alone (``tests/test_placement.py``).

The rules, in the order an action meets them:

- :func:`seat` and :func:`queues`: a newcomer joins the least loaded live replica of its
  service while that one has a seat; when every one is full it weighs its place in line
  against a restore of another replica.
- :func:`replica_devices` (live, with :func:`place` for NVLink topology): the devices a new
  replica goes on.
- :func:`drains`: while replicas wait for their grant, which running replicas stop taking
  newcomers and hand their devices on, once they have held them for :data:`TENURE`.
- :func:`evictions`: which idle resident replicas make room for a restore (LRU).
- :func:`fill`: which idle replicas are restored before the first action.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

__all__ = [
    "TENURE",
    "Holding",
    "Idle",
    "Wanted",
    "drains",
    "evictions",
    "fill",
    "fits",
    "linked",
    "nvlink_groups",
    "place",
    "queues",
    "replica_devices",
    "seat",
    "seats",
]

K = TypeVar("K")
D = TypeVar("D")

#: Restore times a running replica holds its grant before it may be drained for a waiter,
#: so a restore is at most a third of a replica's time on its devices. Measured in the
#: simulator on mopd-2048 at 10 GPUs, seeds 0 and 2: mean ACT 0.77 and 0.78 s with 0, 0.72
#: and 0.73 s with 2, 1.18 and 0.94 s with 4 (a popular service then waits too long).
TENURE = 2.0

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


def seat(loads: Sequence[int], *, seats: int, may_grow: bool) -> int | None:
    """The replica a newcomer joins at once: the index in ``loads`` (actions on each live
    replica that takes newcomers) of the least loaded one, when it has a seat or no other
    replica may start (``may_grow`` false). ``None``: weigh a new replica (:func:`queues`),
    or, with no live replica, start one."""
    if not loads:
        return None
    least = min(range(len(loads)), key=loads.__getitem__)
    if loads[least] < seats or not may_grow:
        return least
    return None


def queues(
    load: int, *, seats: int, run_seconds: float | None, restore_seconds: float | None
) -> bool:
    """Whether a newcomer finding every replica full waits on the least loaded one (``load``
    actions) rather than start another.

    ``restore_seconds`` is what the new replica would cost before it serves: ``None`` when
    no devices have room for one now (it would wait for memory and serve no one sooner), 0
    when an idle copy is resident there. A full replica frees a seat every ``run_seconds /
    seats`` on average, so the newcomer's wait there is its place in line times that. The
    simulator found (mopd-2048 at 16 GPUs) that restoring a third replica of the busiest
    teacher at once cost more than queueing on the two it had. Before any run was measured
    (``run_seconds`` ``None``) the line's length is unknown, and a new replica starts.
    """
    if restore_seconds is None:
        return True
    if run_seconds is None:
        return False
    place_in_line = load - seats + 1
    return place_in_line * run_seconds / seats < restore_seconds


# -- draining ------------------------------------------------------------------------------


@attrs.frozen
class Holding(Generic[K]):
    """A running replica, holding its grant, as :func:`drains` weighs it.

    ``holds``: what the grant is, per resource (each device's bytes live, GPUs simulated).
    ``restored``: its restore is done, so its restore time is known.
    """

    key: K
    holds: Mapping[str, float]
    users: int
    granted_at: float
    restore_seconds: float
    draining: bool = False
    restored: bool = True


def drains(
    running: Sequence[Holding[K]],
    *,
    wanted: Mapping[str, float],
    free: Mapping[str, float],
    now: float,
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
    chosen: list[K] = []
    for holding in candidates:
        if any(deficit.get(k, 0) > 0 for k in holding.holds):
            chosen.append(holding.key)
            for k, amount in holding.holds.items():
                deficit[k] = deficit.get(k, 0) - amount
    return chosen


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
