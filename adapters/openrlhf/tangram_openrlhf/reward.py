"""A single-turn OpenRLHF reward that runs each answer's code against its tests in tangram.

Pass this file as ``--reward.remote_url``: OpenRLHF loads ``reward_func(queries, prompts,
labels)`` from it and calls it in a worker thread (``asyncio.to_thread``), one query at a
time. The answer's last fenced code block runs, followed by the label (its assertions),
in a fresh sandbox of the ``[sandbox]`` pool, with the cores of ``[adapters.openrlhf]``'s
``cpu``; the reward is 1.0 when it exits 0 within ``timeout``.

The call blocks only its own worker thread: the work runs on this process's tangram loop
(one thread with one scheduler, started on first use), never on vLLM's.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from tangram._frameworks import _session
from tangram._frameworks._convert import cpu_demand, extract_code
from tangram.config import ConfigError

__all__ = ["reward_func", "score_code"]


async def score_code(query: str, prompt: str, label: str) -> tuple[float, int]:
    """(reward, exit code) of one query: -1 when the answer holds no code block."""
    config = _session.config_for(None)
    settings = dict(config.adapters.get("openrlhf", {}))
    cpu = cpu_demand(settings.get("cpu", 1), "[adapters.openrlhf]")
    answer = query[len(prompt) :] if query.startswith(prompt) else query
    code = extract_code(answer)
    if code is None:
        return 0.0, -1
    async with (
        _session.session(None) as resources,
        resources.sandbox_pool().sandbox(uuid.uuid4().hex) as sandbox,
    ):
        result = await sandbox.run(
            code=f"{code}\n\n{label or ''}\n",
            cpu=cpu,
            timeout=settings.get("timeout"),
            kind="reward",
        )
    ok = result.exit_code == 0 and not result.timed_out
    # A command killed by a signal has no exit code: -1 tells it from a clean failure.
    return (1.0 if ok else 0.0), -1 if result.exit_code is None else result.exit_code


async def _score_all(queries: list[str], prompts: list[str], labels: list[Any]) -> list[Any]:
    return [await score_code(q, p, lbl) for q, p, lbl in zip(queries, prompts, labels, strict=True)]


def reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
    """OpenRLHF's reward hook: ``{"rewards", "scores", "extra_logs"}`` for the queries.

    :raises ConfigError: no tangram config, or one without ``[sandbox]``.
    """
    if not (len(queries) == len(prompts) == len(labels)):
        raise ConfigError("queries, prompts and labels must have the same length")
    scored = _session.portal_call(_score_all, list(queries), list(prompts), list(labels))
    rewards = torch.tensor([reward for reward, _ in scored])
    exit_codes = torch.tensor([float(code) for _, code in scored])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"exit_code": exit_codes}}
