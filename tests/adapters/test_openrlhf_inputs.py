"""What reaches the OpenRLHF agent from the model's text and from ``[adapters.openrlhf]``.

OpenRLHF's ``MultiTurnAgentExecutor`` does not catch what ``AgentInstance.step`` raises:
anything raised for the model's own text failed the engine actor's generate call and the
training step, a stop a policy could call by writing it. A setting of the wrong type
failed every episode instead of the engine actor at start, or changed what is scored
without a word (``partial = "false"`` was true). Found by a hostile review; each test
failed before its fix. Real sandboxes (tangram's local backend), no stand-in.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

openrlhf = pytest.importorskip("openrlhf") if not os.environ.get("CI") else __import__("openrlhf")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import tangram_openrlhf.agent as agent_module

from tangram._frameworks import _session  # noqa: E402
from tangram.config import ConfigError  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # vLLM's engine loop is asyncio


@pytest.fixture
async def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    path = tmp_path / "tangram.toml"
    path.write_text(
        'mode = "local"\n[sandbox]\nbackend = "local"\n'
        "[adapters.openrlhf]\nmax_turns = 4\ncpu = 1\ntimeout = 30\n"
    )
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    yield path
    await _session.aclose()


async def _step(action: str) -> dict[str, Any]:
    episode = agent_module.AgentInstance()
    await episode.reset({"observation": "prompt"})
    try:
        out: dict[str, Any] = await episode.step(
            {"action_text": action, "label": "assert True", "sampling_params": None}
        )
        return out
    finally:
        await episode._release()


def _call(arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': 'run_code', 'arguments': arguments})}</tool_call>"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    [
        "[" * 100_000 + "]" * 100_000,  # past the parser's recursion: RecursionError
        '{"name": "run_code", "arguments": {"n": ' + "9" * 5000 + "}}",  # a ValueError
    ],
    ids=["nested", "long-integer"],
)
async def test_json_the_parser_cannot_read_is_a_malformed_call(config: Path, body: str) -> None:
    out = await _step(f"<tool_call>{body}</tool_call>")
    assert out["done"] is True  # no tool call was read: the episode ends and is scored


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "said"),
    [("print(1)\0", "NUL byte"), ('print("\ud800")', "not UTF-8")],
    ids=["nul", "lone-surrogate"],
)
async def test_a_bad_argument_goes_back_to_the_model(config: Path, code: str, said: str) -> None:
    out = await _step(_call({"code": code}))
    assert out["done"] is False
    assert said in out["environment_feedback"]


@pytest.mark.parametrize(
    "line",
    [
        'timeout = "30"',
        'partial = "false"',
        'metrics = "no"',
        'feedback = "{out}"',
        'feedback = "{0}"',
        'max_turns = "four"',
        "max_turns = 0",
        "case_timeout = -1",
        "kind = 7",
        'kind = ""',
        'reward = "nosuch_module:fn"',
        'cpu = { max = 4, resizable = "false" }',
    ],
)
def test_each_setting_is_checked_where_the_executor_is_built(
    line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tangram.toml"
    path.write_text(f'mode = "local"\n[sandbox]\nbackend = "local"\n[adapters.openrlhf]\n{line}\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    key = line.partition(" ")[0]
    with pytest.raises(ConfigError, match=key):
        agent_module.AgentExecutor()


@pytest.mark.anyio
async def test_the_executors_episodes_take_the_settings_it_checked(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenRLHF builds an episode per prompt: the executor's checked settings serve each,
    not a new read of the config (which loaded the `reward` object again every time)."""
    executor = agent_module.AgentExecutor()
    read = []
    monkeypatch.setattr(agent_module, "read_settings", lambda: read.append(1) or {})
    episodes = [executor.agent_instance_cls() for _ in range(3)]
    assert read == []
    assert [e.max_turns for e in episodes] == [4, 4, 4]
    assert [e.timeout for e in episodes] == [30, 30, 30]
