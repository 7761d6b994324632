"""GPU model services for tangram: ``from tangram import gpu`` (the ``gpu`` extra).

Kept out of ``tangram/__init__`` so the core imports without torch or NVML; torch itself
is imported only when a :class:`TorchService` loads, and the HTTP services need httpx.
See :mod:`tangram._gpu._pool` for how evict-on-execution is scheduled, and
:mod:`tangram._core._placement` for the placement rules it shares with the simulator.
"""

from __future__ import annotations

try:
    import httpx as _httpx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tangram.gpu needs httpx (and torch): pip install 'tangram[gpu]'") from exc

from ._core._exports import publish as _publish
from ._core._placement import nvlink_groups as nvlink_groups
from ._core._placement import place as place
from ._gpu._devices import Device as Device
from ._gpu._devices import discover_devices as discover_devices
from ._gpu._devices import nvml_nvlink_pairs as nvml_nvlink_pairs
from ._gpu._http import HttpModelService as HttpModelService
from ._gpu._http import SglangService as SglangService
from ._gpu._http import VllmService as VllmService
from ._gpu._pool import GpuPool as GpuPool
from ._gpu._pool import ServiceHandle as ServiceHandle
from ._gpu._replica import DEFAULT_RESTORE_BANDWIDTH as DEFAULT_RESTORE_BANDWIDTH
from ._gpu._service import ModelService as ModelService
from ._gpu._torch import TorchService as TorchService
from .errors import GpuError as GpuError
from .errors import GpuOutOfMemoryError as GpuOutOfMemoryError
from .errors import GpuPoolClosedError as GpuPoolClosedError
from .errors import GpuServiceError as GpuServiceError

__all__ = [
    "DEFAULT_RESTORE_BANDWIDTH",
    "Device",
    "GpuError",
    "GpuOutOfMemoryError",
    "GpuPool",
    "GpuPoolClosedError",
    "GpuServiceError",
    "HttpModelService",
    "ModelService",
    "ServiceHandle",
    "SglangService",
    "TorchService",
    "VllmService",
    "discover_devices",
    "nvlink_groups",
    "nvml_nvlink_pairs",
    "place",
]

_publish("tangram.gpu", globals())
