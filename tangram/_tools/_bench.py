"""The main job: one real agentic-RL rollout step, run on this machine under three policies.

``tangram demo`` proves the policy on modelled actions; this proves the product on real
work. Each trajectory is a coding agent: a modelled LLM generation gap (the trainer's
GPUs, which this machine lacks, so a wait), then a real action in its own sandbox (write
the solution and run a generated test suite, run a build, or call a rate-limited search
service on loopback), and at the end a reward from a seeded torch model served through
the GPU-service pool on the CPU device, with more reward models than its memory budget
holds so evict-on-execution really evicts.

All arms run the same trajectories (same seed, same files, same tests) on the same
cores, memory budget and rate limit; every figure is a measured wall-clock time:

- ``tangram``: :class:`~tangram.ElasticPolicy` lends cores per action
  (``Elastic(1, cores, resizable=True)``) and the runner inside the sandbox starts one
  job per core it currently sees, so a grant that grows is used at once;
- ``static``: today's frameworks, as ``tangram demo`` models them: each trajectory holds
  a slot of ``cores // trajectories`` cores (at least one) from its first action to its
  last, LLM gaps included, and its rate-limit share; a trajectory that finds no free slot
  waits, and that wait is its first action's queueing;
- ``verl``: what verl does today: each sandbox *call* waits on one plain semaphore (verl's
  ``sandbox_fusion.max_concurrent``, an ``asyncio.Semaphore`` around each call to the
  sandbox) and runs on a fixed ``call_cores`` cores (SandboxFusion runs a call as one
  process; verl has no setting for its cores), so ``cores // call_cores`` permits keep the
  cores busy without oversubscribing them: action-level first-come-first-served at a
  fixed degree of parallelism. Search and reward are as in the tangram arm, so the two
  differ only in how cores are lent.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from .._core._demand import Elastic
from .._core._fcfs import FcfsPolicy
from .._core._policy import ElasticPolicy
from .._runtime._run import Runtime
from .._sandbox._backend import SandboxBackend, backend_class
from .._sandbox._pool import Sandbox, SandboxPool
from ..errors import InvalidCapacityError, SandboxError
from ._bench_workload import (
    RUNNER,
    SOLUTION,
    BenchConfig,
    TrajectoryPlan,
    Turn,
    build_source,
    default_config,
    make_plan,
    suite_source,
)

if TYPE_CHECKING:
    import httpx
    import torch

    from .._gpu._pool import GpuPool
    from .._quota._quota import Quota

__all__ = [
    "MeasuredAction",
    "ArmOutcome",
    "BenchConfig",
    "BenchResult",
    "TrajectoryPlan",
    "Turn",
    "default_config",
    "make_plan",
    "run_bench",
]

SEARCH_BURST = 2.0
"""Requests the search service lets a key save up."""
SEARCH_LATENCY = 0.05
"""Seconds the search service takes per accepted request."""
REWARD_WIDTH = 384
"""Hidden width of the reward models: about 2.4 MB each, restored per eviction."""
SAMPLE_EVERY = 0.1
"""Seconds between samples of the cores in use, for the timeline."""


@attrs.frozen
class MeasuredAction:
    """One measured action. Times are seconds from the arm's start; ``act`` = the parts."""

    trajectory: str
    turn: int
    kind: str
    wanted: float
    queue: float
    overhead: float
    exec: float
    units: int
    max_units: int
    outcome: str

    @property
    def act(self) -> float:
        return self.queue + self.overhead + self.exec


@attrs.frozen
class ArmOutcome:
    """Everything measured in one arm."""

    name: str
    records: tuple[MeasuredAction, ...]
    step_seconds: float
    core_seconds: float
    busy_core_seconds: float
    cpu_seconds: float
    timeline: tuple[tuple[float, float, float], ...]
    rewards: dict[str, float]
    gpu: dict[str, int]
    search: dict[str, int]


@attrs.frozen
class BenchResult:
    config: BenchConfig
    backend: str
    tangram: ArmOutcome
    static: ArmOutcome
    verl: ArmOutcome
    #: the later rounds' (tangram, verl) arms, in the order of the rounds
    later: tuple[tuple[ArmOutcome, ArmOutcome], ...] = ()

    @property
    def arms(self) -> tuple[ArmOutcome, ...]:
        return (self.tangram, self.static, self.verl)

    @property
    def rounds(self) -> tuple[tuple[ArmOutcome, ArmOutcome], ...]:
        """Every round's (tangram, verl) arms, the first round's first."""
        return ((self.tangram, self.verl), *self.later)


ProgressHook = Callable[[str, MeasuredAction | None], None]
"""Called with the arm's name and each finished action (``None`` when the arm starts)."""


