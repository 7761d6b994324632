"""A broken set-up fails where the framework builds the adapter; tangram's failures during a
call reach the framework, never the model (issue #18, "Fail loud and early").

Real verl 0.9.1 and OpenRLHF 0.11.2 code paths: verl's ``initialize_tools_from_config``,
its reward loop worker and ``ToolAgentLoop``; OpenRLHF's agent executor loaded from its
file and its ``SingleTurnAgentExecutor`` loading ``reward_func`` by path. The sandbox
failure is injected (``Sandbox.run`` raising ``SandboxBrokenError``), the rest is real.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")
openrlhf = pytest.importorskip("openrlhf") if not os.environ.get("CI") else __import__("openrlhf")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import tangram_openrlhf.agent as agent_module
    import tangram_openrlhf.reward as reward_module
    from _tiny import per_process, tiny_tokenizer
    from omegaconf import OmegaConf
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from tangram_verl import run_code, with_tangram
    from tangram_verl.reward import compute_score
    from tangram_verl.tools import FAILED_CALL
    from test_openrlhf import _call as _openrlhf_call
    from test_openrlhf import _Engine, _params
    from test_verl import (
        TOOLS_YAML,
        _agent_loop,
        _batch,
        _call,
        _reward_config,
        _Server,
        _tests_toml,
    )
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.tools.function_tool import function_tool, get_function_tool
    from verl.tools.tool_registry import initialize_tools_from_config

import tangram  # noqa: E402
from tangram import integrations  # noqa: E402
from tangram._frameworks import _failures, _session  # noqa: E402
from tangram.config import ConfigError  # noqa: E402
from tangram.errors import (  # noqa: E402
    InvalidSettingError,
    SandboxBrokenError,
    SettingTypeError,
    UnscoredSampleError,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["unset", "absent"])
def no_config(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """No usable ``$TANGRAM_CONFIG``: unset, or naming a file this node lacks."""
    if request.param == "unset":
        monkeypatch.delenv("TANGRAM_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TANGRAM_CONFIG", "/nonexistent/tangram.toml")
    return str(request.param)


def test_a_missing_config_fails_verls_tool_loader(no_config: str) -> None:
    with pytest.raises(ConfigError):
        initialize_tools_from_config(str(TOOLS_YAML))


def test_a_missing_config_fails_verls_reward_worker_at_start(
    no_config: str, tmp_path: Path
) -> None:
    tiny_tokenizer(tmp_path / "tok")
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": str(tmp_path / "tok"), "tokenizer_path": None}},
            "reward": {
                "reward_model": {"enable": False},
                "custom_reward_function": {"path": None, "name": None, "reward_kwargs": {}},
                "reward_manager": {
                    "source": "importlib",
                    "name": "TangramRewardManager",
                    "module": {"path": "pkg://tangram_verl.reward"},
                },
            },
        }
    )
    with pytest.raises(ConfigError):
        RewardLoopWorker(config)


def test_a_config_without_the_pool_a_tool_needs_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tangram.toml"
    path.write_text("[capacity]\nsearch = 2\n")
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    with pytest.raises(ConfigError, match=r"no \[sandbox\] table"):
        initialize_tools_from_config(str(TOOLS_YAML))


@pytest.mark.parametrize(
    ("needs", "error"),
    [
        ("sandbox", SettingTypeError),  # its letters were checked one by one: none a table
        (("sandboxes",), InvalidSettingError),  # a typo passed for satisfied
        (("quota.",), InvalidSettingError),
        ((3,), SettingTypeError),
    ],
)
def test_a_need_that_names_no_table_is_refused(
    tmp_path: Path, needs: Any, error: type[Exception]
) -> None:
    """``check(needs=...)`` is what fails a worker at start; one it cannot read checked
    nothing, so the worker started and every call failed later (a review)."""
    path = tmp_path / "tangram.toml"
    path.write_text('mode = "local"\n[capacity]\nsearch = 2\n')  # no [sandbox]
    with pytest.raises(error, match="`needs`"):
        integrations.check(path, needs=needs)
    with pytest.raises(ConfigError, match=r"no \[sandbox\] table"):
        integrations.check(path, needs=("sandbox",))


@pytest.mark.parametrize("piece", ["verl tool", "verl reward", "openrlhf reward"])
def test_a_sandbox_backend_that_cannot_start_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: str
) -> None:
    """Per-process mode starts its pools at the first call; the backend is started (and
    closed) where the framework builds the piece, so no daemon fails the worker there."""
    path = tmp_path / "tangram.toml"
    path.write_text(
        'mode = "local"\n[sandbox]\nbackend = "docker"\n[adapters.verl.reward]\ntests = true\n'
    )
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    with pytest.raises(ConfigError, match=r"'docker' cannot start here.*no-daemon"):
        if piece == "verl tool":
            initialize_tools_from_config(str(TOOLS_YAML))
        elif piece == "verl reward":
            config, _ = _reward_config(tmp_path, tmp_path / "tok", "reward_manager")
            config.reward.tangram.tangram_config = str(path)
            tiny_tokenizer(tmp_path / "tok")
            RewardLoopWorker(config)
        else:
            reward_module.check()


def test_a_sandbox_backend_the_jobs_scheduler_process_cannot_start_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared mode without Ray: verl's tool loader reaches the job's scheduler process,
    whose node agent cannot start the Docker backend, and the worker fails there."""
    path = tmp_path / "tangram.toml"
    path.write_text('[sandbox]\nbackend = "docker"\n[ray]\nlease_timeout = 2\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    monkeypatch.setenv("TANGRAM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANGRAM_JOB", f"fail-{tmp_path.name}")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    with pytest.raises(ConfigError, match=r"shared scheduler cannot serve.*no-daemon"):
        initialize_tools_from_config(str(TOOLS_YAML))


def test_a_missing_config_fails_openrlhfs_executors_at_start(no_config: str) -> None:
    # OpenRLHF's _load_agent_executor, in effect: load the file, build AgentExecutor().
    spec = importlib.util.spec_from_file_location("agent_module", agent_module.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ConfigError):
        module.AgentExecutor()
    # The single-turn executor loads reward_func's file when the engine actor starts.
    with pytest.raises(ConfigError):
        SingleTurnAgentExecutor(remote_rm_url=reward_module.__file__)


def _compute_tool(name: str) -> None:
    """Register a verl function tool ``name`` that runs code through tangram."""

    @function_tool(name)
    @with_tangram(kind="compute")
    async def compute(code: str) -> str:
        """Run Python in a sandbox.

        Args:
            code: the program.
        """
        return (await run_code(code)).stdout.decode()


@pytest.fixture
async def docs_config(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    path = per_process("tangram.toml")  # the sandboxes broken below are this process's
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    _failures.reset()
    yield path
    await _session.aclose()


@pytest.fixture
def broken_sandboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise SandboxBrokenError("the sandbox's process tree vanished")

    monkeypatch.setattr(tangram.Sandbox, "run", broken)


@pytest.mark.anyio
@pytest.mark.parametrize("scope", ["instance", "trajectory"])
async def test_a_broken_sandbox_stops_verls_agent_loop_and_the_model_never_sees_it(
    docs_config: Path, broken_sandboxes: None, tmp_path: Path, scope: str
) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    tools = initialize_tools_from_config(str(TOOLS_YAML))
    tools[0].scope = scope
    server = _Server(tokenizer, [_call("print(1)"), "done<|im_end|>"])
    loop = _agent_loop(tokenizer, server, tools)
    with pytest.raises(SandboxBrokenError, match="vanished"):
        await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}])
    # verl asked once and never generated again: no "Error executing tool" turn.
    assert len(server.prompts) == 1
    assert _failures.counts() == {"run_python": 1}
    assert tools[0]._failed == {}
    async with _session.session() as resources:
        stats = resources.scheduler.stats()
        assert stats.resources["cpu"].held == 0
        assert stats.running == 0


