"""Sandboxed code that reports when it ran and on which cores, and the checks on those
reports: no two overlapping calls on one core, never more cores held than there are.

Shared by the tests of the shared scheduler, on Ray (``adapters/test_shared_ray.py``)
and without it (``test_node.py``, ``adapters/test_verl_node.py``).
"""

from __future__ import annotations

# Busy for ``{seconds}``, then the wall-clock span and the cores it was allowed.
PROBE = (
    "import time\n"
    "t0 = time.time()\n"
    "while time.time() < t0 + {seconds}:\n"
    "    pass\n"
    "line = [l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')][0]\n"
    "print('PROBE', t0, time.time(), line.split(':')[1].strip())\n"
)

Probe = tuple[float, float, set[int]]


def cores_of(text: str) -> set[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``."""
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def probes(outputs: list[str]) -> list[Probe]:
    """Each output's (start, end, allowed cores), from its ``PROBE`` line."""
    found = []
    for output in outputs:
        line = next(x for x in output.splitlines() if x.startswith("PROBE"))
        _, start, end, cores = line.split()
        found.append((float(start), float(end), cores_of(cores)))
    return found


def assert_never_shared(found: list[Probe], cores: int) -> None:
    """No two overlapping calls held one core, and at no moment more than ``cores`` were held."""
    for i, (start, end, mine) in enumerate(found):
        overlapping = [p for j, p in enumerate(found) if j != i and p[0] < end and start < p[1]]
        for other in overlapping:
            assert not mine & other[2], (found[i], other)
        at_start = [p for p in found if p[0] <= start < p[1]]
        assert sum(len(p[2]) for p in at_start) <= cores, at_start
