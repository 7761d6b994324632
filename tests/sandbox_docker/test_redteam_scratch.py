"""Red team: what an action leaves in its container's memory, and what outlives it.

A container's tmpfs mounts count their pages and their inodes against its memory limit,
and no process owns them: once its command is gone, the runner is the only process left
for the OOM killer. Before these fixes:

- empty files (about 1.2 KiB of kernel memory each, which a mount's ``size=`` does not
  count) in ``/tmp``, ``/work`` or ``/dev/shm`` filled the container's 1 GiB, the kernel
  killed the runner, and the sample's tool call failed the training step
  (``SandboxBrokenError``, which the adapters raise);
- the prepared process of the next action, killed by memory pressure from outside its
  container, came back as the *command's* result (exit 126, tangram's own text as
  stderr): a tangram failure handed to the model as its tool's output;
- POSIX message queues, charged to one host uid shared by every sandbox's commands and
  kept in the container's IPC namespace after the action, let one sandbox make another's
  ``mq_open`` fail for as long as it lived.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
from _xattrs import SET_XATTRS, expected

from tangram._core._units import parse_size
from tangram._sandbox._budget import held
from tangram._sandbox._docker._backend import PARKED_RUNNER
from tangram._sandbox._docker._engine import RUNNER_RESERVE
from tangram.errors import InvalidSettingError, SandboxBrokenError

from .docker_support import config, eventually, inspect, open_pool

pytestmark = pytest.mark.anyio

# Empty files until the container is 30 MB from its limit, then a shell that makes more
# until the kernel says no: whatever bounds them must leave the runner its memory.
FILL = r"""
import os
os.makedirs('DIR/d', exist_ok=True)
limit = int(open('/sys/fs/cgroup/memory/memory.limit_in_bytes').read())
use = lambda: int(open('/sys/fs/cgroup/memory/memory.usage_in_bytes').read())
name = 'x' * 200
i = 0
try:
    while use() < limit - 30_000_000:
        for _ in range(1000):
            open(f'DIR/d/{name}{i}', 'w').close(); i += 1
except OSError as exc:
    print('refused after', i, exc, flush=True)
more = 'OUTPUT n=0; while :; do : > DIR/d/y$n || exit 1; n=$((n+1)); done'
os.execv('/bin/sh', ['sh', '-c', more])
"""
OUTPUT = "head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2;"


@pytest.mark.parametrize("output", [True, False], ids=["with-output", "silent"])
@pytest.mark.parametrize("where", ["/tmp", "/work", "/dev/shm"])
async def test_files_without_bytes_never_leave_the_runner_without_memory(
    docker: None, where: str, output: bool
) -> None:
    code = FILL.replace("DIR", where).replace("OUTPUT", OUTPUT if output else "")
    async with open_pool() as setup:  # the default DockerConfig: memory 1 GiB
        async with setup.pool.sandbox("t") as sbx:
            with anyio.fail_after(120):
                try:
                    result = await sbx.run(code=code, timeout=45)
                except SandboxBrokenError as exc:
                    pytest.fail(f"files in {where} killed the runner during the action: {exc}")
                assert not result.ok, result
                try:
                    alive = await sbx.run("echo alive", timeout=20)
                except SandboxBrokenError as exc:
                    pytest.fail(f"files in {where} killed the runner after the action: {exc}")
                assert alive.stdout == b"alive\n", alive
        assert setup.pool.replaced == 0


# Everything a command can make a cleaner stumble on: a tree deeper than Python's stack
# and than PATH_MAX, directories with no permission, thousands of names (within the
# mounts' 4,096 inodes), a symlink to the work dir's file (which must survive), a FIFO,
# a socket.
LITTER = r"""
import os, socket
for top in ('/tmp', '/dev/shm'):
    os.chdir(top)
    for _ in range(1500):
        os.mkdir('nnnnnnnnnn'); os.chdir('nnnnnnnnnn')
    os.chdir(top)
    os.makedirs('locked/inner'); open('locked/inner/f', 'w').close()
    os.chmod('locked/inner', 0); os.chmod('locked', 0)
    os.mkdir('many')
    for i in range(2000):
        open(f'many/{i}', 'w').close()
    os.symlink('/work/keep', 'link')
    os.mkfifo('fifo')
    socket.socket(socket.AF_UNIX).bind(os.path.join(top, 'sock'))
    open('.hidden', 'w').write('x' * 100000)
open('/work/keep', 'w').write('kept')
print('littered')
"""


async def test_an_actions_scratch_files_go_with_it_and_its_work_dir_stays(docker: None) -> None:
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        with anyio.fail_after(120):
            litter = await sbx.run(code=LITTER, timeout=60)
            assert litter.stdout == b"littered\n", litter
            left = await sbx.run("ls -A /tmp /dev/shm; cat /work/keep")
        assert left.stdout == b"/dev/shm:\n\n/tmp:\nkept", left


async def test_a_prepared_process_killed_from_outside_is_not_the_commands_result(
    docker: None,
) -> None:
    """The next action's prepared process is killed from the host (as the OOM killer
    picks it first under pressure from other containers): the command still runs."""
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        assert (await sbx.run("echo one")).stdout == b"one\n"
        runner = (await inspect(sbx))["State"]["Pid"]

        def spares() -> list[int]:
            found = []
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) != runner:
                    try:
                        parent = entry.joinpath("stat").read_text().rpartition(")")[2].split()[1]
                    except OSError:
                        continue
                    if int(parent) == runner:
                        found.append(int(entry.name))
            return found

        async def prepared() -> bool:
            return bool(spares())

        await eventually(prepared)
        for pid in spares():
            os.kill(pid, signal.SIGKILL)
        result = await sbx.run("echo two")
        assert (result.exit_code, result.stdout, result.stderr) == (0, b"two\n", b"")


MQ = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.mq_open(f'/q{os.getpid()}'.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
print('made' if fd >= 0 else os.strerror(ctypes.get_errno()))
"""


