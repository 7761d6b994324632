"""``mode = "shared"`` without Ray: the job's scheduler is a process of its own on the node.

Workers are real processes started as a launcher (torchrun, a shell loop) starts them:
sharing nothing but the config file and the environment. Each reaches the job's scheduler
through the adapters' own session (what verl's tools and OpenRLHF's executor call), and
runs model code in sandboxes of the node's agent: tangram's local backend, for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _probes import PROBE as PROBE_TEMPLATE
from _probes import assert_never_shared, probes

import tangram
from tangram._shared._node import job_key, open_node, socket_path
from tangram.errors import InvalidCapacityError, SchedulerUnavailableError

pytestmark = pytest.mark.timeout(180)

CORES = len(os.sched_getaffinity(0))
PROBE = PROBE_TEMPLATE.format(seconds=0.6)

# One worker of the job: ``calls`` sandbox calls of one core each through the adapters'
# session, then a JSON line with what each call saw and the scheduler process's pid.
WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from tangram._frameworks._session import session

    PROBE = {probe!r}

    async def call(resources, name):
        async with resources.sandbox_pool().sandbox(name) as sbx:
            result = await sbx.run(code=PROBE, cpu=1)
        return result.stdout.decode()

    async def main():
        async with session() as resources:
            info = await resources.scheduler.actor.info.remote()
            print("READY", flush=True)
            outs = await asyncio.gather(
                *(call(resources, f"{{os.getpid()}}-{{i}}") for i in range({calls}))
            )
        print(json.dumps({{"outputs": outs, "pid": info["pid"]}}), flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A job's environment: its own run directory and job name, the docs' sandbox table."""
    config = tmp_path / "tangram.toml"
    config.write_text(
        '[sandbox]\nbackend = "local"\nwarm = 0\ntimeout = 30\n'
        "[ray]\nlease_timeout = 2\nheartbeat = 0.5\n"
    )
    env = dict(os.environ)
    env.update(
        TANGRAM_CONFIG=str(config),
        TANGRAM_RUN_DIR=str(tmp_path / "run"),
        TANGRAM_JOB=f"test-{tmp_path.name}",
    )
    for name in ("TANGRAM_CONFIG", "TANGRAM_RUN_DIR", "TANGRAM_JOB"):
        monkeypatch.setenv(name, env[name])
    return env


def _worker(env: dict[str, str], calls: int) -> subprocess.Popen[str]:
    code = WORKER.format(probe=PROBE, calls=calls)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )


def _scheduler_pids(env: dict[str, str]) -> list[int]:
    """Live processes serving this job's socket (their command line names the module)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"tangram._shared._node" in cmdline and env["TANGRAM_JOB"].encode() in environ:
            pids.append(int(entry.name))
    return pids


def test_four_workers_share_the_nodes_cores_through_one_scheduler_process(
    job: dict[str, str],
) -> None:
    """Four workers, three one-core calls each, on this host: never more cores held than
    it has, no two calls on one core at once, and one scheduler process for all of them.
    Per-process schedulers (``mode = "local"``) would each lend every core."""
    workers = [_worker(job, 3) for _ in range(4)]
    results = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=150)
            assert worker.returncode == 0
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert len({r["pid"] for r in results}) == 1  # racing starts ended with one process
    found = probes([output for result in results for output in result["outputs"]])
    assert len(found) == 12
    assert all(len(cores) == 1 for _, _, cores in found)
    assert_never_shared(found, cores=CORES)
    # Once the workers are gone it ends (IDLE x 2 s), its socket and lock file with it.
    deadline = time.monotonic() + 30
    while _scheduler_pids(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _scheduler_pids(job)
    assert not list(Path(job["TANGRAM_RUN_DIR"]).glob("*.sock"))
    assert not list(Path(job["TANGRAM_RUN_DIR"]).glob("*.lock"))


def test_a_killed_workers_cores_return_when_its_connection_closes(job: dict[str, str]) -> None:
    """SIGKILL mid-call: the kernel closes the worker's socket, and the scheduler gives its
    cores to the next worker without waiting out the lease timeout (10 s here)."""
    Path(job["TANGRAM_CONFIG"]).write_text(
        '[sandbox]\nbackend = "local"\nwarm = 0\n[ray]\nlease_timeout = 10\n'
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import asyncio
                from tangram._frameworks._session import session

                async def main():
                    async with session() as resources:
                        remote = resources.scheduler
                        cores = {k: r.total for k, r in remote.capacity.items()}
                        async with remote.acquire(cores):
                            print("HOLDING", flush=True)
                            await asyncio.sleep(600)

                asyncio.run(main())
                """
            ),
        ],
        env=job,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "HOLDING"
    waiter = _worker(job, 1)
    time.sleep(1.5)
    assert waiter.poll() is None  # waiting: every core is held
    killed = time.time()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    out, _ = waiter.communicate(timeout=60)
    assert waiter.returncode == 0
    started = float(json.loads(out.strip().splitlines()[-1])["outputs"][0].split()[1])
    assert started - killed < 5.0  # a heartbeat's reclaim would come after 9.5 s or more


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_worker_stating_another_capacity_is_refused(job: dict[str, str]) -> None:
    async with open_node(capacity={"conn": 2}, config="c", lease_timeout=2, heartbeat=0.5):
        with pytest.raises(InvalidCapacityError, match="same config"):
            async with open_node(capacity={"conn": 3}, config="c"):
                pass


