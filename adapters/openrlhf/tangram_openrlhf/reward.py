"""A single-turn OpenRLHF reward that grades each answer's code against its tests in tangram.

Pass this file as ``--reward.remote_url``: OpenRLHF loads ``reward_func(queries, prompts,
labels)`` from it and calls it in a worker thread (``asyncio.to_thread``), one query at a
time. The answer's last fenced code block is graded against the label (assertion tests,
or input/output tests: see ``docs/rewards.md``) by tangram's grading harness, in a fresh
sandbox of the ``[sandbox]`` pool, with the cores of ``[adapters.openrlhf]``'s ``cpu``.
The reward is 1.0 when every test passes (with ``partial = true``, the fraction passed);
the verdict comes from the harness, never from the answer's exit status, so an answer
that exits 0 early, hooks ``atexit`` or forges ``__eq__`` scores 0.

The call blocks only its own worker thread: the work runs on this process's tangram loop
(one thread with one scheduler, started on first use), never on vLLM's. A sandbox that
cannot run the harness raises :class:`tangram.errors.SandboxBrokenError` rather than
scoring the answer 0.

OpenRLHF loads this file (by path, as a module named ``reward_func``) when its vLLM engine
actor starts, so the config is checked then and a bad set-up fails the actor. During a
call OpenRLHF catches whatever ``reward_func`` raises, logs it at INFO and gives the
sample no reward (``reward=None``); its experience maker then stops the step rather than
train on it. So a tangram failure is logged here at ERROR, counted, and raised: never
scored as the answer's 0.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from tangram import integrations
from tangram.config import ConfigError
from tangram.integrations import (
    Verdict,
    extract_code,
    grade,
    is_infrastructure,
    parse_tests,
    record,
)
from tangram_openrlhf._settings import settings as read_settings

__all__ = ["check", "reward_func", "score_code"]


async def score_code(query: str, prompt: str, label: Any) -> tuple[float, Verdict | None]:
    """(reward, verdict) of one query; the verdict is ``None`` when the answer has no code.

    :raises ValueError: the label holds no test that can be run.
    """
    settings = read_settings()
    tests = parse_tests(label)
    answer = query[len(prompt) :] if query.startswith(prompt) else query
    code = extract_code(answer)
    if code is None:
        return 0.0, None
    async with (
        integrations.session(settings["tangram_config"]) as resources,
        resources.sandbox_pool().sandbox(f"reward-{uuid.uuid4().hex}") as sandbox,
    ):
        verdict = await grade(
            sandbox,
            code,
            tests,
            cpu=settings["cpu"],
            timeout=settings["timeout"],
            case_timeout=settings["case_timeout"],
        )
    return verdict.score(partial=settings["partial"]), verdict


async def _score_all(queries: list[str], prompts: list[str], labels: list[Any]) -> list[Any]:
    return [await score_code(q, p, lbl) for q, p, lbl in zip(queries, prompts, labels, strict=True)]


def reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
    """OpenRLHF's reward hook: ``{"rewards", "scores", "extra_logs"}`` for the queries.

    ``extra_logs`` holds ``tests_passed`` and ``tests_total`` per query (0 and 0 for an
    answer without code).

    :raises ConfigError: no tangram config, or one without ``[sandbox]``.
    :raises ValueError: a label holds no test that can be run.
    """
    if not (len(queries) == len(prompts) == len(labels)):
        raise ConfigError("queries, prompts and labels must have the same length")
    try:
        scored = integrations.portal_call(_score_all, list(queries), list(prompts), list(labels))
    except Exception as exc:
        if is_infrastructure(exc):
            record("reward", exc)
        raise
    rewards = torch.tensor([reward for reward, _ in scored])
    verdicts = [verdict or Verdict(0, 0) for _, verdict in scored]
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {
            "tests_passed": torch.tensor([float(v.passed) for v in verdicts]),
            "tests_total": torch.tensor([float(v.total) for v in verdicts]),
        },
    }


def check() -> None:
    """Load and check the config ``reward_func`` will use: ``[sandbox]``, and every key of
    ``[adapters.openrlhf]`` as the agent executor checks it.

    :raises ConfigError: no tangram config, an invalid one, one without ``[sandbox]``, or
        a setting of the wrong type or name (``partial = "false"``, ``timeout = "30"``).
    """
    settings = read_settings()
    integrations.check(settings["tangram_config"], needs=("sandbox",))


if __name__ == "reward_func":  # loaded by path by OpenRLHF's executor, at actor start
    check()
