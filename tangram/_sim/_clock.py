"""How long a simulated gap, run or restore may be.

The virtual clock counts seconds in a float, which keeps microseconds up to about 9e9 s.
Past that, what a step adds to the clock is rounded away: a gap of 1e308 made the run
after it take 0 s and the reported ACT 0. :data:`LONGEST_SECONDS` (1e7 s, 115 days) keeps
a trajectory of 900 steps at the limit inside that precision, and no rollout waits on one
tool call or one model load for so long, so a larger value is a mistake in the input.
"""

from __future__ import annotations

from .._core._validate import seconds
from ..errors import InvalidSettingError

__all__ = ["LONGEST_SECONDS", "duration"]

LONGEST_SECONDS = 1e7


def duration(name: str, value: object) -> float:
    """``value`` as a simulated duration: a number of seconds in ``[0, LONGEST_SECONDS]``."""
    checked = seconds(name, value)
    if checked > LONGEST_SECONDS:
        raise InvalidSettingError(
            f"`{name}` must be at most {LONGEST_SECONDS:g} seconds (got {value!r}): "
            "the simulated clock would round shorter times away"
        )
    return checked
