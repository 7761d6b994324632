"""Red team: one Docker sandbox's memory costing another's command (a hostile review).

Each container has its own memory limit, but all of a daemon's containers draw on one
host's memory, and a parked sandbox keeps its work dir's files (tmpfs pages no process
owns, which no OOM kill frees). Nothing bounded their sum: 24 default sandboxes could hold
24 GiB on a 23.5 GiB host, and once the host's memory (or the limit of the cgroup the
daemon puts containers under) was reached, the kernel killed the process it liked most
among *all* containers: another sample's grading, so a right answer scored 0.

The backend now reserves each daemon's memory (:mod:`tangram._sandbox._budget`): half of
it holds one running action per lent core at ``memory`` and ``sandboxes`` parked work
dirs (bytes and inodes); ``memory`` and ``work_size`` are lowered to fit, and a sandbox
past ``sandboxes`` is refused.

The attack itself runs on a small "host": the daemon's parent cgroup capped at a little
over a GiB (restored after), as in a memory-limited Docker-in-Docker pod, so this machine
keeps its memory. The rest is arithmetic on the settings the backend put in force, and
on containers Docker made with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import tangram
from tangram._core._units import parse_size
from tangram._sandbox._budget import held
from tangram._sandbox._docker import _backend as _docker
from tangram._sandbox._docker._backend import (
    PARKED_RUNNER,
    DockerBackend,
    containers_memory_limit,
)
from tangram._sandbox._docker._reaper import PID
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import InvalidSettingError, SandboxError, SettingTypeError
from tangram.integrations import grade

from .docker_support import config, inspect

pytestmark = pytest.mark.anyio

SOCKET = "unix:///var/run/docker.sock"
MIB = 1 << 20


def _memory_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if fields and fields[0] == "cgroup" and "memory" in fields[2].split(","):
            return Path(left.split()[4])
    return None


def _parent_limit_file() -> Path | None:
    """The limit file of the cgroup this daemon (the cgroupfs driver) makes containers under."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        path: Path | None = Path("/sys/fs/cgroup/docker/memory.max")
    else:
        mount = _memory_mount()
        path = mount / "docker" / "memory.limit_in_bytes" if mount is not None else None
    return path if path is not None and os.access(path, os.W_OK) else None


@contextlib.contextmanager
def small_host(size: int) -> Iterator[None]:
    """Every container of the daemon held to ``size`` bytes together, for the block."""
    path = _parent_limit_file()
    if path is None:
        message = "no writable parent cgroup of the daemon's containers (cgroupfs driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: CI never skips")
        pytest.skip(message)
    before = path.read_text().strip()
    path.write_text(str(size))
    try:
        yield
    finally:
        unlimited = before == "max" or int(before) >= 1 << 62
        path.write_text(("max" if path.name == "memory.max" else "-1") if unlimited else before)


def backend(sandboxes: int = 256, cores: list[int] | None = None, **changes: Any) -> DockerBackend:
    lent = {SOCKET: cores} if cores is not None else None
    return DockerBackend([SOCKET], config=config(**changes), cores=lent, sandboxes=sandboxes)


