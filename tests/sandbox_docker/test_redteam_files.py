"""Red team: one sandbox filling the host's file table (issue #27, item 8).

Every open file is a ``struct file`` counted against the host's ``fs.file-max``; once the
count reaches it, every ``open`` of a process without ``CAP_SYS_ADMIN`` fails with
``ENFILE``: another trajectory's action raises ``SandboxError``, grading a right answer
``SandboxBrokenError``. Before the fix a container had the daemon's own descriptor limit
(20,000 here) in each of its 256 processes: 5.1M files, twice this host's file-max.

Nothing here fills this machine's table: each attack stops at a fixed count a little over
the limit it probes (a few thousand files, a fraction of a percent of file-max) and the
bound is then checked with arithmetic on the values the backend derived.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

import tangram
from tangram._sandbox._docker import _backend as _docker
from tangram._sandbox._docker._backend import DockerBackend
from tangram._sandbox._docker._engine import SHM_SEGMENTS, HostInfo
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import InvalidSettingError, SettingTypeError

from .docker_support import Setup, config, inspect, open_pool
from .test_sandbox_docker import docker_over_tcp

pytestmark = pytest.mark.anyio

CAP = 4096
"""Descriptors one attacking process stops at: over any limit derived here (<= 1024)."""

# One process opens the same file until the kernel refuses (or CAP is reached): every
# `open` is a new `struct file` in the host's table even when the path is the same.
HOARD = """
import errno, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
before = len(os.listdir('/proc/self/fd')) - 1
open('hoard', 'w').close()
held, refused = [], None
try:
    while len(held) < CAP:
        held.append(os.open('hoard', os.O_RDONLY))
except OSError as exc:
    refused = errno.errorcode[exc.errno]
print(before + len(held), refused, soft, hard)
""".replace("CAP", str(CAP))

# As many processes as the sandbox may fork, each holding all it can, all at once: what
# one sandbox can hold with descriptors. Every loop stops at a fixed count.
SWARM = """
import errno, os, sys
open('hoard', 'w').close()
report_r, report_w = os.pipe()
hold_r, hold_w = os.pipe()
children = 0
for _ in range(PROCS):
    try:
        pid = os.fork()
    except OSError as exc:
        assert exc.errno == errno.EAGAIN, exc  # the pids limit
        break
    if pid == 0:
        os.close(report_r); os.close(hold_w)
        held = 0
        try:
            while held < CAP:
                os.open('hoard', os.O_RDONLY)
                held += 1
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        os.write(report_w, b'%d\\n' % held)
        os.close(report_w)
        os.read(hold_r, 1)  # hold them until the parent has every count
        os._exit(0)
    children += 1
os.close(report_w)
with os.fdopen(report_r) as reports:
    counts = [int(reports.readline()) for _ in range(children)]
os.close(hold_w)
for _ in range(children):
    os.wait()
