"""AIMD on a key's rates: find a provider's real limit when it is below the configured one.

A ``429`` (or a ``503`` that says when to come back) cuts the key's rates multiplicatively;
they grow back additively with :meth:`tangram.Runtime.set_capacity`, so a configured limit
above the provider's real one converges below it. What the provider accepted since the
last cut measures its real limit, so a limit far below the configured one is found in one
step, not many.
"""

from __future__ import annotations

import math

import attrs

from .._core._validate import number, validator
from .._runtime._run import Runtime
from ._keys import KeyState

__all__ = ["Adapt", "adapt_down", "adapt_up", "note_accepted"]

_ADAPT_EVERY = 0.1

_positive = validator(number, strict=True, finite=False, type_error=ValueError)
_fraction = validator(number, strict=True, maximum=1.0, type_error=ValueError)


@attrs.frozen(kw_only=True)
class Adapt:
    """AIMD on a key's rates when the provider's real limit is below the configured one.

    On a ``429`` or ``503`` the key's rates drop to ``decrease`` times the *refused* rate:
    the rate in effect, or what the provider actually accepted of the requests sent since
    the last cut (over at least ``window`` seconds of sending) when that is lower, so a
    limit far below the configured one is found in one step, not many; at most once per
    ``cooldown``. Afterwards they grow back by
    ``increase`` of the rate at the last cut per second up to ``plateau`` times the refused
    rate, stay there, and only after ``hold`` seconds without a ``429`` keep growing
    towards the configured rate (the provider may have raised its limit). Never below
    ``floor`` of the configured rate.
    """

    decrease: float = attrs.field(default=0.85, validator=_fraction)
    increase: float = attrs.field(default=0.04, validator=_positive)
    cooldown: float = attrs.field(default=1.0, validator=_positive)
    window: float = attrs.field(default=0.5, validator=_positive)
    floor: float = attrs.field(default=0.02, validator=_fraction)
    plateau: float = attrs.field(default=0.97, validator=_fraction)
    hold: float = attrs.field(default=30.0, validator=_positive)


def adapt_up(adapt: Adapt | None, runtime: Runtime, key: KeyState, now: float) -> None:
    """Grow a cut key's rates back, at most every ``_ADAPT_EVERY`` seconds."""
    if adapt is None or key.share >= 1.0 or now - key.adapted_at < _ADAPT_EVERY:
        return
    since = now - max(key.adapted_at, key.cut_at)
    key.adapted_at = now
    plateau = min(1.0, key.refused * adapt.plateau)
    if key.share >= plateau:
        # Hold just under the rate the provider refused; probe above it only after
        # `hold` quiet seconds (its limit may have been raised), else the probing
        # itself would bring a 429 every few seconds for ever.
        if key.plateau_since == math.inf:
            key.plateau_since = now
        if now - key.plateau_since < adapt.hold:
            return
        plateau = 1.0
    share = min(plateau, key.share + adapt.increase * key.ceiling * since)
    if share != key.share:
        key.share = share
        runtime.set_capacity(key.rates())


def adapt_down(adapt: Adapt | None, runtime: Runtime, key: KeyState, now: float) -> None:
    """Cut a refused key's rates, at most once per ``adapt.cooldown``."""
    if adapt is None or now - key.cut_at < adapt.cooldown:
        return
    refused = key.share
    # What the provider took since the last cut measures its real limit when we were
    # sending past it all along (a 429 now says we were): jump there instead of
    # cutting many times. Counted from the last cut, not over a sliding window: the
    # first cut comes at the first 429, when the provider's burst is spent, so the
    # count after it has no burst in it (a 1 s window overestimated by the burst, and
    # the plateau above the limit then drew a 429 every few seconds).
    # Counted by send time: requests in flight at the cut were admitted at the old
    # rate, and those sent just now have not been answered yet.
    span = key.accepted_until - max(key.cut_at, key.first_sent)
    # Under `window` the count says more about start-up bunching than the limit.
    if key.accepted and span >= adapt.window:
        ratios: list[float] = []
        # Less what the provider's bucket may have held at the cut: under one request
        # (it had just refused one), else short spans overestimate by 1 / span.
        if key.requests_kind is not None:
            done = max(0.0, key.accepted - 1.0) / span
            ratios.append(done / key.configured[key.requests_kind].per_second)
        if key.tokens_kind is not None:
            spare = key.largest.get(key.tokens_kind, 0.0)
            used = max(0.0, key.accepted_tokens - spare) / span
            ratios.append(used / key.configured[key.tokens_kind].per_second)
        if ratios:
            refused = min(refused, max(ratios))
    key.accepted = 0
    key.accepted_tokens = 0.0
    key.accepted_until = -math.inf
    key.refused = refused
    key.plateau_since = math.inf
    share = max(adapt.floor, min(key.share, refused) * adapt.decrease)
    key.share = key.ceiling = share
    key.cut_at = key.adapted_at = now
    runtime.set_capacity(key.rates())


def note_accepted(key: KeyState, sent_at: float, tokens: float) -> None:
    """Count an answered request towards AIMD's measure of the real limit.

    Only requests sent since the last cut count: those sent before it went out at the
    rate that was refused.
    """
    if sent_at >= key.cut_at:
        key.accepted += 1
        key.accepted_tokens += tokens
        key.accepted_until = max(key.accepted_until, sent_at)
