"""The trainer's interpreter, lent read-only to sandboxes whose uid cannot reach it.

A training container running as root keeps its environment where no other user can
(a virtualenv, a pyenv under a 0700 ``/root``). Each sandbox runs as a uid of its own,
and bubblewrap, which runs as that uid, cannot open the path to bind it. So a command's
child, while it is still root, lays a mount namespace of its own over the host's: an
empty root-owned tmpfs (mode 0755) on each directory that blocks the way (``/root``),
and the interpreter's own directories bound back in place from descriptors the pool
opened there. The blocking directory's other contents stay out of sight; bubblewrap
then binds the interpreter's directories read-only as for any other. It takes
``CAP_SYS_ADMIN`` (a new mount namespace), which a root trainer on a VM or bare metal
has and one in an unprivileged container lacks: the pool tries it once at start and
falls back to the system's ``python3``, with its warning, where it fails.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import attrs

from ._isolate import bwrap_command, python_dirs, reachable_by_others
from ._spawner import spawn, submit

__all__ = ["Lend", "default_python", "interpreter", "open_lend", "probe_lend"]

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def default_python(other_user: bool) -> str:
    """This interpreter, unless another user cannot reach it: then the system's (which
    :func:`open_lend` may replace by this one again, once the pool has started)."""
    system = shutil.which("python3", path=_SYSTEM_PATH)
    if not other_user or system is None:
        return sys.executable
    mine = (sys.executable, sys.prefix, sys.base_prefix)
    return sys.executable if all(reachable_by_others(p) for p in mine) else system


@attrs.frozen
class Lend:
    """The tmpfs ``tops`` that hide what blocks the way, and the ``dirs`` bound back."""

    tops: tuple[str, ...]
    dirs: tuple[str, ...]


def _blocking_top(directory: str) -> str | None:
    """The highest strict ancestor of ``directory`` that others cannot search, if any."""
    top = None
    current = os.path.dirname(directory)
    while current != "/":
        if not os.stat(current).st_mode & stat.S_IXOTH:
            top = current
        current = os.path.dirname(current)
    return top


def open_lend(python: str) -> Lend | None:
    """What to lay over the host for ``python``; ``None`` when nothing blocks it, or
    when its own directories deny others (lending the way would not open them)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    tops: list[str] = []
    dirs: list[str] = []
    try:
        for directory in python_dirs(python):
            top = _blocking_top(directory)
            if top is None:
                continue
            if not os.stat(directory).st_mode & stat.S_IXOTH:  # searched, or run
                return None
            tops.append(top)
            dirs.append(directory)
    except OSError:
        return None
    if not dirs:
        return None
    kept = sorted(set(tops))
    outer = tuple(t for t in kept if not any(t.startswith(o + "/") for o in kept if o != t))
    return Lend(outer, tuple(dirs))


def probe_lend(bwrap: str, uid: int, lend: Lend, python: str) -> str | None:
    """Run ``python`` in a sandbox as ``uid`` with ``lend`` laid over the host; None if it
    works, else why not (a root without ``CAP_SYS_ADMIN``: an unprivileged container).

    Started as every command is, by the fork server, with the same set-up."""
    with tempfile.TemporaryDirectory(prefix="tangram-probe-") as work:
        os.chown(work, uid, uid)
        dirs = python_dirs(python)
        argv = bwrap_command(
            bwrap, workdir=work, uid=uid, network=False, extra_ro=dirs, tmp_size=1 << 20
        )
        argv += ["--", python, "-c", "import sys; sys.exit(7)"]
        spec: dict[str, object] = {
            "procs": [],
            "lend": (lend.tops, lend.dirs),
            "owner": (uid, uid),
            "cores": (),
            "limits": [],
        }
        try:
            child = submit(spawn, argv, {"PATH": _SYSTEM_PATH}, "/", [], spec).result()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"it could not be lent: {exc}"
        try:
            child.stdin.close()
            if child.pidfd is not None:
                poll = select.poll()  # not select: the pidfd's number may be past 1024
                poll.register(child.pidfd, select.POLLIN)
                if not poll.poll(60_000):
                    os.kill(child.pid, signal.SIGKILL)
            detail = child.stderr.read().decode(errors="replace").strip()
            code = child.wait()
        finally:
            child.close()
    if code != 7:
        return f"it could not be lent: {detail or f'exit {code}'}"
    return None


def interpreter(
    python: str, fell_back: bool, bwrap: str, uid: int | None, keep: str
) -> tuple[str, Lend | None, list[str], str | None]:
    """The interpreter sandboxes run, what is lent for it, the directories bubblewrap
    binds for it, once bubblewrap works for ``uid`` (``None``: the caller's own), and why
    an interpreter out of reach could not be lent.

    ``fell_back``: ``python`` is the system's because this one was out of reach; this
    one is lent instead where that works. ``keep`` (the sandboxes' root) must stay in
    sight, so nothing above it is hidden.
    """
    if uid is None:
        return python, None, python_dirs(python), None
    wanted = sys.executable if fell_back else python
    lend = open_lend(wanted)
    why = None
    if lend is not None and any(keep == t or keep.startswith(t + "/") for t in lend.tops):
        lend, why = None, f"{wanted} could not be lent: the sandboxes' root {keep} is under it"
    if lend is not None:
        why = probe_lend(bwrap, uid, lend, wanted)
        if why is None:
            return wanted, lend, python_dirs(wanted), None
        why = f"{wanted}: {why}"
    return python, None, [d for d in python_dirs(python) if reachable_by_others(d)], why
