"""verl rewards scored through tangram: code tests, a GPU model service or an API judge.

Two entry points, both read by verl by path:

- :func:`compute_score`, an async ``custom_reward_function``
  (``reward.custom_reward_function.path=<this file>``, ``name=compute_score``): verl's
  reward manager awaits it once per sample, on its reward loop.
- :class:`TangramRewardManager`, a reward manager
  (``reward.reward_manager.source=importlib``, ``module.path=<this file>``,
  ``name=TangramRewardManager``): decodes each response as verl's naive manager does and
  scores it the same way; a synchronous ``custom_reward_function`` given with it runs in
  a worker thread under a tangram CPU grant instead of verl's unbounded default executor.

Where to score comes from ``[adapters.verl.reward]`` in the tangram config, overridden by
``reward_kwargs``:

- ``service = "judge"`` and ``encode = "pkg.mod:fn"``: ``fn(solution_str, ground_truth,
  data_source=..., extra_info=...)`` turns a sample into one input row (a tensor of shape
  ``[1, ...]``); the service (``[[gpu.services]]``) scores rows from every sample waiting
  as one batch, restored onto a device only while some sample needs it. The score is the
  first element of the sample's output row.
- ``quota = "judge"`` and ``judge = "pkg.mod:fn"``: ``await fn(client, solution_str,
  ground_truth, data_source=..., extra_info=...)`` with ``client`` an
  ``httpx.AsyncClient`` whose requests go through ``[quota.judge]``'s keys and limits.
- ``tests = true``: the response's last fenced code block is graded against
  ``ground_truth`` (assertion tests, or input/output tests as verl's SandboxFusion
  datasets carry them: see ``docs/rewards.md``) by tangram's grading harness, in a fresh
  sandbox of ``[sandbox]`` with ``cpu`` cores. The score is 1.0 when every test passes
  (with ``partial = true``, the fraction passed); ``timeout`` bounds the whole grading,
  ``case_timeout`` each call into the answer. The verdict never comes from the answer's
  exit status, so an answer that exits 0 early or forges ``__eq__`` scores 0.

With ``group = true`` (:class:`TangramRewardManager` only) a prompt's samples are scored
together, so GRPO's groups complete one after another (``docs/verl.md``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio.to_thread
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.utils.reward_score import default_compute_score

import tangram
from tangram import integrations
from tangram.config import ConfigError
from tangram.errors import UnscoredSampleError
from tangram.integrations import (
    DEFAULT_GROUP_WAIT,
    Gate,
    cpu_demand,
    extract_code,
    flag_of,
    grade,
    is_infrastructure,
    parse_tests,
    record,
    seconds_of,
    step_logs,
    text_of,
)
from tangram_verl.tools import TOOL_METRICS

__all__ = ["TangramRewardManager", "compute_score", "failed_calls", "tool_metrics"]

_SETTINGS = {
    "tangram_config",
    "service",
    "encode",
    "quota",
    "judge",
    "base_url",
    "cpu",
    "tests",
    "timeout",
    "case_timeout",
    "partial",
    "metrics",
    "group",
    "group_wait",
}


def _settings(overrides: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """The table overridden by ``overrides``, each value checked. ``strict``: an override
    key that is no setting is refused too (``reward.tangram``, which is tangram's alone;
    verl's ``reward_kwargs`` also carry verl's own keys)."""
    path = overrides.get("tangram_config")
    config = integrations.config_for(path)
    table = config.adapters.get("verl", {}).get("reward", {})
    settings = {**table, **{k: v for k, v in overrides.items() if k in _SETTINGS}}
    unknown = sorted(set(table) - _SETTINGS)
    if unknown:
        raise ConfigError(f"[adapters.verl.reward]: unknown key(s) {unknown}")
    unknown = sorted(set(overrides) - _SETTINGS) if strict else []
    if unknown:
        raise ConfigError(f"reward.tangram: unknown key(s) {unknown}; known: {sorted(_SETTINGS)}")
    # Each value checked, not read with bool(): `partial = "false"` scored half an answer
    # 0.5 where the file meant all or nothing.
    for key in ("tests", "partial", "metrics", "group"):
        if key in settings:
            flag_of(settings[key], f"[adapters.verl.reward] `{key}`")
    for key in ("timeout", "case_timeout"):
        if key in settings:
            seconds_of(settings[key], f"[adapters.verl.reward] `{key}`")
    for key in ("service", "encode", "quota", "judge", "base_url"):
        if key in settings:
            text_of(settings[key], f"[adapters.verl.reward] `{key}`")
    settings["cpu"] = cpu_demand(settings.get("cpu", 1), "[adapters.verl.reward]")
    settings["tangram_config"] = path
    return settings


def _check_scoring(settings: Mapping[str, Any]) -> None:
    """What the settings score with, checked where the manager is built: the functions
    they name loaded, the service declared. Each passed the start and failed every
    sample after it (a ``tests = false`` with nothing else, an ``encode`` that does not
    load, a ``service`` no ``[[gpu.services]]`` entry names).

    :raises ConfigError: no way to score, or one that cannot work.
    """
    if not _needs(settings):
        raise ConfigError(
            "[adapters.verl.reward] needs `tests = true` (code tests), `service` (GPU) or "
            "`quota` (API judge)"
        )
    if settings.get("tests"):
        return
    key = "encode" if "service" in settings else "judge"
    try:
        integrations.load_object(settings.get(key, ""))
    except ConfigError as exc:
        raise ConfigError(f"[adapters.verl.reward] `{key}`: {exc}") from None
    if "service" in settings:
        gpu = integrations.config_for(settings.get("tangram_config")).gpu
        names = sorted(service.name for service in (gpu.services if gpu is not None else ()))
        if settings["service"] not in names:
            raise ConfigError(
                f"[adapters.verl.reward] `service` {settings['service']!r} is not a "
                f"[[gpu.services]] entry (declared: {names})"
            )


def _needs(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """The config tables the settings will use, for :func:`tangram.integrations.check`."""
    if settings.get("tests"):
        return ("sandbox",)
    if "service" in settings:
        return ("gpu",)
    if "quota" in settings:
        return (f"quota.{settings['quota']}",)
    return ()


def _tool_fields(sample: Mapping[str, Any]) -> Any:
    """The trajectory's ``extra_fields``: whole as ``tool_extra_fields`` where the agent
    loop scores each sample as it ends, key by key where the trainer scores the batch."""
    fields = sample.get("tool_extra_fields", None)
    if fields is not None:
        return fields
    return {key: sample[key] for key in ("tool_rewards", "extras") if key in sample}


def failed_calls(extra_fields: Any) -> int:
    """Tool calls of the sample that tangram failed under, as :func:`~tangram_verl.with_tangram`
    marks them (a NaN in ``tool_rewards``): the model saw :data:`~tangram_verl.tools.FAILED_CALL`
    where the tool's output should have been."""
    rewards = extra_fields.get("tool_rewards") if isinstance(extra_fields, Mapping) else None
    if rewards is None or isinstance(rewards, (str, bytes)):
        return 0
    try:
        values = list(rewards)
    except TypeError:  # not a sequence: no call of ours marked it
        return 0
    return sum(1 for r in values if _is_nan(r))


