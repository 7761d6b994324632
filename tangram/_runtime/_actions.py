"""An ``acquire``'s arguments made into an :class:`Action`, every mistake refused at the call.

The local runtime and a shared scheduler's proxy both check a demand where it is written,
before anything is queued or sent, against the capacity they know; this is the one place
that check lives, so a ``RemoteRuntime`` needs no runtime of its own to validate with.
Synchronous and clock-free: it holds only the capacity, the estimator and a cache.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._core._action import Action
from .._core._demand import Demand, build_demand
from .._core._efficiency import Efficiency
from .._core._estimator import Estimate, Estimator
from .._core._resources import Capacity
from .._core._validate import seconds
from ..errors import DemandTypeError, InvalidDemandError

__all__ = ["Actions", "duration"]

_CACHE_SIZE = 256


def duration(name: str, value: object, *, finite: bool) -> float:
    """A duration argument of ``acquire``, refused as a demand error.

    Callers test for ``None`` (not given) themselves: every acquire passes here twice.
    """
    return seconds(
        name, value, finite=finite, type_error=DemandTypeError, value_error=InvalidDemandError
    )


class Actions:
    """Numbers, checks and estimates the actions of one scheduler.

    Demands are cached by their amounts (the same few shapes repeat for a whole run); the
    cache is dropped when the capacity changes, since a demand that fitted may not now.
    """

    def __init__(self, capacity: Capacity, estimator: Estimator) -> None:
        self._capacity = capacity
        self._estimator = estimator
        self._ids = 0
        self._demands: dict[tuple[tuple[str, object], ...], tuple[Demand, tuple[type, ...]]] = {}

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    @capacity.setter
    def capacity(self, capacity: Capacity) -> None:
        self._capacity = capacity
        self._demands.clear()

    def build(
        self,
        demand: Mapping[str, object] | None,
        amounts: Mapping[str, object],
        kind: str,
        trajectory: str | None,
        estimate: float | None,
    ) -> Action:
        """The action ``acquire(demand, kind=..., **amounts)`` asks for.

        :raises InvalidDemandError: (and its subclasses) for a demand that cannot be served.
        """
        if demand is not None:
            if not isinstance(demand, Mapping):
                raise DemandTypeError(
                    f"`demand` must be a mapping of resource to amount (got {demand!r})"
                )
            if amounts:
                raise DemandTypeError(
                    "give the demand either as a mapping or as keywords, not both "
                    f"(got {dict(demand)!r} and {dict(amounts)!r})"
                )
            amounts = demand
        if not isinstance(kind, str):
            raise DemandTypeError(f"`kind` must be a string (got {kind!r})")
        if trajectory is not None and not isinstance(trajectory, str):
            raise DemandTypeError(f"`trajectory` must be a string or None (got {trajectory!r})")
        built = self._demand(amounts)
        # An infinite estimate would turn the policy's completion-time sums into NaN.
        given = None if estimate is None else duration("estimate", estimate, finite=True)
        if given is None:
            guess = self._estimator.predict(kind)
        else:
            elastic = built.elastic
            efficiency: Efficiency = (
                elastic.efficiency
                if elastic is not None and elastic.efficiency is not None
                else self._estimator.predict(kind).efficiency
            )
            guess = Estimate(max(given, 1e-9), efficiency)
        self._ids += 1
        return Action(self._ids, kind, trajectory, built, guess, learned=given is None)

    def _demand(self, amounts: Mapping[str, object]) -> Demand:
        # A hit must also match each amount's type: True == 1 and hash(True) == hash(1), so
        # ``cpu=True`` would otherwise be served the demand cached for ``cpu=1`` and skip
        # the check that rejects booleans.
        try:
            key = tuple(amounts.items())
            hit = self._demands.get(key)
        except TypeError:  # an unhashable amount: validate without caching
            return build_demand(amounts, self._capacity)
        types = tuple(map(type, amounts.values()))
        if hit is not None and hit[1] == types:
            return hit[0]
        built = build_demand(amounts, self._capacity)
        if len(self._demands) >= _CACHE_SIZE:
            self._demands.clear()
        self._demands[key] = (built, types)
        return built
