"""What tangram's part of a tool call raises never reaches the model as its tool's output,
and what the model's arguments or an adapter's settings get wrong fails typed, where it is made.

A hostile review of the adapters (helper, this round) proved each with a test that failed:
a bug raising inside tangram (a plain ``AttributeError`` in a backend) was shown to the
model by verl, OpenRLHF and ``with_tangram`` as its tool's error, and the episode scored;
the OpenRLHF reward file read ``[adapters.openrlhf]`` unchecked (``partial = "false"``
scored half an answer 0.5); verl's reward manager started with settings that failed every
sample; demands of the wrong type passed a tool's build; a failed ``reset`` went
uncounted; and the model's malformed arguments raised untyped errors, which, once tangram's
bugs count as tangram's, would have been a stop of training the model could call at will.
The injected bug stands for any exception tangram never meant to raise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")
openrlhf = pytest.importorskip("openrlhf") if not os.environ.get("CI") else __import__("openrlhf")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import tangram_openrlhf.agent as agent_module
    import tangram_openrlhf.reward as reward_module
    from _tiny import per_process, tiny_tokenizer
    from tangram_verl import with_tangram
    from test_fail_early import _compute_tool
    from test_openrlhf import _call as _openrlhf_call
    from test_openrlhf import _Engine, _params
    from test_verl import TOOLS_YAML, _agent_loop, _call, _Server
    from verl.tools.function_tool import get_function_tool
    from verl.tools.tool_registry import initialize_tools_from_config

import tangram  # noqa: E402
from tangram import integrations  # noqa: E402
from tangram._frameworks import _failures, _session  # noqa: E402
from tangram._sandbox._local._backend import _LocalHandle  # noqa: E402
from tangram.config import ConfigError  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def verl_config(monkeypatch: pytest.MonkeyPatch):
    path = per_process("tangram.toml")
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    _failures.reset()
    yield path
    await _session.aclose()


@pytest.fixture
async def openrlhf_config(monkeypatch: pytest.MonkeyPatch):
    path = per_process("openrlhf.toml")
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    _failures.reset()
    yield path
    await _session.aclose()


BUG = "'NoneType' object has no attribute 'read'  <<tangram-internal-bug>>"


@pytest.fixture
def buggy_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside tangram's local backend: its execute raises a plain AttributeError."""

    async def execute(self: Any, request: Any) -> Any:
        raise AttributeError(BUG)

    monkeypatch.setattr(_LocalHandle, "execute", execute)


async def _held(resources: Any) -> float:
    return resources.scheduler.stats().resources["cpu"].held


# ---------------------------------------------------------------------------------------
# a bug raising inside tangram is handed to the model as its tool's output
# ---------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("scope", ["instance", "trajectory"])
async def test_a_tangram_bug_under_verls_sandbox_tool_fails_the_step(
    verl_config: Path, buggy_backend: None, tmp_path: Path, scope: str
) -> None:
    """A plain exception raised inside tangram (not a TangramError/OSError) is not
    'infrastructure' per is_infrastructure, so SandboxTool.execute does not keep it for
    release: verl's ToolAgentLoop shows the model "Error executing tool ...: <bug text>"
    and generates again."""
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    tools = initialize_tools_from_config(str(TOOLS_YAML))
    tools[0].scope = scope
    server = _Server(tokenizer, [_call("print(1)"), "done<|im_end|>"])
    loop = _agent_loop(tokenizer, server, tools)
    with contextlib.suppress(Exception):
        await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}])
    seen = "".join(server.prompts[1:])
    assert "tangram-internal-bug" not in seen, "tangram's own bug reached the model as output"
    assert len(server.prompts) == 1, "the step went on after tangram failed"


async def _episode(tokenizer: Any, engine: Any) -> Any:
    """One OpenRLHF episode through tangram's executor: a tool call, then an answer."""
    return await agent_module.AgentExecutor().execute(
        prompt="Q: ",
        label="assert True",
        sampling_params=_params(),
        max_length=4096,
        hf_tokenizer=tokenizer,
        llm_engine=engine,
    )


@pytest.mark.anyio
async def test_a_tangram_bug_under_an_openrlhf_episode_fails_it(
    openrlhf_config: Path, buggy_backend: None, tmp_path: Path
) -> None:
    """AgentInstance._step turns every non-'infrastructure' exception of a tool call into
    "error: {exc}" feedback: a bug inside tangram becomes the model's
    next observation and the episode is scored as usual."""
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    engine = _Engine(tokenizer, [_openrlhf_call("print(1)"), "done"])
    with contextlib.suppress(Exception):
        await _episode(tokenizer, engine)
    seen = "".join(engine.prompts[1:])
    assert "tangram-internal-bug" not in seen, "tangram's own bug reached the model as output"
    assert len(engine.prompts) == 1, "the episode went on after tangram failed"


