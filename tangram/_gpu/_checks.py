"""The one GPU argument check the shared ones (``tangram/_core/_validate.py``) lack.

Every bad argument to a device, a service or the pool is a
:class:`~tangram.errors.SettingTypeError` (a wrong type; also a ``TypeError`` and a
``ValueError``) or an :class:`~tangram.errors.InvalidSettingError` (a value out of range;
a ``ValueError``), naming the value and what is allowed; sizes in messages are written by
:func:`tangram._core._units.format_size`.
"""

from __future__ import annotations

from ..errors import SettingTypeError

__all__ = ["check_bool"]


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``: a truthy string such as ``"no"`` would
    otherwise switch the setting on."""
    if not isinstance(value, bool):
        raise SettingTypeError(f"`{name}` must be True or False (got {value!r})")
    return value