def _reward_model(seed: int) -> torch.nn.Module:
    """A small seeded reward head: features of the test history in, one score out."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    widths = (16, REWARD_WIDTH, REWARD_WIDTH, REWARD_WIDTH, REWARD_WIDTH)
    layers: list[torch.nn.Module] = []
    for inputs, outputs in itertools.pairwise(widths):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(REWARD_WIDTH, 1))
    with torch.no_grad():
        for parameter in net.parameters():
            torch.nn.init.normal_(parameter, std=0.05, generator=generator)
    return net


def _reward_memory() -> int:
    """Bytes one reward model holds on its device: its tensors and a quarter for activations."""
    probe = _reward_model(0)
    tensors = (*probe.parameters(), *probe.buffers())
    return int(sum(t.numel() * t.element_size() for t in tensors) * 1.25) + 4096


def _search_quota(name: str, rate: float, burst: float) -> Quota:
    from .._core._resources import Rate
    from ..quota import ApiKey, Quota

    # The same provider key in both arms: the server limits their sum, as a provider would.
    headers = {"Authorization": "Bearer bench"}
    key = ApiKey(name="k", requests=Rate(rate, burst=burst), headers=headers)
    return Quota([key], name=name)


async def _make_backend(config: BenchConfig) -> SandboxBackend:
    """The sandbox backend for one arm, lending the first ``config.cores`` cores."""
    available = sorted(os.sched_getaffinity(0))
    if config.cores > len(available):
        raise InvalidCapacityError(
            f"--cores {config.cores}, but this process may use {len(available)} cores"
        )
    cls = backend_class(config.sandbox)
    if not await cls.usable():
        raise SandboxError(
            f"--sandbox {config.sandbox}: {cls.__name__} cannot start here with its defaults "
            "(`tangram doctor` says why; see docs/sandboxes.md)"
        )
    return cls.lending(available[: config.cores])


class _Arm:
    """One arm's run: its pools, runtime, clock and measurements."""

    def __init__(
        self, name: str, config: BenchConfig, plans: Sequence[TrajectoryPlan], hook: ProgressHook
    ) -> None:
        self.name = name
        self.config = config
        self.plans = plans
        self.hook = hook
        self.static = name == "static"
        self.records: list[MeasuredAction] = []
        self.timeline: list[tuple[float, float, float]] = []
        self.rewards: dict[str, float] = {}
        self.history: dict[str, list[float]] = {}
        self.restore_seconds: dict[str, float] = {}
        self.cpu_seconds = 0.0
        self.reserved = 0
        self.reserved_seconds = 0.0
        self.start = 0.0
        self.python = "python3"
        self.slot = max(1, config.cores // len(plans))
        self.slots = anyio.Semaphore(max(1, config.cores // self.slot))
        self.calls = anyio.Semaphore(max(1, config.cores // config.call_cores))

    async def run(self, backend: SandboxBackend) -> ArmOutcome:
        from .._testing._quota_server import Limit, QuotaServer
        from ..gpu import Device, GpuPool, TorchService

        config = self.config
        memory = await anyio.to_thread.run_sync(_reward_memory)
        log = self.restore_seconds

        class Timed(TorchService):
            """Adds up the seconds spent restoring: the reward actions' overhead."""

            async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
                started = anyio.current_time()
                try:
                    await super().restore(replica, devices)
                finally:
                    log[self.name] = log.get(self.name, 0.0) + anyio.current_time() - started

        services = [
            Timed(
                f"reward-{k}",
                functools.partial(_reward_model, config.seed * 1000 + k),
                memory=memory,
                empty_cache=False,
            )
            for k in range(config.reward_models)
        ]
        # Room for two reward models at once: with three or more in use, each restore of
        # an evicted one evicts the least recently used.
        gpu = GpuPool(services, devices=[Device("cpu:0", 2 * memory + 1024)], links=[])
        limit = Limit(requests=config.search_rate, requests_burst=SEARCH_BURST)
        server = QuotaServer(limit, latency=SEARCH_LATENCY)
        if self.static:
            share = config.search_rate / len(self.plans)
            burst = max(1.0, SEARCH_BURST / len(self.plans))
            quotas = [_search_quota(f"search-{p.name}", share, burst) for p in self.plans]
        else:
            quotas = [_search_quota("search", config.search_rate, SEARCH_BURST)]
        capacity: dict[str, object] = {}
        for quota in quotas:
            capacity.update(quota.capacity())
        policy = ElasticPolicy() if self.name == "tangram" else FcfsPolicy()
        async with (
            server,
            SandboxPool(backend, warm=len(self.plans)) as pool,
            gpu,
            contextlib.AsyncExitStack() as clients,
        ):
            capacity.update(pool.capacity())
            capacity.update(gpu.capacity())
            self.python = pool.backend.python
            https = [
                await clients.enter_async_context(q.client(base_url=server.url)) for q in quotas
            ]
            await pool.wait_warm()
            async with Runtime(capacity, policy=policy) as runtime:
                self.start = anyio.current_time()
                self.hook(self.name, None)
                async with anyio.create_task_group() as group:
                    group.start_soon(self._sample, runtime, group.cancel_scope)
                    async with anyio.create_task_group() as trajectories:
                        for index, plan in enumerate(self.plans):
                            http = https[index if self.static else 0]
                            trajectories.start_soon(self._trajectory, pool, gpu, http, plan)
                    group.cancel_scope.cancel()
                step = anyio.current_time() - self.start
                stats = runtime.stats()
            busy = stats.resources["cpu"].unit_seconds
            gpu_stats = gpu.service_stats()
            # The pool tops its warm set up after each checkout; let those creations end
            # before it closes: closing a Docker pool mid-create can hang or leak one.
            await pool.wait_warm()
        return ArmOutcome(
            name=self.name,
            records=tuple(sorted(self.records, key=lambda r: (r.trajectory, r.turn))),
            step_seconds=step,
            core_seconds=self.reserved_seconds if self.static else busy,
            busy_core_seconds=busy,
            cpu_seconds=self.cpu_seconds,
            timeline=tuple(self.timeline),
            rewards=dict(sorted(self.rewards.items())),
            gpu={
                "restores": sum(int(s["restores"] or 0) for s in gpu_stats.values()),
                "evictions": sum(int(s["evictions"] or 0) for s in gpu_stats.values()),
            },
            search={"accepted": len(server.accepted), "rejected": len(server.rejected)},
        )

    def _now(self) -> float:
        return anyio.current_time() - self.start

    async def _sample(self, runtime: Runtime, scope: anyio.CancelScope) -> None:
        """Sample cores granted to actions and, for static, cores reserved by slots."""
        while not scope.cancel_called:
            held = runtime.stats().resources["cpu"].held
            reserved = self.reserved * self.slot if self.static else held
            self.timeline.append((round(self._now(), 3), held, reserved))
            await anyio.sleep(SAMPLE_EVERY)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """A static arm's per-trajectory reservation; nothing for tangram."""
        if not self.static:
            yield
            return
        async with self.slots:
            self.reserved += 1
            taken = anyio.current_time()
            try:
                yield
            finally:
                self.reserved -= 1
                self.reserved_seconds += (anyio.current_time() - taken) * self.slot

    async def _trajectory(
        self, pool: SandboxPool, gpu: GpuPool, http: httpx.AsyncClient, plan: TrajectoryPlan
    ) -> None:
        self.history[plan.name] = []
        async with pool.sandbox(plan.name) as sbx, contextlib.AsyncExitStack() as slot:
            await sbx.put("runner.py", RUNNER)
            for number, turn in enumerate(plan.turns):
                await anyio.sleep(turn.gap)
                wanted = self._now()
                if number == 0:
                    await slot.enter_async_context(self._slot())
                waited = self._now() - wanted
                record = await self._act(sbx, http, plan, number, turn, wanted, waited)
                self._finish(record)
            await anyio.sleep(plan.reward_gap)
            self._finish(await self._reward(gpu, plan, len(plan.turns)))

    def _finish(self, record: MeasuredAction) -> None:
        self.records.append(record)
        self.hook(self.name, record)

    async def _act(
        self,
        sbx: Sandbox,
        http: httpx.AsyncClient,
        plan: TrajectoryPlan,
        number: int,
        turn: Turn,
        wanted: float,
        waited: float,
    ) -> MeasuredAction:
        """Run one turn's action; ``waited`` is the static arm's wait for its slot.

        The verl arm's wait for its semaphore is queueing too, like the grant's.
        """
        if turn.kind == "search":
            return await self._search(http, plan, number, wanted)
        if turn.kind == "tests":
            await sbx.put("solution.py", SOLUTION.format(end="" if turn.buggy else " + 1"))
            script = f"test_turn{number}.py"
            await sbx.put(script, suite_source(turn))
            argv = [self.python, "runner.py", script, "test_"]
        else:
            script = f"build_turn{number}.py"
            await sbx.put(script, build_source(turn, self.config.seed + number))
            argv = [self.python, "runner.py", script, "job_"]
        if self.name == "verl":
            asked = self._now()
            async with self.calls:
                waited = self._now() - asked
                result = await sbx.run(
                    argv, cpu=self.config.call_cores, kind=turn.kind, timeout=120
                )
        else:
            cpu = self.slot if self.static else Elastic(1, self.config.cores, resizable=True)
            result = await sbx.run(argv, cpu=cpu, kind=turn.kind, timeout=120)
        done = self._now()
        self.cpu_seconds += 0.0 if math.isnan(result.cpu_seconds) else result.cpu_seconds
        passed, _, rest = result.stdout.decode(errors="replace").partition(" passed, ")
        failed = rest.partition(" failed")[0]
        if turn.kind == "tests" and passed.isdigit() and failed.isdigit():
            self.history[plan.name].append(int(passed) / max(1, int(passed) + int(failed)))
        # Queueing is the wait for the grant, plus the wait for a static slot or for the
        # verl arm's semaphore; overhead is what is left of the measured ACT: writing the
        # files, starting the process.
        queue = waited + result.queue_seconds
        overhead = max(0.0, done - wanted - result.exec_seconds - queue)
        return MeasuredAction(
            plan.name,
            number,
            turn.kind,
            wanted,
            queue,
            overhead,
            result.exec_seconds,
            result.units,
            result.max_units,
            f"exit {result.exit_code}" if result.exit_code else "ok",
        )

    async def _search(
        self, http: httpx.AsyncClient, plan: TrajectoryPlan, number: int, wanted: float
    ) -> MeasuredAction:
        sent: list[float] = []

        async def trace(event: str, info: dict[str, Any]) -> None:
            if event.endswith(".send_request_headers.started") and not sent:
                sent.append(self._now())

        response = await http.get(
            "/search", params={"q": f"{plan.name}-{number}"}, extensions={"trace": trace}
        )
        done = self._now()
        first = sent[0] if sent else wanted
        return MeasuredAction(
            plan.name,
            number,
            "search",
            wanted,
            first - wanted,
            0.0,
            done - first,
            0,
            0,
            "ok" if response.status_code == 200 else f"http {response.status_code}",
        )

    async def _reward(self, gpu: GpuPool, plan: TrajectoryPlan, number: int) -> MeasuredAction:
        import torch

        wanted = self._now()
        history = self.history.get(plan.name, [])
        features = torch.zeros(1, 16)
        for i, share in enumerate(history[-16:]):
            features[0, i] = share
        name = f"reward-{plan.reward_model}"
        restored = self.restore_seconds.get(name, 0.0)
        async with gpu.use(name) as service:
            ready = self._now()
            restore = self.restore_seconds.get(name, 0.0) - restored
            score = await service(features)
        done = self._now()
        self.rewards[plan.name] = float(torch.sigmoid(score).reshape(-1)[0])
        # Before `ready`: the wait for device memory (queueing), then the restore of an
        # evicted model (overhead), as the pool measured it.
        overhead = min(ready - wanted, restore)
        return MeasuredAction(
            plan.name,
            number,
            "reward",
            wanted,
            ready - wanted - overhead,
            overhead,
            done - ready,
            0,
            0,
            "ok",
        )


async def _run(config: BenchConfig, hook: ProgressHook) -> BenchResult:
    plans = make_plan(config)
    arms: dict[str, ArmOutcome] = {}
    backend_name = config.sandbox
    for name in ("tangram", "static", "verl"):
        backend = await _make_backend(config)
        arms[name] = await _Arm(name, config, plans, hook).run(backend)
    later: list[tuple[ArmOutcome, ArmOutcome]] = []
    for number in range(2, config.rounds + 1):
        # Which arm goes first alternates, so a drift of the machine's speed over the
        # run (another job starting, the disk cache warming) favours neither.
        order = ("verl", "tangram") if number % 2 == 0 else ("tangram", "verl")
        labelled = functools.partial(_labelled, hook, number)
        pair: dict[str, ArmOutcome] = {}
        for name in order:
            backend = await _make_backend(config)
            pair[name] = await _Arm(name, config, plans, labelled).run(backend)
        later.append((pair["tangram"], pair["verl"]))
    return BenchResult(
        config, backend_name, arms["tangram"], arms["static"], arms["verl"], tuple(later)
    )


def _labelled(hook: ProgressHook, number: int, arm: str, record: MeasuredAction | None) -> None:
    """Progress of a later round's arm, named with its round (``verl 2``)."""
    hook(f"{arm} {number}", record)


def run_bench(config: BenchConfig, hook: ProgressHook | None = None) -> BenchResult:
    """Run the three arms, tangram first, then ``config.rounds - 1`` more rounds of the
    tangram and verl arms, each on fresh pools and runtimes; blocks until done.

    A ``KeyboardInterrupt`` cancels the step; every sandbox, server and model pool is
    closed on the way out (their ``async with`` blocks shield their cleanup).
    """
    return anyio.run(_run, config, hook or (lambda arm, record: None))
