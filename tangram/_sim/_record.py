"""Recording what a live :class:`~tangram.Runtime` served as a tangram-trace/1 file.

A real rollout, replayed under other policies by ``tangram simulate``, answers "what would
static slots (or a bigger cluster) have cost on *this* step" without running it again.
The recorder is a :class:`tangram.Instrument` of one runtime, beside any others (the
:class:`tangram.testing.InvariantChecker` of a test, say), and sees every action's arrival,
grant, resizes and end on the runtime's own clock.

What a line says is what *ran*, in the trace's terms: an elastic action's
``seconds_at_1`` is the work it did (the integral of its speedup over the units it held),
a rigid one's ``seconds`` its execution time; ``gap`` is the time from the previous action
of its trajectory ending (or from the first recorded arrival) to its arrival. Actions
withdrawn before they ran (cancelled, timed out) are not part of what was served and are
only counted. Actions issued concurrently by one trajectory are written in arrival order
with a gap of 0 when they overlapped, since the format runs a trajectory's actions in
sequence.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio

from .._core._efficiency import Amdahl, Efficiency, Linear, Power, SpeedupTable
from .._core._resources import Shape
from .._core._stats import Outcome
from .._runtime._instrument import Instrument
from .._runtime._lease import Lease
from .._runtime._run import Runtime
from ..errors import SettingTypeError
from ._trace import FORMAT

__all__ = ["TraceRecorder", "record_trace"]

# Kinds the format holds while an action runs; every other name is read as an API budget.
_HELD = frozenset({"cpu", "gpu", "mem"})
_GIB = float(1 << 30)


def _holdable(name: str) -> bool:
    return name in _HELD or name.endswith("_concurrency")


class _Seen:
    """One action as the recorder saw it."""

    __slots__ = ("admitted", "arrival", "finished", "last", "order", "speedup", "units", "work")

    def __init__(self, lease: Lease, order: int) -> None:
        action = lease.action
        elastic = action.demand.elastic
        # The speedup the scheduler plans with: the demand's own model, else the estimate's.
        efficiency = elastic.efficiency if elastic and elastic.efficiency else None
        self.speedup: Callable[[float], float] = (efficiency or action.estimate.efficiency).speedup
        self.arrival = lease.queued_at
        self.order = order
        self.admitted = math.nan
        self.finished = math.nan
        self.last = math.nan
        self.units = 0
        self.work = 0.0

    def ran_until(self, now: float) -> None:
        """Add the work done at the units held since the last change."""
        speed = self.speedup(self.units) if self.units > 0 else 1.0
        self.work += (now - self.last) * speed


class TraceRecorder(Instrument):
    """Record every action ``runtime`` serves; :meth:`lines` or :meth:`write` the trace.

    Attach before the rollout (before or after ``async with runtime:``), run it, then
    write. :func:`record_trace` does all three. Kinds the format cannot name as held
    (``gpu_mem:<device>`` of :class:`tangram.gpu.GpuPool`, other custom counts and sizes)
    are left out of the header, and actions that need them are skipped and counted in
    :attr:`skipped`: their replay would need devices the trace cannot describe.

    It attaches itself as an instrument (:meth:`tangram.Runtime.add_instrument`);
    :meth:`detach` removes it, in any order with other instruments.

    :param name: the trace's ``name`` in its header.
    :raises SettingTypeError: ``runtime`` is not a :class:`tangram.Runtime`, or ``name``
        not a string.
    """

    def __init__(self, runtime: Runtime, *, name: str = "recorded") -> None:
        if not isinstance(runtime, Runtime):
            raise SettingTypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")
        if not isinstance(name, str):
            raise SettingTypeError(f"`name` must be a string (got {name!r})")
        self.runtime = runtime
        self.name = name
        self.withdrawn = 0
        self.skipped = 0
        self._queued = 0
        self._seen: dict[Lease, _Seen] = {}
        self._done: list[tuple[Lease, _Seen]] = []
        runtime.add_instrument(self)

    def __repr__(self) -> str:
        return f"<tangram.TraceRecorder {self.name!r} actions={len(self._done)}>"

    @property
    def actions(self) -> int:
        """Actions recorded so far (ended after running)."""
        return len(self._done)

    def detach(self) -> None:
        """Stop recording (what was seen is kept); safe twice."""
        with contextlib.suppress(KeyError):
            self.runtime.remove_instrument(self)

    # -- hooks -------------------------------------------------------------------------

    def action_queued(self, lease: Lease) -> None:
        self._queued += 1
        self._seen[lease] = _Seen(lease, self._queued)

    def action_granted(self, lease: Lease) -> None:
        seen = self._seen.get(lease)
        if seen is not None:
            seen.admitted = seen.last = lease.admitted_at
            seen.units = lease.units or 0

    def action_resized(self, lease: Lease, now: float) -> None:
        seen = self._seen.get(lease)
        if seen is not None and lease.active:
            seen.ran_until(now)
            seen.last, seen.units = now, lease.units or 0

    def action_finished(self, lease: Lease, outcome: Outcome) -> None:
        seen = self._seen.pop(lease, None)
        if seen is None:
            return
        if math.isnan(seen.admitted):
            self.withdrawn += 1
        else:
            seen.ran_until(lease.finished_at)
            seen.finished = lease.finished_at
            self._done.append((lease, seen))

    # -- the trace -----------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        """The header: the runtime's capacity in the format's terms."""
        capacity: dict[str, float] = {}
        for name, resource in self.runtime.capacity.items():
            if resource.shape is Shape.RATE:
                if not _holdable(name):
                    capacity[name] = resource.total
            elif _holdable(name):
                total = resource.total
                capacity[name] = total / _GIB if resource.shape is Shape.SIZE else total
        return {"format": FORMAT, "name": self.name, "capacity": dict(sorted(capacity.items()))}

    def lines(self) -> Iterator[str]:
        """The trace as lines of text, header first, actions by trajectory and index."""
        capacity = self.runtime.capacity
        header = self.header()
        yield json.dumps(header, sort_keys=True) + "\n"
        done = sorted(self._done, key=lambda item: (item[1].arrival, item[1].order))
        start = done[0][1].arrival if done else 0.0
        ended: dict[str, float] = {}
        index: dict[str, int] = {}
        out: list[tuple[str, int, dict[str, Any]]] = []
        self.skipped = 0
        for lease, seen in done:
            fields = self._fields(lease, seen, capacity, header["capacity"])
            if fields is None:
                self.skipped += 1
                continue
            action = lease.action
            trajectory = action.trajectory if action.trajectory is not None else f"_a{action.id}"
            previous = ended.get(trajectory, start)
            i = index.get(trajectory, 0)
            index[trajectory] = i + 1
            ended[trajectory] = max(previous, seen.finished)
            line = {"trajectory": trajectory, "index": i, "gap": max(0.0, seen.arrival - previous)}
            out.append((trajectory, i, {**line, **fields}))
        for _, _, line in sorted(out, key=lambda item: (item[0], item[1])):
            yield json.dumps(line) + "\n"

    async def write(self, path: str | Path) -> None:
        """Write the trace to ``path`` (UTF-8, one JSON object a line), off the event loop."""
        text = "".join(self.lines())
        await anyio.Path(path).write_text(text, encoding="utf-8")

    def _fields(
        self, lease: Lease, seen: _Seen, capacity: Any, named: dict[str, float]
    ) -> dict[str, Any] | None:
        demand = lease.action.demand
        kinds = [kind for kind, _ in demand.rigid]
        if demand.elastic_kind is not None:
            kinds.append(demand.elastic_kind)
        if any(kind not in named for kind in kinds) or not kinds:
            return None
        line: dict[str, Any] = {"kind": lease.action.kind}
        ran = seen.finished - seen.admitted
        elastic = demand.elastic
        if elastic is not None and demand.elastic_kind is not None:
            efficiency: Efficiency = elastic.efficiency or lease.action.estimate.efficiency
            line.update(
                resource=demand.elastic_kind,
                min=elastic.min,
                max=elastic.max,
                seconds_at_1=seen.work,
                efficiency=_efficiency_dict(efficiency, elastic.max),
            )
        else:
            main = next((k for k, _ in demand.rigid if k != "mem"), demand.rigid[0][0])
            line.update(resource=main, units=demand.amount(main), seconds=ran)
        for kind, amount in demand.rigid:
            if kind == "mem" and line["resource"] != "mem":
                size = capacity[kind].shape is Shape.SIZE
                line["mem_gib"] = amount / _GIB if size else amount
        # What else it held, kept for the record (readers ignore unknown keys).
        others = {k: a for k, a in demand.rigid if k not in (line["resource"], "mem")}
        if others:
            line["also"] = others
        return line


def _efficiency_dict(efficiency: Efficiency, units: int) -> dict[str, Any]:
    """The format's form of a speedup model; any other model as a table up to ``units``."""
    if isinstance(efficiency, Linear):
        return {"model": "linear"}
    if isinstance(efficiency, Amdahl):
        return {"model": "amdahl", "parallel_fraction": efficiency.parallel_fraction}
    if isinstance(efficiency, Power):
        return {"model": "power", "alpha": efficiency.alpha}
    if isinstance(efficiency, SpeedupTable):
        return {"model": "table", "speedup": list(efficiency.speedups)}
    return {"model": "table", "speedup": [efficiency.speedup(m) for m in range(1, units + 1)]}


