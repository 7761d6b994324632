"""The Docker sandbox's cgroup files on this machine, for the direct-write fast path.

When the daemon runs on this machine and its containers' cgroup files are writable here, a
grant is a write of ``cpuset.cpus`` and the CFS quota (microseconds) instead of an Engine
API call (tens of milliseconds). Both cgroup v2 and v1 layouts are found from
``/proc/PID/cgroup``; ``root`` lets tests lay out either tree on any host.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["PERIOD_US", "CgroupFiles"]

PERIOD_US = 100_000
"""CFS period: quota is granted cores times this."""


class CgroupFiles:
    """The container's cgroup files on this machine, for the direct-write fast path."""

    def __init__(self, version: str, quota: Path, cpuset: Path) -> None:
        self.version = version
        self.quota = quota
        self.cpuset = cpuset

    @classmethod
    def find(cls, pid: int, version: str, root: Path = Path("/")) -> CgroupFiles | None:
        """The files of ``pid``'s cgroup, or ``None`` when they are not writable here.

        ``root`` is where ``/proc`` and ``/sys`` are read from: ``/`` but in tests, which
        lay out a cgroup v2 tree on a host that mounts v1.
        """
        try:
            lines = (root / "proc" / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        if version == "2":
            for line in lines:
                if line.startswith("0::"):
                    base = root / "sys" / "fs" / "cgroup" / line[3:].lstrip("/")
                    files = cls(version, base / "cpu.max", base / "cpuset.cpus")
                    return files if files.usable() else None
            return None
        paths: dict[str, Path] = {}
        mounts = _v1_mounts(root)
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            for controller in controllers.split(","):
                if controller in ("cpu", "cpuset") and controller in mounts:
                    paths[controller] = mounts[controller] / rel.lstrip("/")
        if "cpu" not in paths or "cpuset" not in paths:
            return None
        files = cls(version, paths["cpu"] / "cpu.cfs_quota_us", paths["cpuset"] / "cpuset.cpus")
        return files if files.usable() else None

    def usable(self) -> bool:
        return os.access(self.quota, os.W_OK) and os.access(self.cpuset, os.W_OK)

    def read(self) -> tuple[str, int]:
        cpuset = self.cpuset.read_text().strip()
        raw = self.quota.read_text().split()
        quota = -1 if raw[0] == "max" else int(raw[0])
        return cpuset, quota

    def write(self, cpuset: str, quota_us: int, growing: bool) -> None:
        # Growing: widen the cpuset before raising the quota; shrinking: the reverse, so
        # the quota never exceeds what the cpuset can use.
        quota_text = f"{quota_us} {PERIOD_US}" if self.version == "2" else str(quota_us)
        steps = [(self.cpuset, cpuset), (self.quota, quota_text)]
        for path, value in steps if growing else reversed(steps):
            with open(path, "w") as handle:
                handle.write(value)


def _v1_mounts(root: Path) -> dict[str, Path]:
    mounts: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in (root / "proc" / "self" / "mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields = right.split()
            if not fields or fields[0] != "cgroup":
                continue
            point = root / left.split()[4].lstrip("/")
            for option in fields[2].split(","):
                mounts.setdefault(option, point)
    return mounts
