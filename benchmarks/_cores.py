"""What the benchmarks' sandbox calls report, and how many cores they held at once.

Each call runs :data:`PROBE`: fixed work, then a line with when it ran and the cores its
affinity allowed. ``ray_overhead.py`` and ``node_overhead.py`` read those lines back to
say whether a mode ever held more cores than the host has, or put two calls on one core.
Not a benchmark itself (``make bench`` runs the files without a leading underscore).
"""

from __future__ import annotations

# The command a tool call runs: ``{work}`` loop iterations, then when and on which cores.
PROBE = (
    "import time\n"
    "t0 = time.time()\n"
    "x = 0\n"
    "for i in range({work}):\n"
    "    x += i\n"
    "t1 = time.time()\n"
    "line = [l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')][0]\n"
    "print('PROBE', t0, t1, line.split(':')[1].strip())\n"
)

Probe = tuple[float, float, set[int]]


def probes(outputs: list[str]) -> tuple[list[Probe], int]:
    """Each call's (start, end, allowed cores) from its own output; how many had none."""
    found, failed = [], 0
    for output in outputs:
        line = next((x for x in output.splitlines() if x.startswith("PROBE")), None)
        if line is None:
            failed += 1
            continue
        _, start, end, listed = line.split()
        cores: set[int] = set()
        for part in listed.split(","):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
        found.append((float(start), float(end), cores))
    return found, failed


def occupancy(found: list[Probe]) -> tuple[int, int]:
    """Peak cores held at once (a core counted once per command on it) and core overlaps."""
    peak = overlaps = 0
    for i, (start, end, cores) in enumerate(found):
        peak = max(peak, sum(len(c) for s, e, c in found if s <= start < e))
        overlaps += sum(1 for s, e, c in found[i + 1 :] if s < end and start < e and cores & c)
    return peak, overlaps


def core_targets(peak: int, overlaps: int, cores: int) -> dict[str, dict[str, object]]:
    """The two targets every shared mode is held to: no more cores than the host has, and
    never two calls on one core."""
    return {
        "shared_peak_cores": {"value": peak, "goal": f"<= {cores}", "met": peak <= cores},
        "shared_core_overlaps": {"value": overlaps, "goal": "== 0", "met": overlaps == 0},
    }