print(children, sum(counts), max(counts))
""".replace("CAP", str(CAP))

RAISE = """
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
seen = []
for target in (0, 1):  # itself, and the runner its limit came from
    try:
        resource.prlimit(target or os.getpid(), resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
        seen.append('raised')
    except (OSError, ValueError) as exc:
        seen.append(type(exc).__name__)
line = [l for l in open('/proc/self/limits') if l.startswith('Max open files')][0]
print(soft, hard, seen, line.split()[3:5])
"""

# SysV shared memory lives in the container's IPC namespace, not in a process: each
# segment holds a `struct file` while the sandbox is parked, so the table filled with
# live sandboxes, none running (4,096 segments each; 600 parked sandboxes fill it here).
SEGMENTS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
made = sum(libc.shmget(0, 4096, 0o1000 | 0o600) >= 0 for _ in range(COUNT))
print(made)
"""
LISTED = "print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1)"


def file_max_here() -> int:
    return int(Path("/proc/sys/fs/file-max").read_text())


def host_of(sbx: Sandbox) -> HostInfo:
    info: HostInfo = sbx._handle._info  # type: ignore[attr-defined]
    return info


def table_share(info: HostInfo, pids: int) -> int:
    """What every sandbox that may run at once on this daemon can hold, all together."""
    return info.running * (info.open_files * pids + SHM_SEGMENTS)


async def test_one_process_holds_no_more_descriptors_than_the_derived_limit(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        info = host_of(sbx)
        with anyio.fail_after(30):
            result = await sbx.run(code=HOARD, timeout=20)
        held, refused, soft, hard = result.stdout.split()
        assert refused == b"EMFILE" and int(held) < CAP, f"one process held {held} files"
        assert int(held) == int(soft) == int(hard) == info.open_files, result


async def test_a_sandbox_holds_no_more_than_its_share_of_the_host_table(docker: None) -> None:
    pids = 24
    async with open_pool(config=config(pids=pids)) as setup, setup.pool.sandbox("t") as sbx:
        info = host_of(sbx)
        with anyio.fail_after(30):
            result = await sbx.run(code=SWARM.replace("PROCS", str(2 * pids)), timeout=20)
        assert result.ok, result
        children, total, most = map(int, result.stdout.split())
        # The runner, the command and its children are all the pids limit allows.
        assert 0 < children < pids and most < CAP, result
        assert total <= info.open_files * pids, f"{children} processes held {total} files"
        assert info.file_max == file_max_here()
        assert table_share(info, pids) <= info.file_max // 2


async def test_the_limit_is_set_by_docker_and_no_command_can_raise_it(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        limit = host_of(sbx).open_files
        ulimits = (await inspect(sbx))["HostConfig"]["Ulimits"]
        assert {"Name": "nofile", "Soft": limit, "Hard": limit} in ulimits
        assert (await sbx.run("ulimit -n; ulimit -Hn")).stdout == f"{limit}\n{limit}\n".encode()
        result = await sbx.run(code=RAISE)
        assert result.stdout.decode().split("[", 1)[0].split() == [str(limit)] * 2, result
        assert "raised" not in result.stdout.decode(), result
        assert f"['{limit}', '{limit}']" in result.stdout.decode(), result


async def test_shared_memory_segments_do_not_outlive_their_action(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        made = await sbx.run(code=SEGMENTS.replace("COUNT", "64"))
        assert made.stdout == b"64\n", made
        left = await sbx.run(code=LISTED)
        assert left.stdout == b"0\n", f"{left.stdout!r} segments held by a parked sandbox"


async def test_the_bound_counts_every_host_on_one_daemon(docker: None) -> None:
    socket = "unix:///var/run/docker.sock"
    async with docker_over_tcp() as url:
        backend = DockerBackend([socket, url], config=config())
        async with SandboxPool(backend) as pool, tangram.Runtime(capacity=pool.capacity()):
            infos = list(backend._hosts.values())
            cores = sum(len(info.host.cores) for info in infos)
            # One kernel behind both: the TCP host's file-max is probed in a container.
            assert {info.file_max for info in infos} == {infos[0].file_max}
            assert {info.running for info in infos} == {cores}
            assert all(table_share(info, 256) <= info.file_max // 2 for info in infos)
            async with pool.sandbox("a") as a, pool.sandbox("b") as b:
                for sbx in (a, b):
                    limit = host_of(sbx).open_files
                    assert (await sbx.run("ulimit -n")).stdout == f"{limit}\n".encode()


async def test_a_host_table_too_small_for_the_settings_fails_at_start(
    docker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One core lent: half of a 100,000-file table leaves a running sandbox 179 descriptors
    # in each of its 256 processes, under the 256 programs are given at least.
    monkeypatch.setattr(_docker, "file_max_here", lambda: 100_000)
    socket = "unix:///var/run/docker.sock"

    def backend(**changes: object) -> DockerBackend:
        return DockerBackend([socket], config=config(**changes), cores={socket: [0]})

    refused = backend()
    with pytest.raises(InvalidSettingError, match="file-max"):
        async with SandboxPool(refused):
            pass
    assert not refused._hosts  # its clients were closed
    # Asked for explicitly, a limit that fits is kept; one over it is refused.
    fits = (100_000 // 2 - SHM_SEGMENTS) // 256
    async with (
        SandboxPool(backend(open_files=fits)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        assert (await sbx.run("ulimit -n")).stdout == f"{fits}\n".encode()
    with pytest.raises(InvalidSettingError, match="open_files"):
        async with SandboxPool(backend(open_files=fits + 1)):
            pass


async def test_no_pids_limit_is_warned_about(
    docker: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tangram.sandbox.docker"):
        async with open_pool(config=config(pids=None)) as setup, setup.pool.sandbox("t") as sbx:
            limit = host_of(sbx).open_files
            assert (await sbx.run("ulimit -n")).stdout == f"{limit}\n".encode()
    assert "pids=None" in caplog.text


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, InvalidSettingError), (15, InvalidSettingError), ("1024", SettingTypeError)],
)
def test_open_files_is_checked_where_it_is_given(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="open_files"):
        tangram.DockerConfig(open_files=value)  # type: ignore[arg-type]
