"""The baseline policy: strict first-come first-served at a fixed degree of parallelism.

Kept apart from :mod:`._policy`, whose pieces it reuses (the admission check, the scan
of what is free, the rate wake-up), to measure what elasticity and size-aware admission
buy: the paper's fixed-DoP ablation.
"""

from __future__ import annotations

from typing import Literal

import attrs

from ..errors import InvalidSettingError, SettingTypeError
from ._policy import _EPS, Entry, Plan, State, _rate_wait, _Scan, may_admit

__all__ = ["FcfsPolicy"]


@attrs.frozen(kw_only=True)
class FcfsPolicy:
    """Strict first-come first-served with a fixed degree of parallelism: the baseline.

    Each elastic action gets ``dop`` units (clamped to its range; ``"min"`` or ``"max"``
    for its bounds) at start and keeps them. Nothing passes a blocked head. This is the
    paper's fixed-DoP ablation, kept to measure what elasticity buys.
    """

    dop: int | Literal["min", "max"] = "min"

    def __attrs_post_init__(self) -> None:
        dop = self.dop
        if dop not in ("min", "max") and not (type(dop) is int and 1 <= dop < 2**63):
            error = InvalidSettingError if type(dop) is int else SettingTypeError
            raise error(f"`dop` must be 'min', 'max' or a whole number >= 1, < 2**63 (got {dop!r})")

    may_admit = staticmethod(may_admit)

    def due(self, arrival: float, seconds: float) -> float:
        """First come, first served: every action is due when it comes, none is passed."""
        return arrival

    def units_for(self, entry: Entry, total: float) -> int:
        elastic = entry.action.demand.elastic
        assert elastic is not None
        if self.dop == "min":
            want = elastic.min
        elif self.dop == "max":
            want = elastic.max
        else:
            want = min(max(self.dop, elastic.min), elastic.max)
        return max(elastic.min, min(want, int(total + _EPS)))

    def plan(self, state: State) -> Plan:
        scan = _Scan(state)
        scan.surplus = {}
        plan = Plan()
        for entry in state.waiting():
            demand = entry.action.demand
            units = 0
            need = demand.rigid
            if demand.elastic_kind is not None:
                units = self.units_for(entry, state.totals[demand.elastic_kind])
                need = (*need, (demand.elastic_kind, float(units)))
            if not scan.fits(need):
                plan.wake_at = _rate_wait(state, scan, need)
                break
            scan.take(need)
            plan.admits.append((entry, units))
        return plan