@pytest.mark.anyio
async def test_a_tangram_bug_under_with_tangram_is_a_failed_call(
    verl_config: Path, buggy_backend: None, tmp_path: Path
) -> None:
    """with_tangram re-raises a non-TangramError from run_code as the function's own
    : verl shows the bug's text to the model, no NaN marks the call,
     and the sample is scored."""
    _compute_tool("review_buggy")
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    call = json.dumps({"name": "review_buggy", "arguments": {"code": "print(1)"}})
    server = _Server(tokenizer, [f"<tool_call>{call}</tool_call><|im_end|>", "done<|im_end|>"])
    loop = _agent_loop(tokenizer, server, [get_function_tool("review_buggy")])
    output = None
    with contextlib.suppress(Exception):
        output = await loop.run(
            {"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "go"}]
        )
    seen = "".join(server.prompts[1:])
    assert "tangram-internal-bug" not in seen, "tangram's own bug reached the model as output"
    if output is not None:
        assert any(math.isnan(r) for r in output.extra_fields["tool_rewards"]), (
            "the call is not marked: the sample will be scored"
        )


# ---------------------------------------------------------------------------------------
# the OpenRLHF single-turn reward reads its settings unchecked
# ---------------------------------------------------------------------------------------


def _openrlhf_toml(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "orl.toml"
    path.write_text(
        'mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 1\n[adapters.openrlhf]\n' + extra
    )
    return path


@pytest.mark.parametrize(
    "extra",
    ['partial = "false"\n', 'timeout = "30"\n', 'case_timeout = "5"\n', "partail = true\n"],
)
def test_the_openrlhf_reward_file_checks_its_settings_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    """docs/openrlhf.md: the reward file raises ConfigError at load for a value of
    [adapters.openrlhf] of the wrong type (`partial = "false"`, `timeout = "30"`). But
    reward.check() checks only `cpu`, and score_code reads `partial`
    with bool() and passes `timeout`/`case_timeout` raw."""
    monkeypatch.setenv("TANGRAM_CONFIG", str(_openrlhf_toml(tmp_path, extra)))
    with pytest.raises(ConfigError):
        reward_module.check()


HALF = "```python\ndef add(a, b):\n    return 5\n```"  # passes 1 of 2 tests
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


def test_the_openrlhf_reward_never_reads_partial_false_as_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`partial = "false"` is read with bool(): True, so an answer that
    passes half the tests scores 0.5 where the file meant all or nothing (0.0)."""
    monkeypatch.setenv("TANGRAM_CONFIG", str(_openrlhf_toml(tmp_path, 'partial = "false"\n')))
    try:
        out = reward_module.reward_func([HALF], [""], [TESTS])
    except ConfigError:
        return  # refused: fine
    finally:
        integrations.portal_call(_session.aclose)
    assert float(out["rewards"][0]) == 0.0, float(out["rewards"][0])


# ---------------------------------------------------------------------------------------
# verl reward settings that cannot work pass the manager's start
# ---------------------------------------------------------------------------------------


def _manager(tmp_path: Path, table: str, overrides: dict[str, Any] | None = None) -> Any:
    from omegaconf import OmegaConf
    from tangram_verl.reward import TangramRewardManager

    toml = tmp_path / "r.toml"
    toml.write_text(
        'mode = "local"\n[sandbox]\nbackend = "local"\nwarm = 0\n'
        '[gpu]\ndevices = { "cpu:0" = "1MiB" }\n[[gpu.services]]\nname = "judge"\n'
        'factory = "_tiny:build_judge"\n[adapters.verl.reward]\n' + table
    )
    config = OmegaConf.create(
        {"reward": {"tangram": {"tangram_config": str(toml), **(overrides or {})}}}
    )
    tok = tiny_tokenizer(tmp_path / "tok")
    return TangramRewardManager(config, tok, None)


@pytest.mark.parametrize(
    ("table", "overrides"),
    [
        ("tests = true\n", {"partail": True}),  # misspelt override: dropped silently
        ("tests = false\n", None),  # nothing to score with: every sample raises
        ('service = "judge"\nencode = "no_such_module:encode"\n', None),
        ('service = "nosuch"\nencode = "_tiny:encode"\n', None),
    ],
)
def test_verls_reward_manager_refuses_settings_that_cannot_score(
    tmp_path: Path, table: str, overrides: dict[str, Any] | None
) -> None:
    """The manager's start checked value types, not that the settings can score: an
    unknown key in `reward.tangram` was dropped, and an `encode` that does not load, a
    `service` no [[gpu.services]] entry names, or none of tests/service/quota passed the
    start, and every sample then raised or was scored another way than asked."""
    with pytest.raises((ConfigError, tangram.errors.TangramError)):
        _manager(tmp_path, table, overrides)


# ---------------------------------------------------------------------------------------
# with_tangram / TangramTool demands are not checked where they are declared
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amounts", [{"cpu": "two"}, {"cpu": -1}, {"cpu": math.inf}, {"search": True}]
)
@pytest.mark.anyio
async def test_with_tangram_checks_its_demand_where_it_decorates(
    verl_config: Path, amounts: dict[str, Any]
) -> None:
    """with_tangram loads the config at decoration but never checks the
    demand: every call then fails with InvalidDemandError, which the tool turns
    into FAILED_CALL + NaN for each call of the run instead of failing the worker at
    start (docs/verl.md: 'A function tool's config is loaded when with_tangram decorates
    it')."""
    with pytest.raises((ConfigError, tangram.errors.InvalidDemandError)):

        @with_tangram(**amounts)
        async def tool(x: str) -> str:
            return x


@pytest.mark.parametrize("demand", [{"search": "one"}, {"search": -3}, {"search": [1]}])
@pytest.mark.anyio
async def test_a_tangram_tool_checks_its_demand_where_it_is_built(
    verl_config: Path, demand: dict[str, Any]
) -> None:
    """TangramTool's demand_of checks only that `demand` is a
    non-empty table: amounts of the wrong type or sign, or resources the config lacks,
    pass initialize_tools_from_config and fail every call."""
    from tangram_verl.tools import TangramTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "s",
                "parameters": {"type": "object", "properties": {}, "required": []},
            },
        }
    )
    with pytest.raises((ConfigError, tangram.errors.InvalidDemandError)):
        TangramTool(
            {
                "type": "native",
                "wraps": "tangram_verl.examples.HttpSearchTool",
                "demand": demand,
                "url": "http://127.0.0.1:1/search",
            },
            schema,
        )


