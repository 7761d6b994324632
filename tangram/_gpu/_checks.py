"""How the GPU executor words what it refuses: sizes in human units, typed argument errors.

Every bad argument to a device, a service or the pool is a :class:`~tangram.errors.TangramError`
that also subclasses the builtin a caller would catch, and names the value and what is
allowed. A wrong type raises :class:`~tangram.errors.DemandTypeError`, which is both a
``TypeError`` and a ``ValueError``, so code that caught either before still does; a bad
value raises :class:`~tangram.errors.InvalidCapacityError` (a ``ValueError``): a device's
memory is a capacity of the runtime, and a service's settings size what it asks of it.
"""

from __future__ import annotations

from ..errors import DemandTypeError, InvalidCapacityError

__all__ = ["TYPE_ERROR", "VALUE_ERROR", "check_bool", "format_bytes"]

#: What a GPU argument of the wrong type raises.
TYPE_ERROR = DemandTypeError
#: What a GPU argument with a value out of range raises.
VALUE_ERROR = InvalidCapacityError

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(size: float) -> str:
    """``size`` bytes as people read them: ``"512 B"``, ``"4.8 MiB"``, ``"80.0 GiB"``.

    Binary units, as devices report their memory and as ``"16GiB"`` is written; one
    decimal, so that two sizes a message compares stay apart.
    """
    if abs(size) < 1024:
        return f"{size:g} B"
    value = float(size)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:.1f} {unit}"


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; a truthy string is not a setting."""
    if not isinstance(value, bool):
        raise TYPE_ERROR(f"`{name}` must be True or False (got {value!r})")
    return value
