"""What the verl and OpenRLHF adapters share at their edges: demands as a framework's YAML
writes them, a sandbox's result as the model and the framework's metrics read it.

Both adapters take their settings from files the framework hands over unchecked, so the
demands are checked here, naming where they came from, before any call is scheduled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

from .._core._demand import Elastic
from .._core._units import parse_size
from .._sandbox._backend import RunResult
from ..errors import ConfigError, InvalidCapacityError

__all__ = [
    "count_of",
    "cpu_demand",
    "demand_of",
    "extract_code",
    "flag_of",
    "format_result",
    "result_metrics",
    "seconds_of",
    "text_of",
]


def cpu_demand(value: object, where: str) -> int | Elastic:
    """``2`` (rigid cores) or ``{min: 1, max: 4, resizable: true}`` (elastic), from YAML/TOML.

    :raises ConfigError: anything else, naming ``where``.
    """
    if _whole(value) and value >= 1:
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"min", "max", "resizable"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown} in `cpu`")
        low, high = value.get("min", 1), value.get("max")
        # int(1.9) was 1 and int(inf) an OverflowError: bounds are whole, as a rigid
        # count is, and a flag is a boolean (bool("false") is True).
        if not (_whole(low) and _whole(high)):
            raise ConfigError(
                f"{where}: `cpu` needs whole `min` and `max` (got {low!r} and {high!r})"
            )
        resizable = flag_of(value.get("resizable", False), f"{where}: `cpu.resizable`")
        try:
            return Elastic(low, high, resizable=resizable)
        except ValueError as exc:
            raise ConfigError(f"{where}: `cpu`: {exc}") from exc
    raise ConfigError(f"{where}: `cpu` must be a core count or {{min, max}} (got {value!r:.80})")


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def flag_of(value: object, where: str) -> bool:
    """A yes/no setting: ``true`` or ``false`` as the file writes them, never a string
    (``bool("false")`` is True, so a quoted flag turned a setting on).

    :raises ConfigError: anything but a boolean, naming ``where``.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false (got {value!r:.80})")
    return value


def seconds_of(value: object, where: str) -> float | None:
    """A time limit in seconds (> 0 and finite), or ``None`` for none.

    :raises ConfigError: a string, a bool, zero, a negative or a non-finite number.
    """
    if value is None:
        return None
    if _whole(value) or isinstance(value, float):
        seconds = float(value) if abs(value) < 2**1023 else math.inf
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    raise ConfigError(f"{where} must be a number of seconds > 0 (got {value!r:.80})")


def count_of(value: object, where: str) -> int:
    """A whole number >= 1 (turns, tests).

    :raises ConfigError: anything else, a numeric string included.
    """
    if _whole(value) and value >= 1:
        return value
    raise ConfigError(f"{where} must be a whole number >= 1 (got {value!r:.80})")


def text_of(value: object, where: str) -> str:
    """A non-empty string (an action kind, a parameter's name).

    :raises ConfigError: anything else.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string (got {value!r:.80})")
    return value


def demand_of(value: object, where: str) -> dict[str, object]:
    """A demand table (``{search: 1, cpu: {min: 1, max: 4}}``) as ``acquire`` takes it,
    each amount checked where the table is read: taken as it was, ``cpu = "two"`` or
    ``search = -1`` passed the worker's start and failed every call of the run after it.

    :raises ConfigError: not a non-empty table, or an amount that is not a number >= 0
        and finite, a size (``"2GiB"``), an :class:`~tangram.Elastic` or a ``{min, max}``.
    """
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{where}: `demand` must be a non-empty table (got {value!r:.80})")
    demand: dict[str, object] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: a demand names a resource (got {name!r:.80})")
        if isinstance(amount, Mapping):
            amount = cpu_demand(amount, where)
        elif isinstance(amount, str):
            try:
                parse_size(amount)
            except InvalidCapacityError as exc:
                raise ConfigError(f"{where}: demand {name!r}: {exc}") from None
        elif not isinstance(amount, Elastic) and not (
            isinstance(amount, (int, float))
            and not isinstance(amount, bool)
            and 0 <= amount < math.inf
        ):
            raise ConfigError(
                f"{where}: demand {name!r} must be a number >= 0, a size or "
                f"{{min, max}} (got {amount!r:.80})"
            )
        demand[name] = amount
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
