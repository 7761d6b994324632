"""API quotas for tangram: ``from tangram import quota`` needs the ``api`` extra (httpx).

Kept out of ``tangram/__init__`` so that the core imports without httpx; see
:mod:`tangram._quota` for how quotas are scheduled.
"""

from __future__ import annotations

try:
    import httpx as _httpx  # noqa: F401
    import stamina as _stamina  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tangram.quota needs httpx and stamina: pip install 'tangram[api]'") from exc

from ._quota import DEFAULT_HEADROOM as DEFAULT_HEADROOM
from ._quota import DEFAULT_JITTER as DEFAULT_JITTER
from ._quota import Adapt as Adapt
from ._quota import ApiKey as ApiKey
from ._quota import KeyStats as KeyStats
from ._quota import Quota as Quota
from ._quota import QuotaTransport as QuotaTransport
from ._quota import Retry as Retry
from ._quota import SetAside as SetAside
from ._quota_server import Limit as Limit
from ._quota_server import QuotaServer as QuotaServer
from .errors import QuotaDeadlineError as QuotaDeadlineError

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_JITTER",
    "Adapt",
    "ApiKey",
    "KeyStats",
    "Limit",
    "Quota",
    "QuotaDeadlineError",
    "QuotaServer",
    "QuotaTransport",
    "Retry",
    "SetAside",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        _obj.__module__ = "tangram.quota"
del _name, _obj
