"""Red-team review of the local backend and the code reward: attacks not covered elsewhere.

Each test performs an attack as a policy rewarded for any hole would, and asserts the safe
behaviour, so it fails while the hole is open.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _grading import anyio_backend, judge, pool  # noqa: F401 (fixtures)

from tangram._sandbox._pool import SandboxPool
from tangram.errors import SandboxBrokenError

pytestmark = pytest.mark.anyio


WRONG = "def add(a, b):\n    return 0\n"
RIGHT = "def add(a, b):\n    return a + b\n"


# -- the code reward: a wrong answer scoring > 0 -----------------------------------------


@pytest.mark.parametrize(
    "tests",
    [
        pytest.param(
            "if __name__ == '__main__':\n    assert add(2, 3) == 5\n    assert add(-1, 4) == 3\n",
            id="asserts under a main guard",
        ),
        pytest.param(
            "def check(candidate):\n    assert candidate(2, 3) == 5\n\n"
            "if __name__ == '__main__':\n    check(add)\n",
            id="check() called under a main guard",
        ),
    ],
)
async def test_tests_under_a_main_guard_are_run_not_skipped(pool: SandboxPool, tests: str) -> None:
    """Test files often end with ``if __name__ == "__main__":``. Run as a script (what the
    naive reward does) the block runs; the harness runs the tests with ``__name__`` set
    to ``"__tests__"``, so the block is skipped and counted as a passed test."""
    verdict = await judge(pool, WRONG, tests)
    assert verdict.score() == 0.0, verdict
    assert (await judge(pool, RIGHT, tests)).score() == 1.0


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            "def sum(xs):\n    return 0\n",
            "assert sum([1, 2, 3]) == 6\nassert sum([]) == 0\n",
            id="sum",
        ),
        pytest.param(
            "def max(xs):\n    return -1\n",
            "assert max([1, 5, 2]) == 5\n",
            id="max",
        ),
    ],
)
async def test_an_answer_function_named_like_a_builtin_is_the_one_tested(
    pool: SandboxPool, answer: str, tests: str
) -> None:
    """A task whose function shares a builtin's name (``sum``, ``max``, ``sorted``...):
    the harness leaves builtin names out of the answer's proxies, so the tests call the
    real builtin, which is right, and any answer (here a wrong one) scores 1.0. In one
    program the answer's definition would shadow the builtin and score 0."""
    verdict = await judge(pool, answer, tests)
    assert verdict.score() == 0.0, verdict


# -- the code reward: a wrong answer turning its 0 into an infrastructure failure ----------

# The limit of stdout the pool keeps (1 MiB) minus the "started" line (32 hex digits, a
# space, '{"started": true}', a newline): the answer's string fills stdout so that the cut
# falls 40 bytes into the verdict line, after the secret.
_STARTED = 32 + 1 + len('{"started": true}') + 1
_FILL = (1 << 20) - _STARTED - 40


async def test_a_verdict_line_cut_by_the_output_limit_is_not_an_infrastructure_failure(
    pool: SandboxPool,
) -> None:
    """Tests that print a result (common in generated suites) write it to the harness's
    stdout, the verdict's channel. An answer returning a string of the right length puts
    the pool's 1 MiB cut inside the verdict line: the host reads the secret, then broken
    JSON, and raises SandboxBrokenError, which stops the training step."""
    # Ends in a newline, so the verdict starts a line of its own; print's own newline stays
    # in the harness's buffer until it exits, after the verdict.
    answer = f"def add(a, b):\n    return 'x' * {_FILL - 1} + '\\n'\n"
    tests = "r = add(2, 3)\nprint(r)\nassert r == 5\n"
    try:
        verdict = await judge(pool, answer, tests)
    except SandboxBrokenError as exc:
        pytest.fail(f"a wrong answer turned its 0 into an infrastructure failure: {exc}")
    assert verdict.score() == 0.0
    assert (await judge(pool, RIGHT, tests)).score() == 1.0


