"""API quotas for tangram: ``from tangram import quota`` needs the ``api`` extra (httpx).

Kept out of ``tangram/__init__`` so that the core imports without httpx; see
:mod:`tangram._quota._quota` for how quotas are scheduled. The loopback server that
enforces a provider's limits in tests is :class:`tangram.testing.QuotaServer`.
"""

from __future__ import annotations

try:
    import httpx as _httpx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tangram.quota needs httpx: pip install 'tangram[api]'") from exc

from ._core._exports import publish as _publish
from ._quota._adapt import Adapt as Adapt
from ._quota._aside import SetAside as SetAside
from ._quota._keys import DEFAULT_HEADROOM as DEFAULT_HEADROOM
from ._quota._keys import DEFAULT_JITTER as DEFAULT_JITTER
from ._quota._keys import ApiKey as ApiKey
from ._quota._keys import KeyStats as KeyStats
from ._quota._quota import DEFAULT_DEADLINE as DEFAULT_DEADLINE
from ._quota._quota import Quota as Quota
from ._quota._retry import IDEMPOTENT_METHODS as IDEMPOTENT_METHODS
from ._quota._retry import Retry as Retry
from ._quota._transport import QuotaTransport as QuotaTransport
from .errors import QuotaDeadlineError as QuotaDeadlineError

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_HEADROOM",
    "DEFAULT_JITTER",
    "IDEMPOTENT_METHODS",
    "Adapt",
    "ApiKey",
    "KeyStats",
    "Quota",
    "QuotaDeadlineError",
    "QuotaTransport",
    "Retry",
    "SetAside",
]

_publish("tangram.quota", globals())
