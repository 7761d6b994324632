"""Memory reserved per sandbox, so no sandbox's memory can get another's command killed.

All sandboxes of a backend draw on one pool of memory: for local sandboxes, the base
cgroup above every sandbox's leaf, capped at half the trainer's memory (see
:meth:`._local._cgroup.CgroupTree.cap_total`); for Docker ones, each daemon's host, half
the memory its containers may use together (:mod:`._docker._backend`). Were each
sandbox simply limited to ``memory``, that would be one shared pool: a sandbox's files
(tmpfs pages no process owns, which outlive its command) could fill it, and another
sandbox's next command, a grading harness for a different sample say, was OOM-killed at
start (a policy lowering its siblings' rewards). So the cap is not shared but *reserved*,
split where nothing can outgrow its share:

- a parked sandbox holds only its work dir's files: at most ``disk`` bytes plus its
  inodes (a tmpfs of that size with ``inodes_for(disk)`` inodes: :mod:`._local._quota_fs`,
  or Docker's ``/work`` mount). Its action's ``/tmp``, ``/dev/shm``, IPC objects and
  processes end with the action (namespaces that end with it locally; emptied and killed
  by the runner in a container) before its cores are given back;
- at most one action per lent core runs at once (the pool never lends a core twice), and
  a running sandbox holds at most ``memory`` (its leaf's or container's limit counts
  every page of it).

So ``cores x memory + sandboxes x (disk + inodes)`` never exceeds the cap (for Docker,
``sandboxes x`` also each container's runner, which a parked container keeps): a sandbox
then reaches only its own limits, never the cap's. ``memory`` and ``disk`` are ceilings: where
the asked values do not fit, running actions and parked files each get half the cap (or
what the other side leaves), shared equally; ``sandboxes`` sandboxes may be alive at once,
and the backend refuses to create one more (a :class:`~tangram.errors.SandboxError`),
or, while one is being destroyed, waits for its place (:class:`Places`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import anyio
import attrs

from .._core._units import format_size
from ..errors import SandboxError

__all__ = [
    "INODE_BYTES",
    "MIN_DISK",
    "MIN_MEMORY",
    "MemoryPlan",
    "Places",
    "held",
    "inodes_for",
    "plan_memory",
]

INODE_BYTES = 2 << 10
"""Kernel memory one tmpfs inode may hold, charged to the sandbox: 1.45 KiB measured for
an empty file or directory with a 255-byte name (the inode, its dentry, the name)."""

_BYTES_PER_INODE = 16 << 10  # tmpfs's own default is one inode per page of RAM
_MIN_INODES = 128
MIN_MEMORY = 48 << 20
"""Below this per action not even a Python interpreter starts: refused at start."""
MIN_DISK = 256 << 10
"""Below this per work dir a sandbox cannot hold a small program: refused at start."""
_MIB = 1 << 20


def inodes_for(size: int) -> int:
    """How many files and directories a work dir of ``size`` bytes may hold."""
    return max(_MIN_INODES, size // _BYTES_PER_INODE)


def held(disk: int) -> int:
    """What a parked sandbox may hold: its work dir's bytes and its inodes."""
    return disk + inodes_for(disk) * INODE_BYTES


def _disk_within(share: int) -> int:
    """The largest work dir whose bytes and inodes together fit in ``share``."""
    low, high = 0, share
    while low < high:  # _held is increasing: a bisection, 40-odd steps
        middle = (low + high + 1) // 2
        if held(middle) <= share:
            low = middle
        else:
            high = middle - 1
    return low // 4096 * 4096  # tmpfs sizes are whole pages


@attrs.frozen
class MemoryPlan:
    """The limits in force, and whether they keep every sandbox within its reservation.

    ``memory`` is each leaf's limit (and each process's address space), ``disk`` each work
    dir's size, ``sandboxes`` how many may be alive at once (``None``: not limited).
    ``problem`` says why the settings cannot work here (the pool refuses to start);
    ``said`` is the sentence for ``protections.memory`` and the start-up log.
    """

    memory: int | None
    disk: int | None
    sandboxes: int | None
    said: str
    problem: str | None = None
    lowered: bool = False


