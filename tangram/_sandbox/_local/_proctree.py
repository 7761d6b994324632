"""Every process of one local sandbox action, found however it tried to hide, and ended.

A command can fork, leave its session (``setsid``), scrub its environment and make itself
non-dumpable. What it cannot leave is, depending on what the host offers: bubblewrap's pid
namespace, its sandbox's cgroup, and (with a uid per sandbox) its real uid. The scan here
takes the union of those with the session and an environment marker, so resizes reach
every thread and the clean-up after an action leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import attrs

from ._cgroup import CgroupLeaf

__all__ = ["MARKER", "Tree", "kill_tree", "pin_tree"]

MARKER = "TANGRAM_SANDBOX_MARK"
"""Environment variable carrying an action's marker (only where no namespace holds it)."""


@attrs.define
class Tree:
    """How to find every process of one action, whatever it did to hide."""

    session: int
    marker: str | None
    uid: int | None
    leaf: CgroupLeaf | None
    namespaced: bool


def _pids(tree: Tree) -> tuple[list[int], int]:
    """Pids of the action: its session, its uid, its cgroup, its pid namespace, its marker.

    Also returns how many of them are leftovers: not the command itself (nor, under
    bubblewrap, bubblewrap's own processes).
    """
    found: dict[int, bool] = {}  # pid -> is a leftover
    if tree.leaf is not None:
        # Nothing leaves a cgroup without root: its member list is the whole action, and
        # far cheaper than reading every process's status on a busy host.
        found = {pid: pid != tree.session for pid in tree.leaf.pids()}
    else:
        _scan(tree, found)
    if tree.namespaced:
        for pid in list(found):
            if found[pid] and _status_field(pid, "NSpid:") in (1, 2):
                found[pid] = False  # bubblewrap's pid 1, and the command itself
    return list(found), sum(found.values())


def _scan(tree: Tree, found: dict[int, bool]) -> None:
    """Every process of the action by session, pid namespace, uid and marker, from /proc."""
    own = os.getpid()
    needle = f"{MARKER}={tree.marker}".encode() if tree.marker else None
    namespace: str | None = None
    children: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == own:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rpartition(b")")[2].split()
            if fields[0] == b"Z":
                continue  # already dead, waiting to be reaped
            parent, session = int(fields[1]), int(fields[3])
            if pid == tree.session:
                found[pid] = False
                continue
            if tree.namespaced and parent == tree.session:
                namespace = os.readlink(f"/proc/{pid}/ns/pid")
                found[pid] = False
                continue
            if tree.namespaced:
                children.append(pid)
            if session == tree.session:
                found[pid] = True
                continue
            if tree.uid is not None and _real_uid(pid) == tree.uid:
                # From status, not the owner of /proc/PID: a process that made itself
                # non-dumpable shows root there.
                found[pid] = True
                continue
            if needle is not None:
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    if needle in handle.read():
                        found[pid] = True
        except (OSError, IndexError, ValueError):
            continue
    if namespace is not None:
        for pid in children:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                    found.setdefault(pid, True)


def _real_uid(pid: int) -> int | None:
    return _status_field(pid, "Uid:", last=False)


def _status_field(pid: int, name: str, *, last: bool = True) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name):
                values = line.split()[1:]
                return int(values[-1] if last else values[0])
    return None


def pin_tree(tree: Tree, cores: tuple[int, ...]) -> None:
    """Set the affinity of every thread of every process of the action's tree."""
    for pid in _pids(tree)[0]:
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cores)


def kill_tree(tree: Tree) -> int:
    """Kill the action's whole tree, orphans included; return how many were left behind.

    Repeats until a scan after the session's death finds nothing, because a process
    forking while we scan can add a pid after the scan passed it; a forking process that
    has a kill pending cannot. The session's own fork counts too: a scan that found it
    alone, just before its kill, missed the child it was cloning (bubblewrap starting
    the command as a cancel landed), which then ran on, re-parented, with no cores.
    """
    killed = 0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        # Scan before killing: a process killed first may be gone before the scan counts it.
        ended = not _alive(tree.session)
        pids, leftovers = _pids(tree)
        if tree.session > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(tree.session, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed = max(killed, leftovers)
        if ended and not [pid for pid in pids if pid != tree.session]:
            break
        time.sleep(0.005)
    return killed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it forks nothing more)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