# The answer's top level caps its judge's memory where it stands (``prlimit`` needs only
# the same uid; being non-dumpable does not stop it), then makes the judge buffer more.
_CAP_THE_JUDGE = (
    "import os, resource\n"
    "for line in open(f'/proc/{os.getppid()}/status'):\n"
    "    if line.startswith('VmSize:'):\n"
    "        cap = int(line.split()[1]) * 1024 + (1 << 20)\n"
    "resource.prlimit(os.getppid(), resource.RLIMIT_AS, (cap, cap))\n"
)
# Call and assertion tests: a long line on the reply pipe before the answer says it is
# ready (its descriptor is the last argument on its command line).
_FLOOD_THE_REPLY = (
    "reply = int(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[-2])\n"
    "for _ in range(64):\n"
    "    os.write(reply, b'x' * (1 << 16))\n" + WRONG
)
# Input/output tests: four MiB of output, under the harness's 8 MiB cap.
_FLOOD_THE_OUTPUT = "import sys\nsys.stdout.write('x' * (4 << 20))\n"


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        pytest.param(
            _CAP_THE_JUDGE + _FLOOD_THE_REPLY,
            "assert add(2, 3) == 5\nassert add(-1, 4) == 3\n",
            id="assert",
        ),
        pytest.param(
            _CAP_THE_JUDGE + _FLOOD_THE_REPLY,
            {"fn_name": "add", "inputs": [[2, 3], [-1, 4]], "outputs": [5, 3]},
            id="call",
        ),
        pytest.param(
            _CAP_THE_JUDGE + _FLOOD_THE_OUTPUT,
            {"inputs": ["2 3\n", "-1 4\n"], "outputs": ["5\n", "3\n"]},
            id="stdio",
        ),
    ],
)
async def test_a_judge_whose_memory_the_answer_capped_is_not_an_infrastructure_failure(
    pool: SandboxPool, answer: str, tests: object
) -> None:
    """``test_a_wrong_answer_cannot_make_grading_an_infrastructure_failure`` (Docker) has
    the answer lower its judge's open files; lowering its address space instead makes the
    harness's next buffer a MemoryError outside every per-test guard (``Answer._start``
    catches only AnswerError, ``_run_stdio`` only OSError): the harness reports its own
    error and the host raises SandboxBrokenError, stopping the training step."""
    try:
        verdict = await judge(pool, answer, tests)
    except SandboxBrokenError as exc:
        pytest.fail(f"a wrong answer turned its 0 into an infrastructure failure: {exc}")
    assert verdict.score() == 0.0


# -- the local backend: a resource flood that kills the trainer ------------------------------

_FILLING_TRAINER = """
import sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend

async def main():
    backend = LocalBackend(root=sys.argv[1], memory="512MiB", disk="256MiB")
    async with (
        tangram.SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with (
            pool.sandbox("t0") as a, pool.sandbox("t1") as b,
            pool.sandbox("t2") as c, pool.sandbox("t3") as d,
        ):
            for sbx in (a, b, c, d):  # each well inside its own memory and disk
                result = await sbx.run("head -c 200M /dev/zero > fill", timeout=30)
                print("filled", result.exit_code, result.signal, flush=True)
            # The trainer goes on with its own work while those trajectories think.
            work = bytearray(96 << 20)
            for i in range(0, len(work), 4096):
                work[i] = 1
            print("trainer alive", flush=True)

anyio.run(main)
"""


def _memory_cgroup_v1() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return where if (where / "memory.limit_in_bytes").exists() else None
    return None


