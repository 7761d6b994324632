"""The scheduler's per-step figures reach OpenRLHF's logs (``metrics = true``).

OpenRLHF's own ``MultiTurnAgentExecutor.execute`` drives tangram's ``AgentInstance`` in
real sandboxes, and OpenRLHF's ``Experience.concat_experiences`` stacks the episodes'
``info``, which its actor logs each step. ``SamplesGenerator._process_response_into_experience``
turns ``extra_logs`` into ``info`` but lives in a module that imports vLLM, so its four
lines for it are repeated here. The one stand-in is the vLLM engine (vLLM needs a GPU), as
in test_openrlhf.py.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

openrlhf = pytest.importorskip("openrlhf") if not os.environ.get("CI") else __import__("openrlhf")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from _tiny import tiny_tokenizer
    from openrlhf.trainer.ppo_utils.experience import Experience  # type: ignore[import-untyped]
    from test_openrlhf import DOCS_CONFIG, TESTS, _call, _Engine, _load_executor, _params

    from tangram._frameworks import _session


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def metrics_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    """The docs' config with ``metrics = true``, as ``$TANGRAM_CONFIG``."""
    toml = tmp_path / "tangram.toml"
    toml.write_text(DOCS_CONFIG.read_text() + "metrics = true\n")
    monkeypatch.setenv("TANGRAM_CONFIG", str(toml))
    yield toml
    await _session.aclose()


def _info(extra_logs: dict[str, Any]) -> dict[str, torch.Tensor]:
    # SamplesGenerator._process_response_into_experience's conversion, verbatim in effect.
    info = {}
    for key, value in extra_logs.items():
        if isinstance(value, torch.Tensor):
            value = value.flatten()[0].item()
        info[key] = torch.tensor([value])
    return info


@pytest.mark.anyio
async def test_episodes_carry_what_the_scheduler_did_into_openrlhfs_step_info(
    metrics_config: Path, tmp_path: Path
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = _load_executor()
    answer = "Done:\n```python\ndef add(a, b):\n    return a + b\n```"
    turns = {0: [_call("print(1)"), _call("print(2)"), answer], 1: [_call("print(3)"), answer]}
    results: dict[int, dict[str, Any]] = {}

    async def episode(n: int) -> None:
        engine = _Engine(tokenizer, turns[n])
        results[n] = await executor.execute(f"#{n}", TESTS, _params(), 4096, tokenizer, engine)

    async with anyio.create_task_group() as tg:
        for n in turns:
            tg.start_soon(episode, n)

    logs = [results[n]["extra_logs"] for n in turns]
    assert set(logs[0]) == set(logs[1])  # OpenRLHF stacks them: the same keys in each
    assert {"tangram/queue_s/run_code", "tangram/exec_s/reward", "tangram/held/cpu"} <= set(logs[0])
    experiences = [Experience(info=_info(results[n]["extra_logs"])) for n in turns]
    info = Experience.concat_experiences(experiences, tokenizer.pad_token_id).info
    # Each episode carries the change since the process's previous one: together, all
    # the step did. Three tool calls and two gradings ran.
    assert info["tangram/actions/run_code"].sum().item() == 3
    assert info["tangram/actions/reward"].sum().item() == 2
    assert info["tangram/actions"].sum().item() == 5
    assert info["tangram/exec_s/run_code"].sum().item() > 0
    # A level at the episode's end: the other episode may hold a core then; the last to
    # end saw none held.
    assert min(info["tangram/held/cpu"].tolist()) == 0.0
    assert info["tool_calls"].tolist() == [2.0, 1.0]
