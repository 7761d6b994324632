"""Setting failing keys aside: a key that keeps failing gets a cool-down, then one probe.

Transport errors and ``5xx`` answers (other than a ``503`` that says when to come back,
which is a limit, see :mod:`._adapt`) count as failures. A key set aside is chosen only
when no other key is left (see :func:`._keys.choose`); its cool-down doubles on each repeat.
"""

from __future__ import annotations

import math

import attrs

from .._core._validate import number, validator, whole
from ._keys import SETTING_ERRORS, KeyState

__all__ = ["SetAside", "note_failure", "note_recovered"]

_positive = validator(number, strict=True, finite=False, **SETTING_ERRORS)
_count = validator(whole, minimum=1, **SETTING_ERRORS)


@attrs.frozen(kw_only=True)
class SetAside:
    """When a failing key is set aside: after ``failures`` in a row (transport errors or
    ``5xx`` other than a ``503`` that says when to come back), for ``cooldown`` seconds,
    doubling on each repeat up to ``max_cooldown``; then one probe decides."""

    failures: int = attrs.field(default=3, validator=_count)
    cooldown: float = attrs.field(default=2.0, validator=_positive)
    max_cooldown: float = attrs.field(default=60.0, validator=_positive)


def note_failure(set_aside: SetAside, key: KeyState, now: float, sent_at: float) -> None:
    """Count a failed request; set the key aside after too many in a row, or a failed probe."""
    key.failed += 1
    if sent_at < key.aside_at:
        # Sent before the key was set aside: its failure says nothing new, and letting
        # it double the cool-down would push the probe out by every request in flight.
        return
    key.failures += 1
    if key.aside_until > -math.inf or key.failures >= set_aside.failures:
        cooldown = min(set_aside.max_cooldown, set_aside.cooldown * 2**key.asides)
        key.asides += 1
        key.aside_at = now
        key.aside_until = now + cooldown
        key.failures = 0


def note_recovered(key: KeyState) -> None:
    """An answer from the key: its failures in a row end, and a set-aside key is back."""
    key.failures = 0
    if key.aside_until > -math.inf:
        key.asides = 0
        key.aside_until = -math.inf
