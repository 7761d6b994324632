"""The scheduler's per-step figures reach verl's reward extra info (``metrics = true``).

verl's own ``RewardLoopWorker`` loads ``TangramRewardManager`` by module path and awaits
it per sample; its samples' ``reward_extra_info`` go through verl's own batching (every
sample's keys read from the first's) and ``process_validation_metrics``, which makes the
validation metrics the trainer logs. Sandboxes are real (tangram's local backend); no
stand-in is needed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from _hacks import RIGHT, TESTS, WRONG
    from _tiny import tiny_tokenizer
    from test_verl import _batch, _reward_config, _tests_toml
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.metric_utils import process_validation_metrics

from tangram._frameworks import _session  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_reward_samples_carry_what_the_scheduler_did_into_verls_metrics(
    tmp_path: Path,
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    toml = _tests_toml(tmp_path)
    toml.write_text(toml.read_text() + "metrics = true\n")
    config, _ = _reward_config(tmp_path, tmp_path / "tok", "reward_manager")
    config.reward.tangram.tangram_config = str(toml)
    worker = RewardLoopWorker(config)
    answers = [RIGHT, WRONG, RIGHT]
    data = _batch(tokenizer, [f"```python\n{a}```" for a in answers], [TESTS] * 3)
    try:
        outputs = await worker.compute_score_batch(data)
    finally:
        await _session.aclose()
    assert [o["reward_score"] for o in outputs] == [1.0, 0.0, 1.0]
    infos = [o["reward_extra_info"] for o in outputs]
    # verl's agent loop and reward loop read every sample's keys from the first one's.
    keys = list(infos[0])
    columns = {key: np.array([info[key] for info in infos]) for key in keys}
    assert {"tangram/queue_s/reward", "tangram/exec_s/reward", "tangram/held/cpu"} <= set(keys)
    # Each sample carries the change since the previous one: together, the step's three
    # gradings (one action each).
    assert columns["tangram/actions/reward"].sum() == 3
    assert columns["tangram/exec_s/reward"].sum() > 0
    metrics = process_validation_metrics(
        ["code"] * 3, [f"uid{i}" for i in range(3)], {k: list(v) for k, v in columns.items()}
    )
    assert metrics["code"]["tangram/actions/reward"]["mean@1"] * 3 == pytest.approx(3)
    assert metrics["code"]["acc"]["mean@1"] == pytest.approx(2 / 3)
