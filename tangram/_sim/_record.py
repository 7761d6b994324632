"""Recording what a live :class:`~tangram.Runtime` served as a tangram-trace/1 file.

A real rollout, replayed under other policies by ``tangram simulate``, answers "what would
static slots (or a bigger cluster) have cost on *this* step" without running it again.
The recorder hooks one runtime instance the way :class:`tangram.testing.InvariantChecker`
does, by wrapping its ledger's bookkeeping methods on the instance (never the class), and
sees every action's arrival, grant, resizes and end on the runtime's own clock.

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
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from .._core._efficiency import Amdahl, Efficiency, Linear, Power, SpeedupTable
from .._core._ledger import Ledger
from .._core._policy import RUNNING, Entry, Plan
from .._core._resources import Shape
from .._runtime._run import Runtime
from ._trace import FORMAT

__all__ = ["TraceRecorder", "record_trace"]

_MISSING = object()
# Kinds the format holds while an action runs; every other name is read as an API budget.
_HELD = frozenset({"cpu", "gpu", "mem"})
_GIB = float(1 << 30)


def _holdable(name: str) -> bool:
    return name in _HELD or name.endswith("_concurrency")


class _Seen:
    """One action as the recorder saw it."""

    __slots__ = ("admitted", "arrival", "finished", "last", "units", "work")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.admitted = math.nan
        self.finished = math.nan
        self.last = math.nan
        self.units = 0
        self.work = 0.0


class TraceRecorder:
    """Record every action ``runtime`` serves; :meth:`lines` or :meth:`write` the trace.

    Attach before the rollout (before or after ``async with runtime:``), run it, then
    write. :func:`record_trace` does all three. Kinds the format cannot name as held
    (``gpu_mem:<device>`` of :class:`tangram.gpu.GpuPool`, other custom counts and sizes)
    are left out of the header, and actions that need them are skipped and counted in
    :attr:`skipped`: their replay would need devices the trace cannot describe.

    :param name: the trace's ``name`` in its header.
    :raises TypeError: ``runtime`` is not a :class:`tangram.Runtime`.
    """

    def __init__(self, runtime: Runtime, *, name: str = "recorded") -> None:
        if not isinstance(runtime, Runtime):
            raise TypeError(f"`runtime` must be a tangram.Runtime (got {runtime!r})")
        self.runtime = runtime
        self.name = name
        self.withdrawn = 0
        self.skipped = 0
        self._seen: dict[Entry, _Seen] = {}
        self._done: list[tuple[Entry, _Seen]] = []
        self._patched: dict[str, object] = {}
        ledger = runtime._ledger
        self._wrap(ledger, "submit", self._submit(ledger.submit))
        self._wrap(ledger, "step", self._step(ledger.step))
        self._wrap(ledger, "finish", self._finish(ledger.finish))
        self._wrap(ledger, "withdraw", self._withdraw(ledger.withdraw))

    def __repr__(self) -> str:
        return f"<tangram.TraceRecorder {self.name!r} actions={len(self._done)}>"

    @property
    def actions(self) -> int:
        """Actions recorded so far (ended after running)."""
        return len(self._done)

    # -- hooks -------------------------------------------------------------------------

    def _wrap(self, ledger: Ledger, name: str, replacement: object) -> None:
        self._patched[name] = ledger.__dict__.get(name, _MISSING)
        setattr(ledger, name, replacement)

    def detach(self) -> None:
        """Stop recording: put the ledger's own methods back (what was seen is kept)."""
        ledger = self.runtime._ledger
        for name, old in self._patched.items():
            if old is _MISSING:
                delattr(ledger, name)
            else:
                setattr(ledger, name, old)
        self._patched.clear()

    def _submit(self, method: Callable[..., Entry]) -> Callable[..., Entry]:
        def submit(action: Any, now: float) -> Entry:
            entry = method(action, now)
            self._seen[entry] = _Seen(now)
            return entry

        return submit

    def _step(self, method: Callable[..., Plan]) -> Callable[..., Plan]:
        def step(now: float) -> Plan:
            plan = method(now)
            for entry, _ in plan.resizes:
                seen = self._seen.get(entry)
                if seen is not None and entry.state == RUNNING:
                    seen.work += (now - seen.last) * entry.speed(seen.units)
                    seen.last, seen.units = now, entry.units
            for entry, _ in plan.admits:
                seen = self._seen.get(entry)
                if seen is not None:
                    seen.admitted = seen.last = now
                    seen.units = entry.units
            return plan

        return step

    def _finish(self, method: Callable[..., None]) -> Callable[..., None]:
        def finish(entry: Entry, now: float, *args: Any, **kwargs: Any) -> None:
            seen = self._seen.pop(entry, None)
            if seen is not None and entry.state == RUNNING:
                seen.work += (now - seen.last) * entry.speed(seen.units)
                seen.finished = now
                self._done.append((entry, seen))
            method(entry, now, *args, **kwargs)

        return finish

    def _withdraw(self, method: Callable[[Entry], None]) -> Callable[[Entry], None]:
        def withdraw(entry: Entry) -> None:
            if self._seen.pop(entry, None) is not None:
                self.withdrawn += 1
            method(entry)

        return withdraw

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
        done = sorted(self._done, key=lambda item: (item[1].arrival, item[0].seq))
        start = done[0][1].arrival if done else 0.0
        ended: dict[str, float] = {}
        index: dict[str, int] = {}
        out: list[tuple[str, int, dict[str, Any]]] = []
        self.skipped = 0
        for entry, seen in done:
            fields = self._fields(entry, seen, capacity, header["capacity"])
            if fields is None:
                self.skipped += 1
                continue
            action = entry.action
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
        self, entry: Entry, seen: _Seen, capacity: Any, named: dict[str, float]
    ) -> dict[str, Any] | None:
        demand = entry.action.demand
        kinds = [kind for kind, _ in demand.rigid]
        if demand.elastic_kind is not None:
            kinds.append(demand.elastic_kind)
        if any(kind not in named for kind in kinds) or not kinds:
            return None
        line: dict[str, Any] = {"kind": entry.action.kind}
        ran = seen.finished - seen.admitted
        elastic = demand.elastic
        if elastic is not None and demand.elastic_kind is not None:
            efficiency: Efficiency = elastic.efficiency or entry.action.estimate.efficiency
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


@contextlib.asynccontextmanager
async def record_trace(
    runtime: Runtime, path: str | Path, *, name: str = "recorded"
) -> AsyncIterator[TraceRecorder]:
    """Record what ``runtime`` serves inside the block and write it to ``path`` on exit.

    ``async with tangram.record_trace(runtime, "step.jsonl"):`` around a rollout step;
    the file is written even when the block raises, so a failed step can be replayed.
    """
    recorder = TraceRecorder(runtime, name=name)
    try:
        yield recorder
    finally:
        recorder.detach()
        with anyio.CancelScope(shield=True):
            await recorder.write(path)
