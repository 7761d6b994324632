"""Argument checks shared by every layer: one wording for "must be a number of seconds".

Each public constructor checks its arguments where the caller made them (attrs validators,
trio's ``CapacityLimiter``): a ``TypeError`` for a wrong type, a ``ValueError`` for a bad
range, the parameter named, the value shown. The callers may pick the error classes (a
demand's bad deadline is an :class:`~tangram.errors.InvalidDemandError`); by default a
wrong type is a :class:`~tangram.errors.SettingTypeError` and a bad range an
:class:`~tangram.errors.InvalidSettingError`, tangram errors that are still the
``TypeError`` and ``ValueError`` callers catch. The checks live here once and the types
stay where they belong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import InvalidSettingError, SettingTypeError
from ._units import parse_size

__all__ = [
    "byte_size",
    "non_negative",
    "number",
    "positive",
    "real",
    "seconds",
    "validator",
    "whole",
]

#: The largest whole number a setting takes: a C ``long long``.
_MOST_WHOLE = 2**63 - 1

#: What a check raises: an exception class, or a function that builds one from the message
#: (a config loader's, which says where in the file the value was found).
_Error = Callable[[str], Exception]


def real(value: int | float) -> float:
    """``value`` as a float, an int past a float's range read as infinite.

    ``float(10**400)`` raises ``OverflowError``, which is neither tangram's error nor the
    ``ValueError`` a caller catches. Read as infinite, such a number meets the finite check
    every caller makes anyway, and is refused there with the caller's own typed error.
    """
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def number(
    name: str,
    value: object,
    *,
    minimum: float = 0.0,
    strict: bool = False,
    maximum: float | None = None,
    finite: bool = True,
    unit: str = "",
    type_error: _Error = SettingTypeError,
    value_error: _Error = InvalidSettingError,
) -> float:
    """``value`` as a float, or the caller's errors naming ``name``.

    NaN is always refused: it compares false with every bound, so it would slip past a
    range check and stall whatever clock or budget it reaches. So is an int past a
    float's range, even where infinity is allowed: an attrs field keeps the int it was
    given, and the first sum with a float would raise ``OverflowError`` far from here.
    """
    what = f"a number of {unit} " if unit else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(f"`{name}` must be {what or 'a number '}(got {value!r})")
    amount = real(value)
    low_ok = amount > minimum if strict else amount >= minimum
    high_ok = maximum is None or amount <= maximum
    too_large = isinstance(value, int) and math.isinf(amount)
    if (
        math.isnan(amount)
        or not low_ok
        or not high_ok
        or (finite and math.isinf(amount))
        or too_large
    ):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        if maximum is not None:
            bound += f" and <= {maximum:g}"
        elif finite or too_large:
            bound += " and finite" if finite else ", as a float (math.inf for no limit)"
        raise value_error(f"`{name}` must be {what}{bound} (got {value!r})")
    return amount


def seconds(
    name: str,
    value: object,
    *,
    strict: bool = False,
    finite: bool = True,
    type_error: _Error = SettingTypeError,
    value_error: _Error = InvalidSettingError,
) -> float:
    """A duration: ``>= 0`` (``> 0`` with ``strict``), finite unless ``finite=False``."""
    return number(
        name,
        value,
        strict=strict,
        finite=finite,
        unit="seconds",
        type_error=type_error,
        value_error=value_error,
    )


def whole(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    type_error: _Error = SettingTypeError,
    value_error: _Error = InvalidSettingError,
) -> int:
    """A whole number from ``minimum`` to ``2**63 - 1`` (bools refused: ``True`` is not a
    count). Past that bound no count is meant, and a C call (``setrlimit``, ``islice``)
    would raise ``OverflowError`` at first use, far from the call that set it."""
    # The bound in both messages: "must be a whole number" alone hides that 0 is refused.
    message = f"`{name}` must be a whole number >= {minimum} and < 2**63 (got {value!r})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(message)
    if not minimum <= value <= _MOST_WHOLE:
        raise value_error(message)
    return value


def validator(check: Callable[..., Any], **options: Any) -> Callable[[object, Any, object], None]:
    """An attrs validator: ``check`` (one of the above) with ``options``, named by the field."""

    def validate(instance: object, attribute: Any, value: object) -> None:
        check(attribute.name, value, **options)

    return validate


positive = validator(number, strict=True, finite=False)
"""attrs validator: a number ``> 0`` (infinity allowed: "no limit")."""
non_negative = validator(number)
"""attrs validator: a finite number ``>= 0``."""


def byte_size(name: str, value: object) -> int:
    """``value`` (``"512MiB"`` or a whole number of bytes) in bytes, checked where it is
    given: a bad size would otherwise fail at the first container or sandbox made."""
    if isinstance(value, str):
        try:
            return int(parse_size(value))
        except InvalidSettingError as exc:
            raise InvalidSettingError(f"`{name}`: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingTypeError(
            f"`{name}` must be a size like '512MiB' or a whole number of bytes (got {value!r})"
        )
    return whole(name, value)
