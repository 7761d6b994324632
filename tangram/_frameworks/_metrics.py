"""The scheduler's and the executors' figures, for Prometheus and for a trainer's per-step log.

Two readers of the same numbers, and no numbers of their own: every figure is read, when
asked for, from :meth:`tangram.Runtime.stats`, the sandbox pools, the GPU pool and the
API quotas, so nothing here counts anything and nothing can drift from what the
scheduler did.

- :class:`Collector` is a prometheus-client custom collector (its documented pattern:
  ``collect()`` yields metric families built on each scrape). Prometheus computes rates
  itself, so it gets running totals.
- :class:`StepMetrics` is for trackers that log one flat dict per training step (verl's
  and OpenRLHF's): it keeps the last totals it handed out, and hands out the change since
  then, so a step's entry says what that step's rollouts did.

The runtime and the pools belong to one event loop and change only on it, while a
Prometheus scrape runs in the HTTP server's thread: the collector reads them on their
loop (``anyio.from_thread``), never from the scrape's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs

from .._core._stats import Stats
from .._runtime._run import Runtime
from .._sandbox._pool import SandboxPool
from ..errors import RuntimeClosedError, SettingTypeError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .._gpu._pool import GpuPool
    from .._quota._keys import KeyStats
    from .._quota._quota import Quota

__all__ = ["Collector", "StepMetrics", "adapter_keys", "is_level", "step_logs"]

PREFIX = "tangram/"
#: Keys of a step's dict that are levels now, not changes since the last step.
_LEVELS = ("held/", "waiting", "running")


@attrs.frozen
class Snapshot:
    """Everything the two readers report, read at one instant on the runtime's loop."""

    stats: Stats
    replaced: Mapping[str, int]
    services: Mapping[str, Mapping[str, float | int | None]]
    devices: Mapping[str, Mapping[str, int | None]]
    keys: Mapping[tuple[str, str], KeyStats]


@attrs.frozen
class Sources:
    """The runtime and the executors whose figures are read, checked once when built."""

    runtime: Any  # a Runtime, or a RemoteRuntime (tangram.ray) for StepMetrics
    sandboxes: tuple[SandboxPool, ...]
    gpu: GpuPool | None
    quotas: tuple[Quota, ...]

    @classmethod
    def of(
        cls,
        runtime: object,
        sandboxes: SandboxPool | Iterable[SandboxPool] | None,
        gpu: GpuPool | None,
        quotas: Quota | Iterable[Quota] | None,
    ) -> Sources:
        if not callable(getattr(runtime, "stats", None)):
            raise SettingTypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")
        pools = _many(
            "sandboxes", "tangram.SandboxPool", sandboxes, lambda p: isinstance(p, SandboxPool)
        )
        if gpu is not None and not callable(getattr(gpu, "service_stats", None)):
            raise SettingTypeError(f"`gpu` must be a tangram.gpu.GpuPool (got {gpu!r})")
        keyed = _many(
            "quotas",
            "tangram.quota.Quota",
            quotas,
            lambda q: callable(getattr(q, "stats", None)) and hasattr(q, "name"),
        )
        return cls(runtime, pools, gpu, keyed)

    def read(self, stats: Stats) -> Snapshot:
        """The executors' figures beside ``stats``; on the runtime's loop (quotas read it)."""
        gpu = self.gpu
        return Snapshot(
            stats=stats,
            replaced={pool.kind: pool.replaced for pool in self.sandboxes},
            services=gpu.service_stats() if gpu is not None else {},
            devices=gpu.usage() if gpu is not None else {},
            keys={(q.name, key): s for q in self.quotas for key, s in q.stats().items()},
        )


