"""Which core ids an action gets: the pool's half of allocate-on-execution.

The runtime decides how many cores each action holds; :class:`CoreSet` picks which,
keeping one action's cores together (one NUMA node when the host has several) and never
lending a core to two actions at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from ..errors import InvalidCapacityError

__all__ = ["CoreSet", "format_cpu_list", "numa_nodes", "parse_cpu_list"]


def numa_nodes(cores: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Group ``cores`` by the NUMA node Linux reports for them (one group if unknown)."""
    wanted = set(cores)
    groups: list[tuple[int, ...]] = []
    base = Path("/sys/devices/system/node")
    with contextlib.suppress(OSError):
        for node in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            listed = parse_cpu_list((node / "cpulist").read_text())
            group = tuple(c for c in listed if c in wanted)
            if group:
                groups.append(group)
    seen = {c for g in groups for c in g}
    rest = tuple(c for c in cores if c not in seen)
    if rest:
        groups.append(rest)
    return tuple(groups)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def format_cpu_list(cores: Sequence[int]) -> str:
    """The inverse of :func:`parse_cpu_list`, with ranges folded."""
    parts: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


class CoreSet:
    """Which core ids are free on one host, and a choice that keeps an action together.

    The runtime guarantees the *count* of cores lent never exceeds the capacity; this
    picks the ids. A new action goes to the NUMA node whose free cores fit it most
    tightly (best fit keeps big free blocks for big actions), taking neighbouring ids;
    a growing action takes free cores of its own node first, nearest first; a shrinking
    one gives back the cores furthest from its first core.
    """

    def __init__(self, nodes: Sequence[Sequence[int]]) -> None:
        self._node_of = {core: index for index, node in enumerate(nodes) for core in node}
        self._nodes = [tuple(node) for node in nodes]
        self._free = set(self._node_of)

    @property
    def free(self) -> frozenset[int]:
        return frozenset(self._free)

    def __len__(self) -> int:
        return len(self._node_of)

    def take(self, count: int, near: Sequence[int] = ()) -> tuple[int, ...]:
        """Take ``count`` free cores, next to ``near`` when given.

        :raises InvalidCapacityError: fewer than ``count`` cores are free, which means
            the runtime's capacity for this host is larger than the cores it has.
        """
        if count > len(self._free):
            raise InvalidCapacityError(
                f"asked for {count} cores but only {len(self._free)} of {len(self)} are free: "
                "the runtime's cpu capacity exceeds the cores the sandbox pool owns"
            )
        chosen: list[int] = []
        if near:
            anchor = near[0]
            home = self._node_of[anchor]
            order = sorted(self._free, key=lambda c: (self._node_of[c] != home, abs(c - anchor), c))
            chosen = order[:count]
        else:
            fits = [
                (len(free), index, free)
                for index, node in enumerate(self._nodes)
                if len(free := [c for c in node if c in self._free]) >= count
            ]
            if fits:
                _, _, free = min(fits, key=lambda item: (item[0], item[1]))
                chosen = _tightest_window(free, count)
            else:  # spans nodes: fill the emptiest nodes first
                by_node = sorted(
                    ([c for c in node if c in self._free] for node in self._nodes),
                    key=len,
                    reverse=True,
                )
                for free in by_node:
                    chosen.extend(free[: count - len(chosen)])
                    if len(chosen) == count:
                        break
        self._free.difference_update(chosen)
        return tuple(chosen)

    def give(self, cores: Sequence[int]) -> None:
        """Return ``cores``; returning a core that is free or unknown is a bug."""
        for core in cores:
            if core not in self._node_of or core in self._free:
                raise RuntimeError(f"core {core} returned twice or never lent")
        self._free.update(cores)

    def resize(self, cores: tuple[int, ...], count: int) -> tuple[int, ...]:
        """Grow or shrink a held set to ``count`` cores, keeping the ones it had."""
        if count == len(cores):
            return cores
        if count < len(cores):
            anchor = cores[0]
            keep = sorted(cores, key=lambda c: (abs(c - anchor), c))[:count]
            drop = [c for c in cores if c not in keep]
            self.give(drop)
            return tuple(c for c in cores if c in keep)
        extra = self.take(count - len(cores), near=cores)
        return cores + extra


def _tightest_window(free: list[int], count: int) -> list[int]:
    """The ``count`` free cores spanning the smallest id range (neighbours share caches)."""
    ordered = sorted(free)
    best = min(range(len(ordered) - count + 1), key=lambda i: ordered[i + count - 1] - ordered[i])
    return ordered[best : best + count]