def _trainer_in_a_cgroup(limit: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (given a fresh sandbox root, then ``args``) as a trainer in a memory
    cgroup of ``limit`` bytes of its own: a pod's limit, in practice. The boxes a killed
    trainer left are reaped, and the cgroup removed, however it ends."""
    own = _memory_cgroup_v1()
    if own is None:
        pytest.skip("needs a cgroup v1 memory controller")
    group = own / f"redteam-{os.getpid()}"
    group.mkdir()
    root = tempfile.mkdtemp(prefix="tangram-redteam-", dir="/tmp")
    os.chmod(root, 0o755)
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))

        def enter() -> None:
            with open(group / "cgroup.procs", "w") as handle:
                handle.write("0")

        return subprocess.run(
            [sys.executable, "-c", script, root, *args],
            preexec_fn=enter,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        from tangram._sandbox._local._quota_fs import reap_boxes

        reap_boxes(Path(root))  # the boxes of a killed trainer
        for leftover in sorted(group.rglob("*"), key=lambda p: -len(p.parts)):
            if leftover.is_dir():
                leftover.rmdir()
        group.rmdir()
        os.rmdir(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a memory cgroup for a trainer")
def test_files_left_in_idle_sandboxes_cannot_get_the_trainer_oom_killed() -> None:
    """A trainer in a memory-limited container (768 MiB here, a pod's limit in practice)
    with four live trajectories. Each sandbox's work dir is a tmpfs counted in its own
    cgroup, below the trainer's, so the container's limit holds every sandbox's files as
    well as the trainer. Four policies each write 200 MiB, inside their own 512 MiB memory
    and 256 MiB disk; those pages belong to no process, so killing sandbox processes frees
    nothing, and the next thing the OOM killer can pick is the trainer itself."""
    run = _trainer_in_a_cgroup(768 << 20, _FILLING_TRAINER)
    assert run.returncode == 0 and "trainer alive" in run.stdout, (
        f"the trainer died (status {run.returncode}) of files its sandboxes left: {run.stdout!r}"
    )


async def test_output_past_the_limit_does_not_cost_the_trainer_a_core(pool: SandboxPool) -> None:
    """Only ``output_limit`` bytes of each stream are kept, but the trainer's event loop
    goes on reading (and dropping) whatever the command writes, as fast as it writes it:
    a command copying /dev/zero to stdout and stderr for its whole timeout held about
    three quarters of one of the trainer's cores (3.7 s of CPU in 5 s), every action
    that does so another core of the trainer's one event-loop thread."""
    import resource

    async with pool.sandbox("flood") as sbx:
        before = resource.getrusage(resource.RUSAGE_SELF)
        result = await sbx.run("cat /dev/zero & cat /dev/zero >&2 & wait", timeout=4)
        after = resource.getrusage(resource.RUSAGE_SELF)
    assert result.timed_out and result.stdout_truncated
    spent = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert spent < 0.5, f"the trainer spent {spent:.1f} s of CPU draining discarded output"


# -- the local backend: one sandbox's memory costing another sandbox its command ------------

_SIBLING_TRAINER = r"""
import os, sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend
from tangram.integrations import grade

RIGHT = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 4) == 3\n"
# Each is inside the hog's own 4 GiB and 1 GiB disk, and over the 512 MiB every sandbox
# together may use; the work dir's files stay after the command, the others while it runs.
ATTACKS = {
    "work dir files": "head -c 1000M /dev/zero > fill",
    # Just under the cap, so the hog's own small processes are not what the OOM killer
    # picks: the next process to need memory there is the biggest, the victim's.
    "/tmp files": "head -c 500M /dev/zero > /tmp/fill; sleep 8",
    "/dev/shm files": "head -c 500M /dev/zero > /dev/shm/fill; sleep 8",
    # Many small processes, none bigger than the victim: the OOM killer picks the victim.
    "anonymous memory": (
        "for i in $(seq 100); do { head -c 5M /dev/zero; exec sleep 8; } | tail -c 5M & done;"
        " wait"
    ),
}
VICTIM = "sleep 3; exec python3 -c \"b = b'x' * (24 << 20); print('ok')\""

async def main():
    root, attack, victim = sys.argv[1:4]
    cores = sorted(os.sched_getaffinity(0))[:2]  # two actions at once: hog and victim
    backend = LocalBackend(root=root, cores=cores, memory="4GiB", disk="1GiB")
    async with (
        tangram.SandboxPool(backend) as pool,
        tangram.Runtime(capacity=pool.capacity()),
    ):
        async with pool.sandbox("hog") as hog, pool.sandbox("victim") as other:
            async def run_hog():
                r = await hog.run(ATTACKS[attack], timeout=8)
                print("hog", r.exit_code, r.signal, flush=True)

            async with anyio.create_task_group() as group:
                if victim == "command":  # running when the hog fills memory
                    group.start_soon(run_hog)
                    await anyio.sleep(0.2)
                    r = await other.run(VICTIM, timeout=30)
                    print("victim", r.exit_code, r.signal, r.stdout, flush=True)
                else:  # a grading of another sample, started once the hog has filled
                    group.start_soon(run_hog)
                    await anyio.sleep(3)
                    try:
                        verdict = await grade(other, RIGHT, TESTS, timeout=20)
                        print("verdict", verdict.score(), flush=True)
                    except Exception as exc:
                        print("error", type(exc).__name__, str(exc)[:300], flush=True)

anyio.run(main)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a memory cgroup for a trainer")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="runs two actions at once")
@pytest.mark.parametrize("victim", ["command", "grade"])
@pytest.mark.parametrize(
    "attack", ["work dir files", "/tmp files", "/dev/shm files", "anonymous memory"]
)
def test_one_sandboxs_memory_does_not_get_anothers_command_killed(attack: str, victim: str) -> None:
    """Every sandbox's cgroup sits under one cap (half the trainer's memory, 512 MiB in
    this 1 GiB trainer). Had each sandbox been limited only by its own ``memory`` (4 GiB)
    and ``disk`` (1 GiB), the cap was one pool: a hog filling it with files (its work
    dir's, its action's ``/tmp`` or ``/dev/shm``: pages no process owns) or with many
    small processes got another trajectory's command OOM-killed, or its grading of a right
    answer fail (a SandboxBrokenError stopping the step, or a 0): in GRPO, lowering the
    rewards of the hog's siblings. Each sandbox now has a reservation of the cap."""
    run = _trainer_in_a_cgroup(1 << 30, _SIBLING_TRAINER, attack, victim)
    wanted = "victim 0 None b'ok\\n'" if victim == "command" else "verdict 1.0"
    assert wanted in run.stdout, (
        f"another sandbox's {attack} cost this one its {victim}: {run.stdout!r} "
        f"{run.stderr[-1500:]!r}"
    )


_CANCELLING_TRAINER = r"""
import sys, anyio, tangram
from tangram._sandbox._local._backend import LocalBackend

HOG = "head -c 380M /dev/zero > /tmp/fill; exec sleep 60"
VICTIM = "exec python3 -c \"b = b'x' * (200 << 20); print('ok')\""

async def main():
    # One lent core: one action at a time, which may hold the whole running share.
    backend = LocalBackend(root=sys.argv[1], cores=[0], disk="16MiB", sandboxes=2)
    async with tangram.SandboxPool(backend) as pool, tangram.Runtime(capacity=pool.capacity()):
        async with pool.sandbox("hog") as hog, pool.sandbox("victim") as victim:
            leaf = hog._handle._leaf
            for i in range(600):
                # The trainer gives up on the action (a deadline, a worker gone in shared
                # mode) just as its command starts, at one delay after another.
                with anyio.move_on_after((i % 80) * 0.0002):
                    await hog.run(HOG, timeout=60)
                if leaf.pids():
                    print("left running", i, sorted(leaf.pids()), flush=True)
                    break
            result = await victim.run(VICTIM, timeout=30)
            print("victim", result.exit_code, result.signal, result.stdout, flush=True)

anyio.run(main)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a memory cgroup for a trainer")
def test_a_run_cancelled_as_it_starts_leaves_nothing_running() -> None:
    """A run cancelled between the spawn's submit and its wait left the command running
    with no tree to kill it, and one cancelled as bubblewrap cloned the command left the
    clone (the kill's last scan came before the clone): either ran on after its core was
    lent again, outside every reservation, and got the next command on that core
    OOM-killed (a re-attack of the memory reservation: 4 of 300 cancelled runs)."""
    run = _trainer_in_a_cgroup(1 << 30, _CANCELLING_TRAINER)
    assert "left running" not in run.stdout, run.stdout
    assert "victim 0 None b'ok\\n'" in run.stdout, (run.stdout, run.stderr[-1500:])