async def test_no_sandbox_can_take_the_message_queues_every_sandbox_shares(docker: None) -> None:
    """Their budget is one host uid's, and a queue outlives the action: none is made."""
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        made = await sbx.run(code=MQ)
    assert made.stdout == b"Too many open files\n", made


def test_the_mounts_and_their_inodes_fit_the_memory_beside_the_runner() -> None:
    for memory in ("1GiB", "256MiB", "128MiB", "96MiB"):
        sizes = config(memory=memory).mounts
        limit = int(parse_size(memory))
        assert sum(held(size) for size in sizes) + RUNNER_RESERVE <= limit, memory
    assert config().mounts == (512 << 20, 64 << 20, 64 << 20)  # as asked where they fit
    assert config(memory=None).mounts == (512 << 20, 64 << 20, 64 << 20)
    with pytest.raises(InvalidSettingError, match="cannot hold a sandbox's files"):
        config(memory="64MiB")


PTY = r"""
import os, pty
try:
    pty.openpty()
    print('opened')
except OSError as exc:
    print('refused', os.path.exists('/dev/ptmx'), os.listdir('/dev/pts'))
"""


async def test_no_sandbox_can_take_the_pseudo_terminals_the_host_shares(docker: None) -> None:
    """`kernel.pty.max` counts every container's terminals and the host's: none is lent."""
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        opened = await sbx.run(code=PTY)
    assert opened.stdout == b"refused False []\n", opened


# Everything an action may leave that outlives its processes, each made until the
# container is 40 MiB from its limit (or the kernel refuses): SysV semaphore arrays and
# message queues (in the IPC namespace, owned by no process), and files in the scratch
# mounts. Parked, a sandbox must then hold no more than its reservation counts.
HOARD = r"""
import ctypes, os
kind = KIND
libc = ctypes.CDLL(None, use_errno=True)
limit = int(open('/sys/fs/cgroup/memory/memory.limit_in_bytes').read())
use = lambda: int(open('/sys/fs/cgroup/memory/memory.usage_in_bytes').read())
class Msg(ctypes.Structure):
    _fields_ = [('mtype', ctypes.c_long), ('mtext', ctypes.c_char * 8000)]
message = Msg(1, b'x' * 8000)
made = 0
while use() < limit - (40 << 20):
    if kind == 'sem':
        ok = libc.semget(0, 32000, 0o1600) >= 0
    elif kind == 'msg':
        queue = libc.msgget(0, 0o1600)
        ok = queue >= 0 and libc.msgsnd(queue, ctypes.byref(message), 8000, 0o4000) == 0
    else:
        try:
            with open(f'{kind}/f{made}', 'wb') as f:
                f.write(b'x' * (1 << 20))
            ok = True
        except OSError:
            ok = False
    if not ok:
        break
    made += 1
print(kind, made, use() >> 20)
"""


def _usage(container: str) -> int:
    for path in (
        f"/sys/fs/cgroup/memory/docker/{container}/memory.usage_in_bytes",
        f"/sys/fs/cgroup/system.slice/docker-{container}.scope/memory.current",
        f"/sys/fs/cgroup/docker/{container}/memory.current",
    ):
        try:
            return int(Path(path).read_text())
        except OSError:
            continue
    raise AssertionError(f"no memory cgroup found for container {container}")


@pytest.mark.parametrize("kind", ["sem", "msg", "/tmp", "/dev/shm"])
async def test_a_parked_sandbox_holds_no_more_than_its_reservation(docker: None, kind: str) -> None:
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        reserved = setup.pool.backend.reservations[sbx.host.name]  # type: ignore[attr-defined]
        with anyio.fail_after(60):
            hoard = await sbx.run(code=HOARD.replace("KIND", repr(kind)), timeout=45)
        held_now = _usage((await inspect(sbx))["Id"])
    assert hoard.stdout.startswith(f"{kind} ".encode()), hoard  # the attack itself ran
    allowed = held(reserved.config.work_bytes) + PARKED_RUNNER
    assert held_now <= allowed, (
        f"parked with an empty /work, the sandbox holds {held_now >> 20} MiB, its "
        f"reservation {allowed >> 20} MiB; the action made {hoard.stdout!r}"
    )


async def test_no_command_can_set_an_extended_attribute(docker: None) -> None:
    """Every setter, by number, on each tmpfs mount: ``EOPNOTSUPP``."""
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        code = SET_XATTRS.replace("WHERE", repr(("/work", "/tmp", "/dev/shm")))
        result = await sbx.run(code=code, timeout=30)
    assert result.stdout == expected("/work", "/tmp", "/dev/shm"), result


@pytest.mark.parametrize("mode", [0o000, 0o100, 0o200, 0o400, 0o500])
async def test_a_command_cannot_lock_the_next_one_out_of_its_work_dir(
    docker: None, mode: int
) -> None:
    """The sandbox's user owns /work and may take its own permissions off it: every later
    command failed to start (exit 126). The mode is put back before each command."""
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        await sbx.put("kept", b"kept")
        assert (await sbx.run(code=f"import os; os.chmod('/work', {mode})")).exit_code == 0
        after = await sbx.run("cat kept")
    assert (after.exit_code, after.stdout) == (0, b"kept"), after
