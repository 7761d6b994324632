"""Parsing of human-written quantities: sizes such as ``"2GiB"`` and rates such as ``"50/s"``.

Kept apart from the resource model so the trace reader and the config loader share it.
"""

from __future__ import annotations

import math
import re

from ..errors import InvalidCapacityError

__all__ = ["format_count", "format_size", "parse_rate", "parse_size"]

_SIZE_FACTORS: dict[str, float] = {
    "": 1.0,
    "b": 1.0,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2.0**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2.0**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2.0**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2.0**40,
}
_PERIODS: dict[str, float] = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*/\s*([a-zA-Z]+)\s*$")


_BINARY = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def format_size(value: float) -> str:
    """``value`` bytes as people write them: ``"32GiB"``, ``"1.5MiB"``, ``"512B"``.

    The largest binary unit with at least one whole unit, to two decimals; a message
    saying ``3.43597e+10`` makes the reader do the division.
    """
    for suffix, factor in _BINARY:
        if abs(value) >= factor:
            return f"{value / factor:.2f}".rstrip("0").rstrip(".") + suffix
    return f"{format_count(value)}B"


def format_count(value: float) -> str:
    """A count exactly when it is whole (``34359738368``, not ``3.43597e+10``)."""
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return f"{value:g}"


def is_rate_text(text: str) -> bool:
    """Whether ``text`` is written as a rate (``"50/s"``) rather than a size."""
    return "/" in text


def is_count_text(text: str) -> bool:
    """Whether ``text`` is a bare number with no unit (``"8"``, ``" 2.5 "``)."""
    match = _SIZE_RE.match(text)
    return match is not None and not match.group(2)


def parse_size(text: str) -> float:
    """Return the number of bytes in ``text`` (``"2GiB"``, ``"512 MB"``, ``"1e9"``).

    :raises InvalidCapacityError: the text is not a size.
    """
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _SIZE_FACTORS:
        raise InvalidCapacityError(f"not a size: {text!r} (write e.g. '2GiB' or '512MB')")
    value = float(match.group(1)) * _SIZE_FACTORS[match.group(2).lower()]
    if not math.isfinite(value):
        raise InvalidCapacityError(f"size {text!r} is not finite")
    return value


def parse_rate(text: str) -> float:
    """Return units per second in ``text`` (``"50/s"``, ``"3000/min"``).

    :raises InvalidCapacityError: the text is not a rate.
    """
    match = _RATE_RE.match(text)
    if match is None or match.group(2).lower() not in _PERIODS:
        raise InvalidCapacityError(f"not a rate: {text!r} (write e.g. '50/s' or '3000/min')")
    value = float(match.group(1)) / _PERIODS[match.group(2).lower()]
    if not math.isfinite(value):
        raise InvalidCapacityError(f"rate {text!r} is not finite")
    return value
