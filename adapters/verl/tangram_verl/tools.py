"""verl tools that run through tangram, declared in verl's own tool YAML.

``actor_rollout_ref.rollout.multi_turn.tool_config_path`` names a YAML whose entries give
``class_name``, ``config`` and ``tool_schema``; verl builds each tool with
``cls(config=..., tool_schema=...)`` once per agent-loop worker process and calls
``create`` / ``execute`` / ``release`` from that worker's event loop. Nothing here is
passed a runtime: each call takes this process and loop's scheduler from
:func:`tangram._frameworks._session.session`, started on first use from the file named by the
tool's ``config.tangram_config`` or ``$TANGRAM_CONFIG``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.tools.tool_registry import get_tool_class
from verl.utils.rollout_trace import rollout_trace_op

import tangram
from tangram._frameworks import _session
from tangram._frameworks._convert import cpu_demand, demand_of, format_result, result_metrics
from tangram._frameworks._session import release_later
from tangram.config import ConfigError

__all__ = ["SandboxTool", "TangramTool", "run_code", "with_tangram"]

_OWN_KEYS = {"type", "tangram_config"}


class SandboxTool(BaseTool):
    """Runs model-written code in a tangram sandbox, lending cores per call.

    ``create`` binds a sandbox (a work dir or container from the config's ``[sandbox]``
    pool) to the instance; ``execute`` runs the call's code in it through the scheduler,
    with the cores ``config.cpu`` asks for (a count, or ``{min, max}`` for an elastic
    grant the command reads from ``$TANGRAM_CPUS``); ``release`` gives the sandbox back.
    Files persist between the calls of one instance. verl 0.9's ``ToolAgentLoop`` makes
    one instance per tool call, so with the default ``scope: instance`` each call starts
    clean. ``scope: trajectory`` binds the sandbox to the trajectory instead (the
    ``agent_data`` verl passes to ``execute``): its calls share files, and the sandbox goes
    back when verl drops the trajectory's state at the end of the rollout.

    ``config`` keys: ``tangram_config`` (path; default ``$TANGRAM_CONFIG``), ``cpu``
    (default 1), ``timeout`` (seconds per call), ``kind`` (the action kind statistics and
    estimates are kept under, default the tool's name), ``language`` (``python`` or
    ``shell``), ``code_param`` (the argument holding the code, default ``code``),
    ``scope`` (``instance`` or ``trajectory``).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        where = f"tool {self.name!r}"
        allowed = _OWN_KEYS | {"cpu", "timeout", "kind", "language", "code_param", "scope"}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown config key(s) {unknown}")
        self.config_path: str | None = config.get("tangram_config")
        self.cpu = cpu_demand(config.get("cpu", 1), where)
        self.timeout: float | None = config.get("timeout")
        self.kind: str = config.get("kind", self.name)
        self.language: str = config.get("language", "python")
        if self.language not in ("python", "shell"):
            raise ConfigError(f"{where}: `language` must be 'python' or 'shell'")
        self.code_param: str = config.get("code_param", "code")
        self.scope: str = config.get("scope", "instance")
        if self.scope not in ("instance", "trajectory"):
            raise ConfigError(f"{where}: `scope` must be 'instance' or 'trajectory'")
        self._instances: dict[str, tuple[Any, tangram.Sandbox]] = {}
        # Keyed by verl's AgentData: the entry goes when verl drops the trajectory.
        self._trajectories: weakref.WeakKeyDictionary[Any, tangram.Sandbox] = (
            weakref.WeakKeyDictionary()
        )
        self._binding = asyncio.Lock()

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        if self.scope == "instance":
            async with _session.session(self.config_path) as resources:
                block = resources.sandbox_pool().sandbox(instance_id)
                sandbox = await block.__aenter__()
            self._instances[instance_id] = (block, sandbox)
        return instance_id, ToolResponse()

    async def _trajectory_sandbox(self, trajectory: Any) -> tangram.Sandbox:
        async with self._binding:  # parallel calls of one trajectory share one sandbox
            sandbox = self._trajectories.get(trajectory)
            if sandbox is None:
                name = str(getattr(trajectory, "request_id", uuid.uuid4().hex))
                async with _session.session(self.config_path) as resources:
                    block = resources.sandbox_pool().sandbox(name)
                    sandbox = await block.__aenter__()
                self._trajectories[trajectory] = sandbox
                weakref.finalize(trajectory, release_later, asyncio.get_running_loop(), block)
            return sandbox

    @rollout_trace_op  # type: ignore[untyped-decorator]  # verl tracing, as BaseTool
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get(self.code_param)
        if not isinstance(code, str):
            return ToolResponse(text=f"`{self.code_param}` must be a string"), 0.0, {}
        trajectory = kwargs.get("agent_data")
        if self.scope == "trajectory" and trajectory is not None:
            sandbox = await self._trajectory_sandbox(trajectory)
        else:
            if instance_id not in self._instances and self.scope == "trajectory":
                # Called without verl's trajectory state: the instance is all there is.
                async with _session.session(self.config_path) as resources:
                    block = resources.sandbox_pool().sandbox(instance_id)
                    self._instances[instance_id] = (block, await block.__aenter__())
            entry = self._instances.get(instance_id)
            if entry is None:
                raise KeyError(f"no sandbox for instance {instance_id!r}: call create first")
            sandbox = entry[1]
        async with _session.session(self.config_path):
            if self.language == "python":
                result = await sandbox.run(
                    code=code, cpu=self.cpu, timeout=self.timeout, kind=self.kind
                )
            else:
                result = await sandbox.run(code, cpu=self.cpu, timeout=self.timeout, kind=self.kind)
        return ToolResponse(text=format_result(result)), 0.0, result_metrics(result)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        entry = self._instances.pop(instance_id, None)
        if entry is not None:
            await entry[0].__aexit__(None, None, None)