# ---------------------------------------------------------------------------------------
# a tangram failure in OpenRLHF's reset() is neither counted nor logged at ERROR
# ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_failed_openrlhf_reset_is_counted(
    openrlhf_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reset() has no is_infrastructure/record handler, unlike step():
    a pool that cannot give a sandbox fails the episode uncounted (docs/openrlhf.md:
    'Every tangram failure is logged at ERROR ... and counted per action kind')."""
    from tangram._sandbox._pool import SandboxPool
    from tangram.errors import SandboxError

    async def no_sandbox(self: Any) -> Any:
        raise SandboxError("could not create a sandbox: no uid left")

    monkeypatch.setattr(SandboxPool, "_checkout", no_sandbox)
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    engine = _Engine(tokenizer, [_openrlhf_call("print(1)"), "done"])
    with pytest.raises(SandboxError):
        await _episode(tokenizer, engine)
    assert sum(_failures.counts().values()) == 1, _failures.counts()


# ---------------------------------------------------------------------------------------
# the model's malformed tool-call arguments raise untyped exceptions from execute
# ---------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "parameters",
    [
        {"code": "print(1)", "language": ["python"]},  # TypeError: unhashable type
        {"code": "print(1)", "language": {"x": 1}},
        {"code": "print(1)", "timeout": 10**400},  # OverflowError in float()
        ["print(1)"],  # AttributeError: 'list' object has no attribute 'get'
        "print(1)",
    ],
)
async def test_the_models_malformed_arguments_are_answered_to_it(
    verl_config: Path, parameters: Any
) -> None:
    """SandboxTool.execute checks `code` and answers a bad `language` string as the
    tool's answer, but `language` that is not hashable (`in` a set), a
    `timeout` integer past float range (`float()`), and arguments that are
    not an object (`.get`) raise TypeError/OverflowError/AttributeError out
    of execute. verl shows them to the model today, but they are untyped, and any fix of
    F1 that treats non-TangramError exceptions as tangram's would turn them into a stop
    of training the policy can call at will."""
    tool = initialize_tools_from_config(str(TOOLS_YAML))[0]
    tool.timeout = None  # no configured cap: the call's own timeout applies
    instance, _ = await tool.create()
    try:
        response, _, _ = await tool.execute(instance, parameters)
        assert isinstance(response.text, str) and response.text
    finally:
        await tool.release(instance)
