"""An OpenRLHF agent whose tool calls and reward run through tangram.

Pass this file to OpenRLHF: ``--train.agent_func_path $(python -c "import
tangram_openrlhf.agent as m; print(m.__file__)")``. OpenRLHF loads it by path, builds
``AgentExecutor()`` with no arguments in each vLLM engine actor and calls ``execute`` on
the engine's event loop, one ``AgentInstance()`` per prompt. So configuration comes from
the tangram config named by ``$TANGRAM_CONFIG`` (set it in the Ray job's runtime
environment), table ``[adapters.openrlhf]``:

- ``max_turns`` (4): model turns before the episode ends;
- ``cpu`` (1, or ``{min, max}``), ``timeout``, ``kind`` (``"run_code"``): each tool call;
- ``reward`` (``"tests"``): grade the answer's code (its last fenced block, else its last
  tool call's) against the label's tests with tangram's grading harness, in a fresh
  sandbox (never the trajectory's, which the model's own code has run in), and score 1.0
  when every test passes (``docs/rewards.md``); or ``"pkg.mod:fn"``, awaited as
  ``fn(action_text, label, sandbox)`` with the trajectory's :class:`tangram.Sandbox`;
- ``case_timeout`` (10), ``partial`` (false): the ``"tests"`` reward's limit per call into
  the answer (``timeout`` bounds the whole grading), and whether it scores the fraction of
  tests passed instead of all or nothing;
- ``feedback``: the text appended after a tool call, ``{output}`` standing for its output;
- ``metrics`` (false): add the scheduler's figures to each episode's ``extra_logs``, which
  OpenRLHF logs per step (``tangram/queue_s``, ``tangram/held/cpu`` ...: docs/metrics.md).

A tool call is written as verl and Qwen write them:
``<tool_call>{"name": "run_code", "arguments": {"code": "..."}}</tool_call>``. Every step
awaits: sandbox work runs in tangram's worker threads and subprocesses, never on vLLM's
loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
import weakref
from typing import Any

import torch
from openrlhf.utils.agent import (  # type: ignore[import-untyped]
    AgentInstanceBase,
    MultiTurnAgentExecutor,
)

import tangram
from tangram import integrations
from tangram.integrations import (
    extract_code,
    format_result,
    grade,
    is_infrastructure,
    is_level,
    parse_tests,
    record,
    release_later,
    step_logs,
)
from tangram_openrlhf._settings import settings as read_settings

__all__ = ["AgentExecutor", "AgentInstance", "parse_tool_calls"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The ``<tool_call>`` JSON objects of a model turn; malformed ones are skipped.

    Every way ``json`` fails on what a model writes is a malformed call: nesting deeper
    than the parser recurses, an integer longer than Python converts (a ``ValueError``
    of its own). Raised out of ``step``, OpenRLHF's executor failed the training step.
    """
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            continue
        if isinstance(call, dict) and isinstance(call.get("arguments"), dict):
            calls.append(call)
    return calls


