"""A node's reports to the job: what an agent decided reaches the job's stats intact.

No Ray needed: the agent's runtime and the job's runtime are both ``tangram.Runtime``;
the report is the dict the agent would send.
"""

from __future__ import annotations

import anyio
import pytest

import tangram
from tangram._shared._reports import Outbox, merge, record, snapshot

pytestmark = pytest.mark.anyio


async def test_a_nodes_report_puts_its_actions_and_books_in_the_jobs_stats() -> None:
    async with (
        tangram.Runtime({"cpu@n0": 2}) as node,
        tangram.Runtime({"cpu@n0": 2, "search": 4}) as job,
    ):
        outbox = Outbox()
        node.add_instrument(outbox)
        async with anyio.create_task_group() as tg:
            for _ in range(3):

                async def one() -> None:
                    async with node.acquire({"cpu@n0": 1}, kind="sandbox"):
                        await anyio.sleep(0.01)

                tg.start_soon(one)
        with pytest.raises(RuntimeError):
            async with node.acquire({"cpu@n0": 1}, kind="sandbox"):
                raise RuntimeError("the command failed")
        async with node.acquire({"cpu@n0": 2}, kind="held"):
            report = snapshot(node, outbox)
            assert outbox.records == []  # taken: the next report starts afresh
        record(job._recorder, report.pop("records"))
        stats = merge(job.stats(), {"n0": report})
    sandbox = stats.kinds["sandbox"]
    assert (sandbox.completed, sandbox.failed) == (3, 1)
    assert sandbox.exec.count == 4
    assert "held" not in stats.kinds  # still running when reported
    cores = stats.resources["cpu@n0"]
    assert (cores.total, cores.held, cores.peak) == (2, 2, 2)
    assert cores.unit_seconds > 0
    assert stats.running == 1
    assert stats.resources["search"] == job.stats().resources["search"]


def test_a_gone_nodes_books_count_nothing_held() -> None:
    report = {
        "resources": {"cpu@n0": (4.0, 3.0, 0.75, 12.0, 4.0)},
        "waiting": 0,
        "running": 0,
        "decisions": 7,
        "decision_seconds": 0.01,
        "resizes": 0,
        "evictions": 0,
    }
    stats = tangram.Runtime({"cpu@n0": 0}).stats()  # its capacity cut to 0 when it left
    merged = merge(stats, {"n0": report})
    assert merged.resources["cpu@n0"].held == 0
    assert merged.resources["cpu@n0"].peak == 4.0
    assert merged.decisions == stats.decisions + 7