@pytest.mark.anyio
async def test_a_broken_sandbox_stops_openrlhfs_episode(
    monkeypatch: pytest.MonkeyPatch, broken_sandboxes: None, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANGRAM_CONFIG", str(per_process("openrlhf.toml")))
    _failures.reset()
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    executor = agent_module.AgentExecutor()
    engine = _Engine(tokenizer, [_openrlhf_call("print(1)"), "done"])
    try:
        with pytest.raises(SandboxBrokenError):
            await executor.execute(
                prompt="Q: ",
                label="assert True",
                sampling_params=_params(),
                max_length=4096,
                hf_tokenizer=tokenizer,
                llm_engine=engine,
            )
        assert len(engine.prompts) == 1
        assert _failures.counts() == {"run_code": 1}
        async with _session.session() as resources:
            pool = resources.sandbox_pool()
            warm = resources.config.sandbox.warm if resources.config.sandbox else 0
            await pool.wait_warm()
            assert len(pool._live) == warm  # the episode's sandbox went back at once
    finally:
        await _session.aclose()


@pytest.mark.anyio
async def test_a_failure_under_a_function_tool_is_no_observation_and_no_score(
    docs_config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """verl turns whatever a function tool raises into the model's next observation, so
    ``with_tangram`` does not raise a tangram failure: the model sees ``FAILED_CALL``
    (never the error), the call is marked in ``tool_rewards``, and both reward entries
    refuse the sample, in the agent loop's streamed layout and the trainer's batch one."""
    from _hacks import RIGHT, TESTS

    _compute_tool("tangram_failing")
    healthy = tangram.Sandbox.run

    async def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise SandboxBrokenError("the sandbox's process tree vanished")

    monkeypatch.setattr(tangram.Sandbox, "run", broken)
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    call = json.dumps({"name": "tangram_failing", "arguments": {"code": "print(1)"}})
    server = _Server(tokenizer, [f"<tool_call>{call}</tool_call><|im_end|>", "done<|im_end|>"])
    loop = _agent_loop(tokenizer, server, [get_function_tool("tangram_failing")])
    output = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}])
    assert len(server.prompts) == 2
    assert FAILED_CALL in server.prompts[1]
    assert "vanished" not in server.prompts[1] and "Error executing" not in server.prompts[1]
    rewards = output.extra_fields["tool_rewards"]
    assert len(rewards) == 1 and math.isnan(rewards[0])
    assert _failures.counts() == {"compute": 1}

    monkeypatch.setattr(tangram.Sandbox, "run", healthy)
    toml = _tests_toml(tmp_path)
    config, _ = _reward_config(tmp_path, tmp_path / "tok", "reward_manager")
    config.reward.tangram.tangram_config = str(toml)
    worker = RewardLoopWorker(config)
    sample = _batch(tokenizer, [f"```python\n{RIGHT}```"], [TESTS])
    streamed, batched, clean = copy.deepcopy(sample), copy.deepcopy(sample), copy.deepcopy(sample)
    streamed.non_tensor_batch["tool_extra_fields"] = np.array([output.extra_fields], dtype=object)
    batched.non_tensor_batch["tool_rewards"] = np.empty(1, dtype=object)
    batched.non_tensor_batch["tool_rewards"][0] = list(rewards)
    clean.non_tensor_batch["tool_rewards"] = np.empty(1, dtype=object)
    clean.non_tensor_batch["tool_rewards"][0] = [0.0]
    solution = f"```python\n{RIGHT}```"
    try:
        for data in (streamed, batched):
            with pytest.raises(UnscoredSampleError, match="not scored"):
                await worker.compute_score_batch(data)
        with pytest.raises(UnscoredSampleError):
            await compute_score(
                "code", solution, TESTS, {"tool_rewards": rewards}, tangram_config=str(toml)
            )
        # The same answer, its tool call not marked, is scored.
        assert [o["reward_score"] for o in await worker.compute_score_batch(clean)] == [1.0]
        assert (
            await compute_score(
                "code", solution, TESTS, {"tool_rewards": [0.0]}, tangram_config=str(toml)
            )
            == 1.0
        )
    finally:
        await _session.aclose()
    # Counted once, where it happened: refusing the sample is no failure of its own.
    assert _failures.counts() == {"compute": 1}


