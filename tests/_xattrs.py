"""Sandboxed code that sets an extended attribute through every setter the kernel has.

A POSIX ACL on a tmpfs inode is up to 64 KiB of kernel memory that neither the mount's
size nor the sandbox's memory limit counts: 1,311 files of a parked Docker work dir held
302 MiB of the host's memory. Both backends refuse every setter, so each line must say
``EOPNOTSUPP`` eight times. Shared by ``test_sandbox_seccomp.py`` and
``sandbox_docker/test_redteam_scratch.py``.
"""

from __future__ import annotations

import errno

# For each directory, each setter (by its number, so a libc without a wrapper is no way
# around it) on a file there, with a valid ACL (owner, group, other); prints the errno.
SET_XATTRS = r"""
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
acl = (2).to_bytes(4, 'little') + b''.join(
    tag.to_bytes(2, 'little') + perm.to_bytes(2, 'little') + (2**32 - 1).to_bytes(4, 'little')
    for tag, perm in ((1, 6), (4, 4), (0x20, 4)))
calls = {'x86_64': (188, 189, 190, 463), 'aarch64': (5, 6, 7, 463)}[platform.machine()]
for where in WHERE:
    path = os.path.join(where, 'xattr-probe').encode()
    open(path, 'w').close()
    fd = os.open(path, os.O_RDONLY)
    seen = []
    for name in (b'system.posix_acl_access', b'user.probe'):
        for number, args in zip(calls, (
            (path, name, acl, len(acl), 0),
            (path, name, acl, len(acl), 0),
            (fd, name, acl, len(acl), 0),
            (-100, path, 0, name, None, 0),
        )):
            result = libc.syscall(number, *args)
            seen.append('set' if result == 0 else errno.errorcode[ctypes.get_errno()])
    os.close(fd)
    os.unlink(path)
    print(where, ' '.join(seen))
"""


def expected(*where: str) -> bytes:
    """What :data:`SET_XATTRS` prints where every setter is refused ``EOPNOTSUPP`` (which
    Python names ``ENOTSUP``, the same number on Linux)."""
    refused = errno.errorcode[errno.EOPNOTSUPP]
    return b"".join(f"{w} {' '.join([refused] * 8)}\n".encode() for w in where)
