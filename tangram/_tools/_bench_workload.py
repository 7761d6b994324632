"""The work of ``tangram bench``: its size, the seeded agent plan, and the sandbox files.

Kept apart from the arms (:mod:`tangram._tools._bench`) so that what runs in the sandboxes can be
read on its own: the tiny parallel runner, the agent's solution with its early bug, the
generated test suites and build jobs. Pure except for :func:`usable_cores`.
"""

from __future__ import annotations

import os
import random
from typing import Any, Literal

import attrs

from .._core._validate import number as check_number
from .._core._validate import whole
from .._sandbox._backend import BACKENDS, EMBEDDED_BACKEND
from ..errors import InvalidSettingError, SettingTypeError

__all__ = [
    "BUILD_HEADER",
    "BUILD_JOB",
    "RUNNER",
    "SOLUTION",
    "TEST_CASE",
    "TEST_HEADER",
    "BenchConfig",
    "TrajectoryPlan",
    "Turn",
    "build_source",
    "default_config",
    "make_plan",
    "suite_source",
    "usable_cores",
]

# The runner: one forked job at a time per core in its CPU set, re-read before each job
# (as `make -j` with a jobserver would), so the cores of a grant that grows or shrinks
# while it runs are used as they come and go. Jobs are a generated module's functions.
RUNNER = """\
import importlib.util, os, sys
path, prefix = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())
spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pending = sorted(n for n in dir(module) if n.startswith(prefix))
total, running, failed, peak = len(pending), {}, [], 0
while pending or running:
    while pending and len(running) < len(os.sched_getaffinity(0)):
        name = pending.pop(0)
        pid = os.fork()
        if pid == 0:
            try:
                getattr(module, name)()
            except BaseException:
                os._exit(1)
            os._exit(0)
        running[pid] = name
    peak = max(peak, len(running))
    pid, status = os.wait()
    name = running.pop(pid)
    if status:
        failed.append(name)
print(f"{total - len(failed)} passed, {len(failed)} failed, peak {peak} jobs")
sys.exit(1 if failed else 0)
"""

# The agent's solution; the buggy draft stops the sieve one step early, so the square of
# the last prime below sqrt(n) is reported prime whenever it lies below n.
SOLUTION = """\
def primes_below(n):
    sieve = bytearray([1]) * max(n, 2)
    sieve[0] = sieve[1] = 0
    for i in range(2, int(n ** 0.5){end}):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, len(sieve), i)))
    return [i for i in range(n) if sieve[i]]
"""

TEST_HEADER = """\
from solution import primes_below


def _trial_division(n):
    return [m for m in range(2, n) if all(m % d for d in range(2, int(m ** 0.5) + 1))]
"""

TEST_CASE = """

def test_primes_{k}():
    assert primes_below({n}) == _trial_division({n})
"""

BUILD_HEADER = """\
import marshal, os


def _source(seed, count):
    return "\\n".join(
        f"def f{i}(x, y={seed % 7 + 1}):\\n    z = x * {i} + y\\n"
        f"    return [z + j for j in range(y)]\\n"
        for i in range(count)
    )
"""

BUILD_JOB = """

def job_{k}():
    code = compile(_source({seed}, {count}), "mod{k}.py", "exec")
    os.makedirs("build", exist_ok=True)
    with open("build/mod{k}.bin", "wb") as out:
        out.write(marshal.dumps(code))
"""