def test_the_scheduler_process_never_imports_ray(job: dict[str, str]) -> None:
    """The transport is Ray's stand-in: a job without Ray never pays for importing it."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        sys.modules["ray"] = None  # any import of Ray fails
        from tangram._frameworks._session import session

        async def main():
            async with session() as resources:
                async with resources.sandbox_pool().sandbox("t") as sbx:
                    result = await sbx.run(code="print(6 * 7)", cpu=1)
            print(result.stdout.decode().strip())

        asyncio.run(main())
        """
    )
    env = dict(job, TANGRAM_JOB=job["TANGRAM_JOB"] + "-noray")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


def test_jobs_are_named_by_launcher_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TANGRAM_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    session = job_key("a.toml")
    assert job_key("b.toml") != session  # another file: another job's scheduler
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    assert job_key("a.toml") not in {session, job_key("b.toml")}
    monkeypatch.setenv("TANGRAM_JOB", "mine")
    torchrun = job_key("a.toml")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-2")
    assert job_key("a.toml") == torchrun  # $TANGRAM_JOB names it first


def test_a_run_directory_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user able to write there could put a socket of theirs in the scheduler's
    place and answer every worker's calls."""
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(folder))
    with pytest.raises(SchedulerUnavailableError, match="alone"):
        socket_path("k")


def _open_to_others(run: Path) -> Path:
    (path,) = run.glob("*.sock")
    run.chmod(0o755)
    path.chmod(0o777)
    return path


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_another_users_connection_gets_no_answer(
    job: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: another user reaches the socket (its directory opened to them, as a careless
    set-up might) and calls the scheduler. The server checks the peer's uid and closes
    the connection without reading a frame: no pickle of theirs is ever loaded."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    run = Path(tempfile.mkdtemp(prefix="tangram-peer-"))  # pytest's tmp_path is root's alone
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(run))
    async with open_node(capacity={"conn": 1}, config="peer", lease_timeout=2, heartbeat=0.5):
        path = _open_to_others(run)
        probe = textwrap.dedent(
            f"""
            import os, socket, struct, pickle
            os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})
            s = socket.socket(socket.AF_UNIX)
            s.connect({str(path)!r})
            payload = pickle.dumps((1, "scheduler", "counters", ()))
            try:
                s.sendall(struct.pack("!I", len(payload)) + payload)
                s.settimeout(5)
                print("ANSWER" if s.recv(4) else "CLOSED")
            except (BrokenPipeError, ConnectionResetError):
                print("CLOSED")
            """
        )
        out = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
            )
        )
        os.chmod(run, 0o700)
    shutil.rmtree(run, ignore_errors=True)
    assert out.stdout.strip() == "CLOSED", out.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_call_after_the_scheduler_process_is_gone_fails_typed(job: dict[str, str]) -> None:
    """The scheduler process killed under a worker: a waiting acquire and the next one
    raise SchedulerUnavailableError, never hang."""
    async with open_node(capacity={"conn": 1}, config="gone", lease_timeout=2, heartbeat=0.5) as r:
        info = await r.actor.info.remote()
        async with r.acquire(conn=1):
            os.kill(info["pid"], signal.SIGKILL)
            with anyio.fail_after(10), pytest.raises(tangram.errors.SchedulerUnavailableError):
                async with r.acquire(conn=1):
                    pass
        with pytest.raises(tangram.errors.SchedulerUnavailableError):
            async with r.acquire(conn=1):
                pass


