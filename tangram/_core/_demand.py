"""What one action asks for: a vector over resource kinds, at most one of them elastic.

A plain number is a rigid demand: the action needs exactly that much. An
:class:`Elastic` demand names a range of whole units; the scheduler picks the grant inside
it and, for a resizable action, changes it while the action runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

from ..errors import (
    CapacityExceededError,
    DemandTypeError,
    InvalidCapacityError,
    InvalidDemandError,
    UnknownResourceError,
)
from ._efficiency import Efficiency
from ._resources import Capacity, Resource, Shape, format_amount
from ._units import parse_size
from ._validate import real

__all__ = ["MOST_UNITS", "Demand", "Elastic", "build_demand", "describe"]


#: The most units an elastic bound may name. The ledger sums units as floats, which count
#: whole units exactly only up to 2**53 (past about 10**308 not at all), and no resource
#: has that many units to lend: a larger "no limit" is refused at the call, not met as an
#: OverflowError halfway through an admission.
MOST_UNITS = 2**53


def _whole(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DemandTypeError(f"`{attribute.name}` must be a whole number of units (got {value!r})")
    if not 1 <= value <= MOST_UNITS:
        raise InvalidDemandError(f"`{attribute.name}` must be >= 1 and <= 2**53 (got {value!r})")


def _efficiency(
    instance: object, attribute: attrs.Attribute[Efficiency | None], value: object
) -> None:
    if value is not None and not isinstance(value, Efficiency):
        raise DemandTypeError(
            f"`efficiency` must be tangram.Amdahl, Power, Linear, SpeedupTable or have a "
            f"speedup(units) method (got {value!r})"
        )


@attrs.frozen
class Elastic:
    """An elastic demand: any whole number of units from ``min`` to ``max``.

    More units shorten the action by ``efficiency`` (learned online from past actions of
    the same kind when not given). A ``resizable`` action follows grant changes while it
    runs, as a cgroup quota does; the default is ``False`` because a body that reads its
    grant once cannot give units back, and growing it would only bill idle units.

    :raises InvalidDemandError: ``min < 1``, ``max < min``, or a bound past ``2**53``.
    :raises DemandTypeError: non-integer bounds or an object that is not an efficiency.
    """

    min: int = attrs.field(validator=_whole)
    max: int = attrs.field(validator=_whole)
    efficiency: Efficiency | None = attrs.field(default=None, validator=_efficiency, kw_only=True)
    resizable: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.max < self.min:
            raise InvalidDemandError(f"`max` must be >= `min` (got {self.max} < {self.min})")
        if not isinstance(self.resizable, bool):
            raise DemandTypeError(f"`resizable` must be a bool (got {self.resizable!r})")


@attrs.frozen(cache_hash=True)
class Demand:
    """A validated demand: rigid amounts, and the elastic range when there is one.

    ``minimum`` is what must be free to start (rigid amounts plus the elastic ``min``).
    Built by :func:`build_demand` against a capacity, so every amount is known to fit.
    Its hash is kept: the queue files alike actions by kind and demand at every arrival.
    """

    rigid: tuple[tuple[str, float], ...]
    elastic_kind: str | None = None
    elastic: Elastic | None = None
    # Read by every admission check of every pass: computed once, not per read.
    minimum: tuple[tuple[str, float], ...] = attrs.field(init=False, eq=False, repr=False)

    @minimum.default
    def _minimum(self) -> tuple[tuple[str, float], ...]:
        if self.elastic_kind is None or self.elastic is None:
            return self.rigid
        return (*self.rigid, (self.elastic_kind, float(self.elastic.min)))

    # The kinds of ``minimum``, sorted: the waiting queue files actions by them.
    kinds: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)

    @kinds.default
    def _kinds(self) -> tuple[str, ...]:
        return tuple(sorted({kind for kind, _ in self.minimum}))

    def amount(self, kind: str, elastic_units: int = 0) -> float:
        total = sum(value for name, value in self.rigid if name == kind)
        if kind == self.elastic_kind:
            total += elastic_units
        return total


def describe(amounts: Iterable[tuple[str, float]], capacity: Capacity) -> str:
    """``cpu=3, mem=2GiB``: amounts in each resource's units, for messages."""
    return ", ".join(
        f"{name}={format_amount(capacity[name], value)}"
        if name in capacity
        else f"{name}={value:g}"
        for name, value in amounts
    )


def _amount(name: str, value: object, resource: Resource) -> float:
    shape = resource.shape
    if isinstance(value, str):
        if shape is not Shape.SIZE:
            # The usual cause: ``Runtime(capacity={"mem": 16})``, a bare number, which is a
            # count in whatever unit the caller picked; sizes are declared by their unit.
            raise DemandTypeError(
                f"demand {name!r} takes a number: capacity {name!r} is a "
                f"{shape.value} ({format_amount(resource, resource.total)}), and only a size "
                f"capacity written with a unit (capacity={{{name!r}: '16GiB'}}) takes text "
                f"like '2GiB' (got {value!r})"
            )
        try:
            return parse_size(value)
        except InvalidCapacityError as exc:
            raise InvalidDemandError(f"demand {name!r}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DemandTypeError(f"demand {name!r} must be a number (got {value!r})")
    amount = real(value)
    if math.isnan(amount) or amount < 0 or math.isinf(amount):
        raise InvalidDemandError(f"demand {name!r} must be >= 0 and finite (got {value!r})")
    return amount


def build_demand(amounts: Mapping[str, object], capacity: Capacity) -> Demand:
    """Validate ``amounts`` against ``capacity`` and return the :class:`Demand`.

    :raises UnknownResourceError: a name that is not in ``capacity``.
    :raises DemandTypeError: ``amounts`` is not a mapping, or holds a value of the wrong type.
    :raises InvalidDemandError: a negative, NaN or infinite amount, an empty demand, more
        than one elastic kind, or an elastic rate.
    :raises CapacityExceededError: more than the total of some kind.
    """
    if not isinstance(amounts, Mapping):  # the simulator's steps come here unchecked
        raise DemandTypeError(f"a demand must be a mapping of resource to amount (got {amounts!r})")
    rigid: list[tuple[str, float]] = []
    elastic_kind: str | None = None
    elastic: Elastic | None = None
    for name, value in amounts.items():
        resource = capacity.get(name)
        if resource is None:
            known = ", ".join(sorted(capacity)) or "none"
            raise UnknownResourceError(f"unknown resource {name!r} (this runtime has: {known})")
        if isinstance(value, Elastic):
            if elastic_kind is not None:
                raise InvalidDemandError(
                    f"at most one resource may be elastic (got {elastic_kind!r} and {name!r})"
                )
            if resource.shape is not Shape.COUNT:
                raise InvalidDemandError(
                    f"only counted resources can be elastic ({name!r} is a {resource.shape.value})"
                )
            elastic_kind, elastic = name, value
            needed = float(value.min)
        else:
            needed = _amount(name, value, resource)
            if needed == 0:
                continue
            rigid.append((name, needed))
        limit = resource.burst if resource.shape is Shape.RATE else resource.total
        if needed > limit:
            what = "burst" if resource.shape is Shape.RATE else "capacity"
            raise CapacityExceededError(
                f"demand {name!r} needs {format_amount(resource, needed)}, more than the "
                f"whole {what} {format_amount(resource, limit)}"
            )
    if not rigid and elastic is None:
        raise InvalidDemandError("the demand is empty: name at least one resource amount > 0")
    return Demand(tuple(rigid), elastic_kind, elastic)
