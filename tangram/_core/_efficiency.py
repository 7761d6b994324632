"""How an elastic action speeds up with more units.

An action that takes ``T1`` seconds on one unit takes ``T1 / speedup(m)`` on ``m`` units,
where ``speedup(m) = E(m) * m`` and the parallel efficiency ``E`` falls as ``m`` grows.
The four models are the ones the tangram-trace/1 format names; :class:`Amdahl` is the one
the online estimator fits, since its two parameters are identifiable from a handful of
(units, seconds) samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from ..errors import DemandTypeError, InvalidDemandError

__all__ = [
    "Amdahl",
    "Efficiency",
    "Estimate",
    "Linear",
    "Power",
    "SpeedupTable",
    "efficiency_from_dict",
]


@runtime_checkable
class Efficiency(Protocol):
    """Anything with ``speedup(units) -> float``: non-decreasing, ``speedup(1) > 0``."""

    def speedup(self, units: float) -> float: ...


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DemandTypeError(f"`{attribute.name}` must be a number (got {value!r})")
    if not 0.0 <= value <= 1.0:
        raise InvalidDemandError(f"`{attribute.name}` must be within [0, 1] (got {value!r})")


@attrs.frozen
class Linear:
    """Perfect scaling, ``E(m) = 1``: an upper bound, rarely true of real work."""

    def speedup(self, units: float) -> float:
        return float(units)


@attrs.frozen
class Amdahl:
    """A serial share ``1 - p`` that no number of units shortens: time = T1·((1-p) + p/m)."""

    parallel_fraction: float = attrs.field(validator=_fraction)

    def speedup(self, units: float) -> float:
        p = self.parallel_fraction
        return 1.0 / ((1.0 - p) + p / units)


@attrs.frozen
class Power:
    """Speedup ``m ** alpha``: a smooth diminishing return without a hard ceiling."""

    alpha: float = attrs.field(validator=_fraction)

    def speedup(self, units: float) -> float:
        return float(float(units) ** self.alpha)


def _speedups(value: Sequence[float]) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise DemandTypeError(f"`speedup` must be a list of numbers (got {value!r})")
    out: list[float] = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise DemandTypeError(f"`speedup[{i}]` must be a number (got {x!r})")
        if not math.isfinite(x) or x <= 0:
            raise InvalidDemandError(f"`speedup[{i}]` must be > 0 and finite (got {x!r})")
        if out and x < out[-1]:
            raise InvalidDemandError(
                f"`speedup` must not decrease (entry {i} is {x!r} < {out[-1]!r})"
            )
        out.append(float(x))
    if not out:
        raise InvalidDemandError("`speedup` must have at least one entry")
    return tuple(out)


@attrs.frozen
class SpeedupTable:
    """Measured speedups: entry ``i`` is the speedup with ``i + 1`` units; flat past the end."""

    speedups: tuple[float, ...] = attrs.field(converter=_speedups)

    def speedup(self, units: float) -> float:
        index = min(int(units), len(self.speedups)) - 1
        if index < 0:
            return self.speedups[0] * units
        return self.speedups[index]


@attrs.frozen
class Estimate:
    """A duration model: ``seconds_at_1`` on one unit, sped up by ``efficiency``.

    Part of the model layer (an action carries one) although the estimator is what usually
    makes it: keeping it here lets :mod:`tangram._core._action` describe an action without
    importing the policy layer that learns estimates.
    """

    seconds_at_1: float
    efficiency: Efficiency

    def seconds(self, units: float) -> float:
        return self.seconds_at_1 / self.efficiency.speedup(max(units, 1.0))


def efficiency_from_dict(spec: Mapping[str, object]) -> Efficiency:
    """Build a model from its tangram-trace/1 form, e.g. ``{"model": "amdahl", ...}``.

    :raises InvalidDemandError: unknown model or a bad parameter.
    """
    if not isinstance(spec, Mapping):
        raise DemandTypeError(f"an efficiency must be an object (got {spec!r})")
    model = spec.get("model")
    if model == "linear":
        return Linear()
    if model == "amdahl":
        return Amdahl(_required(spec, "parallel_fraction"))  # type: ignore[arg-type]
    if model == "power":
        return Power(_required(spec, "alpha"))  # type: ignore[arg-type]
    if model == "table":
        return SpeedupTable(_required(spec, "speedup"))  # type: ignore[arg-type]
    raise InvalidDemandError(
        f"unknown efficiency model {model!r} (expected amdahl, power, linear or table)"
    )


def _required(spec: Mapping[str, object], key: str) -> object:
    if key not in spec:
        raise InvalidDemandError(f"efficiency model {spec.get('model')!r} needs `{key}`")
    return spec[key]