def test_socket_paths_fit_a_unix_address(job: dict[str, str]) -> None:
    path = socket_path(job_key("/a/very/long/config/path" * 20))
    assert len(str(path).encode()) < 108
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    path.unlink()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_steps_figures_come_from_the_jobs_scheduler(job: dict[str, str]) -> None:
    """What the adapters hand a trainer's logger each sample, in shared mode: the shared
    scheduler's figures (its node agent's pools are not this process's to read)."""
    from tangram._frameworks._metrics import step_logs
    from tangram._frameworks._session import aclose, session

    try:
        async with session() as resources:
            assert resources.job
            before = await step_logs(resources.scheduler, resources, ("sandbox",))
            async with resources.sandbox_pool().sandbox("steps") as sbx:
                await sbx.run(code="print(1)", cpu=1)
            after = await step_logs(resources.scheduler, resources, ("sandbox",))
    finally:
        await aclose()
    assert set(after) == set(before)  # fixed keys: the frameworks stack the dicts
    assert after["tangram/actions"] >= 1
    assert any(k.startswith("tangram/unit_s/cpu@") and v > 0 for k, v in after.items())


STEP_WORKER = """
import asyncio, json, sys
from tangram._frameworks._metrics import step_logs
from tangram._frameworks._session import aclose, session

async def main():
    loop = asyncio.get_running_loop()
    try:
        async with session() as r:
            await step_logs(r.scheduler, r, ("sandbox",))
            print("READY", flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if line.strip() == "run":
                async with r.sandbox_pool().sandbox("s") as sbx:
                    await sbx.run(code="print(1)", cpu=1)
            print(json.dumps(await step_logs(r.scheduler, r, ("sandbox",))), flush=True)
    finally:
        await aclose()

asyncio.run(main())
"""


def _end(worker: subprocess.Popen[str]) -> None:
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()


