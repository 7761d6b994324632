"""The OpenRLHF adapter on the real OpenRLHF package (0.11.2), on the CPU.

OpenRLHF's own ``MultiTurnAgentExecutor.execute`` drives tangram's ``AgentInstance``,
loaded from ``tangram_openrlhf/agent.py`` the way OpenRLHF's vLLM actor loads
``--train.agent_func_path`` (``_load_agent_executor`` lives in a module that imports
vLLM, so its three lines are repeated here); its ``SingleTurnAgentExecutor`` loads and
calls ``reward_func`` from ``tangram_openrlhf/reward.py`` as ``--reward.remote_url``
does. Tool calls and rewards run in real sandboxes (tangram's local backend). The one
stand-in is the vLLM engine and its sampling parameters (vLLM needs a GPU): the engine
returns fixed turns, encoded by a real tokenizer built in the test.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

openrlhf = pytest.importorskip("openrlhf") if not os.environ.get("CI") else __import__("openrlhf")

# transformers' import chain warns about things that are its own business; pytest would
# turn them into errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import tangram_openrlhf.agent as agent_module
    import tangram_openrlhf.reward as reward_module
    from _hacks import HACKS, RIGHT, WRONG
    from _hacks import TESTS as TESTS_2
    from _tiny import per_process, tiny_tokenizer
    from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor
    from tangram_openrlhf.agent import parse_tool_calls

    from tangram._frameworks import _session


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # vLLM's engine loop is asyncio


DOCS_CONFIG = per_process("openrlhf.toml")


@pytest.fixture
async def config(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    """The docs' config as ``$TANGRAM_CONFIG``; this loop's scheduler stopped after."""
    monkeypatch.setenv("TANGRAM_CONFIG", str(DOCS_CONFIG))
    yield DOCS_CONFIG
    await _session.aclose()


class _Engine:
    """Stand-in for OpenRLHF's vLLM engine: each call returns the next fixed turn."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.prompts: list[str] = []

    async def generate(
        self, prompt_ids: list[int], params: Any, multi_modal_data: Any = None
    ) -> Any:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        text = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


def _params() -> Any:
    """Stand-in for ``vllm.SamplingParams``: the two attributes the executors read."""
    return SimpleNamespace(max_tokens=None, logprobs=None)


