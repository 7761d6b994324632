"""torch and NVML, the GPU extra's optional imports, each in one place and on first use.

``import tangram.gpu`` must not import torch (seconds of start-up, and absent without the
extra) nor initialise NVML (which imports fine on a host without a GPU but fails to init).
So :data:`torch` is a stand-in that imports the real module when an attribute is first
read, and keeps what it read; type checkers see the real module. :func:`nvml` initialises
NVML per query, as its API expects (``nvmlInit``/``nvmlShutdown`` pairs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["nvml", "torch"]


class _OnFirstUse:
    """A module imported when one of its attributes is first read.

    :raises ImportError: on that first read, when the module is not installed.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        value = getattr(importlib.import_module(self._name), attribute)
        # Later reads find it on the instance and skip this method (hot paths bind tensors).
        setattr(self, attribute, value)
        return value

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


if TYPE_CHECKING:
    import torch
else:
    torch = _OnFirstUse("torch")


def nvml() -> Any:
    """The initialised ``pynvml`` module, or ``None`` where NVML is missing or has no GPU.

    The caller shuts it down (``nvmlShutdown``) when its query is done.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on a GPU-less host
        return None
    return pynvml
