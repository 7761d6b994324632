"""Configuration files for the adapters: ``tangram.config.load()`` and ``open_scheduler``.

``import tangram`` does not import this module; it is what the verl and OpenRLHF adapters
read in each worker process (from the path in a tool's YAML or ``$TANGRAM_CONFIG``). See
:mod:`tangram._config` for the file's structure.
"""

from __future__ import annotations

from ._config import ENV_VAR as ENV_VAR
from ._config import Config as Config
from ._config import ConfigError as ConfigError
from ._config import GpuConfig as GpuConfig
from ._config import GpuServiceConfig as GpuServiceConfig
from ._config import PolicyConfig as PolicyConfig
from ._config import QuotaConfig as QuotaConfig
from ._config import RayConfig as RayConfig
from ._config import SandboxConfig as SandboxConfig
from ._config import load as load
from ._config import open_scheduler as open_scheduler
from ._config import parse as parse

__all__ = [
    "ENV_VAR",
    "Config",
    "ConfigError",
    "GpuConfig",
    "GpuServiceConfig",
    "PolicyConfig",
    "QuotaConfig",
    "RayConfig",
    "SandboxConfig",
    "load",
    "open_scheduler",
    "parse",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tangram._"):
        _obj.__module__ = "tangram.config"
del _name, _obj
