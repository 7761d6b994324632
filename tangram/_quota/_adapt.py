"""AIMD on a key's rates: find a provider's real limit and hold just under it.

A provider's limit is a token bucket: sending under its rate is never refused, and once
its burst is spent it accepts exactly its rate, however fast it is sent to. So the one
precise measure of an unknown limit is what the provider accepts *while it is refusing*.
When ``429``s (or ``503``s that say when to come back) start, the key keeps its rates for
``window`` seconds and counts what the provider accepted meanwhile: that is its limit, and
the cut goes to ``decrease`` of it (10%, where TCP halves: the measure is precise). The
rates then grow back to a ``plateau`` under the limit and hold there; only after ``hold``
quiet seconds do they probe upwards again (the provider may have raised its limit), and
only while requests queue for the key.

The count used to run from the last cut instead, so once a cut had brought the rate under
the limit it measured the client's own rate: each probe lowered the estimate, and the key
settled at 86.5% of the real limit on ``benchmarks/api_quota.py``.
"""

from __future__ import annotations

import math

import attrs

from .._core._validate import number, validator
from .._runtime._run import Runtime
from ._keys import SETTING_ERRORS, KeyState

__all__ = ["Adapt", "adapt_down", "adapt_up", "note_accepted"]

_ADAPT_EVERY = 0.1
# Growth above the plateau is computed over at most this many seconds: the first answer after
# an idle spell must not multiply the rate by the length of the spell.
_PROBE_STEP = 1.0
# Seconds of answered requests kept while nothing is refused: a refusal that comes back
# now may be for a request sent this long ago on a loaded machine.
_KEEP = 10.0
# Refusals per accepted request, over the measure's span, that show the rate in effect was
# above the provider's limit all along (a tenth over it), not a burst of bunched requests.
_DENSE = 0.1
# Windows of refusals after which a key that could not measure the limit cuts anyway.
_BLIND = 3.0

_positive = validator(number, strict=True, finite=False, **SETTING_ERRORS)
_fraction = validator(number, strict=True, maximum=1.0, **SETTING_ERRORS)
_multiple = validator(number, minimum=1.0, **SETTING_ERRORS)


@attrs.frozen(kw_only=True)
class Adapt:
    """How a key finds and holds its provider's real limit (see the module docstring).

    :param decrease: refusals cut the rates to this share of the measured limit (or of
        the rate in effect, when lower or when the provider accepted too little to
        measure): a back-off of 10%, not TCP's halving, since the measure is precise.
    :param increase: afterwards they grow back by this share of the limit per second...
    :param plateau: ...up to this share of it, and hold there.
    :param hold: seconds at the plateau before probing above it, growing as by
        ``increase``; only while requests wait for the key's budget, so an idle key does
        not drift up.
    :param above: how far the rates may be probed, as a multiple of the configured ones.
        At 1 (the default) a configured rate is the provider's promise and a ceiling;
        above 1 it is a guess, and with nothing refused yet the key probes past it at once,
        growing by ``explore`` of its rate per second until the provider refuses.
    :param explore: that growth.
    :param window: seconds the rates are kept once the provider refuses, counting what
        it accepts meanwhile: the measure of its limit (refusals that stop within it were
        a passing burst and cut nothing).
    :param cooldown: at most one cut per this many seconds.
    :param floor: never below this share of the configured rates.
    """

    decrease: float = attrs.field(default=0.9, validator=_fraction)
    increase: float = attrs.field(default=0.1, validator=_positive)
    plateau: float = attrs.field(default=0.99, validator=_fraction)
    hold: float = attrs.field(default=30.0, validator=_positive)
    explore: float = attrs.field(default=1.0, validator=_positive)
    above: float = attrs.field(default=1.0, validator=_multiple)
    window: float = attrs.field(default=1.0, validator=_positive)
    cooldown: float = attrs.field(default=1.0, validator=_positive)
    floor: float = attrs.field(default=0.02, validator=_fraction)


def adapt_up(adapt: Adapt | None, runtime: Runtime, key: KeyState, now: float) -> None:
    """Grow a key's rates back to its plateau, or probe above it; every ``_ADAPT_EVERY`` s."""
    if adapt is None or now - key.adapted_at < _ADAPT_EVERY:
        return
    since = now - max(key.adapted_at, key.cut_at)
    key.adapted_at = now
    if key.overload_at < math.inf:
        if now - key.refused_at < adapt.window:
            return  # being refused: measuring the limit, not growing
        key.overload_at = math.inf  # the refusals stopped by themselves: a passing burst
    known = min(adapt.above, key.refused * adapt.plateau)
    if key.share < known:
        share = min(known, key.share + adapt.increase * known * since)
    else:
        if key.plateau_since == math.inf:
            key.plateau_since = now
        # Probe only with requests queued: an unused rate says nothing about the limit,
        # and a rate grown idle would meet the next burst of work far above it.
        if key.share >= adapt.above or key.waiting_count == 0:
            return
        step = min(since, _PROBE_STEP)
        if key.refused == math.inf:
            # Nothing refused yet: the limit may be anywhere above, so grow by a share of
            # the rate; else the limit found is the scale, as on the way back to it.
            share = key.share * (1.0 + adapt.explore * step)
        elif now - key.plateau_since >= adapt.hold:
            share = key.share + adapt.increase * known * step
        else:
            return
        share = min(adapt.above, share)
    if share != key.share:
        key.share = share
        runtime.set_capacity(key.rates())


