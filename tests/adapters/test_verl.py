"""The verl adapter on the real verl package (0.9.1), on the CPU.

verl's own code drives tangram's: its ``ToolAgentLoop`` parses the model's tool call and
calls the tool; its ``initialize_tools_from_config`` loads the tool YAML shipped in
docs/examples; its ``@function_tool`` registry calls the function tool; its reward loop
worker loads and awaits the reward function and the reward manager by module path, both
in this process and in the Ray actor its ``RewardLoopManager`` starts on a real local
Ray cluster. Sandboxes are real (tangram's local backend), the reward model is a real
torch module restored by tangram's GPU pool onto a simulated CPU device, and the search
API is a real loopback HTTP server enforcing a concurrency limit. The one stand-in is the
LLM server behind the agent loop (vLLM needs a GPU): it returns fixed token ids, encoded
by a real tokenizer built in the test.
"""

from __future__ import annotations

import gc
import json
import os
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")
ray = pytest.importorskip("ray") if not os.environ.get("CI") else __import__("ray")

# verl's import chain imports ``ray.experimental.state``, which warns that it moved;
# that is verl's to fix, and pytest turns warnings into errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch
    from _tiny import ROLLOUT, per_process, tiny_tokenizer
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.experimental.reward_loop.reward_loop import RewardLoopManager, RewardLoopWorker
    from verl.tools.base_tool import BaseTool
    from verl.tools.function_tool import FunctionTool, function_tool
    from verl.tools.schemas import ToolResponse
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.workers.rollout.replica import TokenOutput

from tangram_verl import SandboxTool, TangramTool, run_code, with_tangram  # noqa: E402

from tangram._frameworks import _failures, _session  # noqa: E402
from tangram.errors import UnknownSandboxError  # noqa: E402
from tangram.testing import Limit, QuotaServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOOLS_YAML = ROOT / "docs" / "examples" / "verl_tools.yaml"
TANGRAM_TOML = per_process("tangram.toml")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # verl's agent and reward loops are asyncio