def record_trace(
    runtime: Runtime, path: str | Path, *, name: str = "recorded"
) -> AbstractAsyncContextManager[TraceRecorder]:
    """Record what ``runtime`` serves inside the block and write it to ``path`` on exit.

    ``async with tangram.record_trace(runtime, "step.jsonl"):`` around a rollout step;
    the file is written even when the block raises, so a failed step can be replayed.

    :raises SettingTypeError: at the call, not at the ``async with``: ``runtime`` is not a
        :class:`tangram.Runtime`, ``path`` not a path, or ``name`` not a string.
    """
    if not isinstance(runtime, Runtime):
        raise SettingTypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")
    if not isinstance(path, (str, os.PathLike)):
        raise SettingTypeError(f"`path` must be a str or a path (got {path!r})")
    if not isinstance(name, str):
        raise SettingTypeError(f"`name` must be a string (got {name!r})")
    return _record(runtime, path, name)


@contextlib.asynccontextmanager
async def _record(runtime: Runtime, path: str | Path, name: str) -> AsyncIterator[TraceRecorder]:
    """The block of :func:`record_trace`, its arguments already checked."""
    recorder = TraceRecorder(runtime, name=name)
    try:
        yield recorder
    finally:
        recorder.detach()
        with anyio.CancelScope(shield=True):
            await recorder.write(path)