def adapt_down(
    adapt: Adapt | None, runtime: Runtime, key: KeyState, now: float, sent_at: float
) -> None:
    """A request sent at ``sent_at`` was refused: once refusals have lasted
    ``adapt.window``, cut the key's rates to just under the limit they measured."""
    if adapt is None or sent_at < key.cut_at:
        return  # sent at a rate already cut: it says nothing about the rate in effect
    key.refused_at = now
    # From the first refusal on, the provider's burst is spent: it accepts its rate. Keep
    # the rate meanwhile (the refusals it costs are few next to the many cuts of a rate
    # cut blind): what the provider accepts of it is the measure.
    if key.overload_at == math.inf:
        key.overload_at, key.overload_sent = now, sent_at
        key.overload_refusals = 0
    key.overload_refusals += 1
    if now - key.overload_at < adapt.window or now - key.cut_at < adapt.cooldown:
        return
    measure = _measure(adapt, key, sent_at)
    if measure is None and now - key.overload_at < _BLIND * adapt.window:
        return  # too little sent to measure yet (a request stuck in flight)
    if measure is not None and key.overload_refusals >= _DENSE * measure[1]:
        # Refused all along: the provider was taking its rate, and that was measured.
        key.refused = min(key.share, measure[0])
        share = key.refused * adapt.decrease
    else:
        # A few refusals among many accepted: requests bunched past the provider's burst
        # (a stalled loop sending its backlog at once), not a rate above its limit, and
        # the count measured the client. Back off a little and keep the limit found;
        # counted as a limit, a loaded machine's stalls lowered it run after run (53%).
        key.refused = min(key.refused, key.share)
        share = key.share * adapt.decrease
    key.plateau_since = math.inf
    key.share = max(adapt.floor, share)
    key.cut_at = key.adapted_at = now
    key.overload_at = math.inf
    runtime.set_capacity(key.rates())


def _measure(adapt: Adapt, key: KeyState, sent_at: float) -> tuple[float, int] | None:
    """The provider's limit as a share of the configured rates, from what it accepted of
    the requests sent since the first refused one and before ``sent_at`` (a refused one),
    and how many that was; ``None`` over less than ``adapt.window`` of sending.

    Timed by send (the headers written), up to the earliest request still in flight, so
    every accepted request in the span has been answered: ending the span at the last
    answer left out those sent before it but answered later (a third too low at load 10
    on 2 cores), and timing it by answers counted the provider's burst, accepted just
    before the first refusal but answered after it (17% too high at 30/s, burst 5).
    """
    start = key.overload_sent
    end = min(sent_at, min(key.sending, default=sent_at))
    if end - start < adapt.window:
        return None
    taken = sorted((sent, t) for _, sent, t in key.answered if start <= sent < end)
    if len(taken) < 2:
        return None
    # From the first accepted request to the last, each of which took a token the moment
    # the provider had one: n requests span n - 1 refills, with no boundary error. (Over
    # the refused ends the count was one request off either way: 3% at 30/s over 1 s.)
    # A client that stalls meanwhile (a busy loop) loses nothing to the provider's
    # bucket while the stall is shorter than its burst; a longer one errs low, on the
    # safe side. (Leaving long gaps out erred high: the tokens saved up during a stall
    # are taken in a burst after it, 13% too high at load 12 on 2 cores.)
    span = taken[-1][0] - taken[0][0]
    if span < adapt.window / 2:
        return None
    ratios: list[float] = []
    if key.requests_kind is not None:
        done = (len(taken) - 1) / span
        ratios.append(done / key.configured[key.requests_kind].per_second)
    if key.tokens_kind is not None:
        used = sum(t for _, t in taken[:-1]) / span
        ratios.append(used / key.configured[key.tokens_kind].per_second)
    return max(ratios), len(taken)


def note_accepted(key: KeyState, tokens: float, now: float, sent_at: float) -> None:
    """Keep an answer for the measure of the real limit (see ``_measure``)."""
    answered = key.answered
    answered.append((now, sent_at, tokens))
    keep = min(key.overload_at, now - _KEEP)
    while answered and answered[0][0] < keep:
        answered.popleft()