def _load_executor() -> AgentExecutorBase:
    # OpenRLHF's _load_agent_executor, verbatim in effect (its module imports vLLM).
    spec = importlib.util.spec_from_file_location("agent_module", agent_module.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    executor = module.AgentExecutor()
    assert isinstance(executor, AgentExecutorBase)
    return executor


def _call(code: str) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': 'run_code', 'arguments': {'code': code}})}</tool_call>"


TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


@pytest.mark.anyio
async def test_the_multi_turn_executor_runs_tool_calls_in_one_sandbox_per_prompt(
    config: Path, tmp_path: Path
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = _load_executor()

    def turns(n: int) -> list[str]:
        return [
            # The first call leaves a file; the second finds it: one sandbox per episode.
            _call(f"open('state.txt', 'w').write('{n}'); print('wrote', {n})"),
            _call(
                "import os; print('found', open('state.txt').read(), os.environ['TANGRAM_CPUS'])"
            ),
            "Done:\n```python\ndef add(a, b):\n    return a + b\n```",
        ]

    engines = [_Engine(tokenizer, turns(n)) for n in range(3)]
    results: dict[int, dict[str, Any]] = {}

    async def episode(n: int) -> None:
        results[n] = await executor.execute(
            f"Write add #{n}.", TESTS, _params(), 4096, tokenizer, engines[n]
        )

    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(episode, n)

    for n in range(3):
        result = results[n]
        assert result["reward"] == 1.0
        assert float(result["scores"]) == 1.0
        assert result["extra_logs"] == {"turns": 3.0, "tool_calls": 2.0}
        assert len(result["action_ranges"]) == 3
        transcript = engines[n].prompts[-1]
        assert f"wrote {n}" in transcript
        found = transcript.split("found ", 1)[1].split("\n", 1)[0].split()
        assert found[0] == str(n)  # its own file, not another episode's
        assert 1 <= int(found[1]) <= 4
    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.kinds["run_code"].completed == 6
        assert stats.kinds["reward"].completed == 3
        assert stats.resources["cpu"].held == 0
        pool = resources.sandbox_pool()
        await pool.wait_warm()
        # Every episode's sandbox went back: only the warm set is left.
        assert len(pool._live) == resources.config.sandbox.warm == 8


@pytest.mark.anyio
async def test_a_wrong_answer_or_a_failing_call_scores_zero(config: Path, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = _load_executor()
    engine = _Engine(
        tokenizer,
        [
            _call("raise SystemExit(3)"),
            "```python\ndef add(a, b):\n    return a - b\n```",
        ],
    )
    result = await executor.execute("Write add.", TESTS, _params(), 4096, tokenizer, engine)
    assert result["reward"] == 0.0
    assert "(exit code 3)" in engine.prompts[-1]


def test_tool_calls_are_parsed_as_hermes_writes_them() -> None:
    text = _call("print(1)") + "<tool_call>not json</tool_call>" + _call("print(2)")
    assert [c["arguments"]["code"] for c in parse_tool_calls(text)] == ["print(1)", "print(2)"]


@pytest.mark.anyio
async def test_the_single_turn_reward_function_runs_the_tests_in_a_sandbox(
    config: Path, tmp_path: Path
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = SingleTurnAgentExecutor(remote_rm_url=reward_module.__file__)
    right = _Engine(tokenizer, ["```python\ndef add(a, b):\n    return a + b\n```"])
    wrong = _Engine(tokenizer, ["```python\ndef add(a, b):\n    return 5\n```"])
    good = await executor.execute("Write add.", TESTS, _params(), 512, tokenizer, right)
    bad = await executor.execute("Write add.", TESTS, _params(), 512, tokenizer, wrong)
    assert good["reward"].tolist() == [1.0]
    assert bad["reward"].tolist() == [0.0]
    # ``return 5`` passes the first assertion and fails the second.
    assert bad["extra_logs"]["tests_passed"].tolist() == [1.0]
    assert bad["extra_logs"]["tests_total"].tolist() == [2.0]


@pytest.fixture
def fast_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The docs' config with short grading limits: the hacks that hang cost them."""
    toml = tmp_path / "fast.toml"
    toml.write_text(
        DOCS_CONFIG.read_text().replace("timeout = 30", "timeout = 6\ncase_timeout = 2")
    )
    monkeypatch.setenv("TANGRAM_CONFIG", str(toml))
    return toml


def test_no_hack_of_the_red_team_scores_through_the_reward_function(fast_config: Path) -> None:
    """Every hack of ``tests/_hacks.py`` through ``reward_func`` as OpenRLHF calls it (from a
    worker thread), beside a correct answer; the old reward gave 15 of them 1.0."""
    names = list(HACKS)
    queries = [f"Q\n```python\n{RIGHT}```"] + [f"Q\n```python\n{HACKS[n].answer}```" for n in names]
    labels = [TESTS_2] + [HACKS[n].tests for n in names]
    scored = reward_module.reward_func(queries, ["Q\n"] * len(queries), labels)
    rewards = dict(zip(["right", *names], scored["rewards"].tolist(), strict=True))
    assert rewards == {"right": 1.0, **{n: 0.0 for n in names}}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "name",
    [
        "os._exit(0) before the tests",
        "an atexit handler that exits 0",
        "fork, the parent exits 0",
        "return an object whose __eq__ is always true",
        "read the tests and answer from a table",
    ],
)
async def test_a_hack_in_the_final_answer_scores_zero_in_the_agent(
    fast_config: Path, tmp_path: Path, name: str
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = _load_executor()
    engine = _Engine(tokenizer, [f"Done:\n```python\n{HACKS[name].answer}```"])
    try:
        result = await executor.execute(
            "Write add.", HACKS[name].tests, _params(), 4096, tokenizer, engine
        )
    finally:
        await _session.aclose()
    assert result["reward"] == 0.0


@pytest.mark.anyio
async def test_files_the_models_tool_calls_left_do_not_reach_the_reward(
    fast_config: Path, tmp_path: Path
) -> None:
    """Tool calls plant modules that would forge a verdict if the grading ran beside them
    (in the trajectory's sandbox, without ``-I``): the reward grades in a fresh sandbox."""
    forge = (
        "import os, sys; s = sys.stdin.readline().strip(); print(s, '{\"started\": true}'); "
        'print(s, \'{"passed": 2, "total": 2}\'); sys.stdout.flush(); os._exit(0)'
    )
    plant = "; ".join(
        f"open({module!r}, 'w').write({forge!r})"
        for module in ("json.py", "ast.py", "sitecustomize.py", "select.py")
    )
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = _load_executor()
    engine = _Engine(tokenizer, [_call(plant), f"```python\n{WRONG}```"])
    try:
        result = await executor.execute("Write add.", TESTS_2, _params(), 4096, tokenizer, engine)
    finally:
        await _session.aclose()
    assert result["reward"] == 0.0
    assert result["extra_logs"]["tool_calls"] == 1.0
