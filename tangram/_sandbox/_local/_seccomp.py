"""The system calls a local sandbox's commands may not make, as a seccomp filter for bwrap.

Namespaces and a uid per sandbox leave the kernel's shared state reachable (issue #27):
a command traced the sandbox's own init and forged its exit status, read the trainer's
session keyring and left keys in it for other trajectories, and watched with ``inotify``
which files of the shared, read-only ``/usr`` another sandbox opened. Docker's default
profile denies the same calls; this filter, handed to bubblewrap (``--seccomp FD``),
denies them to every process of a local sandbox, after bubblewrap's own set-up.

The list is a deny list modelled on Docker's default profile, not its allow list: the
calls below either reach state outside the sandbox or need privileges a sandbox never
has, and no program of the tests or benchmarks uses them. Each answers ``EPERM``, as
Docker's do, so programs see a refusal they already handle. Calls from another ABI
(32-bit programs on x86-64) kill the process: the filter would not recognise them.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile
from collections.abc import Mapping

import attrs

__all__ = ["DENIED", "NO_XATTRS", "SyscallFilter", "syscall_filter"]

DENIED: tuple[str, ...] = (
    # Another process's memory and descriptors (the sandbox's init, a judge).
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    # The kernel keyring, shared with the trainer's session and between sandboxes.
    "add_key",
    "request_key",
    "keyctl",
    # Watching file accesses of the shared read-only system directories.
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    # Kernel attack surface a sandbox never needs.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # Mounts and namespaces (bubblewrap has made the sandbox's before the filter).
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    # Files by handle, which bypass the mount namespace's view.
    "name_to_handle_at",
    "open_by_handle_at",
    # The host's clock, kernel, modules, swap, accounting and log.
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "syslog",
    "iopl",
    "ioperm",
    "modify_ldt",
    "lookup_dcookie",
    "vhangup",
    "uselib",
    "ustat",
    "sysfs",
)
"""Calls a sandbox's commands may not make; where this architecture lacks one, it is not
in the filter (``SyscallFilter.numbers`` names those that are)."""

NO_XATTRS: tuple[str, ...] = ("setxattr", "lsetxattr", "fsetxattr", "setxattrat")
"""Refused ``EOPNOTSUPP``, as by a file system without extended attributes: a POSIX ACL on
a tmpfs inode (the work dir, ``/tmp``) is up to 64 KiB of kernel memory that neither the
mount's size nor the sandbox's memory limit counts (1,000 files held 63 MiB)."""


_RWF_NOWAIT = 0x8
_UNIFIED = {"setxattrat": 463}


@attrs.frozen
class SyscallFilter:
    """A compiled filter: the BPF program bubblewrap loads, and the calls it denies."""

    program: bytes
    numbers: Mapping[str, int]

    def pipe(self) -> int:
        """A descriptor to read the program from once (bubblewrap reads to its end).

        A pipe per command: a shared descriptor would share its offset, so the second
        command's bubblewrap would read nothing.
        """
        read, write = os.pipe()
        try:
            os.write(write, self.program)  # a few hundred bytes: under a pipe's buffer
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return read


@functools.cache
def syscall_filter() -> SyscallFilter:
    """The filter for this machine's architecture, built with libseccomp once.

    :raises OSError: libseccomp (``libseccomp.so.2``) is not on this host, or refused
        the filter; the local backend then runs without it and says so.
    """
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as exc:  # no library to load
        raise OSError(errno.ENOENT, f"libseccomp is not usable here ({exc})") from None
    arch = seccomp.system_arch()
    numbers: dict[str, int] = {}
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED:
        number = seccomp.resolve_syscall(arch, name)
        if number < 0:  # not a call of this architecture
            continue
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        numbers[name] = number
    for name in NO_XATTRS:
        # A call newer than this libseccomp (setxattrat, Linux 6.13) by its number: from
        # 424 on, one number on every architecture.
        number = seccomp.resolve_syscall(arch, name)
        if number < 0:
            number = _UNIFIED.get(name, -1)
        if number >= 0:
            rules.add_rule(seccomp.ERRNO(errno.EOPNOTSUPP), number)
            numbers[name] = number
    # ``preadv2`` with RWF_NOWAIT reads only what is cached: one sandbox probed which
    # pages of a shared ``/usr`` file another had read (a channel across time, issue
    # #27's second review). Refused with that flag alone; plain reads keep their timing.
    number = seccomp.resolve_syscall(arch, "preadv2")
    if number >= 0:
        nowait = seccomp.Arg(5, seccomp.MASKED_EQ, _RWF_NOWAIT, _RWF_NOWAIT)
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "preadv2", nowait)
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program:
        raise OSError(errno.EINVAL, "libseccomp exported an empty filter")
    return SyscallFilter(program, numbers)
