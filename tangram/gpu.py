"""GPU model services for tangram: ``from tangram import gpu`` (the ``gpu`` extra).

Kept out of ``tangram/__init__`` so the core imports without torch or NVML; torch itself
is imported only when a :class:`TorchService` loads, and the HTTP services need httpx.
See :mod:`tangram._gpu` for how evict-on-execution is scheduled.
"""

from __future__ import annotations

try:
    import httpx as _httpx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tangram.gpu needs httpx (and torch): pip install 'tangram[gpu]'") from exc

from ._gpu import DEFAULT_RESTORE_BANDWIDTH as DEFAULT_RESTORE_BANDWIDTH
from ._gpu import Device as Device
from ._gpu import GpuPool as GpuPool
from ._gpu import ModelService as ModelService
from ._gpu import ServiceHandle as ServiceHandle
from ._gpu import TorchService as TorchService
from ._gpu import discover_devices as discover_devices
from ._gpu import nvlink_groups as nvlink_groups
from ._gpu import nvml_nvlink_pairs as nvml_nvlink_pairs
from ._gpu import place as place
from ._gpu_http import HttpModelService as HttpModelService
from ._gpu_http import SglangService as SglangService
from ._gpu_http import VllmService as VllmService
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

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        _obj.__module__ = "tangram.gpu"
del _name, _obj