def _is_nan(value: Any) -> bool:
    """NaN as any real number type says it (a float, numpy's float16/32/64, a 0-d array)."""
    if getattr(value, "ndim", 0) != 0:
        return False  # an array of several: no reward of a call
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def refuse_failed(extra_fields: Any) -> None:
    """Raise :class:`~tangram.errors.UnscoredSampleError` for a sample with a failed call.

    verl's function tools need an observation whatever happens, so a tangram failure
    under one went to the model as a fixed text; the sample is not scored, and the step
    fails as it does when a :class:`~tangram_verl.SandboxTool` raises. (The failure was
    counted where it happened, in the agent-loop worker.)
    """
    failed = failed_calls(extra_fields)
    if failed:
        raise UnscoredSampleError(
            f"{failed} tool reward(s) of this sample are NaN, which is how with_tangram "
            "marks a call that tangram failed under (the agent-loop worker logged it at "
            "ERROR): the sample is not scored"
        )


def tool_metrics(extra_fields: Any) -> dict[str, float]:
    """A sample's tool totals (:func:`tangram_verl.tools.record_call`), zeros without calls.

    Every sample gets every key: verl builds its reward metrics from the first sample's
    keys and reads them from all.
    """
    totals: Any = {}
    if isinstance(extra_fields, Mapping):
        extras = extra_fields.get("extras")
        if isinstance(extras, Mapping):
            totals = extras.get("tangram") or {}
    return {name: float(totals.get(name, 0.0)) for name in TOOL_METRICS}