@pytest.mark.anyio
async def test_a_bad_argument_from_the_model_is_the_tools_answer_not_a_failure(
    docs_config: Path, tmp_path: Path
) -> None:
    """A NUL byte in the model's code is refused by tangram as a bad argument: the model
    gets the tool's error as its answer, as from any tool, and the step goes on. Taken
    for an infrastructure failure it stopped the step: a stop the policy could call."""
    tokenizer = tiny_tokenizer(tmp_path / "tok")

    _compute_tool("tangram_nul")
    tools = [*initialize_tools_from_config(str(TOOLS_YAML)), get_function_tool("tangram_nul")]
    for name in ("run_python", "tangram_nul"):
        call = json.dumps({"name": name, "arguments": {"code": "print('a\u0000b')"}})
        server = _Server(tokenizer, [f"<tool_call>{call}</tool_call><|im_end|>", "done<|im_end|>"])
        loop = _agent_loop(tokenizer, server, tools)
        output = await loop.run(
            {"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}]
        )
        assert "NUL byte" in server.prompts[1], name
        assert FAILED_CALL not in server.prompts[1]
        assert not any(math.isnan(r) for r in output.extra_fields["tool_rewards"])
    assert _failures.counts() == {}


@pytest.mark.anyio
async def test_a_host_failure_creating_a_sandbox_is_tangrams(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The host's disk full when a sandbox is made (no warm one left): typed as the pool's
    ``SandboxError``, so a function tool marks it rather than hand ``[Errno 28]`` to the
    model as its tool's output."""
    import errno

    import tangram._sandbox._local._backend as local

    toml = tmp_path / "t.toml"
    toml.write_text('mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 0\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(toml))
    _failures.reset()

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", "/var/tmp/tangram/box")

    monkeypatch.setattr(local, "make_box", full)

    _compute_tool("tangram_enospc")
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    call = json.dumps({"name": "tangram_enospc", "arguments": {"code": "print(1)"}})
    server = _Server(tokenizer, [f"<tool_call>{call}</tool_call><|im_end|>", "done<|im_end|>"])
    loop = _agent_loop(tokenizer, server, [get_function_tool("tangram_enospc")])
    try:
        output = await loop.run(
            {"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}]
        )
    finally:
        await _session.aclose()
    assert FAILED_CALL in server.prompts[1]
    assert "No space left" not in server.prompts[1]
    assert math.isnan(output.extra_fields["tool_rewards"][0])
    assert _failures.counts() == {"compute": 1}


@pytest.mark.parametrize(
    ("rewards", "failed"),
    [
        ([0.0, math.nan], 1),
        ([np.float64("nan")], 1),
        ([np.float32("nan"), np.float16("nan")], 2),
        (np.array([np.nan, 1.0], dtype=np.float32), 1),
        ([np.array(np.nan)], 1),
        ((1.0, 0.5), 0),
        ([[math.nan]], 0),  # not a reward of a call
        ("nan", 0),
        (None, 0),
    ],
)
def test_every_kind_of_nan_marks_a_call(rewards: Any, failed: int) -> None:
    from tangram_verl.reward import failed_calls

    assert failed_calls({"tool_rewards": rewards}) == failed
