"""Configuration files for the adapters: ``tangram.config.load()`` and ``open_scheduler``.

``import tangram`` does not import this module; it is what the verl and OpenRLHF adapters
read in each worker process (from the path in a tool's YAML or ``$TANGRAM_CONFIG``). See
:mod:`tangram._frameworks._config` for the file's structure. What an adapter builds on
beside the config (sessions, demands, the failure rule, the code reward) is
:mod:`tangram.integrations`.
"""

from __future__ import annotations

from ._core._exports import publish as _publish
from ._frameworks._config import ENV_VAR as ENV_VAR
from ._frameworks._config import Config as Config
from ._frameworks._config import ConfigError as ConfigError
from ._frameworks._config import GpuConfig as GpuConfig
from ._frameworks._config import GpuServiceConfig as GpuServiceConfig
from ._frameworks._config import PolicyConfig as PolicyConfig
from ._frameworks._config import QuotaConfig as QuotaConfig
from ._frameworks._config import RayConfig as RayConfig
from ._frameworks._config import SandboxConfig as SandboxConfig
from ._frameworks._config import load as load
from ._frameworks._config import parse as parse
from ._frameworks._failures import counts as _counts
from ._frameworks._open import open_scheduler as open_scheduler


def infrastructure_failures() -> dict[str, int]:
    """Tangram's own failures in this process so far (a scheduler gone, a sandbox broken),
    per action kind: the calls the adapters raised to the framework or dropped from
    scoring instead of handing them to the model. A trainer can log it per step."""
    return _counts()


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
    "infrastructure_failures",
    "load",
    "open_scheduler",
    "parse",
]

_publish("tangram.config", globals())
