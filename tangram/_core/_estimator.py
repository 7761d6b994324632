"""Online estimates of action durations and speedups, learned from completed actions.

The paper profiles each action kind offline to get its efficiency curve; users of an SDK
will not. Instead every completed action reports ``(kind, units, seconds)`` and the
estimator fits Amdahl's law, ``seconds = a + b / units``, per kind: ``a`` is the serial
part and ``b`` the parallel part of the one-unit time ``T1 = a + b``. The fit is a
regression pulled towards a prior that counts as ``prior_weight`` old samples: one sample
at any unit count already gives a usable ``T1``, the prior's parallel fraction holds
until different unit counts have been seen, and then the data decide. The prior fades
like any old sample, so it does not bias a kind with plenty of data (a fixed penalty did:
with samples at 1 to 16 units the parallel part is weakly identified, and a fixed pull
worth one sample moved a true ``p = 0.99`` to 0.955 and ``T1`` by 4%). Old samples fade
(``decay``), so a kind whose work changes is followed, and the number of kinds kept is
bounded, so memory does not grow over a days-long run.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict

# Estimate lives in the model layer (an action carries one); it is re-exported here
# because this is where estimates are made.
from ..errors import InvalidSettingError, SettingTypeError
from ._efficiency import Amdahl, Estimate
from ._validate import real, whole

__all__ = ["Estimate", "Estimator"]

_ALLOWED = {
    "prior_seconds": "a number > 0 and finite",
    "prior_parallel_fraction": "a number within [0, 1]",
    "prior_weight": "a number > 0 and finite",
    "decay": "a number within (0, 1]",
}

_EAGER_SAMPLES = 32
_REFIT_EVERY = 16


class _KindStats:
    """Decayed sufficient statistics of the regression ``t = a + b * x`` with ``x = 1/m``."""

    __slots__ = ("count", "prior_t1", "prior_w", "sw", "swt", "swx", "swxt", "swxx")

    def __init__(self, prior_t1: float, prior_weight: float) -> None:
        self.sw = self.swx = self.swxx = self.swt = self.swxt = 0.0
        self.count = 0
        self.prior_w = prior_weight
        # The prior is fixed when the kind is first seen. Were it the running mean at
        # prediction time, every observation of any kind would change every kind's
        # estimate, and a cached estimate would disagree with a fresh one.
        self.prior_t1 = prior_t1

    def add(self, x: float, t: float, decay: float) -> None:
        self.sw = self.sw * decay + 1.0
        self.swx = self.swx * decay + x
        self.swxx = self.swxx * decay + x * x
        self.swt = self.swt * decay + t
        self.swxt = self.swxt * decay + x * t
        self.prior_w *= decay
        self.count += 1


class Estimator:
    """Learns ``T1`` and an Amdahl speedup per action kind from completed actions.

    :param prior_seconds: ``T1`` assumed for a kind never seen, until any kind has been
        seen; after that a new kind starts from the running mean over all kinds.
    :param prior_parallel_fraction: the share of ``T1`` assumed to parallelise.
    :param prior_weight: how many samples the prior is worth; it fades like a sample.
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
            if (
                isinstance(value, bool)
                or not (isinstance(value, (int, float)) and low <= value <= high)
                or not math.isfinite(real(value))
                or (name in ("prior_seconds", "prior_weight", "decay") and value <= 0)
            ):
                error = (
                    SettingTypeError
                    if isinstance(value, bool) or not isinstance(value, (int, float))
                    else InvalidSettingError
                )
                raise error(f"`{name}` must be {_ALLOWED[name]} (got {value!r})")
        whole("max_kinds", max_kinds, minimum=1)
        self._prior_seconds = float(prior_seconds)
        self._prior_p = float(prior_parallel_fraction)
        self._prior_weight = float(prior_weight)
        self._decay = float(decay)
        self._max_kinds = max_kinds
        self._kinds: OrderedDict[str, _KindStats] = OrderedDict()
        self._cache: dict[str, Estimate] = {}
        self._last: str | None = None  # most recent kind: already at the LRU's end
        self._mean_t1 = 0.0
        self._mean_weight = 0.0

    def __len__(self) -> int:
        return len(self._kinds)

    def observe(self, kind: str, units: float, seconds: float) -> None:
        """Record that an action of ``kind`` took ``seconds`` on (on average) ``units``."""
        if not (0.0 <= seconds < math.inf and 0.0 < units < math.inf):  # NaN fails both
            return
        stats = self._kinds.get(kind)
        if stats is None:
            stats = self._kinds[kind] = _KindStats(self._start_t1(), self._prior_weight)
            if len(self._kinds) > self._max_kinds:
                old, _ = self._kinds.popitem(last=False)
                self._cache.pop(old, None)
        elif self._last is not kind:
            self._kinds.move_to_end(kind)
        self._last = kind
        stats.add(1.0 / units, seconds, self._decay)
        # Refit on every sample while a kind is young, then on every 16th: at thousands of
        # completions a second, a refit per sample was 15% of an acquire/release cycle,
        # and one sample more moves a well-fed fit by well under a percent.
        if stats.count <= _EAGER_SAMPLES or stats.count % _REFIT_EVERY == 0:
            self._cache.pop(kind, None)
            estimate = self.predict(kind)
            self._mean_weight = self._mean_weight * self._decay + 1.0
            self._mean_t1 += (estimate.seconds_at_1 - self._mean_t1) / self._mean_weight

    def predict(self, kind: str) -> Estimate:
        """The current estimate for ``kind`` (the prior when it was never observed)."""
        cached = self._cache.get(kind)
        if cached is not None:
            return cached
        stats = self._kinds.get(kind)
        if stats is None:
            return Estimate(self._start_t1(), Amdahl(self._prior_p))
        a, b = self._solve(stats)
        t1 = max(a + b, 1e-9)
        estimate = Estimate(t1, Amdahl(min(1.0, max(0.0, b / t1))))
        self._cache[kind] = estimate
        return estimate

    def _start_t1(self) -> float:
        """``T1`` a kind starts from: the running mean over kinds, or the prior before any."""
        return self._mean_t1 if self._mean_weight > 0 else self._prior_seconds

    def _solve(self, s: _KindStats) -> tuple[float, float]:
        """Fit ``t = a + b x`` to the samples, pulled towards the prior.

        The prior enters twice, both times with the weight of ``prior_weight`` samples
        that fades like theirs. As a pseudo-sample of the prior model at the samples' mean
        ``x``: it blends the prior's time into the data's where the data are, so one sample
        at 4 units moves ``T1`` as much as one at 1 unit would (a pull towards a fixed
        ``(a0, b0)`` instead traded the split for the scale, and a first sample longer
        than the prior came out with no speedup at all). And as a penalty
        ``(p0 a - (1 - p0) b)^2`` on the split alone, which keeps a small floor so the
        split stays the prior's while every sample used the same number of units.
        """
        t0, p0, q0 = s.prior_t1, self._prior_p, 1.0 - self._prior_p
        w0 = s.prior_w
        x0 = s.swx / s.sw
        y0 = t0 * (q0 + p0 * x0)
        lp = max(w0, 1e-6 * s.sw)
        m11 = s.sw + w0 + lp * p0 * p0
        m12 = s.swx + w0 * x0 - lp * p0 * q0
        m22 = s.swxx + w0 * x0 * x0 + lp * q0 * q0
        r1, r2 = s.swt + w0 * y0, s.swxt + w0 * x0 * y0
        det = m11 * m22 - m12 * m12
        a = (r1 * m22 - r2 * m12) / det
        b = (m11 * r2 - m12 * r1) / det
        if a < 0:  # all the time explained by the parallel term: refit with a = 0
            a, b = 0.0, max(0.0, r2 / m22)
        elif b < 0:  # no speedup at all: refit with b = 0
            a, b = r1 / m11, 0.0
        return a, b
