"""Resource kinds and their capacities.

Three shapes cover what agentic rollouts consume outside the trainer:

- a *count* is held while an action runs (cores, GPUs, concurrent connections);
- a *size* is held the same way but written with units (``"16GiB"`` of memory);
- a *rate* is not held at all: an action takes units from a budget that refills at
  ``per_second`` up to ``burst`` (requests or tokens per second of an API quota).

Counts and sizes are the paper's concurrency-type consumption, rates its quota-type one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import attrs

from ..errors import InvalidCapacityError
from ._units import (
    format_count,
    format_size,
    is_count_text,
    is_rate_text,
    parse_rate,
    parse_size,
)
from ._validate import real

__all__ = ["Capacity", "Rate", "Resource", "Shape", "format_amount", "parse_capacity"]


class Shape(enum.Enum):
    COUNT = "count"
    SIZE = "size"
    RATE = "rate"


def _check_rate(instance: Rate, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidCapacityError(f"`{attribute.name}` must be a number (got {value!r})")
    if not math.isfinite(real(value)) or value <= 0:
        raise InvalidCapacityError(f"`{attribute.name}` must be > 0 and finite (got {value!r})")


def _default_burst(self: Rate) -> float:
    # The default runs before the validators, so it must not trip over a bad
    # ``per_second`` (``float("fast")`` would raise a bare ValueError): leave that value
    # alone and let the validator report it as InvalidCapacityError.
    value: object = self.per_second
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 1.0
    return max(1.0, real(value))


@attrs.frozen
class Rate:
    """A refilling budget: ``per_second`` units a second, at most ``burst`` saved up.

    Unlike a count, units taken from a rate are never given back: this is a token bucket,
    the shape of an API's requests-per-second or tokens-per-minute limit. ``burst``
    defaults to one second's worth (at least one unit).
    """

    per_second: float = attrs.field(validator=_check_rate)
    burst: float = attrs.field(
        default=attrs.Factory(_default_burst, takes_self=True),
        validator=_check_rate,
    )


@attrs.frozen
class Resource:
    """One resource kind: its name, shape and total (units, bytes, or units per second)."""

    name: str
    shape: Shape
    total: float
    burst: float = 0.0


def format_amount(resource: Resource, value: float) -> str:
    """An amount of ``resource`` in its own units: ``"2GiB"`` of a size, ``"3"`` of a count,
    ``"5"`` units of a rate (what one action takes from its budget)."""
    if resource.shape is Shape.SIZE:
        return format_size(value)
    return format_count(value)


def _resource(name: str, value: object) -> Resource:
    if not isinstance(name, str) or not name:
        raise InvalidCapacityError(f"resource names must be non-empty strings (got {name!r})")
    if isinstance(value, Rate):
        return Resource(name, Shape.RATE, float(value.per_second), float(value.burst))
    if isinstance(value, str):
        if is_count_text(value):
            # A bare number in text (an environment variable, a YAML string) is a count,
            # as the same number unquoted would be; a size carries a unit ("16GiB").
            return _count(name, float(value), value)
        # Parse errors are re-raised naming the capacity: "not a size: '16 bananas'" alone
        # does not say which entry of a long config is wrong.
        try:
            if is_rate_text(value):
                rate = parse_rate(value)
                if rate <= 0:
                    raise InvalidCapacityError(f"must be > 0 (got {value!r})")
                return Resource(name, Shape.RATE, rate, max(1.0, rate))
            return Resource(name, Shape.SIZE, parse_size(value))
        except InvalidCapacityError as exc:
            raise InvalidCapacityError(f"capacity {name!r}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidCapacityError(
            f"capacity {name!r} must be a number, a size like '16GiB', a rate like '50/s' "
            f"or tangram.Rate (got {value!r})"
        )
    return _count(name, real(value), value)


def _count(name: str, amount: float, written: object) -> Resource:
    if not math.isfinite(amount) or amount < 0:
        raise InvalidCapacityError(f"capacity {name!r} must be >= 0 and finite (got {written!r})")
    return Resource(name, Shape.COUNT, amount)


@attrs.frozen
class Capacity(Mapping[str, Resource]):
    """The resources a runtime schedules, by name. Build it with :func:`parse_capacity`."""

    _resources: Mapping[str, Resource]

    def __getitem__(self, name: str) -> Resource:
        return self._resources[name]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._resources)

    def __len__(self) -> int:
        return len(self._resources)

    def totals(self) -> dict[str, float]:
        return {name: res.total for name, res in self._resources.items()}

    def with_updates(self, updates: Mapping[str, object]) -> Capacity:
        merged = dict(self._resources)
        for name, value in updates.items():
            new = _resource(name, value)
            old = merged.get(name)
            if old is not None and old.shape is not new.shape:
                raise InvalidCapacityError(
                    f"capacity {name!r} changes shape from {old.shape.value} to {new.shape.value}"
                )
            merged[name] = new
        return Capacity(merged)


def parse_capacity(capacity: Mapping[str, object] | Capacity) -> Capacity:
    """Turn ``{"cpu": 8, "mem": "16GiB", "search": "50/s"}`` into a :class:`Capacity`.

    :raises InvalidCapacityError: a value is negative, NaN, of the wrong type or unit.
    """
    if isinstance(capacity, Capacity):
        return capacity
    if not isinstance(capacity, Mapping):
        raise InvalidCapacityError(
            f"capacity must be a mapping of name to amount (got {capacity!r})"
        )
    if not capacity:
        raise InvalidCapacityError("capacity must name at least one resource")
    return Capacity({name: _resource(name, value) for name, value in capacity.items()})
