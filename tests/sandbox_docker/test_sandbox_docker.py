"""The Docker sandbox backend against a real daemon.

With ``CI`` set these never skip: a missing daemon or image is set up with
``.ci/docker.sh`` (idempotent) and a failure to do so fails the tests. Without ``CI`` they
skip on a machine with no Docker. The image is built from the host's own files, with no
registry pull (see ``.ci/docker.sh`` and docs/sandboxes.md).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import tangram
from tangram._sandbox._backend import RunResult
from tangram._sandbox._docker._backend import (
    PARKED_QUOTA_US,
    PERIOD_US,
    DockerBackend,
    DockerConfig,
)
from tangram._sandbox._docker._cgroupfs import CgroupFiles
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import SandboxBrokenError, SandboxError

from .docker_support import (
    CPUSET_FILES,
    IMAGE,
    QUOTA_FILES,
    REPO,
    Setup,
    aiodocker,
    config,
    docker_quota_is,
    eventually,
    inspect,
    open_pool,
    quota_of,
)

pytestmark = pytest.mark.anyio


async def test_grant_applied_during_the_action_and_parked_after(setup: Setup) -> None:
    cores = setup.pool.hosts[0].cores
    async with setup.pool.sandbox("t") as sbx:
        probe = f"cat {QUOTA_FILES} 2>/dev/null; cat {CPUSET_FILES} 2>/dev/null; nproc"
        result = await sbx.run(probe, cpu=len(cores))
        lines = result.stdout.decode().split()
        assert result.ok, result
        assert quota_of(lines[0]) == len(cores) * PERIOD_US
        assert tangram._sandbox._cores.parse_cpu_list(lines[1]) == list(result.cores)
        assert int(lines[-1]) == len(cores)
        result = await sbx.run(probe, cpu=1)
        lines = result.stdout.decode().split()
        assert quota_of(lines[0]) == PERIOD_US and int(lines[-1]) == 1
        handle = sbx._handle
        if handle.fast_path:  # type: ignore[attr-defined]
            assert handle._cgroup.read()[1] == PARKED_QUOTA_US  # type: ignore[attr-defined]
        # Docker's own view catches up with the parked values.
        await eventually(lambda: docker_quota_is(sbx, PARKED_QUOTA_US))


async def test_api_path_applies_grants_too(docker: None) -> None:
    async with (
        open_pool(config=config(fast_path=False)) as setup,
        setup.pool.sandbox("t") as sbx,
    ):
        assert not sbx._handle.fast_path  # type: ignore[attr-defined]
        result = await sbx.run(f"cat {QUOTA_FILES} 2>/dev/null", cpu=1)
        assert quota_of(result.stdout.decode()) == PERIOD_US
        host = (await inspect(sbx))["HostConfig"]
        assert host["CpuQuota"] == PARKED_QUOTA_US


RESIZE_PROBE = r"""
import os, pathlib, time
def quota():
    for path in ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max"):
        try:
            return int(open(path).read().split()[0])
        except OSError:
            pass
seen = [(quota(), len(os.sched_getaffinity(0)))]
pathlib.Path("ready").write_text("")
end = time.monotonic() + 30
while time.monotonic() < end and len(seen) < 3:
    now = (quota(), len(os.sched_getaffinity(0)))
    if now != seen[-1] and now[0] // 100000 == now[1]:
        seen.append(now)
