"""The group (GRPO) reward under verl's own reward loop worker (issue #18).

Real verl 0.9.1 code path: ``RewardLoopWorker`` builds ``TangramRewardManager`` from the
config and scores a batch through ``compute_score_batch``, a task per sample, as the
trainer's ``compute_rm_score`` asks it to; the answers are graded in real local sandboxes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from _tiny import tiny_tokenizer
    from test_verl import _batch, _reward_config, _tests_toml
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

import tangram  # noqa: E402
from tangram._frameworks import _session  # noqa: E402

GROUPS, N = 3, 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Admitted(tangram.Instrument):
    """The trajectory (sandbox) of each admission, in the order the scheduler made them."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def action_granted(self, lease: tangram.Lease) -> None:
        self.order.append(lease.action.trajectory or "")


def _worker(tmp_path: Path, group: bool) -> RewardLoopWorker:
    toml = _tests_toml(tmp_path)
    config, _ = _reward_config(tmp_path, tmp_path / "tok", "reward_manager")
    config.reward.tangram.tangram_config = str(toml)
    config.reward.tangram.group = group
    return RewardLoopWorker(config)


def _samples(tokenizer: Any) -> Any:
    from _hacks import RIGHT, TESTS, WRONG

    answers = [RIGHT if (g + i) % 2 else WRONG for g in range(GROUPS) for i in range(N)]
    data = _batch(tokenizer, [f"```python\n{a}```" for a in answers], [TESTS] * len(answers))
    data.non_tensor_batch["uid"] = np.array([f"prompt-{n // N}" for n in range(len(answers))])
    return data, [1.0 if (g + i) % 2 else 0.0 for g in range(GROUPS) for i in range(N)]


@pytest.mark.anyio
@pytest.mark.parametrize("group", [True, False])
async def test_a_groups_samples_reach_the_scheduler_together(tmp_path: Path, group: bool) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    worker = _worker(tmp_path, group)
    data, expected = _samples(tokenizer)
    admitted = _Admitted()
    try:
        async with _session.session(_tests_toml(tmp_path)) as resources:
            resources.scheduler.add_instrument(admitted)
        outputs = await worker.compute_score_batch(data)
        assert [o["reward_score"] for o in outputs] == expected
        manager = worker.reward_manager
        async with _session.session(_tests_toml(tmp_path)) as resources:
            gates = dict(resources.gates)
        if group:
            (gate,) = gates.values()
            stats = gate.stats
            assert (stats.groups, stats.samples, stats.timed_out) == (GROUPS, GROUPS * N, 0)
        else:
            assert manager.group_wait is None and not gates
        # Each grading's sandbox is a trajectory of its own, named after its prompt.
        prompts = [name.split("-")[2] for name in admitted.order]
        assert sorted(prompts) == sorted(str(n // N) for n in range(GROUPS * N))
        runs = sum(1 for n, p in enumerate(prompts) if n == 0 or prompts[n - 1] != p)
        if group:
            assert runs == GROUPS, prompts
    finally:
        await _session.aclose()
