"""``[adapters.openrlhf]``, read and checked once, for the agent executor and the reward file.

Both entry points read the same table: the reward file read it unchecked, so
``partial = "false"`` scored half an answer 0.5 and ``timeout = "30"`` failed every call
after a load that passed.
"""

from __future__ import annotations

from typing import Any

from tangram import integrations
from tangram.config import ConfigError
from tangram.integrations import count_of, cpu_demand, flag_of, seconds_of, text_of

__all__ = ["DEFAULT_FEEDBACK", "settings"]

_SETTINGS = {
    "max_turns",
    "cpu",
    "timeout",
    "kind",
    "reward",
    "feedback",
    "tangram_config",
    "case_timeout",
    "partial",
    "metrics",
}
DEFAULT_FEEDBACK = "\n<tool_response>\n{output}</tool_response>\n"


def settings() -> dict[str, Any]:
    """``[adapters.openrlhf]``, each value checked: read where the executor is built, so a
    mistake fails the engine actor at start, not every episode's step (which OpenRLHF
    does not catch) or, quietly, what is scored (``partial = "false"`` was true)."""
    config = integrations.config_for(None)
    table = dict(config.adapters.get("openrlhf", {}))
    unknown = sorted(set(table) - _SETTINGS)
    if unknown:
        raise ConfigError(f"[adapters.openrlhf]: unknown key(s) {unknown}")

    def where(key: str) -> str:
        return f"[adapters.openrlhf] `{key}`"

    feedback = text_of(table.get("feedback", DEFAULT_FEEDBACK), where("feedback"))
    try:
        feedback.format(output="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"{where('feedback')} may name only {{output}} (got {feedback!r}: {exc!r})"
        ) from None
    reward = text_of(table.get("reward", "tests"), where("reward"))
    if reward != "tests":
        try:
            integrations.load_object(reward)
        except ConfigError as exc:
            raise ConfigError(f"{where('reward')}: {exc}") from None
    path = table.get("tangram_config")
    return {
        "tangram_config": None if path is None else text_of(path, where("tangram_config")),
        "max_turns": count_of(table.get("max_turns", 4), where("max_turns")),
        "cpu": cpu_demand(table.get("cpu", 1), "[adapters.openrlhf]"),
        "timeout": seconds_of(table.get("timeout"), where("timeout")),
        "kind": text_of(table.get("kind", "run_code"), where("kind")),
        "reward": reward,
        "feedback": feedback,
        "case_timeout": seconds_of(table.get("case_timeout"), where("case_timeout")),
        "partial": flag_of(table.get("partial", False), where("partial")),
        "metrics": flag_of(table.get("metrics", False), where("metrics")),
    }
