"""verl's agent-loop workers without Ray, on the docs' own config: one scheduler per node.

Issue 18's first finding, outside Ray: four agent-loop worker processes running
``ToolAgentLoop`` with the docs' config held 6 cores of a 2-core host, and pinned 3 calls
to one core, because each had a scheduler of its own. Here four plain processes (as a
launcher without Ray starts them, sharing nothing but the environment) each build the
tools from the docs' YAML with verl's own loader and run verl's own ``ToolAgentLoop``
on two trajectories at once (the worker of ``test_shared_ray.py``, outside Ray). The
LLM server is the one stand-in (vLLM needs a GPU); sandboxes are tangram's local backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _probes import assert_never_shared, probes

if not os.environ.get("CI"):
    pytest.importorskip("verl")
    pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "examples"

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path[:0] = [{here!r}, {tests!r}]
    from _probes import PROBE
    from test_shared_ray import VerlWorker

    worker = VerlWorker()  # verl's tool loader on the docs' YAML, as the worker starts
    seen = asyncio.run(worker.rollout(PROBE.format(seconds=0.4), 2, {tok!r}))
    print(json.dumps(seen))
    """
)


@pytest.mark.timeout(300)
def test_four_verl_workers_without_ray_share_the_hosts_cores(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        TANGRAM_CONFIG=str(DOCS / "tangram.toml"),  # the docs' own: no mode, so shared
        TANGRAM_RUN_DIR=str(tmp_path / "run"),
        TANGRAM_JOB=f"verl-{tmp_path.name}",
    )
    code = WORKER.format(here=str(HERE), tests=str(HERE.parent), tok=str(tmp_path / "tok"))
    workers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=280)
            assert worker.returncode == 0
            outputs.extend(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    found = probes(outputs)
    assert len(found) == 8
    assert_never_shared(found, cores=len(os.sched_getaffinity(0)))
    assert all(len(cores) == 1 for _, _, cores in found)  # the docs' cpu: 1
