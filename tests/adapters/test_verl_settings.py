"""verl tools' and reward's settings, checked where verl builds them, and what a set-up
mistake at a call is: tangram's failure, never the tool's output.

verl's ``ToolAgentLoop`` hands what ``execute`` raises to the model as the tool's text and
goes on. A ``timeout: "20"``, a demand on a resource the config lacks or more cores than
the node has reached every call as a bad argument, so the policy trained on a set-up
mistake while every call failed; a flag written as a string (``partial = "false"``) was
read as true. Found by a hostile review; each test failed before its fix. Real verl
classes and real sandboxes (tangram's local backend).
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl") if not os.environ.get("CI") else __import__("verl")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from tangram_verl import SandboxTool, TangramTool, with_tangram
    from tangram_verl.reward import compute_score
    from tangram_verl.tools import FAILED_CALL
    from verl.tools.schemas import OpenAIFunctionToolSchema

from tangram._frameworks import _failures, _session  # noqa: E402
from tangram.config import ConfigError  # noqa: E402

SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "run",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "tangram.toml"
    path.write_text('mode = "local"\n[capacity]\nsearch = 2\n[sandbox]\nbackend = "local"\n')
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    _failures.reset()
    yield path
    _failures.reset()


@pytest.fixture
async def session(config: Path) -> AsyncIterator[Path]:
    """The config, and this loop's session stopped after the test."""
    yield config
    await _session.aclose()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"timeout": "20"}, "`timeout`"),
        ({"default_timeout": 0}, "`timeout`"),
        ({"kind": 7}, "`kind`"),
        ({"language": ["python"]}, "`language`"),
        ({"code_param": ""}, "`code_param`"),
        ({"cpu": {"max": float("inf")}}, "`cpu`"),
        ({"cpu": {"min": 1.9, "max": 4}}, "`cpu`"),
        ({"cpu": {"max": 4, "resizable": "false"}}, "resizable"),
    ],
)
def test_a_sandbox_tools_settings_are_checked_when_verl_builds_it(
    config: Path, options: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        SandboxTool({"type": "native", **options}, SCHEMA)


async def _failed_outside_the_handler(tool: Any) -> None:
    """The call raises (verl shows the model its text) and ``release``, which verl calls
    outside that handler, raises it again: the failure reaches the worker, counted."""
    instance_id, _ = await tool.create()
    with pytest.raises(Exception) as raised:
        await tool.execute(instance_id, {"code": "print(1)", "query": "q"})
    with pytest.raises(type(raised.value)):
        await tool.release(instance_id)
    assert sum(_failures.counts().values()) == 1


@pytest.mark.anyio
async def test_more_cores_than_the_node_has_is_tangrams_failure(session: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    await _failed_outside_the_handler(SandboxTool({"type": "native", "cpu": cores + 1}, SCHEMA))


@pytest.mark.anyio
async def test_a_demand_on_a_resource_the_config_lacks_is_tangrams_failure(session: Path) -> None:
    tool = TangramTool(
        {
            "type": "native",
            "wraps": "tangram_verl.examples.HttpSearchTool",
            "demand": {"serach": 1},  # a typo of `search`
            "url": "http://127.0.0.1:9/search",
        },
        SCHEMA,
    )
    await _failed_outside_the_handler(tool)


@pytest.mark.anyio
async def test_a_function_tools_demand_typo_is_a_failed_call(session: Path) -> None:
    @with_tangram(serach=1)
    async def search(query: str) -> str:
        return "result"

    response, reward, _ = await search("q")
    assert response.text == FAILED_CALL and reward != reward  # NaN marks the sample
    assert _failures.counts() == {"search": 1}


@pytest.mark.anyio
async def test_a_demand_the_function_builds_from_the_models_arguments_is_the_calls(
    session: Path,
) -> None:
    """Inside the function, a demand may come from the model (``cores`` here): its error
    is the call's, as before, never a failed call that would refuse the sample."""
    import tangram

    @with_tangram()
    async def build(cores: int) -> str:
        async with tangram.acquire(cpu=cores):
            return "built"

    with pytest.raises(tangram.errors.CapacityExceededError):
        await build(10_000)
    assert _failures.counts() == {}


@pytest.mark.parametrize(
    "line",
    ['partial = "false"', 'tests = "yes"', "timeout = -1", 'metrics = "no"', "cpu = 0"],
)
def test_the_rewards_settings_are_checked(
    line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tangram.toml"
    path.write_text(
        f'mode = "local"\n[sandbox]\nbackend = "local"\n[adapters.verl.reward]\n{line}\n'
    )
    monkeypatch.setenv("TANGRAM_CONFIG", str(path))
    key = line.partition(" ")[0]
    with pytest.raises(ConfigError, match=key):
        asyncio.run(compute_score("x", "no code", "assert True"))


def test_a_trajectory_scoped_tool_serves_a_second_loop(config: Path) -> None:
    """Its lock bound to the first loop it waited on: overlapping first calls of
    trajectories on a second loop raised RuntimeError, which verl shows the model."""
    tool = SandboxTool({"type": "native", "scope": "trajectory"}, SCHEMA)

    class AgentData:  # verl's AgentData: a plain, weak-referenceable class
        def __init__(self, request_id: str) -> None:
            self.request_id = request_id
            self.extra_fields: dict[str, Any] = {}

    async def rollout() -> list[object]:
        try:
            ids = [(await tool.create())[0] for _ in range(3)]
            agents = [AgentData(f"r{i}") for i in range(3)]
            results = await asyncio.gather(
                *(
                    tool.execute(i, {"code": "print(1)"}, agent_data=a)
                    for i, a in zip(ids, agents, strict=True)
                ),
                return_exceptions=True,
            )
            for i in ids:
                await tool.release(i)
            return results
        finally:
            await _session.aclose()

    def errors(results: list[object]) -> list[object]:
        return [r for r in results if isinstance(r, BaseException)]

    assert not errors(asyncio.run(rollout()))
    box: list[object] = []
    run: Callable[[], None] = lambda: box.extend(asyncio.run(rollout()))  # noqa: E731
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert len(box) == 3 and not errors(box), box