@pytest.fixture
async def docs_config(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    """The docs' tangram config as ``$TANGRAM_CONFIG``; this loop's scheduler stopped after."""
    monkeypatch.setenv("TANGRAM_CONFIG", str(TANGRAM_TOML))
    yield TANGRAM_TOML
    await _session.aclose()


def test_the_docs_tool_yaml_loads_with_verls_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_CONFIG", str(TANGRAM_TOML))
    tools = initialize_tools_from_config(str(TOOLS_YAML))
    run, search = tools
    assert isinstance(run, SandboxTool)
    assert run.name == "run_python"
    assert run.cpu == 1  # rigid: elastic cores only where a tool declares them (#18)
    assert isinstance(search, TangramTool)
    assert search.name == "search"
    assert search.demand == {"search": 1, "search_conn": 1}
    assert type(search.inner).__name__ == "HttpSearchTool"


class _Server:
    """Stand-in for verl's LLM server (vLLM needs a GPU): fixed turns as real token ids."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.prompts: list[str] = []

    async def generate(self, request_id: str, prompt_ids: list[int], **kwargs: Any) -> TokenOutput:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        text = self.turns.pop(0)
        return TokenOutput(token_ids=self.tokenizer.encode(text, add_special_tokens=False))


def _agent_loop(tokenizer: Any, server: _Server, tools: list[Any]) -> ToolAgentLoop:
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": ROLLOUT}, "data": {}})
    return ToolAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(tools),
    )


def _call(code: str) -> str:
    arguments = json.dumps({"name": "run_python", "arguments": {"code": code}})
    return f"<tool_call>{arguments}</tool_call><|im_end|>"


TURNS = [
    _call("open('n.txt', 'w').write(str(sum(range(10))))"),
    _call(
        "import os; print(open('n.txt').read(), os.environ['TANGRAM_CPUS'], "
        "len(os.sched_getaffinity(0)))"
    ),
    "The sum is 45.<|im_end|>",
]


@pytest.mark.anyio
async def test_tool_agent_loop_runs_the_call_in_a_tangram_sandbox(
    docs_config: Path, tmp_path: Path
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    tools = initialize_tools_from_config(str(TOOLS_YAML))
    server = _Server(tokenizer, TURNS)
    loop = _agent_loop(tokenizer, server, tools)
    output = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "Sum?"}])

    # The third generation saw the second call's real output: the file the first call
    # wrote in the trajectory's sandbox, the granted core count in $TANGRAM_CPUS, and an
    # affinity pinned to that many cores.
    assert len(server.prompts) == 3
    tool_turn = server.prompts[2].rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    total, granted, visible = tool_turn.split()
    assert total == "45"
    assert 1 <= int(granted) <= 4
    assert int(visible) == int(granted)
    assert output.num_turns == 6
    assert "The sum is 45." in tokenizer.decode(output.response_ids)

    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.kinds["run_python"].completed == 2
        assert stats.resources["cpu"].held == 0
        assert stats.running == stats.waiting == 0
        pool = resources.sandbox_pool()
        warm = resources.config.sandbox.warm if resources.config.sandbox else 0
        # The trajectory's sandbox goes back once verl drops the trajectory's state.
        await pool.wait_warm()
        assert len(pool._live) == warm + 1
        del loop, output
        gc.collect()
        for _ in range(200):
            if len(pool._live) == warm:
                break
            await anyio.sleep(0.01)
        assert len(pool._live) == warm


@pytest.mark.anyio
async def test_a_call_on_an_instance_with_no_sandbox_is_a_tangram_error(
    docs_config: Path,
) -> None:
    """Never created (or already released): tangram's error, kept for ``release``."""
    run = initialize_tools_from_config(str(TOOLS_YAML))[0]
    run.scope = "instance"
    try:
        with pytest.raises(UnknownSandboxError, match="'never-created'") as caught:
            await run.execute("never-created", {"code": "print(1)"})
        assert isinstance(caught.value, KeyError)  # what it raised before it had a class
        assert str(caught.value).startswith("no sandbox for instance")  # not KeyError's repr
        # Like any tangram failure under verl, raised again from release, then forgotten.
        with pytest.raises(UnknownSandboxError):
            await run.release("never-created")
        assert run._failed == {}
    finally:
        _failures.reset()


class _Probe(BaseTool):
    """A plain verl tool (no tangram) that records how many of its calls overlap."""

    active = 0
    peak = 0

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        type(self).active += 1
        type(self).peak = max(type(self).peak, type(self).active)
        try:
            await anyio.sleep(0.02)
        finally:
            type(self).active -= 1
        return ToolResponse(text="ok"), 0.0, {}


@pytest.mark.anyio
async def test_the_wrapper_puts_an_unchanged_tool_under_the_api_limits(
    docs_config: Path,
) -> None:
    """The docs' search entry against a real server allowing 4 connections per key."""
    tools = initialize_tools_from_config(str(TOOLS_YAML))
    search = tools[1]
    async with QuotaServer(Limit(concurrency=4), latency=0.2) as server:
        search.inner.url = f"{server.url}/search"

        async def call(i: int, tool: BaseTool) -> None:
            instance, _ = await tool.create()
            response, _, _ = await tool.execute(instance, {"query": f"q{i}"})
            results.append(response.text or "")
            await tool.release(instance)

        # The bare tool, unchanged, floods the server: some of 8 calls are refused.
        results: list[str] = []
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(call, i, search.inner)
        assert server.rejected
        refused = len(server.rejected)

        # Wrapped: the same 8 calls are admitted 4 at a time, at most 5 a second.
        results = []
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(call, i, search)
        elapsed = anyio.current_time() - started
    assert len(server.rejected) == refused
    assert all('"key"' in text for text in results)
    assert elapsed >= 0.3  # 8 requests at 5/s: 3 wait past the burst
    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.kinds["search"].completed == 8
        assert stats.resources["search_conn"].peak == 4
        assert stats.resources["search_conn"].held == 0


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["local", "shared"])
async def test_an_api_judge_reward_goes_through_the_quota(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compute_score with ``quota``: every judge request is admitted by the key's limits,
    of this process (``local``) or of the job (``shared``, the default: its scheduler
    sends them; here the node's scheduler process, without Ray). In shared mode every
    judge request raised ``SettingTypeError`` before."""
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANGRAM_JOB", f"judge-{tmp_path.name}")
    toml = tmp_path / "judge.toml"
    toml.write_text(
        f'mode = "{mode}"\n'
        "[quota.judge]\n"
        'keys = [{ name = "a", requests = "50/s", concurrency = 2, '
        'headers = { Authorization = "Bearer a" } }]\n'
        "[adapters.verl.reward]\n"
        'quota = "judge"\n'
        'judge = "_tiny:ask_judge"\n'
    )
    from tangram_verl.reward import compute_score

    scores: dict[int, float] = {}
    try:
        async with QuotaServer(Limit(concurrency=2), latency=0.05) as server:

            async def one(i: int) -> None:
                scores[i] = await compute_score(
                    "test",
                    f"the answer is {i}",
                    "3",
                    {},
                    tangram_config=str(toml),
                    base_url=server.url,
                )

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
        assert scores == {i: float(i == 3) for i in range(6)}
        assert len(server.accepted) == 6
        assert not server.rejected  # 6 concurrent samples, never more than 2 in flight
        assert server.peak_in_flight["a"] == 2
    finally:
        await _session.aclose()


def _tests_toml(tmp_path: Path) -> Path:
    toml = tmp_path / "tests.toml"
    toml.write_text(
        'mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 2\n'
        "[adapters.verl.reward]\ntests = true\ntimeout = 6\ncase_timeout = 2\n"
    )
    return toml


@pytest.mark.anyio
async def test_a_code_reward_grades_the_answer_against_its_tests(tmp_path: Path) -> None:
    """compute_score with ``tests``: assertion tests and verl's SandboxFusion JSON (stdio),
    right answers 1.0, wrong ones and every hack of the red team 0.0."""
    from _hacks import HACKS, RIGHT, RIGHT_MAIN, STDIO, TESTS, WRONG
    from tangram_verl.reward import compute_score

    toml = _tests_toml(tmp_path)
    samples = {
        "right": (RIGHT, TESTS, 1.0),
        "wrong": (WRONG, TESTS, 0.0),
        "right stdio": (RIGHT_MAIN, json.dumps(STDIO), 1.0),
        **{name: (hack.answer, hack.tests, 0.0) for name, hack in HACKS.items()},
    }
    try:
        for name, (answer, truth, expected) in samples.items():
            solution = f"Let me write it.\n```python\n{answer}```\nDone."
            score = await compute_score("code", solution, truth, {}, tangram_config=str(toml))
            assert score == expected, name
        assert await compute_score("code", "no code", TESTS, {}, tangram_config=str(toml)) == 0.0
        async with _session.session(toml) as resources:
            stats = resources.scheduler.stats()
            assert stats.kinds["reward"].completed == len(samples)
            assert stats.resources["cpu"].held == 0
    finally:
        await _session.aclose()


@pytest.mark.anyio
async def test_the_reward_manager_grades_code_under_verls_reward_loop(tmp_path: Path) -> None:
    from _hacks import HACKS, RIGHT, TESTS

    tokenizer = tiny_tokenizer(tmp_path / "tok")
    toml = _tests_toml(tmp_path)
    config, _ = _reward_config(tmp_path, tmp_path / "tok", "reward_manager")
    config.reward.tangram.tangram_config = str(toml)
    worker = RewardLoopWorker(config)
    hacks = ["os._exit(0) before the tests", "return an object whose __eq__ is always true"]
    answers = [RIGHT, *(HACKS[name].answer for name in hacks)]
    data = _batch(tokenizer, [f"```python\n{a}```" for a in answers], [TESTS] * len(answers))
    try:
        outputs = await worker.compute_score_batch(data)
        assert [o["reward_score"] for o in outputs] == [1.0, 0.0, 0.0]
    finally:
        await _session.aclose()


@pytest.mark.anyio
# The tool holds a connection while its code waits for a core: a hold-and-wait, which the
# runtime warns about. No task here holds cores while it waits for a connection, so it
# cannot deadlock.
@pytest.mark.filterwarnings("ignore::tangram.errors.DeadlockRiskWarning")
async def test_function_tools_run_through_tangram(docs_config: Path) -> None:
    _Probe.active = _Probe.peak = 0

    @function_tool("tangram_square")
    @with_tangram(search_conn=1, kind="square")
    async def square(x: int) -> str:
        """Square a number in a sandbox.

        Args:
            x: the number.
        """
        result = await run_code(f"print({x} * {x})")
        return result.stdout.decode().strip()

    from verl.tools.function_tool import get_function_tool

    tool = get_function_tool("tangram_square")
    assert isinstance(tool, FunctionTool) and tool.is_async
    assert tool.tool_schema.function.parameters.required == ["x"]
    answers = []

    async def ask(x: int) -> None:
        answers.append(await tool.call({"x": x}))

    async with anyio.create_task_group() as tg:
        for x in range(6):
            tg.start_soon(ask, x)
    assert sorted(answers, key=int) == [str(x * x) for x in range(6)]
    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.kinds["square"].completed == 6
        assert stats.kinds["run_code"].completed == 6
        assert stats.resources["search_conn"].peak <= 4


def _reward_config(tmp_path: Path, tokenizer_dir: Path, manager: str) -> tuple[Any, Path]:
    toml = tmp_path / "reward.toml"
    toml.write_text(
        # Per process: the test reads this process's own pool and runtime (shared mode's
        # reward workers are tests/adapters/test_shared_ray.py's).
        'mode = "local"\n'
        "[gpu]\n"
        'devices = { "cpu:0" = "1MiB" }\n'
        "[[gpu.services]]\n"
        'name = "judge"\n'
        'factory = "_tiny:build_judge"\n'
        "[adapters.verl.reward]\n"
        'service = "judge"\n'
        'encode = "_tiny:encode"\n'
    )
    custom = {"path": None, "name": None, "reward_kwargs": {}}
    source = {"source": "register", "name": "naive", "module": {"path": None}}
    if manager == "custom_function":
        custom = {
            "path": "pkg://tangram_verl.reward",
            "name": "compute_score",
            "reward_kwargs": {"tangram_config": str(toml)},
        }
    else:
        source = {
            "source": "importlib",
            "name": "TangramRewardManager",
            "module": {"path": "pkg://tangram_verl.reward"},
        }
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": str(tokenizer_dir), "tokenizer_path": None}},
            "reward": {
                "reward_model": {"enable": False},
                "custom_reward_function": custom,
                "reward_manager": source,
                "tangram": {"tangram_config": str(toml)},
            },
        }
    )
    return config, toml


def _batch(tokenizer: Any, answers: list[str], truths: list[str]) -> DataProto:
    prompt = tokenizer.encode("Q", add_special_tokens=False)
    width = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in answers)
    responses, masks = [], []
    for answer in answers:
        ids = tokenizer.encode(answer, add_special_tokens=False)
        pad = width - len(ids)
        responses.append(ids + [tokenizer.pad_token_id] * pad)
        masks.append([1] * len(prompt) + [1] * len(ids) + [0] * pad)
    n = len(answers)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt] * n),
            "responses": torch.tensor(responses),
            "attention_mask": torch.tensor(masks),
        },
        non_tensors={
            "data_source": np.array(["test"] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object),
            "extra_info": np.array([{} for _ in truths], dtype=object),
        },
    )


@pytest.mark.anyio
@pytest.mark.parametrize("manager", ["custom_function", "reward_manager"])
async def test_rewards_score_on_the_gpu_pool_under_verls_reward_loop(
    tmp_path: Path, manager: str
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    config, toml = _reward_config(tmp_path, tmp_path / "tok", manager)
    worker = RewardLoopWorker(config)
    data = _batch(
        tokenizer,
        ["the answer is 42", "no idea", "42, surely", "it is 7"],
        ["42", "42", "42", "8"],
    )
    try:
        outputs = await worker.compute_score_batch(data)
        assert [o["reward_score"] for o in outputs] == [1.0, 0.0, 1.0, 0.0]
        async with _session.session(toml) as resources:
            stats = resources.gpu_pool().service_stats()["judge"]
            # Four samples, scored concurrently: the pool batched them into fewer runs.
            assert stats["batched"] == 4
            assert stats["runs"] < 4
            assert resources.scheduler.stats().resources["gpu_mem:cpu:0"].held == 0
    finally:
        await _session.aclose()


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A small local Ray cluster whose worker processes can import the ``_tiny`` helpers."""
    ray.init(
        address="local",  # a cluster of its own, never one left running
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("manager", ["custom_function", "reward_manager"])
def test_rewards_score_under_verls_reward_loop_manager_on_ray(
    cluster: None, tmp_path: Path, manager: str
) -> None:
    """verl's own ``RewardLoopManager`` on a real local Ray cluster: it starts the reward
    worker as a Ray actor (a process of its own, which loads the reward function or manager
    by module path and scores on its own tangram GPU pool) and ``compute_rm_score`` blocks
    on ``ray.get``. The stand-in: the pool's device is a simulated ``cpu:0`` (no GPU here).
    """
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    config, toml = _reward_config(tmp_path, tmp_path / "tok", manager)
    config.reward.num_workers = 1
    data = _batch(
        tokenizer,
        ["the answer is 42", "no idea", "42, surely", "it is 7"],
        ["42", "42", "42", "8"],
    )

    def pool_state(worker: Any) -> tuple[Any, ...]:
        """Runs in the actor, on a Ray thread: reads the pool of the loop that scored."""
        import asyncio

        async def read() -> tuple[Any, ...]:
            async with _session.session(toml) as resources:
                stats = resources.gpu_pool().service_stats()["judge"]
                held = resources.scheduler.stats().resources["gpu_mem:cpu:0"].held
                return stats, held, os.getpid()

        return asyncio.run_coroutine_threadsafe(read(), worker.loop).result(timeout=30)

    manager_ = RewardLoopManager(config)
    try:
        (worker,) = manager_.reward_loop_workers
        scored = manager_.compute_rm_score(data)
        # verl puts each sample's reward on its last response token, zeros elsewhere.
        rm_scores = scored.batch["rm_scores"]
        ends = data.batch["attention_mask"][:, 1:].sum(dim=1) - 1
        assert rm_scores[torch.arange(4), ends].tolist() == [1.0, 0.0, 1.0, 0.0]
        assert rm_scores.sum(dim=1).tolist() == [1.0, 0.0, 1.0, 0.0]
        stats, held, pid = ray.get(worker.__ray_call__.remote(pool_state))
        # The actor's process scored the four samples through its pool, which batched them.
        assert pid != os.getpid()
        assert stats["batched"] == 4
        assert stats["runs"] < 4
        assert held == 0
    finally:
        for handle in manager_.reward_loop_workers:
            ray.kill(handle)
        # The manager names its actors: the next test's manager reuses the name.
        for _ in range(100):
            try:
                ray.get_actor("reward_loop_worker_0")
            except ValueError:
                break
            time.sleep(0.05)
