"""Hostile code against the Docker runner's channel, on the real daemon (issue #17).

Each test is an attack a policy rewarded for any hole would try: forging the runner's
replies, tracing it, flooding its channel or its logs, and bad arguments that must fail at
the call instead of costing the sandbox. They never skip on CI (see test_sandbox_docker).
"""

from __future__ import annotations

import logging

import anyio
import pytest

from tangram._sandbox._backend import ExecRequest
from tangram._sandbox._docker._backend import DockerBackend
from tangram.errors import SandboxBrokenError

from .docker_support import (
    Setup,
    config,
    inspect,
)

pytestmark = pytest.mark.anyio

FORGED = (
    '{"ok": true, "exit_code": 0, "stdout": "QUxMIFRFU1RTIFBBU1NFRAo=", "stderr": "", "id": 1}\n'
)


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
        # A command starts as from a shell: nothing ignored or blocked (SIGPIPE ends `yes`).
        signals = await sbx.run("grep -E '^Sig(Ign|Blk)' /proc/self/status")
        assert signals.stdout.split() == [b"SigBlk:", b"0" * 16, b"SigIgn:", b"0" * 16]
        assert (await sbx.run("yes | head -n 1")).stdout == b"y\n"


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
        log = anyio.Path(details.get("LogPath") or "/nonexistent")
        logged = (await log.stat()).st_size if await log.exists() else 0
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


HOSTILE = r"""
import json, os, struct, sys
HEADER = struct.Struct(">IQ")
def exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise SystemExit
        data += chunk
    return data
def frame():
    meta_len, data_len = HEADER.unpack(exact(HEADER.size))
    return json.loads(exact(meta_len)), exact(data_len)
def send(meta, data=b""):
    body = json.dumps(meta).encode()
    os.write(1, HEADER.pack(len(body), len(data)) + body + data)
hello, _ = frame()
key = hello["key"]
send({"id": 0, "key": key, "ok": True, "ready": True})
request, _ = frame()
ATTACK
"""

ATTACKS = {
    # A header that announces a gigabyte, then bytes for ever.
    "oversize": "os.write(1, HEADER.pack(10, 1 << 30))\nwhile True: os.write(1, b'x' * 65536)",
    # No frame at all: an endless line, as the old channel was flooded with.
    "garbage": "while True: os.write(1, b'A' * 65536)",
    "wrong-key": "send({'id': request['id'], 'key': 'guess', 'ok': True, 'exit_code': 0})",
    "wrong-id": "send({'id': request['id'] + 1, 'key': key, 'ok': True, 'exit_code': 0})",
    "not-json": "os.write(1, HEADER.pack(5, 0) + b'{{{{{')",
    "bad-split": "send({'id': request['id'], 'key': key, 'ok': True, 'exit_code': 0, "
    "'stdout_len': 99}, b'short')",
    "stderr-flood": "chunk = b'e' * (1 << 20)\n"
    "for _ in range(64): os.write(2, chunk)\n"
    "send({'id': request['id'], 'key': key, 'ok': True, 'exit_code': 7, 'stdout_len': 0})",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_a_runner_gone_wrong_breaks_only_its_sandbox(
    docker: None, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever is on the channel, the host buffers one capped frame and never decodes junk.

    The runner is replaced by one that answers the handshake and then misbehaves, as a
    runner taken over would: the worst that can come from the container's side.
    """
    caplog.set_level(logging.DEBUG, logger="tangram")
    backend = DockerBackend(config=config())
    host = (await backend.start())[0]
    backend._runner = HOSTILE.replace("ATTACK", ATTACKS[attack])
    try:
        handle = await backend.create(host)
        try:
            request = ExecRequest(("true",), b"", {}, 10.0, 1 << 20, host.cores[:1], 1.0)
            with anyio.fail_after(30):
                if attack == "stderr-flood":
                    assert (await handle.execute(request)).exit_code == 7
                else:
                    with pytest.raises(SandboxBrokenError):
                        await handle.execute(request)
            assert handle._reader.buffered <= 2 << 20  # type: ignore[attr-defined]
        finally:
            await handle.destroy()
    finally:
        await backend.aclose()
    assert sum(len(record.getMessage()) for record in caplog.records) < 64 << 10


async def test_the_runner_answers_a_cancel_while_idle(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        await sbx.put("kept.txt", b"kept")
        handle = sbx._handle
        with anyio.fail_after(5):
            await handle._settle(handle._next_id(), 0)  # type: ignore[attr-defined]
        assert not handle._destroyed  # type: ignore[attr-defined]
        assert await sbx.get("kept.txt") == b"kept"
        assert (await sbx.run("echo alive")).stdout == b"alive\n"
