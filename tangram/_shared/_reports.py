"""A node's decisions, reported to the job: what the job's view needs of a node's runtime.

A host agent decides its node's cores itself (a runtime of its own in the agent), so a
sandbox action never messages the job's actor. The job's view (``remote.stats()``, the
adapters' metrics) still covers every node: the agent keeps what ended since its last
report (:class:`Outbox`), and the job's actor asks each agent for a :func:`snapshot` when
its stats are read, or takes one the agent pushes when its outbox fills. :func:`merge`
folds the snapshots into the job's :class:`~tangram._core._stats.Stats`.

Both ends import this module, as they do :mod:`._protocol`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from .._core._stats import Outcome, Recorder, ResourceStats, Stats, split
from .._runtime._instrument import Instrument

if TYPE_CHECKING:
    from .._runtime._lease import Lease
    from .._runtime._run import Runtime

__all__ = ["FULL", "Outbox", "merge", "snapshot"]

# Ended actions an agent keeps before it pushes them to the job's actor unasked: one
# message per this many actions, however rarely anyone reads the job's stats.
FULL = 1024

# (kind, outcome, queue, overhead, exec): what the job's recorder needs of one action.
Record = tuple[str, str, float, float, float]


class Outbox(Instrument):
    """The node runtime's ended actions, as the job's recorder will record them."""

    __slots__ = ("records", "seq")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.seq = 0  # reports made: the job keeps the books of the newest it received

    def action_finished(self, lease: Lease, outcome: Outcome) -> None:
        self.records.append((lease.action.kind, outcome.value, *split(lease)))

    def take(self) -> list[Record]:
        records, self.records = self.records, []
        return records


def snapshot(runtime: Runtime, outbox: Outbox) -> dict[str, Any]:
    """What the node's runtime tells the job: its ended actions since the last, its books."""
    stats = runtime.stats()
    outbox.seq += 1
    return {
        "seq": outbox.seq,
        "records": outbox.take(),
        "resources": {name: attrs.astuple(res) for name, res in stats.resources.items()},
        "waiting": stats.waiting,
        "running": stats.running,
        "decisions": stats.decisions,
        "decision_seconds": stats.decision_seconds,
        "resizes": stats.resizes,
        "evictions": stats.evictions,
    }


def record(recorder: Recorder, records: list[Record]) -> None:
    """Count a node's ended actions in the job's recorder, as if it had decided them."""
    for kind, outcome, queue, overhead, exec_ in records:
        recorder.record(kind, Outcome(outcome), queue, overhead, exec_)


def merge(stats: Stats, nodes: Mapping[str, Mapping[str, Any]]) -> Stats:
    """The job's stats with each node's kinds and counts taken from its last snapshot.

    A node's kinds are its own (``cpu@<node>``): the node's books replace the job's for
    them, keeping the job's ``total`` (zero once the node is gone). Queue lengths and
    decision counts add up; the job's per-kind time splits already hold the records.
    """
    resources = dict(stats.resources)
    waiting, running = stats.waiting, stats.running
    decisions, seconds = stats.decisions, stats.decision_seconds
    resizes, evictions = stats.resizes, stats.evictions
    for node in nodes.values():
        for name, fields in node["resources"].items():
            if name not in resources:
                continue
            mine = ResourceStats(*fields)
            total = resources[name].total
            held = mine.held if total > 0 else 0.0
            resources[name] = ResourceStats(
                total=total,
                held=held,
                utilisation=held / total if total > 0 else 0.0,
                unit_seconds=mine.unit_seconds,
                peak=mine.peak,
            )
        waiting += node["waiting"]
        running += node["running"]
        decisions += node["decisions"]
        seconds += node["decision_seconds"]
        resizes += node["resizes"]
        evictions += node["evictions"]
    return attrs.evolve(
        stats,
        resources=resources,
        waiting=waiting,
        running=running,
        decisions=decisions,
        decision_seconds=seconds,
        resizes=resizes,
        evictions=evictions,
    )
