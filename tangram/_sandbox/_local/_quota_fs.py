"""A local sandbox's box on the host: a size-capped file system for its work dir, and its end.

``RLIMIT_FSIZE`` caps one file, not their total: six files under it put 5.9 GiB on the
host's disk. So when this process is root each sandbox's box (a directory in the backend's
root) is the mount point of its own tmpfs of ``disk`` bytes, and the work dir is a
directory inside it: a write past the quota fails with ``ENOSPC`` whatever the number of
files, and inodes are capped too (``nr_inodes``), so a flood of empty files is bounded as
well. tmpfs pages are charged to the memory cgroup of the process that writes them, so a
sandbox's files count against its ``memory`` as well: they are RAM. A loop device or a
project quota would keep them on disk, but needs a file system made per sandbox (slow) or
mount options the host's ``/tmp`` rarely has.

Removing a box never recurses in Python: ``shutil.rmtree`` raised ``RecursionError`` on a
tree 20,000 directories deep (``ignore_errors`` does not catch it) and left the work dir
behind. A mounted box goes with one lazy unmount, whatever is in it; an unmounted one with
a walk that holds one directory descriptor at a time, follows no link, stays on the box's
file system and checks each ``..`` on the way up against the directory it came down from,
in this process (no ``rm`` to find, no process to start).

The mount's source names the process that made it, so the next backend to start reaps the
boxes of a process that was killed before it could unmount them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from pathlib import Path

import attrs

from .._budget import inodes_for

__all__ = ["Box", "make_box", "mount_problem", "reap_boxes", "remove_box"]

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_SOURCE = "tangram-sbx-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@attrs.define
class Box:
    """One sandbox's directory on the host; ``work`` inside it is what the sandbox owns."""

    path: Path
    work: Path
    mounted: bool


def mount_problem() -> str | None:
    """Why a tmpfs per sandbox cannot be mounted here, or None when it can (blocking)."""
    if _LIBC is None:
        return "work dir quotas need Linux"
    if os.geteuid() != 0:
        return "a tmpfs per work dir needs tangram to run as root"
    with tempfile.TemporaryDirectory(prefix="tangram-probe-") as where:
        try:
            _mount(Path(where), 1 << 20)
        except OSError as exc:
            return f"cannot mount a tmpfs ({exc.strerror})"
        _unmount(Path(where))
    return None


def make_box(root: Path, disk: int | None, owner: tuple[int, int] | None, *, mount: bool) -> Box:
    """A new box in ``root``: a tmpfs of ``disk`` bytes when ``mount``, its work dir inside.

    The box is root's (0711): a sandbox with its own uid can reach its work dir but not
    rename it, so it cannot leave it where the next sandbox given that uid would find it.
    """
    path = Path(tempfile.mkdtemp(prefix=_SOURCE, dir=root))
    box = Box(path, path / "work", mounted=False)
    try:
        if mount and disk is not None:
            _mount(path, disk)
            box.mounted = True
        path.chmod(0o711)
        box.work.mkdir(mode=0o700)
        if owner is not None:
            os.chown(box.work, *owner)
    except BaseException:
        remove_box(box)
        raise
    return box


def remove_box(box: Box) -> None:
    """Remove the box and everything in it, at any depth (its processes killed first).

    :raises OSError: the tree could not be removed.
    """
    if box.mounted:
        _unmount(box.path)  # lazy: the pages go the moment nothing holds them
        box.mounted = False
        with contextlib.suppress(FileNotFoundError):
            box.path.rmdir()
        return
    try:
        _empty(os.open(box.path, _DIR_FLAGS))
    except FileNotFoundError:
        return
    box.path.rmdir()


def _empty(fd: int) -> None:
    """Empty the directory open at ``fd`` (and close it), at any depth, without recursion."""
    device = os.fstat(fd).st_dev
    above: list[tuple[tuple[int, int], str]] = []  # (identity, name of the one below)
    try:
        while True:
            child = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                below = os.open(child, _DIR_FLAGS, dir_fd=fd)
                if os.fstat(below).st_dev != device:
                    os.close(below)
                    raise OSError(f"{child!r} is another file system: not removed")
                above.append((_identity(fd), child))
                os.close(fd)
                fd = below
                continue
            if not above:
                return
            identity, name = above.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(fd) != identity:
                raise OSError("a directory was moved while it was being removed")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return (info.st_dev, info.st_ino)


def reap_boxes(root: Path) -> None:
    """Unmount and remove the boxes in ``root`` of tangram processes that died (killed)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    real = Path(os.path.realpath(root))
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = right.split()
        if len(fields) < 2 or fields[0] != "tmpfs" or not fields[1].startswith(_SOURCE):
            continue
        pid = fields[1][len(_SOURCE) :]
        point = Path(left.split()[4])
        if not pid.isdigit() or Path(f"/proc/{pid}").exists() or point.parent != real:
            continue
        with contextlib.suppress(OSError):
            remove_box(Box(point, point / "work", mounted=True))


def _mount(path: Path, size: int) -> None:
    assert _LIBC is not None
    inodes = inodes_for(size)  # also what the reservation counts (see .._budget)
    options = f"size={size},nr_inodes={inodes},mode=0711"
    result = _LIBC.mount(
        f"{_SOURCE}{os.getpid()}".encode(),
        os.fsencode(path),
        b"tmpfs",
        ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
        options.encode(),
    )
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))


def _unmount(path: Path) -> None:
    assert _LIBC is not None
    if _LIBC.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))