@contextlib.asynccontextmanager
async def running(chosen: DockerBackend) -> Any:
    async with (
        SandboxPool(chosen) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        yield pool


async def in_force(sbx: Sandbox) -> tuple[int, int]:
    """The memory limit and the work dir's size Docker made ``sbx``'s container with."""
    host = (await inspect(sbx))["HostConfig"]
    options = dict(option.partition("=")[::2] for option in host["Tmpfs"]["/work"].split(","))
    return int(host["Memory"]), int(options["size"])


async def our_containers(pool: SandboxPool) -> int:
    client = next(iter(pool.backend._hosts.values())).client  # type: ignore[attr-defined]
    mine = f"{PID}={os.getpid()}"
    return len(await client.containers.list(all=True, filters={"label": [mine]}))


# -- the attack ------------------------------------------------------------------------

# What a parked sandbox can keep: the work dir full of data, then of empty files (inodes,
# kernel memory the tmpfs `size` does not count), and the same in /tmp and /dev/shm in
# case they outlive the action. It stays inside its own container's limit (stops 40 MiB
# short), so only what its files cost *others* is at stake.
FILL = r"""
import os
def usage():
    for used, limit in (('memory.usage_in_bytes', 'memory.limit_in_bytes'),
                        ('memory.current', 'memory.max')):
        for base in ('/sys/fs/cgroup/memory', '/sys/fs/cgroup'):
            try:
                return (int(open(f'{base}/{used}').read()),
                        int(open(f'{base}/{limit}').read()))
            except (OSError, ValueError):
                pass
    return 0, 1 << 62
def room():
    used, limit = usage()
    return used < limit - (40 << 20)
made = 0
for where in ('/work', '/tmp', '/dev/shm'):
    os.makedirs(f'{where}/d', exist_ok=True)
    for size in (4 << 20, 64 << 10, 0):
        try:
            while room():
                with open(f'{where}/d/{"x" * 200}{made}', 'wb') as out:
                    out.write(b'\1' * size)
                made += 1
        except OSError:
            pass
print(made, usage()[0] >> 20, flush=True)
"""

# A right answer that needs 150 MiB of its sandbox's memory.
ANSWER = "def f(x):\n    big = b'\\x01' * (150 << 20)\n    return x * 2 + big[0] - 1\n"
TESTS = {"test_list": ["assert f(2) == 4", "assert f(5) == 10"]}
HOST = 1200 * MIB
"""What every container of the daemon may use together, in the attack: 4 attackers with
a 256 MiB work dir full each, and the right answer, do not fit."""


async def test_parked_sandboxes_files_do_not_get_anothers_grading_killed(docker: None) -> None:
    # One core lent: one action at a time. Asked: 1 GiB per action, 256 MiB work dirs,
    # 5 live sandboxes; reserved under half of HOST, each gets its share instead.
    attack = backend(sandboxes=5, cores=[0], memory="1GiB", work_size="256MiB")
    with small_host(HOST):
        async with running(attack) as pool:
            async with pool.sandbox("control") as sbx:
                assert (await grade(sbx, ANSWER, TESTS)).all_passed  # the answer is right
            async with contextlib.AsyncExitStack() as attackers:
                filled = []
                for index in range(4):
                    attacker = await attackers.enter_async_context(pool.sandbox(f"a{index}"))
                    with anyio.fail_after(90):
                        filled.append((await attacker.run(code=FILL, timeout=60)).stdout)
                async with pool.sandbox("victim") as victim:
                    verdict = await grade(victim, ANSWER, TESTS)
                assert verdict.all_passed, (
                    f"other sandboxes' parked files ({filled!r}: files, MiB each) cost a "
                    f"right answer its reward: {verdict}"
                )


# -- the bound -------------------------------------------------------------------------


async def test_what_every_live_sandbox_may_hold_fits_under_the_cap(docker: None) -> None:
    chosen = backend()  # the defaults: 1 GiB per action, 512 MiB work dirs, 256 sandboxes
    async with running(chosen) as pool, pool.sandbox("t") as sbx:
        info = await chosen._hosts["local"].client.system.info()
        ram = int(info["MemTotal"])
        parent = containers_memory_limit(str(info["CgroupDriver"]), str(info["CgroupVersion"]))
        cap = min(ram, parent[0] if parent is not None else ram) // 2
        # Read back from Docker, not from the backend's own books.
        memory, work = await in_force(sbx)
        lent = len(chosen._hosts["local"].host.cores)
        limit = getattr(chosen, "sandboxes", None)
        assert limit is not None, "any number of live sandboxes may hold their files"
        worst = lent * memory + limit * (held(work) + PARKED_RUNNER)
        assert worst <= cap, (
            f"{lent} running actions of {memory >> 20} MiB and {limit} parked sandboxes with "
            f"work dirs of {work >> 20} MiB may hold {worst / 2**30:.1f} GiB, over half "
            f"({cap / 2**30:.1f} GiB) of what the daemon's containers may use"
        )
        # The work dir's own size is what `get` refuses past, and what the runner sees.
        reservation = chosen.reservations["local"]
        assert reservation.config.work_bytes == work
        assert reservation.cap == cap and reservation.running == lent
        mounted = await sbx.run("grep ' /work ' /proc/mounts")
        assert f"size={work // 1024}k".encode() in mounted.stdout, mounted


async def test_hosts_on_one_daemon_share_one_reservation(docker: None) -> None:
    chosen = DockerBackend([SOCKET, SOCKET], config=config(), sandboxes=3)
    async with running(chosen) as pool:
        first, second = chosen.reservations["h0"], chosen.reservations["h1"]
        assert first is second
        assert first.running == sum(len(info.host.cores) for info in chosen._hosts.values())
        async with pool.sandbox("a"), pool.sandbox("b"), pool.sandbox("c"):
            assert first.live == 3  # on either host, counted together
            with pytest.raises(SandboxError, match="sandboxes=3"):
                async with pool.sandbox("d"):
                    pass
        assert first.live == 0


async def test_a_sandbox_past_the_reserved_count_is_refused(docker: None) -> None:
    async with running(backend(sandboxes=2)) as pool:
        async with pool.sandbox("a") as a, pool.sandbox("b") as b:
            before = await our_containers(pool)
            with pytest.raises(SandboxError, match=r"sandboxes=2"):
                async with pool.sandbox("c"):
                    pass
            assert await our_containers(pool) == before  # nothing was made, nothing leaks
            for sbx in (a, b):
                assert (await sbx.run(["echo", "ok"])).stdout == b"ok\n"
        # Each destroyed sandbox gave its place back.
        async with pool.sandbox("d") as d, pool.sandbox("e"):
            assert (await d.run(["echo", "again"])).stdout == b"again\n"


async def test_a_sandbox_asked_for_while_one_is_removed_waits_for_its_place(
    docker: None,
) -> None:
    """At the reserved count, a container being deleted (a broken sandbox's, which the
    pool removes in the background) still holds its place: a sandbox asked for then waits
    for it, where it was refused (a tangram failure in the caller's step)."""
    chosen = backend(sandboxes=2)
    async with running(chosen) as pool:
        host = pool.hosts[0]
        reservation = chosen.reservations[host.name]
        first, second = await chosen.create(host), await chosen.create(host)
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.destroy)
            with anyio.fail_after(30):
                while not reservation.places.leaving:
                    await anyio.lowlevel.checkpoint()
            third = await chosen.create(host)
        assert reservation.live == 2
        for handle in (second, third):
            await handle.destroy()
        assert reservation.live == 0


