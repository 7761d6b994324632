"""What the verl and OpenRLHF adapters share at their edges: demands as a framework's YAML
writes them, a sandbox's result as the model and the framework's metrics read it.

Both adapters take their settings from files the framework hands over unchecked, so the
demands are checked here, naming where they came from, before any call is scheduled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .._core._demand import Elastic
from .._sandbox._backend import RunResult
from ..errors import ConfigError

__all__ = ["cpu_demand", "demand_of", "extract_code", "format_result", "result_metrics"]


def cpu_demand(value: object, where: str) -> int | Elastic:
    """``2`` (rigid cores) or ``{min: 1, max: 4, resizable: true}`` (elastic), from YAML/TOML.

    :raises ConfigError: anything else, naming ``where``.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"min", "max", "resizable"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown} in `cpu`")
        try:
            return Elastic(
                int(value.get("min", 1)),
                int(value["max"]),
                resizable=bool(value.get("resizable", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: `cpu` needs a whole `max` >= `min` ({exc})") from exc
    raise ConfigError(f"{where}: `cpu` must be a core count or {{min, max}} (got {value!r})")


def demand_of(value: object, where: str) -> dict[str, object]:
    """A demand table (``{search: 1, cpu: {min: 1, max: 4}}``) as ``acquire`` takes it."""
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{where}: `demand` must be a non-empty table (got {value!r})")
    demand: dict[str, object] = {}
    for name, amount in value.items():
        demand[str(name)] = cpu_demand(amount, where) if isinstance(amount, Mapping) else amount
    return demand


def format_result(result: RunResult) -> str:
    """What the model reads back: output, errors and why a run stopped, in that order."""
    parts = [result.stdout.decode(errors="replace")]
    if result.stdout_truncated:
        parts.append("...(output truncated)\n")
    if result.stderr:
        parts.append(result.stderr.decode(errors="replace"))
    if result.timed_out:
        parts.append("(timed out)\n")
    elif result.exit_code != 0:
        parts.append(f"(exit code {result.exit_code})\n")
    return "".join(parts)


def result_metrics(result: RunResult) -> dict[str, Any]:
    """Per-call numbers for the framework's metrics: the ACT split and the grant."""
    return {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "cores": result.units,
        "queue_seconds": result.queue_seconds,
        "exec_seconds": result.exec_seconds,
    }


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block of a model's answer (``None`` when it has none)."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None