class AgentInstance(AgentInstanceBase):  # type: ignore[misc]
    """One prompt's episode: a sandbox bound to it from ``reset`` until the episode ends."""

    # OpenRLHF builds one per episode, with no arguments: built by :class:`AgentExecutor`
    # it takes the settings the executor checked, not a new read of the config each time.
    _checked: dict[str, Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = self._checked or read_settings()
        self.config_path: str | None = settings["tangram_config"]
        self.max_turns: int = settings["max_turns"]
        self.cpu = settings["cpu"]
        self.timeout: float | None = settings["timeout"]
        self.kind: str = settings["kind"]
        self.reward: str = settings["reward"]
        self.feedback: str = settings["feedback"]
        self.case_timeout: float | None = settings["case_timeout"]
        self.partial: bool = settings["partial"]
        self.metrics: bool = settings["metrics"]
        self.scheduler_logs: dict[str, float] = {}
        self.turns = 0
        self.tool_calls = 0
        self.last_code: str | None = None
        self._block: Any = None
        self._sandbox: tangram.Sandbox | None = None
        self._finalizer: weakref.finalize[Any, AgentInstance] | None = None

    async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        try:
            async with integrations.session(self.config_path) as resources:
                self._block = resources.sandbox_pool().sandbox(f"openrlhf-{id(self):x}")
                self._sandbox = await self._block.__aenter__()
        except Exception as exc:
            # It fails the episode, as in step: counted and logged at ERROR the same way.
            if is_infrastructure(exc):
                record(self.kind, exc)
            raise
        self._finalizer = weakref.finalize(
            self, release_later, asyncio.get_running_loop(), self._block
        )
        return {"observation": states["observation"]}

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        try:
            return await self._step(states)
        except Exception as exc:
            # OpenRLHF's executor does not catch it: the engine actor's generate call, and
            # the step of training, fail with tangram's error instead of a made-up reward.
            if is_infrastructure(exc):
                record(self.kind, exc)
                await self._release()
            raise

    async def _step(self, states: dict[str, Any]) -> dict[str, Any]:
        action: str = states["action_text"]
        self.turns += 1
        calls = parse_tool_calls(action)
        if calls and self.turns < self.max_turns:
            outputs = []
            for call in calls:
                code = call["arguments"].get("code")
                if not isinstance(code, str):
                    outputs.append("`code` must be a string\n")
                    continue
                self.last_code = code
                self.tool_calls += 1
                try:
                    result = await self._run(code)
                except Exception as exc:
                    if is_infrastructure(exc):
                        raise
                    # The model's bad argument (a NUL byte, text that is not UTF-8): the
                    # tool's answer, as verl's handler makes it. Raised, it stopped training.
                    outputs.append(f"error: {exc}\n")
                    continue
                outputs.append(format_result(result))
            return {
                "rewards": torch.tensor(0.0),
                "scores": torch.tensor(0.0),
                "environment_feedback": "".join(self.feedback.format(output=o) for o in outputs),
                "done": False,
                "sampling_params": states.get("sampling_params"),
                "extra_logs": await self._logs(),
            }
        try:
            reward = await self._score(action, states.get("label"))
        finally:
            await self._release()
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "",
            "done": True,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": await self._logs(),
        }

    async def _logs(self) -> dict[str, float]:
        # The same keys on every step: OpenRLHF stacks the last step's logs across samples.
        logs = {"turns": float(self.turns), "tool_calls": float(self.tool_calls)}
        if self.metrics:
            # OpenRLHF keeps only an episode's last logs, so each step's change since the
            # process's previous one adds up here (levels, ``tangram/held/...``, are now's).
            async with integrations.session(self.config_path) as resources:
                change = await step_logs(resources.scheduler, resources, (self.kind, "reward"))
            for key, value in change.items():
                before = 0.0 if is_level(key) else self.scheduler_logs.get(key, 0.0)
                self.scheduler_logs[key] = before + value
            logs.update(self.scheduler_logs)
        return logs

    async def _run(self, code: str) -> tangram.RunResult:
        if self._sandbox is None:
            raise RuntimeError("step() before reset(): the episode has no sandbox")
        async with integrations.session(self.config_path):
            return await self._sandbox.run(
                code=code, cpu=self.cpu, timeout=self.timeout, kind=self.kind
            )

    async def _score(self, action: str, label: Any) -> float:
        if self.reward == "tests":
            tests = parse_tests(label)
            code = extract_code(action) or self.last_code
            if code is None:
                return 0.0
            async with (
                integrations.session(self.config_path) as resources,
                resources.sandbox_pool().sandbox(f"reward-{uuid.uuid4().hex}") as sandbox,
            ):
                verdict = await grade(
                    sandbox,
                    code,
                    tests,
                    cpu=self.cpu,
                    timeout=self.timeout,
                    case_timeout=self.case_timeout,
                )
            return verdict.score(partial=self.partial)
        fn = integrations.load_object(self.reward)
        async with integrations.session(self.config_path):
            return float(await fn(action, label, self._sandbox))

    async def _release(self) -> None:
        block, self._block, self._sandbox = self._block, None, None
        if self._finalizer is not None:
            self._finalizer.detach()
        if block is not None:
            await block.__aexit__(None, None, None)


class AgentExecutor(MultiTurnAgentExecutor):  # type: ignore[misc]
    """What ``--train.agent_func_path`` loads: built with no arguments, as OpenRLHF does.

    :raises ConfigError: no tangram config, an invalid one, or one without ``[sandbox]``.
    """

    def __init__(self) -> None:
        # OpenRLHF builds the executor when the vLLM engine actor starts: a missing or
        # bad config fails the actor there, not each episode after it.
        settings = read_settings()
        integrations.check(settings["tangram_config"], needs=("sandbox",))
        super().__init__(type("AgentInstance", (AgentInstance,), {"_checked": settings}))