class TangramTool(BaseTool):
    """Any verl tool, unchanged, with each call admitted by tangram first.

    The YAML entry names this class and the tool it wraps::

        - class_name: tangram_verl.tools.TangramTool
          config:
            type: native
            wraps: my_project.tools.SearchTool   # the tool's own class
            demand: {search: 1, search_conn: 1}  # per call: a rate and a concurrency slot
            kind: search
            # every other key is the wrapped tool's own config
          tool_schema: {...}                     # the wrapped tool's schema

    ``execute`` runs inside ``tangram.acquire(demand)``: a call waits for its API quota
    or cores, holds them while the wrapped tool works, and gives the held ones back
    however it ends. ``create``, ``release`` and ``calc_reward`` go straight through.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        where = f"tool {tool_schema.function.name if tool_schema else '?'}"
        inner_config = {k: v for k, v in config.items() if k not in {"wraps", "demand", "kind"}}
        inner_config.pop("tangram_config", None)
        wraps = config.get("wraps")
        if not isinstance(wraps, str):
            raise ConfigError(f"{where}: `wraps` must name the wrapped tool's class")
        tool_class = get_tool_class(wraps)  # type: ignore[no-untyped-call]
        self.inner: BaseTool = tool_class(config=inner_config, tool_schema=tool_schema)
        super().__init__(config, self.inner.tool_schema)
        self.demand = demand_of(config.get("demand"), where)
        self.kind: str = config.get("kind", self.name)
        self.config_path: str | None = config.get("tangram_config")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.inner.get_openai_tool_schema()

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        result: tuple[str, ToolResponse] = await self.inner.create(instance_id, **kwargs)
        return result

    @rollout_trace_op  # type: ignore[untyped-decorator]  # verl tracing, as BaseTool
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        async with (
            _session.session(self.config_path),
            tangram.acquire(self.demand, kind=self.kind, trajectory=instance_id),
        ):
            result: tuple[ToolResponse, float, dict[str, Any]] = await self.inner.execute(
                instance_id, parameters, **kwargs
            )
            return result

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(await self.inner.calc_reward(instance_id, **kwargs))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await self.inner.release(instance_id, **kwargs)


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def with_tangram(
    demand: Mapping[str, object] | None = None,
    /,
    *,
    kind: str | None = None,
    config: str | None = None,
    **amounts: object,
) -> Callable[[F], F]:
    """Admit each call of an async function tool through tangram; put it under ``@function_tool``.

    ::

        @function_tool
        @with_tangram(search=1, kind="search")
        async def web_search(query: str) -> str:
            \"\"\"Search the web. Args: query: what to look for.\"\"\"

    The signature, docstring and annotations pass through, so verl infers the same schema.
    Inside the call the scheduler is current: ``tangram.acquire`` and :func:`run_code`
    work without arguments.
    """
    wanted = {**(demand or {}), **amounts}

    def decorate(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"with_tangram needs an async function (got {fn!r})")
        action = kind or fn.__name__

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            async with _session.session(config):
                if not wanted:
                    return await fn(*args, **kwargs)
                async with tangram.acquire(wanted, kind=action):
                    return await fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


async def run_code(
    code: str,
    *,
    cpu: int | tangram.Elastic = 1,
    timeout: float | None = None,
    kind: str = "run_code",
    config: str | None = None,
) -> tangram.RunResult:
    """Run Python in a fresh sandbox of this process's pool (for stateless function tools)."""
    async with _session.session(config) as resources:
        name = uuid.uuid4().hex
        async with resources.sandbox_pool().sandbox(name) as sandbox:
            return await sandbox.run(code=code, cpu=cpu, timeout=timeout, kind=kind)
