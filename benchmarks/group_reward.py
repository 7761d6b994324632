"""The group (GRPO) reward: when a prompt's samples are all scored, with and without the gate.

What it measures
    A batch of ``G`` prompts with ``n`` samples each (verl's ``rollout.n``), each sample a
    code answer graded against its tests in a fresh local sandbox by tangram's harness,
    scored through verl's own ``RewardLoopWorker.compute_score_batch`` (a task per sample,
    as the trainer's ``compute_rm_score`` drives it) with ``TangramRewardManager``, on
    the machine's cores. Two arms on the same batch, alternating, in one process:

    - *per sample*: ``group = false``, each sample asks for its core when it is ready;
    - *group*: ``group = true``, each sample waits for the rest of its prompt's group and
      the group's demands reach the scheduler together.

    For each arm: when each group's last sample was scored (the group is usable by
    GRPO from then on), averaged over groups, and the whole batch's time.

Why
    GRPO's advantage needs a prompt's whole group. Scored one by one, the groups of a
    batch interleave in the scheduler's line and each finishes near the batch's end;
    admitted together, they finish one after another, so a trainer that consumes groups
    as they complete (streaming, partial rollouts) gets the first ones much sooner. The
    batch itself must not take longer for it.

Targets
    - mean group completion, group / per sample, <= 0.9;
    - batch time, group / per sample, <= 1.1 (no slower, within the noise of a 2-core
      machine running Python start-ups).

The last line of stdout is one JSON object (``"bench": "group_reward"``); exit status 0
whether or not the targets are met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "adapters"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tangram  # noqa: E402
from tangram._frameworks import _session  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from _hacks import RIGHT, TESTS, WRONG
    from _tiny import tiny_tokenizer
    from test_verl import _reward_config
    from verl import DataProto
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker


class _Finished(tangram.Instrument):
    """When each grading's grant went back, per prompt (its sandbox is named after it)."""

    def __init__(self) -> None:
        self.done: dict[str, float] = {}

    def action_finished(self, lease: tangram.Lease, outcome: tangram.Outcome) -> None:
        name = lease.action.trajectory or ""
        if name.startswith("reward-") and lease.finished_at is not None:
            prompt = name.split("-")[1]
            self.done[prompt] = max(self.done.get(prompt, 0.0), lease.finished_at)


def _config(workdir: Path, group: bool) -> Any:
    """verl's config for a reward loop worker with ``TangramRewardManager``, grading code."""
    toml = workdir / "tangram.toml"
    config, _ = _reward_config(workdir, workdir / "tok", "reward_manager")
    toml.write_text(
        'mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 4\n'
        "[adapters.verl.reward]\ntests = true\ntimeout = 30\ncase_timeout = 5\n"
    )
    config.reward.tangram = {"tangram_config": str(toml), "group": group}
    return config


def _batch(tokenizer: Any, groups: int, n: int, seed: int) -> DataProto:
    """``groups`` prompts of ``n`` answers, a seeded mix of right and wrong ones."""
    rng = np.random.default_rng(seed)
    answers = [RIGHT if rng.random() < 0.5 else WRONG for _ in range(groups * n)]
    texts = [f"```python\n{a}```" for a in answers]
    prompt = tokenizer.encode("Q", add_special_tokens=False)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    responses = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]
    masks = [[1] * len(prompt) + [1] * len(row) + [0] * (width - len(row)) for row in ids]
    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt] * len(ids)),
            "responses": torch.tensor(responses),
            "attention_mask": torch.tensor(masks),
        },
        non_tensors={
            "data_source": np.array(["code"] * len(ids), dtype=object),
            "reward_model": np.array([{"ground_truth": TESTS}] * len(ids), dtype=object),
            "extra_info": np.array([{} for _ in ids], dtype=object),
            "uid": np.array([f"p{k // n}" for k in range(len(ids))], dtype=object),
        },
    )


async def _arm(workdir: Path, group: bool, data: DataProto) -> dict[str, float]:
    worker = RewardLoopWorker(_config(workdir, group))
    finished = _Finished()
    try:
        async with _session.session(workdir / "tangram.toml") as resources:
            resources.scheduler.add_instrument(finished)
            await resources.sandbox_pool().wait_warm()
        start = asyncio.get_running_loop().time()
        await worker.compute_score_batch(data)
        end = asyncio.get_running_loop().time()
    finally:
        await _session.aclose()
    done = [t - start for t in finished.done.values()]
    return {"group_done_s": statistics.fmean(done), "batch_s": end - start}


async def main(quick: bool) -> dict[str, Any]:
    groups, n, rounds = (8, 4, 4) if quick else (16, 8, 6)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        tokenizer = tiny_tokenizer(workdir / "tok")
        runs: dict[str, list[dict[str, float]]] = {"per_sample": [], "group": []}
        for r in range(rounds):
            data = _batch(tokenizer, groups, n, seed=r)
            arms = ("per_sample", "group") if r % 2 == 0 else ("group", "per_sample")
            for arm in arms:
                runs[arm].append(await _arm(workdir, arm == "group", data))
    figures: dict[str, Any] = {"groups": groups, "n": n, "rounds": rounds}
    for arm, measured in runs.items():
        for key in ("group_done_s", "batch_s"):
            figures[f"{arm}_{key}"] = round(statistics.fmean(m[key] for m in measured), 3)
    done = figures["group_group_done_s"] / figures["per_sample_group_done_s"]
    batch = figures["group_batch_s"] / figures["per_sample_batch_s"]
    print(
        f"{groups} prompts x {n} samples, {rounds} rounds: mean group completion "
        f"{figures['per_sample_group_done_s']:.2f} s per sample vs "
        f"{figures['group_group_done_s']:.2f} s grouped ({done:.2f}x); batch "
        f"{figures['per_sample_batch_s']:.2f} s vs {figures['group_batch_s']:.2f} s "
        f"({batch:.2f}x)"
    )
    targets = {
        "group_done_vs_per_sample": {
            "value": round(done, 3),
            "goal": "<= 0.9",
            "met": done <= 0.9,
        },
        "batch_vs_per_sample": {"value": round(batch, 3), "goal": "<= 1.1", "met": batch <= 1.1},
    }
    return {"bench": "group_reward", "figures": figures, "targets": targets}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run of under a minute")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.quick))))
