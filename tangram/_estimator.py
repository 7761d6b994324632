"""Online estimates of action durations and speedups, learned from completed actions.

The paper profiles each action kind offline to get its efficiency curve; users of an SDK
will not. Instead every completed action reports ``(kind, units, seconds)`` and the
estimator fits Amdahl's law, ``seconds = a + b / units``, per kind: ``a`` is the serial
part and ``b`` the parallel part of the one-unit time ``T1 = a + b``. The fit is a ridge
regression pulled towards a prior, so one sample at one unit count already gives a usable
``T1`` and the split between ``a`` and ``b`` is learned once different unit counts have
been seen. Old samples fade (``decay``), so a kind whose work changes is followed, and the
number of kinds kept is bounded, so memory does not grow over a days-long run.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import attrs

from ._efficiency import Amdahl, Efficiency

__all__ = ["Estimate", "Estimator"]


@attrs.frozen
class Estimate:
    """A duration model: ``seconds_at_1`` on one unit, sped up by ``efficiency``."""

    seconds_at_1: float
    efficiency: Efficiency

    def seconds(self, units: float) -> float:
        return self.seconds_at_1 / self.efficiency.speedup(max(units, 1.0))


class _KindStats:
    """Decayed sufficient statistics of the regression ``t = a + b * x`` with ``x = 1/m``."""

    __slots__ = ("count", "sw", "swt", "swx", "swxt", "swxx")

    def __init__(self) -> None:
        self.sw = self.swx = self.swxx = self.swt = self.swxt = 0.0
        self.count = 0

    def add(self, x: float, t: float, decay: float) -> None:
        self.sw = self.sw * decay + 1.0
        self.swx = self.swx * decay + x
        self.swxx = self.swxx * decay + x * x
        self.swt = self.swt * decay + t
        self.swxt = self.swxt * decay + x * t
        self.count += 1


class Estimator:
    """Learns ``T1`` and an Amdahl speedup per action kind from completed actions.

    :param prior_seconds: ``T1`` assumed for a kind never seen, until any kind has been
        seen; after that a new kind starts from the running mean over all kinds.
    :param prior_parallel_fraction: the share of ``T1`` assumed to parallelise.
    :param prior_weight: how many samples the prior is worth.
    :param decay: weight kept by older samples at each new one (1.0 never forgets).
    :param max_kinds: kinds remembered; the least recently used is forgotten past this.
    """

    def __init__(
        self,
        *,
        prior_seconds: float = 1.0,
        prior_parallel_fraction: float = 0.8,
        prior_weight: float = 1.0,
        decay: float = 0.99,
        max_kinds: int = 1024,
    ) -> None:
        for name, value, low, high in (
            ("prior_seconds", prior_seconds, 0.0, math.inf),
            ("prior_parallel_fraction", prior_parallel_fraction, 0.0, 1.0),
            ("prior_weight", prior_weight, 0.0, math.inf),
            ("decay", decay, 0.0, 1.0),
        ):
            if not (isinstance(value, (int, float)) and low <= value <= high) or (
                name in ("prior_seconds", "prior_weight", "decay") and value <= 0
            ):
                raise ValueError(f"`{name}` out of range (got {value!r})")
        if max_kinds < 1:
            raise ValueError(f"`max_kinds` must be >= 1 (got {max_kinds!r})")
        self._prior_seconds = float(prior_seconds)
        self._prior_p = float(prior_parallel_fraction)
        self._prior_weight = float(prior_weight)
        self._decay = float(decay)
        self._max_kinds = max_kinds
        self._kinds: OrderedDict[str, _KindStats] = OrderedDict()
        self._cache: dict[str, Estimate] = {}
        self._mean_t1 = 0.0
        self._mean_weight = 0.0

    def __len__(self) -> int:
        return len(self._kinds)

    def observe(self, kind: str, units: float, seconds: float) -> None:
        """Record that an action of ``kind`` took ``seconds`` on (on average) ``units``."""
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(units) and units > 0):
            return
        stats = self._kinds.get(kind)
        if stats is None:
            stats = self._kinds[kind] = _KindStats()
            if len(self._kinds) > self._max_kinds:
                old, _ = self._kinds.popitem(last=False)
                self._cache.pop(old, None)
        else:
            self._kinds.move_to_end(kind)
        stats.add(1.0 / units, seconds, self._decay)
        self._cache.pop(kind, None)
        estimate = self.predict(kind)
        self._mean_weight = self._mean_weight * self._decay + 1.0
        self._mean_t1 += (estimate.seconds_at_1 - self._mean_t1) / self._mean_weight

    def predict(self, kind: str) -> Estimate:
        """The current estimate for ``kind`` (the prior when it was never observed)."""
        cached = self._cache.get(kind)
        if cached is not None:
            return cached
        t0 = self._mean_t1 if self._mean_weight > 0 else self._prior_seconds
        a0, b0 = t0 * (1.0 - self._prior_p), t0 * self._prior_p
        stats = self._kinds.get(kind)
        if stats is None:
            return Estimate(t0, Amdahl(self._prior_p))
        a, b = self._solve(stats, a0, b0)
        t1 = max(a + b, 1e-9)
        estimate = Estimate(t1, Amdahl(min(1.0, max(0.0, b / t1))))
        self._cache[kind] = estimate
        return estimate

    def _solve(self, s: _KindStats, a0: float, b0: float) -> tuple[float, float]:
        # Ridge towards (a0, b0): minimise sum w (t - a - b x)^2 + lam((a-a0)^2 + (b-b0)^2).
        lam = self._prior_weight
        m11, m12, m22 = s.sw + lam, s.swx, s.swxx + lam
        r1, r2 = s.swt + lam * a0, s.swxt + lam * b0
        det = m11 * m22 - m12 * m12
        a = (r1 * m22 - r2 * m12) / det
        b = (m11 * r2 - m12 * r1) / det
        if a < 0:  # all serial time explained by the parallel term: refit with a = 0
            a, b = 0.0, r2 / m22
        if b < 0:
            a, b = r1 / m11, 0.0
        return a, b