@attrs.define(eq=False)
class Places:
    """The live sandboxes of one reservation, against the count it reserves memory for.

    A sandbox being destroyed still holds its files until its removal ends, so its place
    is not free; but it will be, so a sandbox asked for meanwhile waits for it rather than
    being refused. A broken sandbox is destroyed in the background while its trajectory
    goes on: at exactly ``limit`` live, its successor was refused, a tangram failure in
    the caller's step.
    """

    limit: int | None
    """The most live sandboxes (``None``: not limited)."""
    live: int = 0
    """Created and not yet destroyed, those being destroyed included."""
    leaving: int = 0
    """Being destroyed: their places come back when their removal ends."""
    _left: anyio.Event | None = None

    async def take(self, where: str, work: int, setting: str) -> None:
        """Count one more live sandbox, once one of ``limit`` has left if need be.

        :raises SandboxError: ``limit`` sandboxes are alive ``where`` and none is leaving:
            one more would share someone's reservation, and its files could cost them a
            command.
        """
        while self.limit is not None and self.live >= self.limit and self.leaving:
            self._left = left = self._left or anyio.Event()
            await left.wait()
        if self.limit is not None and self.live >= self.limit:
            raise SandboxError(
                f"{self.live} sandboxes are alive {where}, the most this backend reserves "
                f"memory for (sandboxes={self.limit}, each a work dir of {format_size(work)}):"
                f" destroy one first, or allow more with `{setting}` (each work dir then "
                "smaller)"
            )
        self.live += 1

    def give_back(self) -> None:
        """A sandbox that was never used (its creation failed) is not live."""
        self.live -= 1

    @contextlib.contextmanager
    def leave(self) -> Iterator[Callable[[], None]]:
        """Around a removal: yields ``gone``, to call once its files are gone. A removal
        that ends without it (its files still mounted) keeps its place taken."""
        self.leaving += 1
        freed = False

        def gone() -> None:
            nonlocal freed
            if not freed:
                freed = True
                self.live -= 1

        try:
            yield gone
        finally:
            self.leaving -= 1
            left, self._left = self._left, None
            if left is not None:
                left.set()


def plan_memory(
    *,
    cap: int | None,
    cores: int,
    memory: int | None,
    disk: int | None,
    sandboxes: int,
    files_in_memory: bool,
    disk_name: str = "disk",
    overhead: int = 0,
) -> MemoryPlan:
    """Each sandbox's limits under ``cap`` (the base cgroup's), as the module says.

    ``files_in_memory`` is whether a work dir is a tmpfs of ``disk`` bytes (when this
    process is root); otherwise its files are on the host's disk, page cache the kernel
    may reclaim, and a parked sandbox reserves nothing. ``disk_name`` is what the
    backend's users call ``disk`` (``work_size`` for Docker), for the sentences.
    ``overhead`` is what a parked sandbox holds beside its work dir whatever its commands
    do (a Docker container's runner; nothing for a local sandbox), reserved for each too.
    """
    if cap is None or memory is None:
        said = "not reserved: a sandbox's files and processes may use memory others need"
        if cap is None:
            said = f"{said} (no cap over all sandboxes could be set)"
        else:
            said = f"{said} (memory=None)"
        return MemoryPlan(memory, disk, None, said)
    files = files_in_memory and disk is not None
    parked = sandboxes * (held(disk) + overhead) if files and disk is not None else 0
    running = cores * memory
    half = cap // 2
    if running + parked <= cap:
        running_share, parked_share = running, parked
    elif running <= half:
        running_share, parked_share = running, cap - running
    elif parked <= half:
        running_share, parked_share = cap - parked, parked
    else:
        running_share, parked_share = half, cap - half
    new_memory = min(memory, running_share // cores // _MIB * _MIB)
    new_disk = disk
    if files and disk is not None:
        new_disk = min(disk, _disk_within(parked_share // sandboxes - overhead))
    limit = sandboxes if files else None
    lowered = new_memory < memory or new_disk != disk
    said = (
        f"reserved under a cap of {format_size(cap)} for all sandboxes: {cores} running "
        f"actions (one per core) of {format_size(new_memory)}"
    )
    if files and new_disk is not None:
        said += f" and {sandboxes} live sandboxes' work dirs of {format_size(new_disk)}"
        if overhead:
            said += f" (each plus {format_size(overhead)} for its runner)"
    if lowered:
        said += f" (asked: memory {format_size(memory)}"
        said += f", {disk_name} {format_size(disk)})" if disk is not None else ")"
    problem = None
    if new_memory < MIN_MEMORY or (files and new_disk is not None and new_disk < MIN_DISK):
        problem = (
            f"the memory this trainer may use cannot hold the sandboxes that may be alive at "
            f"once: {said}, under the {format_size(MIN_MEMORY)} an action and "
            f"{format_size(MIN_DISK)} a work dir need at least; lend fewer cores (`cores`), "
            "allow fewer live sandboxes (`sandboxes`), or raise the container's memory limit"
        )
    return MemoryPlan(new_memory, new_disk, limit, said, problem, lowered)