async def _alone() -> None:
    """A sample outside any group goes at once."""


async def score(
    settings: Mapping[str, Any],
    solution_str: str,
    ground_truth: Any,
    *,
    data_source: Any = None,
    extra_info: Any = None,
    arrive: Callable[[], Awaitable[None]] = _alone,
    group: str | None = None,
) -> float:
    """One sample's score through the tests, the service or the judge the settings name.

    ``arrive`` is awaited right before the sample asks for its grant: a group's gate
    (:class:`tangram.integrations.Gate`) holds it there for the rest of its group,
    ``group`` (its prompt) which also names its sandbox, for the scheduler's books.

    :raises ValueError: with ``tests``, a ground truth that holds no test to run.
    :raises SandboxBrokenError: with ``tests``, a sandbox that cannot run the harness.
    """
    try:
        return await _score(
            settings, solution_str, ground_truth, data_source, extra_info, arrive, group
        )
    except Exception as exc:
        # verl's reward loop does not catch it: the step fails with tangram's error.
        if is_infrastructure(exc):
            record("reward", exc)
        raise


async def _score(
    settings: Mapping[str, Any],
    solution_str: str,
    ground_truth: Any,
    data_source: Any,
    extra_info: Any,
    arrive: Callable[[], Awaitable[None]],
    group: str | None,
) -> float:
    info = {"data_source": data_source, "extra_info": extra_info}
    async with integrations.session(settings.get("tangram_config")) as resources:
        if settings.get("tests"):
            tests = parse_tests(ground_truth)
            code = extract_code(solution_str)
            if code is None:
                return 0.0
            name = "-".join(("reward", *(() if group is None else (group,)), uuid.uuid4().hex))
            async with resources.sandbox_pool().sandbox(name) as sandbox:
                await arrive()
                verdict = await grade(
                    sandbox,
                    code,
                    tests,
                    cpu=settings["cpu"],
                    timeout=settings.get("timeout"),
                    case_timeout=settings.get("case_timeout"),
                )
            return verdict.score(partial=settings.get("partial", False))
        if "service" in settings:
            encode = integrations.load_object(settings.get("encode", ""))
            row = encode(solution_str, ground_truth, **info)
            await arrive()
            async with resources.gpu_pool().use(settings["service"]) as service:
                output = await service(row)
            return float(output.reshape(-1)[0])
        if "quota" in settings:
            judge = integrations.load_object(settings.get("judge", ""))
            quota = resources.quota(settings["quota"])
            options = {"base_url": settings["base_url"]} if "base_url" in settings else {}
            async with quota.client(**options) as client:
                await arrive()
                return float(await judge(client, solution_str, ground_truth, **info))
    raise ConfigError(
        "[adapters.verl.reward] needs `tests = true` (code tests), `service` (GPU) or "
        "`quota` (API judge)"
    )


async def compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    **reward_kwargs: Any,
) -> float:
    """verl's ``custom_reward_function``, async: scores through tangram (see the module).

    :raises UnscoredSampleError: a tool call of the sample failed in tangram (verl's
        reward managers put the trajectory's ``tool_rewards`` in ``extra_info``).
    """
    settings = _settings(reward_kwargs)
    refuse_failed(extra_info)
    return await score(
        settings, solution_str, ground_truth, data_source=data_source, extra_info=extra_info
    )