def test_the_samples_of_every_worker_add_up_to_what_the_job_did(job: dict[str, str]) -> None:
    """Each worker read the job's scheduler against a baseline of its own, so every
    worker's samples carried every action: two workers, one sandbox action, and the
    samples added up to two (a review). The baseline is now the job's."""
    outs = []
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-c", STEP_WORKER],
                    env=job,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            for _ in range(2)
        ]
        for worker in workers:
            stack.callback(_end, worker)
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "READY"
        for worker, say in zip(workers, ("run", "idle"), strict=True):
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(say + "\n")
            worker.stdin.flush()
            outs.append(json.loads(worker.stdout.readline()))
    assert [out["tangram/actions/sandbox"] for out in outs] == [1, 0]
    exec_s = [out["tangram/exec_s/sandbox"] for out in outs]
    assert exec_s[0] > 0 and exec_s[1] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scheduler_process_that_does_not_answer_fails_the_worker_typed(
    job: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped scheduler process (SIGSTOP: a debugger, a swap storm) still accepts
    connections: a worker reaching it gets SchedulerUnavailableError after the start
    deadline, never waits forever, and never starts a second scheduler beside it."""
    from tangram._shared import _node

    async with open_node(capacity={"conn": 1}, config="stuck", lease_timeout=2, heartbeat=0.5) as r:
        pid = (await r.actor.info.remote())["pid"]
    monkeypatch.setattr(_node, "START_SECONDS", 1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        with anyio.fail_after(20), pytest.raises(SchedulerUnavailableError, match="answer"):
            async with open_node(capacity={"conn": 1}, config="stuck"):
                pass
        assert _scheduler_pids(job) == [pid]
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_waiting_for_the_jobs_lock_can_be_cancelled(job: dict[str, str]) -> None:
    """Another worker holds the job's lock (it is starting the scheduler): a caller with
    a deadline gets it, not a thread stuck in flock until the holder lets go."""
    import fcntl

    key = job_key("held")
    lock = socket_path(key).with_suffix(".lock")
    with open(lock, "w") as held:  # noqa: ASYNC230 - a local file, not waited on
        fcntl.flock(held, fcntl.LOCK_EX)
        began = time.monotonic()
        with anyio.move_on_after(0.5) as scope:
            async with open_node(capacity={"conn": 1}, config="held"):
                pass
        assert scope.cancelled_caught
        assert time.monotonic() - began < 3


def test_one_config_file_is_one_job_however_its_path_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.toml").write_text("")
    assert job_key("t.toml") == job_key(str(tmp_path / "t.toml"))
    assert job_key("./t.toml") == job_key(str(tmp_path / "sub" / ".." / "t.toml"))


def build_judge() -> Any:
    """The judge's factory (a real torch module); each load leaves its pid in a file."""
    import torch

    with open(os.environ["JUDGE_LOADS"], "a") as loads:
        loads.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


JUDGE_WORKER = textwrap.dedent(
    """
    import asyncio, json
    import torch
    from tangram._frameworks._session import session

    async def one(i):
        async with session() as resources, resources.gpu_pool().use("judge") as judge:
            return (await judge(torch.full((1, 4), float(i))))[0].tolist()

    async def main():
        async with session() as resources:
            info = await resources.scheduler.actor.info.remote()
        rows = await asyncio.gather(*(one(i) for i in range(3)))
        print(json.dumps({"rows": rows, "pid": info["pid"]}), flush=True)

    asyncio.run(main())
    """
)


def test_worker_processes_share_one_judge_loaded_in_the_jobs_process(
    job: dict[str, str], tmp_path: Path
) -> None:
    """GPU services once per node without Ray: three worker processes' nine calls run on
    one copy of the judge, loaded by the job's scheduler process (its node agent). The
    device is ``cpu:0`` (no GPU here); the module and its calls are torch's."""
    if os.environ.get("CI"):  # CI has the torch extra: a skip there would hide a failure
        import torch
    else:
        torch = pytest.importorskip("torch")
    loads = tmp_path / "loads.txt"
    Path(job["TANGRAM_CONFIG"]).write_text(
        '[gpu]\ndevices = { "cpu:0" = "1MiB" }\n[[gpu.services]]\nname = "judge"\n'
        'factory = "test_node:build_judge"\n[ray]\nlease_timeout = 2\nheartbeat = 0.5\n'
    )
    here = str(Path(__file__).parent)
    env = dict(job, JUDGE_LOADS=str(loads), PYTHONPATH=os.pathsep.join([here, *sys.path]))
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", JUDGE_WORKER], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    reports = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=150)
            assert worker.returncode == 0
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    for report in reports:
        for i, row in enumerate(report["rows"]):
            assert row == pytest.approx(reference(torch.full((1, 4), float(i)))[0].tolist())
    scheduler = {r["pid"] for r in reports}
    assert len(scheduler) == 1
    assert [int(pid) for pid in loads.read_text().split()] == list(scheduler)


def test_a_scheduler_process_whose_directory_is_removed_still_ends(job: dict[str, str]) -> None:
    """Its run directory removed under it (a /tmp cleaner; a benchmark's temporary one):
    no worker can reach it any more, and it ends as it would have, not never."""
    worker = _worker(job, 0)
    worker.communicate(timeout=120)
    assert worker.returncode == 0
    (pid,) = _scheduler_pids(job)
    shutil.rmtree(job["TANGRAM_RUN_DIR"])
    deadline = time.monotonic() + 30
    while _scheduler_pids(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _scheduler_pids(job), f"scheduler process {pid} outlived its job"