@attrs.frozen(kw_only=True)
class BenchConfig:
    """Size of the step. :func:`default_config` sizes it to this machine's cores."""

    trajectories: int
    cores: int
    turns: int = 8
    seed: int = 0
    #: a name of the sandbox backend registry (``tangram._sandbox._backend.BACKENDS``).
    sandbox: str = EMBEDDED_BACKEND
    time_scale: float = 1.0
    search_rate: float = 2.0
    reward_models: int = 3
    #: cores each sandbox call runs on in the verl arm: one, as SandboxFusion runs a call
    #: as one process and verl has no setting for it.
    call_cores: int = 1
    #: rounds of the tangram and verl arms (the first with static between them, the
    #: others alternating which goes first); the verl ratios are their median, so one
    #: noisy round on a shared machine does not make the figure.
    rounds: int = 3

    def __attrs_post_init__(self) -> None:
        for name in ("trajectories", "cores", "turns", "call_cores", "rounds"):
            whole(name, getattr(self, name), minimum=1)
        if self.call_cores > self.cores:
            raise InvalidSettingError(
                f"`call_cores` must be <= `cores` (got {self.call_cores} > {self.cores})"
            )
        if isinstance(self.reward_models, bool) or not isinstance(self.reward_models, int):
            raise SettingTypeError(
                f"`reward_models` must be a whole number (got {self.reward_models!r})"
            )
        if self.reward_models < 2:
            raise InvalidSettingError(f"`reward_models` must be >= 2 (got {self.reward_models!r})")
        for name in ("time_scale", "search_rate"):
            check_number(name, getattr(self, name), strict=True)
        if not isinstance(self.sandbox, str) or self.sandbox not in BACKENDS:
            raise InvalidSettingError(
                f"`sandbox` must be one of {list(BACKENDS)} (got {self.sandbox!r})"
            )


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container narrows)."""
    return len(os.sched_getaffinity(0))


def default_config(**changes: Any) -> BenchConfig:
    """The default step: three trajectories per core, so static slots are scarce.

    Three per core is the shape where per-trajectory allocation hurts and where rollout
    frameworks run: more trajectories than cores, each busy about a third of its life.
    """
    cores = int(changes.pop("cores", None) or usable_cores())
    trajectories = int(changes.pop("trajectories", None) or 3 * cores)
    return BenchConfig(trajectories=trajectories, cores=cores, **changes)


@attrs.frozen
class Turn:
    """One agent turn: ``gap`` seconds of modelled generation, then one real action."""

    kind: Literal["tests", "build", "search"]
    gap: float
    jobs: int
    buggy: bool
    sizes: tuple[int, ...]


@attrs.frozen
class TrajectoryPlan:
    name: str
    turns: tuple[Turn, ...]
    reward_model: int
    reward_gap: float


def make_plan(config: BenchConfig) -> list[TrajectoryPlan]:
    """Seeded coding-agent trajectories; every arm runs exactly these.

    Generation gaps are 0.3 s plus an exponential (2 s on average, at most 6 s), so the
    environment is busy about a third of a trajectory's life, the AI-coding shape of the
    paper. Tests turns write the agent's current solution (a buggy draft early on, more
    often fixed later) and run 12-20 real test cases; build turns compile 8-14 generated
    modules; search turns make one request. The last turn always runs the tests, whose
    results the reward model scores.
    """
    scale = config.time_scale
    plans: list[TrajectoryPlan] = []
    for index in range(config.trajectories):
        rng = random.Random(f"{config.seed}:{index}")
        turns: list[Turn] = []
        for number in range(config.turns):
            gap = min(6.0, 0.3 + rng.expovariate(1 / 1.7)) * scale
            roll = rng.random()
            last = number == config.turns - 1
            if last or roll < 0.45:
                jobs = max(2, round(rng.randint(12, 20) * scale))
                sizes = tuple(rng.randint(9000, 12000) for _ in range(jobs))
                buggy = rng.random() < 0.6 * (1 - number / config.turns)
                turns.append(Turn("tests", gap, jobs, buggy, sizes))
            elif roll < 0.8:
                jobs = max(2, round(rng.randint(8, 14) * scale))
                sizes = tuple(rng.randint(200, 300) for _ in range(jobs))
                turns.append(Turn("build", gap, jobs, False, sizes))
            else:
                turns.append(Turn("search", gap, 0, False, ()))
        reward_gap = (0.2 + rng.random() * 0.5) * scale
        plans.append(
            TrajectoryPlan(f"t{index}", tuple(turns), index % config.reward_models, reward_gap)
        )
    return plans


def suite_source(turn: Turn) -> str:
    cases = (TEST_CASE.format(k=k, n=n) for k, n in enumerate(turn.sizes))
    return TEST_HEADER + "".join(cases)


def build_source(turn: Turn, seed: int) -> str:
    jobs = (BUILD_JOB.format(k=k, seed=seed + k, count=c) for k, c in enumerate(turn.sizes))
    return BUILD_HEADER + "".join(jobs)
