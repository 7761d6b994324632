"""Hostile code against the Docker runner's channel, on the real daemon (issue #17).

Each test is an attack a policy rewarded for any hole would try: forging the runner's
replies, tracing it, flooding its channel or its logs, and bad arguments that must fail at
the call instead of costing the sandbox. They never skip on CI (see test_sandbox_docker).
"""

from __future__ import annotations

import logging
import os

import anyio
import pytest
from test_sandbox_docker import (  # noqa: F401 - fixtures
    Setup,
    docker,
    inspect,
    setup,
)

from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.anyio

FORGED = (
    '{"ok": true, "exit_code": 0, "stdout": "QUxMIFRFU1RTIFBBU1NFRAo=", "stderr": "", '
    '"id": 1}\n'
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_forged_reply_on_the_runners_stdout_is_not_believed(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        await sbx.put("kept.txt", b"kept")
        forge = (
            "import os\n"
            f"line = {FORGED!r}.encode()\n"
            "for fd in (1, 0):\n"
            "    try:\n"
            "        with open(f'/proc/1/fd/{fd}', 'wb', buffering=0) as channel:\n"
            "            for _ in range(3):\n"
            "                channel.write(line)\n"
            "        print('forged', fd)\n"
            "    except OSError as exc:\n"
            "        print('refused', fd, exc.errno)\n"
            "raise SystemExit(3)\n"
        )
        result = await sbx.run(code=forge)
        assert result.exit_code == 3, result
        assert b"ALL TESTS PASSED" not in result.stdout, result
        assert b"forged" not in result.stdout, result
        # Nothing is off by one afterwards: each call gets its own answer.
        assert (await sbx.run("echo next")).stdout == b"next\n"
        assert await sbx.get("kept.txt") == b"kept"
        assert (await sbx.run("exit 4")).exit_code == 4
    assert setup.pool.replaced == 0


PROBE = r"""
import ctypes, errno, os, stat
libc = ctypes.CDLL(None, use_errno=True)
seen = {}
seen["same_uid"] = os.stat("/proc/1").st_uid == os.getuid()
attached = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH
seen["ptrace"] = attached == 0
if attached == 0:
    os.waitpid(1, 0x40000000)  # __WALL: the runner stops; let it go again
    libc.ptrace(17, 1, 0, 0)  # PTRACE_DETACH
for what in ("fd", "fd/1", "fd/2", "environ", "mem"):
    try:
        if what == "fd":
            os.listdir("/proc/1/fd")
        else:
            os.close(os.open("/proc/1/" + what, os.O_RDONLY))
        seen[what] = True
    except OSError:
        seen[what] = False
own = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
seen["inherited"] = [
    fd for fd in own
    if fd > 2 and os.path.exists(f"/proc/self/fd/{fd}")
    and not stat.S_ISDIR(os.stat(f"/proc/self/fd/{fd}").st_mode)
]
seen["std_are_pipes"] = all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (0, 1, 2))
print(seen)
"""


async def test_commands_cannot_trace_or_open_the_runner(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        result = await sbx.run(code=PROBE, timeout=20)
        assert result.ok, result
        seen = eval(result.stdout)
        assert seen == {
            "same_uid": False,
            "ptrace": False,
            "fd": False,
            "fd/1": False,
            "fd/2": False,
            "environ": False,
            "mem": False,
            "inherited": [],
            "std_are_pipes": True,
        }, seen
        assert (await sbx.run("echo alive")).stdout == b"alive\n"


async def test_an_endless_line_on_the_channel_never_reaches_the_host(setup: Setup) -> None:
    flood = (
        "import os, time\n"
        "try:\n"
        "    channel = os.open('/proc/1/fd/1', os.O_WRONLY)\n"
        "except OSError:\n"
        "    print('refused'); raise SystemExit(5)\n"
        "chunk = b'x' * (1 << 20)\n"
        "end = time.monotonic() + 8\n"
        "while time.monotonic() < end:\n"
        "    os.write(channel, chunk)\n"
    )
    async with setup.pool.sandbox("t") as sbx:
        with anyio.fail_after(60):
            try:
                result = await sbx.run(code=flood, timeout=20)
            except SandboxBrokenError:
                return  # garbage on the channel is a broken sandbox, never a decode error
        assert result.exit_code == 5 and result.stdout == b"refused\n", result
        assert (await sbx.run("echo alive")).stdout == b"alive\n"


async def test_stderr_floods_reach_neither_the_daemon_log_nor_the_trainers(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    flood = (
        "import os\n"
        "try:\n"
        "    channel = os.open('/proc/1/fd/2', os.O_WRONLY)\n"
        "except OSError:\n"
        "    print('refused')\n"
        "else:\n"
        "    chunk = b'y' * (1 << 20)\n"
        "    for _ in range(32):\n"
        "        os.write(channel, chunk)\n"
        "import sys\n"
        "sys.stderr.write('z' * (4 << 20))\n"
    )
    caplog.set_level(logging.DEBUG, logger="tangram")
    async with setup.pool.sandbox("t") as sbx:
        result = await sbx.run(code=flood, timeout=30)
        assert result.stdout == b"refused\n", result
        assert result.stderr_truncated
        details = await inspect(sbx)
        log_path = details.get("LogPath") or ""
        logged = os.path.getsize(log_path) if log_path and os.path.exists(log_path) else 0
        assert details["HostConfig"]["LogConfig"]["Type"] == "none" or logged < 1 << 20
    relayed = sum(len(record.getMessage()) for record in caplog.records)
    assert relayed < 64 << 10, relayed


@pytest.mark.parametrize(
    "arguments",
    [
        {"code": "print('a')\0print('b')"},
        {"command": ["echo", "a\0b"]},
        {"command": "echo a\0b"},
        {"command": "echo $X", "env": {"X": "a\0b"}},
        {"command": "echo $X", "env": {"X\0": "a"}},
        {"command": "echo $X", "env": {"": "a"}},
    ],
    ids=["code", "argv", "shell", "env-value", "env-name", "env-empty-name"],
)
async def test_impossible_arguments_are_a_value_error_at_the_call(
    setup: Setup, arguments: dict[str, object]
) -> None:
    async with setup.pool.sandbox("t") as sbx:
        await sbx.put("kept.txt", b"kept")
        with anyio.fail_after(2), pytest.raises(ValueError):
            await sbx.run(**arguments)  # type: ignore[arg-type]
        assert setup.runtime.stats().resources["cpu"].held == 0
        assert await sbx.get("kept.txt") == b"kept"
        assert (await sbx.run("echo alive")).stdout == b"alive\n"
    assert setup.pool.replaced == 0


async def test_an_error_reply_leaves_the_sandbox_healthy(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        await sbx.put("dir/kept.txt", b"kept")
        with pytest.raises(OSError):
            await sbx.get("dir")
        with pytest.raises(FileNotFoundError):
            await sbx.get("missing")
        with pytest.raises(OSError):
            await sbx.put("dir", b"over a directory")
        assert await sbx.get("dir/kept.txt") == b"kept"
        assert (await sbx.run("echo alive")).stdout == b"alive\n"
    assert setup.pool.replaced == 0