print(seen)
"""


async def test_resize_is_visible_inside_the_running_action(setup: Setup) -> None:
    if len(setup.pool.hosts[0].cores) < 2:
        pytest.skip("needs two cores")
    async with setup.pool.sandbox("a") as a, setup.pool.sandbox("b") as b:
        results: dict[str, RunResult] = {}

        async def elastic() -> None:
            results["a"] = await a.run(
                code=RESIZE_PROBE, cpu=tangram.Elastic(1, 2, resizable=True), timeout=40
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(elastic)
            await eventually(lambda: probe_ready(a))
            results["b"] = await b.run("nproc", cpu=1)
        assert results["b"].stdout == b"1\n"
        assert results["a"].stdout == b"[(200000, 2), (100000, 1), (200000, 2)]\n", results["a"]
        assert set(results["b"].cores).isdisjoint(results["a"].cores[:1])
    assert setup.runtime.stats().resources["cpu"].held == 0


async def probe_ready(sbx: Sandbox) -> bool:
    """Whether the probe in ``sbx`` wrote ``ready`` (looked at from outside the sandbox)."""
    container = sbx._handle.container  # type: ignore[attr-defined]
    try:
        exec_ = await container.exec(["sh", "-c", "test -e /work/ready"], user="65534")
        async with exec_.start(detach=False) as stream:
            while await stream.read_out() is not None:
                pass
        info = await exec_.inspect()
    except Exception:
        return False
    return bool(info.get("ExitCode") == 0)


async def test_state_persists_within_a_trajectory_and_never_leaks(setup: Setup) -> None:
    async with setup.pool.sandbox("one") as one:
        await one.run("echo kept > state.txt")
        assert (await one.run("cat state.txt")).stdout == b"kept\n"
        await one.put("deep/file.bin", b"\x00\xff")
        assert await one.get("deep/file.bin") == b"\x00\xff"
        async with setup.pool.sandbox("two") as two:
            assert (await two.run("cat state.txt")).exit_code != 0
            with pytest.raises(FileNotFoundError):
                await two.get("deep/file.bin")
        first = one._handle.id  # type: ignore[attr-defined]
    client = aiodocker.Docker()
    try:
        with pytest.raises(aiodocker.DockerError):
            await client.containers.get(first)
    finally:
        await client.close()


async def test_hardening_by_default_and_loosened_only_explicitly(docker: None) -> None:
    async with open_pool() as setup, setup.pool.sandbox("t") as sbx:
        host = (await inspect(sbx))["HostConfig"]
        assert host["NetworkMode"] == "none"
        assert host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges"]
        assert host["Memory"] > 0 and host["PidsLimit"] > 0
        result = await sbx.run("id -u; touch /etc/x || echo ro; touch /work/ok && echo rw")
        assert result.stdout == b"65534\nro\nrw\n"
    async with (
        open_pool(config=config(network="bridge", read_only=False, pids=None)) as setup,
        setup.pool.sandbox("t") as sbx,
    ):
        host = (await inspect(sbx))["HostConfig"]
        assert host["NetworkMode"] == "bridge" and host["ReadonlyRootfs"] is False


async def test_hostile_code_is_contained(docker: None) -> None:
    async with open_pool(config=config(memory="128MiB", pids=64), output_limit=1000) as setup:
        async with setup.pool.sandbox("t") as sbx:
            loop = await sbx.run("while :; do :; done", timeout=0.5)
            assert loop.timed_out and loop.exit_code is None and loop.exec_seconds < 5

            bomb = await sbx.run("b() { b | b & }; b; wait", timeout=3)
            assert bomb.exec_seconds < 10

            memory = await sbx.run(
                code="x = []\nwhile True:\n    x.append(bytearray(8 << 20))\n", timeout=20
            )
            assert not memory.ok and not memory.timed_out
            assert memory.signal == 9 or b"MemoryError" in memory.stderr

            flood = await sbx.run("yes", timeout=1)
            assert flood.stdout_truncated and len(flood.stdout) == 1000

            net = await sbx.run(
                code=(
                    "import socket\n"
                    "try:\n"
                    "    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                    "    print('connected')\n"
                    "except OSError as exc:\n"
                    "    print('blocked', exc)\n"
                )
            )
            assert net.stdout.startswith(b"blocked")

            outside = await sbx.run("echo x > /usr/evil || echo refused; echo x > /evil")
            assert outside.stdout == b"refused\n" and outside.exit_code != 0
            assert b"Read-only file system" in outside.stderr

            daemon = (
                "python3 -c 'import os, time\n"
                "if os.fork(): os._exit(0)\n"
                "os.setsid(); time.sleep(301)' &"
            )
            orphans = await sbx.run(f"sleep 300 & {daemon} echo started")
            assert orphans.ok and orphans.leftovers_killed >= 1, orphans
            others = await sbx.run(
                code=(
                    "import os\n"
                    "print([p for p in os.listdir('/proc') if p.isdigit()"
                    " and int(p) not in (1, os.getpid())])\n"
                )
            )
            assert others.stdout == b"[]\n", others

            assert (await sbx.run("echo healthy")).stdout == b"healthy\n"
        assert setup.runtime.stats().resources["cpu"].held == 0
        assert setup.pool.replaced == 0


async def test_container_dying_mid_action_is_replaced(docker: None) -> None:
    async with open_pool(warm=1) as setup:
        async with setup.pool.sandbox("t") as sbx:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:

                    async def doomed() -> None:
                        with pytest.raises(SandboxBrokenError):
                            await sbx.run("touch ready; sleep 300", cpu=1, timeout=120)

                    tg.start_soon(doomed)
                    await eventually(lambda: probe_ready(sbx))
                    await sbx._handle.container.kill()  # type: ignore[attr-defined]
            assert setup.runtime.stats().resources["cpu"].held == 0
            assert setup.pool.replaced == 1
            with pytest.raises(SandboxBrokenError):
                await sbx.run("true")
        async with setup.pool.sandbox("next") as fresh:
            assert (await fresh.run("echo fine")).stdout == b"fine\n"


async def test_several_hosts_form_one_pool(docker: None) -> None:
    socket = "unix:///var/run/docker.sock"
    backend = DockerBackend([socket, socket], config=config())
    async with SandboxPool(backend) as pool:
        capacity = pool.capacity()
        assert set(capacity) == {"cpu@h0", "cpu@h1"}
        async with (
            tangram.Runtime(capacity=capacity),
            pool.sandbox("a") as a,
            pool.sandbox("b") as b,
        ):
            assert {a.host.name, b.host.name} == {"h0", "h1"}
            results = [await a.run("echo a"), await b.run("echo b")]
            assert [r.stdout for r in results] == [b"a\n", b"b\n"]


@contextlib.asynccontextmanager
async def docker_over_tcp() -> AsyncIterator[str]:
    """The local daemon's API on a loopback TCP port, as ``tcp://127.0.0.1:PORT``.

    A remote ``dockerd -H tcp://...`` cannot exist on this one machine; the daemon behind
    the port is the real one, so the pool talks the Engine API over TCP exactly as it
    would to another host (and, the URL not being local, never writes its cgroup files).
    """

    async def pipe(source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteSendStream) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                await sink.send(chunk)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await sink.aclose()

    async def forward(client: anyio.abc.SocketStream) -> None:
        daemon = await anyio.connect_unix("/var/run/docker.sock")
        async with client, daemon, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, daemon)
            tg.start_soon(pipe, daemon, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, forward)
        yield f"tcp://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def test_a_tcp_host_and_the_local_socket_form_one_pool(docker: None) -> None:
    async with docker_over_tcp() as url:
        backend = DockerBackend(["unix:///var/run/docker.sock", url], config=config())
        async with SandboxPool(backend) as pool:
            capacity = pool.capacity()
            assert set(capacity) == {"cpu@h0", "cpu@h1"}
            async with tangram.Runtime(capacity=capacity) as runtime:
                sandboxes = [pool.sandbox(name) for name in ("a", "b")]
                async with sandboxes[0] as a, sandboxes[1] as b:
                    remote = a if a.host.name == "h1" else b
                    assert {a.host.name, b.host.name} == {"h0", "h1"}
                    assert not remote._handle.fast_path  # type: ignore[attr-defined]
                    result = await remote.run(f"cat {QUOTA_FILES} 2>/dev/null; nproc", cpu=1)
                    lines = result.stdout.decode().split()
                    assert result.ok, result
                    assert quota_of(lines[0]) == PERIOD_US and int(lines[-1]) == 1
                    await eventually(lambda: docker_quota_is(remote, PARKED_QUOTA_US))
                assert runtime.stats().resources["cpu@h1"].held == 0


def _cgroup_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_files_are_found_and_written_in_v2_format(tmp_path: Path) -> None:
    """This host mounts cgroup v1, so a v2 host is a file tree laid out as the kernel does.

    The fast path only reads ``/proc/PID/cgroup`` and writes ``cpu.max`` and
    ``cpuset.cpus``: the same reads and writes on a real v2 host.
    """
    scope = "sys/fs/cgroup/system.slice/docker-abc.scope"
    _cgroup_tree(
        tmp_path,
        {
            "proc/42/cgroup": "0::/system.slice/docker-abc.scope\n",
            f"{scope}/cpu.max": "max 100000\n",
            f"{scope}/cpuset.cpus": "\n",
        },
    )
    files = CgroupFiles.find(42, "2", tmp_path)
    assert files is not None
    assert files.quota == tmp_path / scope / "cpu.max"
    files.write("0-1", 2 * PERIOD_US, growing=True)
    assert (tmp_path / scope / "cpu.max").read_text() == f"{2 * PERIOD_US} {PERIOD_US}"
    assert files.read() == ("0-1", 2 * PERIOD_US)
    files.write("3", PARKED_QUOTA_US, growing=False)
    assert files.read() == ("3", PARKED_QUOTA_US)
    assert CgroupFiles.find(43, "2", tmp_path) is None  # no such process


def test_cgroup_v1_files_are_found_through_the_mount_table(tmp_path: Path) -> None:
    _cgroup_tree(
        tmp_path,
        {
            "proc/self/mountinfo": (
                "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                "31 25 0:27 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
                "32 25 0:28 / /proc rw - proc proc rw\n"
            ),
            "proc/42/cgroup": "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpuset/docker/abc/cpuset.cpus": "0-3\n",
        },
    )
    files = CgroupFiles.find(42, "1", tmp_path)
    assert files is not None
    assert files.read() == ("0-3", -1)
    files.write("2", PERIOD_US, growing=False)
    assert files.read() == ("2", PERIOD_US)
    quota = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us"
    assert quota.read_text() == str(PERIOD_US)


def test_image_builds_without_a_registry() -> None:
    # The builder only reads this machine's files; a syntax check keeps it honest offline.
    subprocess.run(
        ["python3", "-m", "py_compile", str(REPO / ".ci" / "sandbox_image.py")], check=True
    )


async def test_docker_view_follows_a_long_action(docker: None) -> None:
    async with (
        open_pool(config=config(sync_after=0.05)) as setup,
        setup.pool.sandbox("t") as sbx,
    ):
        if not sbx._handle.fast_path:  # type: ignore[attr-defined]
            pytest.skip("the daemon's cgroup files are not writable here")
        seen: list[int] = []

        async def watch() -> None:
            with anyio.fail_after(20):
                while not seen or seen[-1] != PERIOD_US:
                    seen.append((await inspect(sbx))["HostConfig"]["CpuQuota"])
                    await anyio.sleep(0.02)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            result = await sbx.run("sleep 1.5", cpu=1)
        assert result.ok and seen[-1] == PERIOD_US
        await eventually(lambda: docker_quota_is(sbx, PARKED_QUOTA_US))


async def test_the_default_backend_is_docker_when_it_is_usable(docker: None) -> None:
    if DockerConfig().image != IMAGE:
        pytest.skip("the default backend looks for the default image")
    async with SandboxPool() as pool, tangram.Runtime(capacity=pool.capacity()):
        assert isinstance(pool.backend, DockerBackend)
        async with pool.sandbox("t") as sbx:
            assert (await sbx.run("echo $TANGRAM_CPUS", cpu=1)).stdout == b"1\n"


async def test_cancelling_an_action_stops_it_and_keeps_the_sandbox_usable(setup: Setup) -> None:
    async with setup.pool.sandbox("t") as sbx:
        with anyio.move_on_after(30):
            async with anyio.create_task_group() as tg:

                async def victim() -> None:
                    await sbx.run("touch ready; sleep 300", timeout=120)

                tg.start_soon(victim)
                await eventually(lambda: probe_ready(sbx))
                tg.cancel_scope.cancel()
        assert setup.runtime.stats().resources["cpu"].held == 0
        # The next action gets its own answer, and nothing of the cancelled one is left.
        result = await sbx.run(
            code=(
                "import os\n"
                "print([p for p in os.listdir('/proc') if p.isdigit()"
                " and int(p) not in (1, os.getpid())])\n"
            )
        )
        assert result.stdout == b"[]\n", result
        assert setup.pool.replaced == 0


async def test_an_image_the_daemon_lacks_fails_the_start_not_each_sandbox(docker: None) -> None:
    """tangram never pulls: a missing image is named where the pool starts (and so where
    an adapter starts it, at worker start), not at every sandbox made from it."""
    backend = DockerBackend(config=DockerConfig(image="tangram-no-such-image:0"))
    with anyio.fail_after(60), pytest.raises(SandboxError, match="has no image 'tangram-no-such"):
        async with SandboxPool(backend):
            pass
