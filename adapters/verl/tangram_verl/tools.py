"""verl tools that run through tangram, declared in verl's own tool YAML.

``actor_rollout_ref.rollout.multi_turn.tool_config_path`` names a YAML whose entries give
``class_name``, ``config`` and ``tool_schema``; verl builds each tool with
``cls(config=..., tool_schema=...)`` once per agent-loop worker process and calls
``create`` / ``execute`` / ``release`` from that worker's event loop. Nothing here is
passed a runtime: each call takes this process and loop's scheduler from
:func:`tangram.integrations.session`, started on first use from the file named by the
tool's ``config.tangram_config`` or ``$TANGRAM_CONFIG``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.tools.tool_registry import get_tool_class
from verl.utils.rollout_trace import rollout_trace_op

import tangram
from tangram import integrations
from tangram.config import ConfigError
from tangram.errors import InvalidDemandError, SandboxError, TangramError, UnknownSandboxError
from tangram.integrations import (
    cpu_demand,
    demand_of,
    format_result,
    is_infrastructure,
    record,
    release_later,
    result_metrics,
    seconds_of,
    text_of,
)

__all__ = [
    "FAILED_CALL",
    "TOOL_METRICS",
    "SandboxTool",
    "TangramTool",
    "record_call",
    "run_code",
    "with_tangram",
]

_OWN_KEYS = {"type", "tangram_config"}
_SANDBOX_KEYS = {"cpu", "timeout", "kind", "language", "code_param", "scope"}
# verl's SandboxFusionTool's keys (verl/tools/sandbox_fusion_tools.py), so its YAML loads.
_FUSION_KEYS = {
    "sandbox_fusion_url",
    "num_workers",
    "rate_limit",
    "default_timeout",
    "default_language",
    "enable_global_rate_limit",
    "memory_limit_mb",
}
_LANGUAGES = {"python", "shell", "bash"}
#: The per-trajectory totals :func:`record_call` keeps (``extras["tangram"]``).
TOOL_METRICS = (
    "tool_calls",
    "tool_cores",
    "tool_queue_seconds",
    "tool_exec_seconds",
    "tool_timeouts",
)
#: A function tool's observation when tangram, not the tool, failed under the call
#: (:func:`with_tangram`): it names no error, so the model learns nothing of the
#: infrastructure from it, and the sample it ends up in is never scored.
FAILED_CALL = "(the tool could not run: an infrastructure failure, not a result of this call)"


class SandboxTool(BaseTool):
    """Runs model-written code in a tangram sandbox, lending cores per call.

    ``create`` binds a sandbox (a work dir or container from the config's ``[sandbox]``
    pool) to the instance and prepares it from verl's ``create_kwargs`` (``files`` to
    write, a ``setup`` shell line to run); ``execute`` runs the call's code in it through
    the scheduler, with the cores ``config.cpu`` asks for (a count, or ``{min, max}`` for
    an elastic grant the command reads from ``$TANGRAM_CPUS``); ``release`` gives the
    sandbox back. Files persist between the calls of one instance. verl 0.9's
    ``ToolAgentLoop`` makes one instance per tool call, so with the default
    ``scope: instance`` each call starts clean. ``scope: trajectory`` binds the sandbox to
    the trajectory instead (the ``agent_data`` verl passes to ``execute``): its calls share
    files, and the sandbox goes back when verl drops the trajectory's state at the end of
    the rollout.

    ``config`` keys: ``tangram_config`` (path; default ``$TANGRAM_CONFIG``), ``cpu``
    (default 1), ``timeout`` (seconds per call), ``kind`` (the action kind statistics and
    estimates are kept under, default the tool's name), ``language`` (``python``,
    ``shell`` or ``bash``), ``code_param`` (the argument holding the code, default
    ``code``), ``scope`` (``instance`` or ``trajectory``). A ``SandboxFusionTool`` entry's
    keys are accepted too, so its YAML needs only a new ``class_name``:
    ``default_timeout`` and ``default_language`` are ``timeout`` and ``language``; a call's
    own ``timeout`` and ``language`` arguments apply as that tool applies them (the
    timeout capped by the configured one); ``sandbox_fusion_url``, ``num_workers``,
    ``rate_limit``, ``enable_global_rate_limit`` and ``memory_limit_mb`` are read and left
    unused, since the code runs in tangram's pool, admitted by its scheduler, under the
    pool's memory limit.

    The config is loaded and checked when verl builds the tool, so a bad set-up fails the
    worker at start. A failure of tangram during a call is never returned as the tool's
    output: verl's ``ToolAgentLoop`` catches what ``execute`` raises and feeds it to the
    model as text, so the failure is kept and raised again from ``release``, which verl
    calls outside that handler, and it reaches the agent-loop worker.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        where = f"tool {self.name!r}"
        unknown = sorted(set(config) - _OWN_KEYS - _SANDBOX_KEYS - _FUSION_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown config key(s) {unknown}")
        self.config_path: str | None = config.get("tangram_config")
        integrations.check(self.config_path, needs=("sandbox",))
        self.cpu = cpu_demand(config.get("cpu", 1), where)
        # Each checked here: a `timeout: "20"` reached every call as a bad argument, which
        # verl hands to the model as the tool's output while training goes on.
        self.timeout = seconds_of(
            config.get("timeout", config.get("default_timeout")), f"{where}: `timeout`"
        )
        self.kind = text_of(config.get("kind", self.name), f"{where}: `kind`")
        language = config.get("language", config.get("default_language", "python"))
        if not isinstance(language, str) or language not in _LANGUAGES:
            raise ConfigError(f"{where}: `language` must be one of {sorted(_LANGUAGES)}")
        self.language: str = language
        self.code_param = text_of(config.get("code_param", "code"), f"{where}: `code_param`")
        self.scope: str = config.get("scope", "instance")
        if self.scope not in ("instance", "trajectory"):
            raise ConfigError(f"{where}: `scope` must be 'instance' or 'trajectory'")
        self._instances: dict[str, tuple[contextlib.AsyncExitStack, tangram.Sandbox]] = {}
        self._prepare: dict[str, Mapping[str, Any]] = {}
        self._failed: dict[str, BaseException] = {}
        # Keyed by verl's AgentData: the entry goes when verl drops the trajectory.
        self._trajectories: weakref.WeakKeyDictionary[Any, tangram.Sandbox] = (
            weakref.WeakKeyDictionary()
        )
        # A lock per trajectory, not one per tool: an asyncio.Lock binds to the first loop
        # it waits on, and verl's workers run trajectories on more than one loop.
        self._binding: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        # verl passes ``create_kwargs=...``; SandboxFusionTool's callers pass the keys.
        options = dict(kwargs.get("create_kwargs") or {})
        options.update({k: v for k, v in kwargs.items() if k != "create_kwargs"})
        try:
            self._prepare[instance_id] = _preparation(options, f"tool {self.name!r}")
            if self.scope == "instance":
                async with integrations.session(self.config_path) as resources:
                    self._instances[instance_id] = await self._bind(
                        resources, instance_id, instance_id
                    )
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            # verl would hand a failed create's error to the model and never call release
            # (it has no instance id), so the failure waits for execute and release.
            self._fail(instance_id, exc)
        return instance_id, ToolResponse()

    async def _bind(
        self, resources: integrations.Resources, name: str, instance_id: str
    ) -> tuple[contextlib.AsyncExitStack, tangram.Sandbox]:
        """A prepared sandbox, and the stack that gives it back.

        The sandbox outlives this call (until ``release``, or until verl drops the
        trajectory), so its block is left open on a stack of its own; a preparation that
        fails closes it here.
        """
        async with contextlib.AsyncExitStack() as stack:
            sandbox = await stack.enter_async_context(resources.sandbox_pool().sandbox(name))
            await self._prepared(sandbox, instance_id)
            held = stack.pop_all()
        return held, sandbox

    async def _prepared(self, sandbox: tangram.Sandbox, instance_id: str) -> None:
        """Write ``files`` and run ``setup`` before the model's first call sees the sandbox."""
        preparation = self._prepare.get(instance_id, {})
        for path, content in preparation.get("files", {}).items():
            await sandbox.put(path, content)
        setup = preparation.get("setup")
        if setup is not None:
            result = await sandbox.run(setup, cpu=self.cpu, timeout=self.timeout, kind="setup")
            if not result.ok:
                raise ConfigError(
                    f"tool {self.name!r}: create_kwargs `setup` failed: {format_result(result)}"
                )

    async def _trajectory_sandbox(
        self, resources: integrations.Resources, trajectory: Any, instance_id: str
    ) -> tangram.Sandbox:
        lock = self._binding.get(trajectory)
        if lock is None:
            lock = self._binding[trajectory] = asyncio.Lock()
        async with lock:  # parallel calls of one trajectory share one sandbox
            sandbox = self._trajectories.get(trajectory)
            if sandbox is None:
                name = str(getattr(trajectory, "request_id", uuid.uuid4().hex))
                held, sandbox = await self._bind(resources, name, instance_id)
                self._trajectories[trajectory] = sandbox
                weakref.finalize(trajectory, release_later, asyncio.get_running_loop(), held)
            return sandbox

    async def _sandbox_for(
        self, resources: integrations.Resources, instance_id: str, trajectory: Any
    ) -> tangram.Sandbox:
        if self.scope == "trajectory" and trajectory is not None:
            return await self._trajectory_sandbox(resources, trajectory, instance_id)
        if instance_id not in self._instances and self.scope == "trajectory":
            # Called without verl's trajectory state: the instance is all there is.
            self._instances[instance_id] = await self._bind(resources, instance_id, instance_id)
        entry = self._instances.get(instance_id)
        if entry is None:
            raise UnknownSandboxError(
                f"no sandbox for instance {instance_id!r}: not created, or already released"
            )
        return entry[1]

    @rollout_trace_op  # type: ignore[untyped-decorator]  # verl tracing, as BaseTool
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        failed = self._failed.get(instance_id)
        if failed is not None:
            raise failed
        # The model's arguments, checked before tangram runs them: what fails from here on
        # is tangram's (or the model's bad text, an InvalidSettingError), never a model's
        # argument that broke the adapter (a list for `parameters`, a huge `timeout`).
        if not isinstance(parameters, Mapping):
            return ToolResponse(text="the arguments must be an object"), 0.0, {}
        code = parameters.get(self.code_param)
        if not isinstance(code, str):
            return ToolResponse(text=f"`{self.code_param}` must be a string"), 0.0, {}
        language = parameters.get("language", self.language)
        if not isinstance(language, str) or language not in _LANGUAGES:
            return ToolResponse(text=f"`language` must be one of {sorted(_LANGUAGES)}"), 0.0, {}
        timeout = _timeout(parameters.get("timeout"), self.timeout)
        trajectory = kwargs.get("agent_data")
        command: str | list[str] | None = None
        if language != "python":
            command = code if language == "shell" else ["bash", "-c", code]
        try:
            async with integrations.session(self.config_path) as resources:
                sandbox = await self._sandbox_for(resources, instance_id, trajectory)
                result = await sandbox.run(
                    command,
                    code=code if command is None else None,
                    cpu=self.cpu,
                    timeout=timeout,
                    kind=self.kind,
                )
        except Exception as exc:
            if is_infrastructure(exc):
                self._fail(instance_id, exc)
            raise
        record_call(trajectory, result)
        return ToolResponse(text=format_result(result)), 0.0, result_metrics(result)

    def _fail(self, instance_id: str, exc: BaseException) -> None:
        if instance_id not in self._failed:
            record(self.kind, exc)
        self._failed[instance_id] = exc

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        entry = self._instances.pop(instance_id, None)
        self._prepare.pop(instance_id, None)
        failed = self._failed.pop(instance_id, None)
        try:
            if entry is not None:
                await entry[0].aclose()
        finally:
            if failed is not None:
                raise failed


def _preparation(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """verl's ``create_kwargs`` for a sandbox, checked: they come from the dataset."""
    unknown = sorted(set(options) - {"files", "setup", "ground_truth"})
    if unknown:
        raise ConfigError(f"{where}: unknown create_kwargs {unknown}; known: files, setup")
    files = options.get("files", {}) or {}
    if not isinstance(files, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (str, bytes)) for k, v in files.items()
    ):
        raise ConfigError(f"{where}: create_kwargs `files` must map paths to contents")
    setup = options.get("setup")
    if setup is not None and not isinstance(setup, str):
        raise ConfigError(f"{where}: create_kwargs `setup` must be a shell line")
    return {"files": dict(files), "setup": setup}


def _timeout(asked: Any, configured: float | None) -> float | None:
    """A call's own ``timeout`` argument (SandboxFusionTool reads one), capped by the
    config's; a value that is no usable number (an int past a float's range) is ignored."""
    if isinstance(asked, bool) or not isinstance(asked, (int, float)):
        return configured
    try:
        seconds = float(asked)
    except OverflowError:
        return configured
    if not 0 < seconds < math.inf:
        return configured
    return seconds if configured is None else min(seconds, configured)


def record_call(trajectory: Any, result: tangram.RunResult) -> None:
    """Add a call's grant and timing to the trajectory's ``extra_fields``, where verl keeps them.

    ``ToolAgentLoop`` drops the metrics ``execute`` returns; what survives a rollout is
    ``AgentData.extra_fields`` (verl: "store any tool session data" there), which becomes
    the sample's ``tool_extra_fields`` in the reward managers' ``extra_info``. The totals go
    under ``extras`` (one of the keys verl gives every sample, so batches from workers
    whose samples made no call still concatenate), as ``extras["tangram"]``.
    """
    fields = getattr(trajectory, "extra_fields", None)
    if not isinstance(fields, dict):
        return
    extras = fields.get("extras")
    if extras is None:
        extras = fields["extras"] = {}
    if not isinstance(extras, dict):
        return
    totals = extras.setdefault("tangram", dict.fromkeys(TOOL_METRICS, 0.0))
    totals["tool_calls"] += 1
    totals["tool_cores"] += result.units
    totals["tool_queue_seconds"] += result.queue_seconds
    totals["tool_exec_seconds"] += result.exec_seconds
    totals["tool_timeouts"] += float(result.timed_out)


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
    What the wrapped tool raises is its own and reaches verl as before; a failure of
    tangram's admission is kept and raised from ``release``, as :class:`SandboxTool` does.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        where = f"tool {tool_schema.function.name if tool_schema else '?'}"
        inner_config = {k: v for k, v in config.items() if k not in {"wraps", "demand", "kind"}}
        inner_config.pop("tangram_config", None)
        wraps = config.get("wraps")
        if not isinstance(wraps, str):
            raise ConfigError(f"{where}: `wraps` must name the wrapped tool's class")
        self.demand = demand_of(config.get("demand"), where)
        self.config_path: str | None = config.get("tangram_config")
        integrations.check(self.config_path)
        tool_class = get_tool_class(wraps)  # type: ignore[no-untyped-call]
        self.inner: BaseTool = tool_class(config=inner_config, tool_schema=tool_schema)
        super().__init__(config, self.inner.tool_schema)
        self.kind = text_of(config.get("kind", self.name), f"{where}: `kind`")
        self._failed: dict[str, BaseException] = {}

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
        failed = self._failed.get(instance_id)
        if failed is not None:
            raise failed
        own: list[Exception] = []  # the wrapped tool's error, told apart from tangram's
        try:
            async with (
                integrations.session(self.config_path),
                tangram.acquire(self.demand, kind=self.kind, trajectory=instance_id),
            ):
                try:
                    result: tuple[ToolResponse, float, dict[str, Any]] = await self.inner.execute(
                        instance_id, parameters, **kwargs
                    )
                except Exception as exc:
                    own.append(exc)
        except Exception as exc:
            if is_infrastructure(exc):
                if instance_id not in self._failed:
                    record(self.kind, exc)
                self._failed[instance_id] = exc
            raise
        if own:
            raise own[0]
        return result

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(await self.inner.calc_reward(instance_id, **kwargs))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        failed = self._failed.pop(instance_id, None)
        try:
            await self.inner.release(instance_id, **kwargs)
        finally:
            if failed is not None:
                raise failed


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
    work without arguments. The config is loaded when the function is decorated (verl
    imports ``function_tool_path`` at worker start), so a bad set-up fails there.

    verl calls function tools without a release step and hands whatever they raise to the
    model as the tool's output. So a tangram failure under the call (the scheduler gone,
    a sandbox that died) is not raised: it is counted, logged at ERROR, and the call
    returns :data:`FAILED_CALL` as its observation with a NaN tool reward, which verl
    keeps in the sample's ``tool_rewards``. tangram's reward entries refuse to score
    such a sample (:class:`tangram.errors.UnscoredSampleError`), so the step fails
    rather than train on it. The function's own exceptions reach verl as before.
    """
    integrations.check(config)
    wanted = {**(demand or {}), **amounts}
    if wanted:
        wanted = demand_of(wanted, "with_tangram")

    def decorate(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"with_tangram needs an async function (got {fn!r})")
        action = kind or fn.__name__

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            own: list[Exception] = []
            try:
                async with contextlib.AsyncExitStack() as stack:
                    await stack.enter_async_context(integrations.session(config))
                    if wanted:
                        await stack.enter_async_context(tangram.acquire(wanted, kind=action))
                    try:
                        return await fn(*args, **kwargs)
                    except Exception as exc:
                        own.append(exc)
            except Exception as exc:
                if not is_infrastructure(exc):
                    raise
                failure = exc
            else:
                # The function's own error reaches verl, unless tangram raised it in there
                # as its own failure (a :func:`run_code` whose sandbox died; not a bad
                # argument or demand, which the function may build from the model's
                # arguments, so they are the call's); an ``OSError`` there is the tool's.
                failure = own[0]
                if (
                    not isinstance(failure, TangramError)
                    or isinstance(failure, InvalidDemandError)
                    or not is_infrastructure(failure)
                ):
                    raise failure
            record(action, failure)
            return ToolResponse(text=FAILED_CALL), math.nan, {}

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
    """Run Python in a fresh sandbox of this process's pool (for stateless function tools).

    :raises InvalidSettingError: the code cannot run (a NUL byte, text that is not UTF-8):
        the caller's, so the model's where it wrote the code.
    :raises TangramError: tangram failed to run it; an exception it never meant to raise
        (a bug) comes as a :class:`~tangram.errors.SandboxError` from it, so that
        :func:`with_tangram` tells it from the function's own errors.
    """
    try:
        async with integrations.session(config) as resources:
            name = uuid.uuid4().hex
            async with resources.sandbox_pool().sandbox(name) as sandbox:
                return await sandbox.run(code=code, cpu=cpu, timeout=timeout, kind=kind)
    except TangramError:
        raise
    except Exception as exc:
        raise SandboxError(f"tangram failed to run the code: {type(exc).__name__}: {exc}") from exc