async def test_a_sandbox_that_fails_to_boot_gives_its_place_back(
    docker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = backend(sandboxes=1)
    async with running(chosen) as pool:

        async def refuse(self: object) -> None:
            raise SandboxError("the runner did not start (a test's failure)")

        with monkeypatch.context() as patch:
            patch.setattr(_docker.DockerHandle, "boot", refuse)
            for _ in range(2):
                with pytest.raises(SandboxError, match="a test's failure"):
                    async with pool.sandbox("broken"):
                        pass
        assert chosen.reservations["local"].live == 0
        async with pool.sandbox("t") as sbx:
            assert (await sbx.run(["echo", "ok"])).stdout == b"ok\n"


def test_sandboxes_is_a_whole_number_of_at_least_one() -> None:
    with pytest.raises(SettingTypeError, match="sandboxes"):
        DockerBackend(config=config(), sandboxes="8")  # type: ignore[arg-type]
    with pytest.raises(InvalidSettingError, match="sandboxes"):
        DockerBackend(config=config(), sandboxes=0)
    chosen = DockerBackend.from_options({"image": config().image, "sandboxes": 8})
    assert chosen.sandboxes == 8


# -- lowering --------------------------------------------------------------------------


def limited_to(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The daemon's containers held to ``size`` bytes together, as the backend reads it."""
    # raising=False: on a backend that reads no such limit, the test fails on what it checks.
    monkeypatch.setattr(
        _docker, "containers_memory_limit", lambda *_: (size, "a test's limit"), raising=False
    )


async def test_memory_and_work_size_are_lowered_to_their_shares_and_said(
    docker: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 GiB for the containers: a 2 GiB cap. One core at 1 GiB fits in its half; 8 work
    # dirs of 512 MiB (576 MiB with inodes) do not, and get what the action leaves.
    limited_to(monkeypatch, 4 << 30)
    chosen = backend(sandboxes=8, cores=[0], memory="1GiB", work_size="512MiB")
    with caplog.at_level(logging.INFO, logger="tangram.sandbox.docker"):
        async with running(chosen) as pool, pool.sandbox("t") as sbx:
            memory, work = await in_force(sbx)
            assert memory == 1 << 30  # fits: kept
            assert work < 512 * MIB
            parked = held(work) + PARKED_RUNNER
            assert 1 * memory + 8 * parked <= 2 << 30
            assert parked > (1 << 30) // 8 - 8192  # the whole rest, shared equally
            reservation = chosen.reservations["local"]
            assert reservation.lowered and reservation.config.work_bytes == work
            # What was asked stays in `config`; the sandbox gets what is in force.
            assert chosen.config.work_size == "512MiB"
            await sbx.put("f", b"x" * (8 * MIB))
            assert len(await sbx.get("f")) == 8 * MIB
    said = [r.getMessage() for r in caplog.records if "reserved under a cap" in r.getMessage()]
    assert said and "asked: memory 1GiB, work_size 512MiB" in said[0], caplog.text
    assert "a test's limit" in said[0]


async def test_the_actions_memory_is_lowered_where_the_cores_do_not_fit(
    docker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 3 GiB cap; 4 GiB of running actions and 4 work dirs of 18 MiB: the actions get
    # what the work dirs leave, split over the cores (4 hosts of one core on one daemon).
    limited_to(monkeypatch, 6 << 30)
    chosen = DockerBackend(
        [SOCKET] * 4,
        config=config(memory="1GiB", work_size="16MiB"),
        cores={SOCKET: [0]},
        sandboxes=4,
    )
    async with running(chosen) as pool, pool.sandbox("t") as sbx:
        memory, work = await in_force(sbx)
        assert work == 16 * MIB
        assert memory < 1 << 30
        assert 4 * memory + 4 * (held(work) + PARKED_RUNNER) <= 3 << 30
        assert (await sbx.run(["echo", "ok"])).stdout == b"ok\n"


async def test_shares_too_small_to_run_anything_fail_at_start(
    docker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited_to(monkeypatch, 512 * MIB)
    refused = backend(sandboxes=10_000)
    with pytest.raises(InvalidSettingError, match="sandboxes"):
        async with SandboxPool(refused):
            pass
    assert not refused._hosts  # its clients were closed


def test_shares_too_small_for_the_containers_own_mounts_are_refused() -> None:
    # 56 MiB per action passes the plan's floor (48 MiB) but cannot hold the runner's
    # reserve beside /work, /tmp and /dev/shm: the config's own check refuses it, at start.
    chosen = DockerBackend(config=config(work_size="16MiB"), sandboxes=1)
    info: Any = SimpleNamespace(running=1, url="a test's daemon")
    total = 2 * (56 * MIB + held(16 * MIB) + PARKED_RUNNER)
    with pytest.raises(InvalidSettingError, match="own files and runner"):
        chosen._reserve(info, total, None)


def test_mounts_lowered_to_fit_the_lowered_memory_are_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 150 MiB per action: the config shrinks its mounts to fit beside the runner, and the
    # smaller work dir still fits the reservation.
    chosen = DockerBackend(config=config(work_size="64MiB"), sandboxes=1)
    info: Any = SimpleNamespace(running=1, url="a test's daemon")
    total = 2 * (150 * MIB + held(64 * MIB) + PARKED_RUNNER)
    with caplog.at_level(logging.INFO, logger="tangram.sandbox.docker"):
        reservation = chosen._reserve(info, total, None)
    assert reservation.config.work_bytes < 64 * MIB
    assert reservation.cap is not None
    memory = int(reservation.config.memory)  # type: ignore[arg-type]
    assert memory + held(reservation.config.work_bytes) + PARKED_RUNNER <= reservation.cap
    assert "own mounts fit" in caplog.text


def test_memory_none_is_not_reserved_and_said(caplog: pytest.LogCaptureFixture) -> None:
    chosen = DockerBackend(config=config(memory=None), sandboxes=1)
    info: Any = SimpleNamespace(running=1, url="a test's daemon")
    with caplog.at_level(logging.WARNING, logger="tangram.sandbox.docker"):
        reservation = chosen._reserve(info, 1 << 30, None)
    assert reservation.limit is None and reservation.cap is None
    assert "not reserved" in caplog.text and "memory=None" in caplog.text


# -- the daemon's containers' cgroup ----------------------------------------------------


def test_the_parent_limit_is_the_tightest_above_the_containers(tmp_path: Path) -> None:
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    (cgroup / "system.slice").mkdir(parents=True)
    (cgroup / "docker").mkdir()
    (cgroup / "memory.max").write_text("max\n")  # the root: none
    (cgroup / "docker" / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "system.slice" / "memory.max").write_text("max\n")
    found = containers_memory_limit("cgroupfs", "2", tmp_path)
    assert found is not None and found[0] == 3 << 30
    assert containers_memory_limit("systemd", "2", tmp_path) is None
    (cgroup / "memory.max").write_text(f"{2 << 30}\n")  # a limit above: the pod's
    assert containers_memory_limit("systemd", "2", tmp_path) == (
        2 << 30,
        f"the limit of {cgroup / 'memory.max'}",
    )
    (cgroup / "docker" / "memory.max").unlink()
    (cgroup / "docker").rmdir()
    assert containers_memory_limit("cgroupfs", "2", tmp_path) is None  # no such parent


def test_a_tighter_parent_limit_sets_the_cap() -> None:
    chosen = DockerBackend(config=config(), sandboxes=4)
    info: Any = SimpleNamespace(running=1, url="a test's daemon")
    loose = chosen._reserve(info, 64 << 30, None)
    tight = chosen._reserve(info, 64 << 30, (8 << 30, "a test's limit"))
    assert loose.cap == 32 << 30 and tight.cap == 4 << 30
    parked = held(tight.config.work_bytes) + PARKED_RUNNER
    assert int(parse_size("1GiB")) + 4 * parked <= 4 << 30