def _many(name: str, kind: str, value: Any, accept: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    items = (value,) if accept(value) else tuple(value) if isinstance(value, Iterable) else None
    if items is None or not all(accept(item) for item in items):
        raise SettingTypeError(f"`{name}` must be a {kind} or an iterable of them (got {value!r})")
    return items


# -- the flat totals a step's dict is made of ------------------------------------------------


def totals(snapshot: Snapshot) -> dict[str, float]:
    """Running totals and levels, one flat key each, in seconds, units and counts."""
    out = scheduler_totals(snapshot.stats)
    _grouped(out, "sandbox_replaced", snapshot.replaced)
    _grouped(out, "restores", {n: s["restores"] or 0 for n, s in snapshot.services.items()})
    _grouped(out, "restore_s", {n: s["restore_seconds"] or 0 for n, s in snapshot.services.items()})
    _grouped(out, "limited", {f"{q}/{k}": s.limited for (q, k), s in snapshot.keys.items()})
    return out


def scheduler_totals(stats: Stats) -> dict[str, float]:
    """The part of :func:`totals` the scheduler's stats hold, without the executors'."""
    out: dict[str, float] = {}
    sums = dict.fromkeys(("actions", "queue_s", "overhead_s", "exec_s"), 0.0)
    for kind, k in stats.kinds.items():
        values = {
            "actions": float(k.completed + k.failed + k.cancelled),
            "queue_s": k.queue.total,
            "overhead_s": k.overhead.total,
            "exec_s": k.exec.total,
        }
        for name, value in values.items():
            out[f"{PREFIX}{name}/{kind}"] = value
            sums[name] += value
    out.update({f"{PREFIX}{name}": value for name, value in sums.items()})
    for resource, r in stats.resources.items():
        out[f"{PREFIX}held/{resource}"] = r.held
        out[f"{PREFIX}unit_s/{resource}"] = r.unit_seconds
    out[f"{PREFIX}waiting"] = float(stats.waiting)
    out[f"{PREFIX}running"] = float(stats.running)
    out[f"{PREFIX}resizes"] = float(stats.resizes)
    return out


def _grouped(out: dict[str, float], name: str, values: Mapping[str, float | int]) -> None:
    out[f"{PREFIX}{name}"] = float(sum(values.values()))
    for label, value in values.items():
        out[f"{PREFIX}{name}/{label}"] = float(value)


def is_level(key: str) -> bool:
    """Whether a step's key is a level at the call (units held), not a change since the last."""
    return key[len(PREFIX) :].startswith(_LEVELS)


class StepMetrics:
    """The change in the scheduler's figures since the last call, as one flat dict per step.

    ``await steps.step()`` returns ``{"tangram/queue_s/run_tests": 4.2, ...}``: seconds
    queued, in overhead (a model's restore, a container's update) and executing per
    action kind and over all kinds (``tangram/queue_s``), actions that ended, unit-seconds
    per resource, resizes, sandboxes replaced, GPU restores and their seconds, and API
    responses limited (429/503) per ``quota/key``, each the change since the previous
    call; units held per resource (``tangram/held/cpu``) and the waiting and running
    counts are levels at the call. Hand the dict to the tracker each step, the way
    verl's and OpenRLHF's loggers take theirs; a Prometheus server wants
    :class:`Collector` instead, which reports the totals and leaves the rates to it.

    A key seen once stays in every later dict (at 0 when nothing changed), so a tracker's
    series never vanish; ``keys`` fixes the set instead, for frameworks that stack the
    dicts of many samples and need every one to have the same keys.

    :param runtime: a :class:`tangram.Runtime`, or a ``tangram.ray`` remote runtime.
    :param sandboxes: sandbox pools, labelled by their ``kind``.
    :param gpu: a :class:`tangram.gpu.GpuPool`.
    :param quotas: :class:`tangram.quota.Quota` objects, labelled by their names.
    :param keys: exactly the keys every dict has.
    """

    def __init__(
        self,
        runtime: Runtime | Any,
        *,
        sandboxes: SandboxPool | Iterable[SandboxPool] | None = None,
        gpu: GpuPool | None = None,
        quotas: Quota | Iterable[Quota] | None = None,
        keys: Collection[str] | None = None,
    ) -> None:
        self._sources = Sources.of(runtime, sandboxes, gpu, quotas)
        if keys is not None and (
            isinstance(keys, str)
            or not isinstance(keys, Collection)
            or not all(isinstance(k, str) for k in keys)
        ):
            raise SettingTypeError(f"`keys` must be a collection of strings (got {keys!r})")
        self._keys = tuple(keys) if keys is not None else None
        self._last: dict[str, float] = {}
        self._seen: dict[str, None] = {}
        self._lock: anyio.Lock | None = None

    def __repr__(self) -> str:
        return f"<tangram.metrics.StepMetrics of {self._sources.runtime!r}>"

    async def step(self) -> dict[str, float]:
        """The change since the previous call (since the start, at the first one)."""
        stats = self._sources.runtime.stats()
        if isinstance(stats, Stats):  # a local runtime: read and compared without a pause
            return self._change(totals(self._sources.read(stats)))
        # A remote runtime answers later: one call at a time, so that each compares with
        # the totals the one before it handed out.
        self._lock = self._lock or anyio.Lock()
        async with self._lock:
            now = totals(self._sources.read(await stats))
            return self._change(now)

    async def _step_shared(self) -> dict[str, float]:
        """:meth:`step` with the job's one baseline for the scheduler's figures.

        For the adapters in shared mode, where every worker reads the job's scheduler: the
        change since the previous read by any worker (``stats_step`` of a ``tangram.ray``
        remote runtime), so the samples of all workers add up to what the job did. The
        executors' figures (this process's quotas) keep this process's baseline.
        """
        self._lock = self._lock or anyio.Lock()
        async with self._lock:
            before, stats = await self._sources.runtime.stats_step()
            now = totals(self._sources.read(stats))
            job = scheduler_totals(before) if before is not None else {}
            self._last.update({key: job.get(key, 0.0) for key in scheduler_totals(stats)})
            return self._change(now)

    def _change(self, now: dict[str, float]) -> dict[str, float]:
        last, self._last = self._last, now
        if self._keys is None:
            self._seen.update(dict.fromkeys(now))
            wanted: Iterable[str] = self._seen
        else:
            wanted = self._keys
        out: dict[str, float] = {}
        for key in wanted:
            value = now.get(key, 0.0)
            if not is_level(key):
                before = last.get(key, 0.0)
                # Totals only grow; a smaller one was restarted (a kind the runtime's
                # bounded book dropped and saw again), and all of it is new.
                value = value - before if value >= before else value
            out[key] = value
        return out


# -- the adapters' hand-off ------------------------------------------------------------------

_TOTALS = (
    "actions",
    "queue_s",
    "overhead_s",
    "exec_s",
    "waiting",
    "running",
    "resizes",
    "sandbox_replaced",
    "restores",
    "restore_s",
    "limited",
)
_PER_KIND = ("actions", "queue_s", "overhead_s", "exec_s")


def adapter_keys(resources: Iterable[str], kinds: Iterable[str]) -> tuple[str, ...]:
    """The keys an adapter hands over: totals, ``resources``' held and unit-seconds, and
    the per-kind times of ``kinds``. Fixed, because both frameworks stack the dicts of
    every sample of a step (verl fails on a sample without a key the first one had)."""
    keys = [f"{PREFIX}{name}" for name in _TOTALS]
    for resource in sorted(resources):
        keys += [f"{PREFIX}held/{resource}", f"{PREFIX}unit_s/{resource}"]
    for kind in dict.fromkeys(kinds):
        keys += [f"{PREFIX}{name}/{kind}" for name in _PER_KIND]
    return tuple(keys)


async def step_logs(scheduler: Any, pools: Any, kinds: Iterable[str]) -> dict[str, float]:
    """What this process's scheduler did since the adapter's previous sample, for its logs.

    ``pools`` is the session's :class:`~tangram._frameworks._session.Resources`, which
    keeps one :class:`StepMetrics` per set of ``kinds``, so each sample carries the
    change since the one before it in this process (in shared mode, since the one before
    it in the job, whichever worker took it): the samples of a step add up to what the
    step did, and the trackers' per-sample mean is that divided by the samples. The
    resources are those of the scheduler's first figures (the config's, in every process
    that reads the same config).
    """
    named = tuple(dict.fromkeys(kinds))
    per_kinds: dict[tuple[str, ...], StepMetrics] = pools.steps
    steps = per_kinds.get(named)
    if steps is None:
        stats = scheduler.stats()
        if not isinstance(stats, Stats):
            stats = await stats
        steps = per_kinds.setdefault(
            named,
            StepMetrics(
                scheduler,
                # The job's pools (shared mode) live in its node agents, whose figures
                # are not this process's: the scheduler's stats carry their actions.
                sandboxes=None if pools.job else pools.sandboxes,
                gpu=None if pools.job else pools.gpu,
                quotas=tuple(pools.quotas.values()),
                keys=adapter_keys(stats.resources, named),
            ),
        )
    return await (steps._step_shared() if pools.job else steps.step())


# -- Prometheus -----------------------------------------------------------------------------

_HINT = "tangram.metrics.Collector needs prometheus-client: pip install 'tangram[metrics]'"


class Collector:
    """A prometheus-client collector of a runtime's, its pools' and its quotas' figures.

    ::

        registry.register(tangram.metrics.Collector(runtime, sandboxes=pool, quotas=[q]))

    Each scrape reads the figures afresh (prometheus-client's custom-collector pattern),
    on the runtime's event loop: build the collector on that loop (inside ``async with
    runtime``) and scrapes from the HTTP server's thread, or ``generate_latest`` called
    on the loop itself, both work. Families, all prefixed ``tangram_``: per ``resource``
    capacity, units held, utilisation, peak and unit-seconds; per ``kind`` actions by
    ``outcome`` and queue, overhead and exec seconds (summaries); waiting and running
    actions, decisions, resizes, evictions; per sandbox ``pool`` replacements; per GPU
    ``service`` restores, evictions, hits, runs and their seconds, per ``device`` memory;
    per ``quota`` and ``key`` requests sent and answered by ``result``, in flight, set
    aside and the adaptive rate's share.

    :raises ImportError: prometheus-client is not installed.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        sandboxes: SandboxPool | Iterable[SandboxPool] | None = None,
        gpu: GpuPool | None = None,
        quotas: Quota | Iterable[Quota] | None = None,
    ) -> None:
        try:
            import prometheus_client.core
        except ImportError as exc:
            raise ImportError(_HINT) from exc
        if not isinstance(runtime, Runtime):
            # A remote runtime's figures arrive by an await; a scrape cannot wait on one.
            raise SettingTypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")
        self._core = prometheus_client.core
        self._sources = Sources.of(runtime, sandboxes, gpu, quotas)
        self._token: anyio.lowlevel.EventLoopToken | None = None
        # Built before the loop runs: the first scrape on the loop finds it.
        with contextlib.suppress(RuntimeError):
            self._token = anyio.lowlevel.current_token()

    def __repr__(self) -> str:
        return f"<tangram.metrics.Collector of {self._sources.runtime!r}>"

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering reads nothing off the loop."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        """The families with their samples now.

        :raises RuntimeClosedError: called off the runtime's loop when that loop is not
            running (or was never seen).
        """
        return self._families(self._snapshot())

    def _snapshot(self) -> Snapshot:
        sources = self._sources
        try:
            self._token = anyio.lowlevel.current_token()
        except RuntimeError:
            pass
        else:
            return sources.read(sources.runtime.stats())
        token = self._token
        loop = getattr(token, "native_token", None)
        if token is None or (
            callable(getattr(loop, "is_running", None)) and not loop.is_running()  # type: ignore[union-attr]
        ):
            raise RuntimeClosedError(
                "the runtime's event loop is not running: scrape while it runs, from its "
                "loop or from another thread (build the Collector on that loop)"
            )

        def read() -> Snapshot:
            return sources.read(sources.runtime.stats())

        try:
            return anyio.from_thread.run_sync(read, token=token)
        except RuntimeError as exc:  # the loop closed between the check and the call
            raise RuntimeClosedError(f"the runtime's event loop is gone ({exc})") from exc

    def _families(self, snap: Snapshot | None) -> Iterator[Metric]:
        core = self._core
        gauge, counter, summary = (
            core.GaugeMetricFamily,
            core.CounterMetricFamily,
            core.SummaryMetricFamily,
        )
        stats = snap.stats if snap is not None else None

        by_resource = {
            "capacity": (gauge, "Units of the resource in total.", "total"),
            "held": (gauge, "Units held by running actions now.", "held"),
            "utilisation": (gauge, "Share of the resource held (a rate: spent).", "utilisation"),
            "peak": (gauge, "Most units held at once.", "peak"),
            "unit_seconds": (counter, "Units held, integrated over seconds.", "unit_seconds"),
        }
        for name, (family, doc, attr) in by_resource.items():
            metric = family(f"tangram_resource_{name}", doc, labels=["resource"])
            for resource, r in stats.resources.items() if stats else ():
                metric.add_metric([resource], getattr(r, attr))
            yield metric

        actions = counter("tangram_actions", "Actions that ended.", labels=["kind", "outcome"])
        phases = {
            phase: summary(f"tangram_action_{phase}_seconds", doc, labels=["kind"])
            for phase, doc in (
                ("queue", "Seconds from the request to the grant."),
                ("overhead", "Seconds from the grant to the start (restores, updates)."),
                ("exec", "Seconds the action's body ran."),
            )
        }
        for kind, k in stats.kinds.items() if stats else ():
            for outcome in ("completed", "failed", "cancelled"):
                actions.add_metric([kind, outcome], getattr(k, outcome))
            for phase, metric in phases.items():
                part = getattr(k, phase)
                metric.add_metric([kind], part.count, part.total)
        yield actions
        yield from phases.values()
        scalars = {
            "tangram_actions_waiting": (gauge, "Actions waiting for a grant.", "waiting"),
            "tangram_actions_running": (gauge, "Actions holding a grant.", "running"),
            "tangram_decisions": (counter, "Scheduling passes.", "decisions"),
            "tangram_decision_seconds": (counter, "Seconds spent planning.", "decision_seconds"),
            "tangram_resizes": (counter, "Grants resized while running.", "resizes"),
            "tangram_evictions": (counter, "Actions evicted by the policy.", "evictions"),
        }
        for name, (family, doc, attr) in scalars.items():
            yield family(name, doc, value=getattr(stats, attr)) if stats else family(name, doc)

        replaced = counter(
            "tangram_sandbox_replaced", "Broken sandboxes replaced.", labels=["pool"]
        )
        for pool, count in snap.replaced.items() if snap else ():
            replaced.add_metric([pool], count)
        yield replaced

        yield from self._gpu(snap)
        yield from self._quotas(snap)

    def _gpu(self, snap: Snapshot | None) -> Iterator[Metric]:
        core = self._core
        per_service = {
            "restores": "Restores actions waited for.",
            "warmed": "Restores made when the pool was entered.",
            "evictions": "Evictions from a device.",
            "hits": "Actions that found the service resident.",
            "runs": "Batches run.",
            "batched": "Actions run, over all batches.",
            "restore_seconds": "Seconds spent restoring.",
            "run_seconds": "Seconds spent running batches.",
        }
        for name, doc in per_service.items():
            metric = core.CounterMetricFamily(f"tangram_gpu_{name}", doc, labels=["service"])
            for service, s in snap.services.items() if snap else ():
                metric.add_metric([service], float(s[name] or 0))
            yield metric
        live = core.GaugeMetricFamily(
            "tangram_gpu_replicas_live", "Replicas loaded now.", labels=["service"]
        )
        for service, s in snap.services.items() if snap else ():
            live.add_metric([service], float(s["replicas_live"] or 0))
        yield live
        memory = core.GaugeMetricFamily(
            "tangram_gpu_memory_bytes",
            "Device memory: capacity, resident, granted, peak and the driver's count.",
            labels=["device", "state"],
        )
        for device, usage in snap.devices.items() if snap else ():
            for state, value in usage.items():
                if value is not None:  # the driver's count without NVML
                    memory.add_metric([device, state], float(value))
        yield memory

    def _quotas(self, snap: Snapshot | None) -> Iterator[Metric]:
        core = self._core
        labels = ["quota", "key"]
        sent = core.CounterMetricFamily("tangram_quota_sent", "Requests sent.", labels=labels)
        answered = core.CounterMetricFamily(
            "tangram_quota_responses",
            "Requests answered: ok, limited (429/503) or failed.",
            labels=[*labels, "result"],
        )
        levels = {
            "in_flight": "Requests in flight.",
            "set_aside": "1 while the key is set aside after failures.",
            "rate_share": "The adaptive limit's rate as a share of the configured one.",
        }
        gauges = {
            name: core.GaugeMetricFamily(f"tangram_quota_{name}", doc, labels=labels)
            for name, doc in levels.items()
        }
        for (quota, key), s in snap.keys.items() if snap else ():
            sent.add_metric([quota, key], s.sent)
            for result in ("ok", "limited", "failed"):
                answered.add_metric([quota, key, result], getattr(s, result))
            for name, metric in gauges.items():
                metric.add_metric([quota, key], float(getattr(s, name)))
        yield sent
        yield answered
        yield from gauges.values()