class TangramRewardManager(RewardManagerBase):
    """verl's per-sample reward manager, scoring through tangram.

    verl builds it with the whole trainer config, the tokenizer and the
    ``custom_reward_function`` (or ``None``). Settings: the tangram config's
    ``[adapters.verl.reward]`` table, overridden by ``reward.tangram`` in verl's config
    (``+reward.tangram.service=judge`` on the command line). The config and the tables
    the settings use are checked when verl builds it. ``reward_extra_info`` carries the
    sample's tool totals (``tool_calls``, ``tool_cores``, ``tool_queue_seconds``,
    ``tool_exec_seconds``, ``tool_timeouts``) beside the score, and with ``metrics = true``
    what this process's scheduler did since the previous sample (``tangram/queue_s``,
    ``tangram/restores``, ``tangram/limited`` ...: docs/metrics.md).

    With ``group = true`` a prompt's samples (verl's ``uid``) handed over together are
    scored together: each waits, just before it asks for its grant, for the others of its
    group being scored at once (in this worker, or in shared mode in any worker of the
    job), and the group's demands reach the scheduler together
    (:class:`tangram.integrations.Gate`). A sample alone goes at once; none waits longer
    than ``group_wait`` seconds (2).
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
    ) -> None:
        reward = config.get("reward", {}) if hasattr(config, "get") else {}
        overrides = reward.get("tangram", None) if hasattr(reward, "get") else None
        self.settings = _settings(dict(overrides or {}), strict=True)
        # Checked here, where verl's reward worker starts, not at the first sample, and
        # before verl's base class makes an event loop that a failed start would leak.
        integrations.check(self.settings.get("tangram_config"), needs=_needs(self.settings))
        if compute_score is None or compute_score is default_compute_score:
            _check_scoring(self.settings)  # tangram scores: with what the settings name
        self.cpu = self.settings["cpu"]
        self.group_wait: float | None = None
        if self.settings.get("group"):
            self.group_wait = self.settings.get("group_wait", DEFAULT_GROUP_WAIT)
            Gate(self.group_wait)  # a bad group_wait fails here
        super().__init__(config, tokenizer, compute_score)
        # Without a custom function verl hands over its rule-based default: tangram's
        # scoring replaces it, since a tangram manager was asked for.
        custom = None if compute_score is default_compute_score else compute_score
        self.custom = custom
        self.custom_is_async = custom is not None and inspect.iscoroutinefunction(custom)

    async def _score(
        self, item: Any, arrive: Callable[[], Awaitable[None]], group: str | None
    ) -> tuple[Any, Any]:
        """The sample's score (or the custom function's result) and its tool fields."""
        response_ids = item.batch["responses"]
        length = int(item.batch["attention_mask"][-response_ids.shape[-1] :].sum())
        tokenizer: Any = self.tokenizer
        solution = await anyio.to_thread.run_sync(
            functools.partial(tokenizer.decode, response_ids[:length], skip_special_tokens=True)
        )
        data_source = item.non_tensor_batch["data_source"]
        ground_truth = item.non_tensor_batch["reward_model"]["ground_truth"]
        extra_info = dict(item.non_tensor_batch.get("extra_info", None) or {})
        tool_fields = _tool_fields(item.non_tensor_batch)
        refuse_failed(tool_fields)
        arguments = {
            "data_source": data_source,
            "solution_str": solution,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        if self.custom is None:
            result: Any = await score(
                self.settings,
                solution,
                ground_truth,
                data_source=data_source,
                extra_info=extra_info,
                arrive=arrive,
                group=group,
            )
        elif self.custom_is_async:
            async with integrations.session(self.settings.get("tangram_config")):
                await arrive()
                result = await self.custom(**arguments)
        else:
            async with integrations.session(self.settings.get("tangram_config")):
                await arrive()
                async with tangram.acquire(cpu=self.cpu, kind="reward"):
                    call = functools.partial(self.custom, **arguments)
                    result = await anyio.to_thread.run_sync(call)
        return result, tool_fields

    async def run_single(self, data: DataProto) -> dict[str, Any]:
        item = data[-1:][0]
        uid = item.non_tensor_batch.get("uid", None)
        async with contextlib.AsyncExitStack() as stack:
            arrive: Callable[[], Awaitable[None]] = _alone
            if self.group_wait is not None and uid is not None:
                # In the gate from the start: verl hands a batch's samples over at once,
                # and each counts as on its way while it decodes. The gate is this loop's,
                # or in shared mode the job's, where a group's samples meet whichever
                # reward worker verl sent them to.
                path = self.settings.get("tangram_config")
                resources = await stack.enter_async_context(integrations.session(path))
                block = resources.group(str(uid), self.group_wait)
                arrive = await stack.enter_async_context(block)
            result, tool_fields = await self._score(item, arrive, None if uid is None else str(uid))
        tools = tool_metrics(tool_fields)
        if self.settings.get("metrics"):
            # What this reward process's scheduler did since its previous sample: verl keeps
            # reward_extra_info per sample (validation metrics, rollout dumps), so the
            # samples of a step add up to the step.
            async with integrations.session(self.settings.get("tangram_config")) as resources:
                tools.update(await step_logs(resources.scheduler, resources, ("reward",)))
        if isinstance(result, Mapping):
            return {"reward_score": result["score"], "reward_extra_info": {**tools, **result}}
        return {"reward_score": float(result), "reward_extra_info": {**tools, "acc": float(result)}}
