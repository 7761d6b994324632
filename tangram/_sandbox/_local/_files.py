"""File moves into and out of a local sandbox's work dir that no symlink can redirect.

The work dir belongs to hostile code: between (or, with a process left running, during)
our calls it can turn any name into a symlink, a FIFO or a device. Resolving a path and
then opening it is a race the sandbox wins (issue #17: root's ``put`` wrote into and
chowned a directory outside, and root's ``get`` read a root-only file). So every step here
goes through a directory file descriptor, one component at a time, with ``O_NOFOLLOW``:
the work dir is opened once when the sandbox is made and every path is walked from that
descriptor, never from a name. ``put`` writes a fresh file under a random name and renames
it over the target, so it never writes through an existing entry; only what it created is
chowned, through its descriptor. ``get`` reads at most ``max_file`` bytes: a sparse file
costs the sandbox no disk but a read of all of it costs the trainer its size in memory (a
1 GiB one took 11.7 s of a worker thread and 2 GiB of peak memory), so the size is checked
on the open descriptor first, and a file that grows while it is read is stopped at the cap.
These are blocking calls: callers run them in a worker
thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator, Sequence

from ...errors import SandboxBrokenError

__all__ = ["WorkDir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 1 << 20


class WorkDir:
    """One sandbox's work dir, held open by descriptor for the sandbox's life.

    :param path: the directory (made by the backend, owned by ``owner`` when given).
    :param owner: ``(uid, gid)`` the sandbox runs as when that differs from ours: what
        ``put`` creates is given to it, and ``get`` reads only what it could read itself.
    :param max_file: the largest file ``read`` returns.
    """

    def __init__(self, path: str, owner: tuple[int, int] | None, max_file: int) -> None:
        self.path = path
        self.owner = owner
        self.max_file = max_file
        self._fd = os.open(path, _DIR_FLAGS)
        self._identity = _identity(os.fstat(self._fd))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def check(self) -> None:
        """Raise :class:`SandboxBrokenError` when the work dir was removed or replaced, and
        give it back its mode (see below) before the next command.

        A work dir silently recreated would hand the next action an empty sandbox that
        looks healthy (issue #17), so a missing one breaks the sandbox instead.
        """
        try:
            alive = os.fstat(self._fd).st_nlink > 0 and (
                _identity(os.stat(self.path, follow_symlinks=False)) == self._identity
            )
        except OSError:
            alive = False
        if not alive:
            raise SandboxBrokenError(f"the work dir {self.path} is gone")
        # A command owns its work dir and may take its own permissions off it (chmod 0):
        # the next command's bubblewrap could not enter it, and the sandbox broke at the
        # sandbox's will (a failed step). Put back before each command.
        with contextlib.suppress(OSError):
            os.fchmod(self._fd, 0o700)

    def write(self, relative: str, data: bytes) -> None:
        """Create or replace the file ``relative`` with ``data``, creating parent dirs.

        :raises PermissionError: a component is a symlink or not a directory, or the
            target is something other than a regular file (a FIFO, a device, a link).
        :raises IsADirectoryError: the target is a directory.
        """
        parts = relative.split("/")
        self.check()
        with self._walk(parts[:-1], create=True) as parent:
            name = parts[-1]
            _refuse_special(parent, name, relative)
            temporary = f".tangram-put-{secrets.token_hex(8)}"
            fd = os.open(
                temporary,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=parent,
            )
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view[:_CHUNK]) :]
                    if self.owner is not None:
                        os.fchown(fd, *self.owner)
                finally:
                    os.close(fd)
                # A rename replaces the entry itself: a symlink put there meanwhile is
                # replaced, never followed.
                os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=parent)
                raise

    def read(self, relative: str) -> bytes:
        """The bytes of the regular file ``relative``.

        :raises FileNotFoundError: there is no such file.
        :raises PermissionError: a component is a symlink, the target is not a regular
            file (a FIFO is refused without opening it for long, so ``get`` cannot hang),
            or the sandbox itself could not read it.
        :raises OSError: (``errno.EFBIG``) the file is larger than ``max_file``: what
            the sandbox wrote, not a fault of the sandbox, so it stays usable.
        """
        parts = relative.split("/")
        self.check()
        with self._walk(parts[:-1], create=False) as parent:
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
            except OSError as exc:
                raise _refusal(exc, relative) from exc
            try:
                info = os.fstat(fd)
                if stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
                if not stat.S_ISREG(info.st_mode):
                    raise PermissionError(f"{relative!r} is not a regular file")
                if self.owner is not None and not _readable_by(info, self.owner):
                    raise PermissionError(f"{relative!r} is not readable by the sandbox")
                self._check_size(info.st_size, relative)
                os.set_blocking(fd, True)
                # One read of the size fstat gave allocates the result once; the loop
                # after it only runs for a file that grew meanwhile, and stops at the cap.
                pieces = [os.read(fd, info.st_size + 1)]
                total = len(pieces[0])
                self._check_size(total, relative)
                while chunk := os.read(fd, min(_CHUNK, self.max_file + 1 - total)):
                    pieces.append(chunk)
                    total += len(chunk)
                    self._check_size(total, relative)
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
            finally:
                os.close(fd)

    def _check_size(self, size: int, relative: str) -> None:
        if size > self.max_file:
            raise OSError(
                errno.EFBIG,
                f"{relative!r} is larger than the backend's max_file ({self.max_file} bytes)",
                relative,
            )

    @contextlib.contextmanager
    def _walk(self, parts: Sequence[str], *, create: bool) -> Iterator[int]:
        """A descriptor of the directory ``parts`` below the work dir, never via a link."""
        current = os.dup(self._fd)
        try:
            for index, part in enumerate(parts):
                created = False
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=current)
                        created = True
                    except FileExistsError:
                        pass
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=current)
                except OSError as exc:
                    raise _refusal(exc, "/".join(parts[: index + 1])) from exc
                os.close(current)
                current = child
                if created and self.owner is not None:
                    # Through the descriptor: whatever the name points to by now, only
                    # the directory just opened (inside the work dir) changes hands.
                    os.fchown(current, *self.owner)
            yield current
        finally:
            os.close(current)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)


def _refuse_special(parent: int, name: str, relative: str) -> None:
    """Refuse to replace what is not a regular file: a FIFO or link the sandbox made."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"{relative!r} exists and is not a regular file")


def _refusal(exc: OSError, relative: str) -> OSError:
    """Name a symlink or a non-directory on the way as what it is: a refusal."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        return PermissionError(f"{relative!r} is a symlink or not a directory: refused")
    return exc


def _readable_by(info: os.stat_result, owner: tuple[int, int]) -> bool:
    uid, gid = owner
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IRUSR)
    if info.st_gid == gid:
        return bool(info.st_mode & stat.S_IRGRP)
    return bool(info.st_mode & stat.S_IROTH)
