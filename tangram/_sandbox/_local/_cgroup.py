"""A cgroup per local sandbox, so its memory, process and core limits count the whole sandbox.

``setrlimit`` limits each process: three processes of 2 GiB under a 2 GiB ``RLIMIT_AS``
held 6 GiB (issue #17). A cgroup's ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1)
counts every page of every process in it, ``/tmp``'s tmpfs and the work dir's included,
and ``pids.max`` every process whatever its uid. ``cpuset.cpus`` holds a command to its
granted cores: affinity alone does not, since any process may widen its own
(``sched_setaffinity`` to every core worked unprivileged), while the kernel intersects
whatever a process asks for with its cpuset, and a write of ``cpuset.cpus`` re-pins every
task of the cgroup at once. Each sandbox gets a leaf below the cgroup this process is in
(never beside it, so the trainer's own limits still hold over its sandboxes), and a
command joins its leaf before it execs, so nothing it forks starts outside.

Where the host does not allow that (no controller, no write access, or cgroup v2 with
processes in this cgroup, which the kernel's no-internal-processes rule forbids to have
controlled children), :func:`open_tree` says why and the backend falls back to per-process
limits with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from pathlib import Path

import attrs

from .._cores import format_cpu_list

__all__ = ["CgroupLeaf", "CgroupTree", "open_tree"]


@attrs.define
class CgroupLeaf:
    """One sandbox's cgroups (one per v1 hierarchy, or one v2 directory)."""

    paths: list[Path]
    memory: Path | None = None
    cpuset: Path | None = None

    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.paths]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(OSError):
                found.update(int(line) for line in (path / "cgroup.procs").read_text().split())
        return found

    def cpu_seconds(self) -> float | None:
        for path in self.paths:
            with contextlib.suppress(OSError, ValueError):
                if (path / "cpu.stat").exists() and not (path / "cpuacct.usage").exists():
                    for line in (path / "cpu.stat").read_text().splitlines():
                        if line.startswith("usage_usec "):
                            return int(line.split()[1]) / 1e6
                if (path / "cpuacct.usage").exists():
                    return int((path / "cpuacct.usage").read_text()) / 1e9
        return None

    def set_cores(self, cores: tuple[int, ...]) -> None:
        """Hold every process of the leaf (and any it starts) to ``cores``."""
        if self.cpuset is not None and cores:
            (self.cpuset / "cpuset.cpus").write_text(format_cpu_list(cores))

    def oom_kills(self) -> int | None:
        """How many of the leaf's processes the kernel killed for its memory limit."""
        if self.memory is None:
            return None
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError, ValueError):
                for line in (self.memory / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return None

    def remove(self) -> None:
        """Remove the leaf once its processes are gone (killed by the caller first)."""
        deadline = time.monotonic() + 5.0
        for path in self.paths:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


@attrs.define
class CgroupTree:
    """This process's parent cgroup(s) for sandboxes, one per controller hierarchy."""

    version: int
    bases: dict[str, Path]  # controller -> this backend's directory for its leaves

    @property
    def controllers(self) -> frozenset[str]:
        return frozenset(self.bases)

    def leaf(self, memory: int | None, processes: int | None) -> CgroupLeaf:
        name = f"sbx-{secrets.token_hex(6)}"
        paths: list[Path] = []
        for base in dict.fromkeys(self.bases.values()):
            path = base / name
            path.mkdir()
            paths.append(path)
        leaf = CgroupLeaf(
            paths,
            memory=self.bases["memory"] / name if "memory" in self.bases else None,
            cpuset=self.bases["cpuset"] / name if "cpuset" in self.bases else None,
        )
        try:
            if self.version == 1 and leaf.cpuset is not None:
                # A v1 cpuset starts empty, and an empty one takes no process.
                _copy_cpuset(self.bases["cpuset"], leaf.cpuset)
            if memory is not None and "memory" in self.bases:
                where = self.bases["memory"] / name
                if self.version == 2:
                    (where / "memory.max").write_text(str(memory))
                    with contextlib.suppress(OSError):
                        (where / "memory.swap.max").write_text("0")
                else:
                    (where / "memory.limit_in_bytes").write_text(str(memory))
                    with contextlib.suppress(OSError):
                        (where / "memory.memsw.limit_in_bytes").write_text(str(memory))
            if processes is not None and "pids" in self.bases:
                (self.bases["pids"] / name / "pids.max").write_text(str(processes))
        except BaseException:
            leaf.remove()
            raise
        return leaf

    def cap_total(self) -> int | None:
        """Hold every sandbox together to half the memory this process may use; the cap.

        A sandbox's files are tmpfs pages no process owns, counted in its leaf and so in
        every cgroup above it, the trainer's included. Live sandboxes each inside their
        own ``memory`` could fill a memory-limited container (a pod) with files, and the
        OOM killer, finding nothing in them to kill, took the trainer. Capped here, the
        base is where the memory runs out: a sandbox's command is killed, not the
        trainer. The ceiling is the tightest limit of this process's cgroup and its
        ancestors, or the host's memory; ``None`` when it cannot be read or written.
        """
        base = self.bases.get("memory")
        ceiling = _memory_ceiling(base.parent) if base is not None else None
        if base is None or ceiling is None:
            return None
        cap = ceiling // 2
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        try:
            (base / name).write_text(str(cap))
        except OSError:
            return None
        return cap

    def close(self) -> None:
        for base in dict.fromkeys(self.bases.values()):
            with contextlib.suppress(OSError):
                base.rmdir()


def _memory_ceiling(own: Path) -> int | None:
    """The smallest memory limit of ``own`` and the cgroups above it, or the host's RAM."""
    limits: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    current = own
    while (current / "cgroup.procs").exists():
        for name in ("memory.max", "memory.limit_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                text = (current / name).read_text().strip()
                if text != "max":
                    limits.append(int(text))
        if current.parent == current:
            break
        current = current.parent
    return min(limits) if limits else None


_V1_WANTED = ("memory", "pids", "cpuacct", "cpuset")


def open_tree(root: Path = Path("/sys/fs/cgroup")) -> CgroupTree | str:
    """This backend's cgroup directories, or a sentence saying why there are none."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = _mounts()
    except OSError as exc:
        return f"cgroups are not readable here ({exc})"
    name = f"tangram-{os.getpid()}-{secrets.token_hex(3)}"
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in own:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            if "cgroup2" in mounts:
                mount, mount_root = mounts["cgroup2"]
                v2 = mount / os.path.relpath(path, mount_root)
            continue
        for controller in controllers.split(","):
            if controller in _V1_WANTED and controller in mounts:
                mount, mount_root = mounts[controller]
                v1[controller] = mount / os.path.relpath(path, mount_root)
    if "memory" in v1:
        return _open_v1(v1, name)
    if v2 is not None and (v2 / "cgroup.controllers").exists():
        return _open_v2(v2, name)
    return "no cgroup memory controller is mounted"


def _reap(own: Path) -> None:
    """Remove the cgroups of tangram processes that died without closing them (killed).

    Their leaves are empty once every process in them is gone, which the kernel sees to.
    """
    with contextlib.suppress(OSError):
        for base in own.glob("tangram-*-*"):
            pid = base.name.split("-")[1]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            with contextlib.suppress(OSError):
                for leaf in base.iterdir():
                    if leaf.is_dir():
                        leaf.rmdir()
                base.rmdir()


def _open_v1(own: dict[str, Path], name: str) -> CgroupTree | str:
    for path in own.values():
        _reap(path)
    bases: dict[str, Path] = {}
    try:
        for controller, path in own.items():
            base = path / name
            base.mkdir()
            bases[controller] = base
            if controller == "cpuset":
                _copy_cpuset(path, base)
    except OSError as exc:
        CgroupTree(1, bases).close()
        return f"cgroup v1: cannot make a cgroup below {own['memory']} ({exc.strerror})"
    return CgroupTree(1, bases)


def _open_v2(own: Path, name: str) -> CgroupTree | str:
    available = set((own / "cgroup.controllers").read_text().split())
    wanted: list[str] = [c for c in ("memory", "pids", "cpu") if c in available]
    if "memory" not in wanted:
        return f"cgroup v2: the memory controller is not delegated to {own}"
    _reap(own)
    base = own / name
    try:
        enabled = set((own / "cgroup.subtree_control").read_text().split())
        missing = [c for c in wanted if c not in enabled]
        if missing:
            (own / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
        base.mkdir()
        (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
    except OSError as exc:
        with contextlib.suppress(OSError):
            base.rmdir()
        why = (
            "this process's cgroup holds processes, so it cannot have controlled children"
            if exc.errno == errno.EBUSY
            else exc.strerror
        )
        return f"cgroup v2: cannot make controlled cgroups below {own} ({why})"
    if "cpuset" in available:
        # Apart, and only if it can be had: a host that will not delegate the cpuset keeps
        # the memory and process limits (the cores then fall back to affinity).
        with contextlib.suppress(OSError):
            if "cpuset" not in enabled:
                (own / "cgroup.subtree_control").write_text("+cpuset")
            (base / "cgroup.subtree_control").write_text("+cpuset")
            wanted.append("cpuset")
    return CgroupTree(2, dict.fromkeys(wanted, base))


def _copy_cpuset(parent: Path, child: Path) -> None:
    for name in ("cpuset.mems", "cpuset.cpus"):
        (child / name).write_text((parent / name).read_text().strip())


def _mounts() -> dict[str, tuple[Path, str]]:
    """Controller (or ``"cgroup2"``) -> (mount point, the hierarchy path mounted there)."""
    found: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3]
        mount_root, mount_point = fields[3], Path(fields[4])
        if fstype == "cgroup2":
            found.setdefault("cgroup2", (mount_point, mount_root))
        elif fstype == "cgroup":
            for option in options.split(","):
                found.setdefault(option, (mount_point, mount_root))
    return found
