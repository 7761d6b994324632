"""Public names say where users import them from, not the private module they live in.

Tracebacks, reprs and the API docs then read ``tangram.Runtime`` and ``tangram.gpu.GpuPool``
(httpx's ``__init__``, trio's ``fixup_module_metadata``). Every public module calls
:func:`publish` once, at its end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

__all__ = ["publish"]


def publish(module: str, namespace: Mapping[str, object]) -> None:
    """Set ``__module__`` of every name in ``namespace["__all__"]`` defined in a private module.

    A name another public module owns keeps its home (``tangram.quota`` re-exports
    ``QuotaDeadlineError``, which stays ``tangram.errors.QuotaDeadlineError``); names from
    other projects, and constants (whose type cannot take a ``__module__``), are left as
    they are.
    """
    names = namespace["__all__"]
    assert isinstance(names, (list, tuple))
    for name in names:
        obj = namespace[name]
        home = getattr(obj, "__module__", None)
        if isinstance(home, str) and (home.startswith("tangram._") or home == module):
            with contextlib.suppress(AttributeError, TypeError):
                obj.__module__ = module
