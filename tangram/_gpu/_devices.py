"""The devices a GPU pool places services on: their memory, discovery, NVLink topology.

Every device is one resource kind of the runtime, ``gpu_mem:<device>`` (bytes). Discovery
and the memory and topology queries ask NVML first (``pynvml`` from nvidia-ml-py), torch's
CUDA counters otherwise, and answer "nothing known" on a host with neither; the placement
rules that read the topology are pure and live in ``tangram/_core/_placement.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import attrs

from .._core._units import parse_size
from .._core._validate import number
from ..errors import InvalidSettingError, SettingTypeError
from ._optional import nvml, torch

__all__ = [
    "KIND_PREFIX",
    "Device",
    "device_memory_used",
    "discover_devices",
    "nvml_nvlink_pairs",
    "to_bytes",
]

logger = logging.getLogger("tangram.gpu")

#: The resource-kind prefix of one device's memory in the runtime's capacity.
KIND_PREFIX = "gpu_mem:"


def to_bytes(value: object, name: str = "memory") -> int:
    """Whole bytes, at least one, from a number or a size like ``"16GiB"``.

    :raises SettingTypeError: neither a number nor text.
    :raises InvalidCapacityError: text that is not a size (from ``parse_size``).
    :raises InvalidSettingError: not finite, or less than one byte.
    """
    if isinstance(value, str):
        size = parse_size(value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingTypeError(f"`{name}` must be bytes or a size like '16GiB' (got {value!r})")
    else:
        size = value
    # Checked before ``int()``, which would turn NaN and infinity into bare builtin errors.
    number(name, size, minimum=1, unit="bytes")
    return int(size)


def _device_name(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise SettingTypeError(f"a device's `name` must be text like 'cuda:0' (got {value!r})")


def _device_index(instance: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise SettingTypeError(f"`index` must be a device number or None (got {value!r})")
    if value is not None and value < 0:
        raise InvalidSettingError(f"`index` must be >= 0 (got {value!r})")


@attrs.frozen
class Device:
    """One device the pool places services on, with the memory it may fill.

    ``Device("cuda:0", memory="80GiB")`` is a GPU; ``Device("cpu:0", memory="64MiB")``
    is a simulated budget on the host (tests, and the benchmark without a GPU), which runs
    the very same code with torch's ``"cpu"`` device.

    :raises SettingTypeError: a name that is not text, or a memory that is not a size.
    :raises InvalidSettingError: a memory below one byte, or not finite.
    :raises InvalidCapacityError: a memory written as text that is not a size.
    """

    name: str = attrs.field(validator=_device_name)
    memory: int = attrs.field(converter=to_bytes)
    index: int | None = attrs.field(default=None, validator=_device_index)

    @property
    def kind(self) -> str:
        """The runtime resource kind of this device's memory."""
        return KIND_PREFIX + self.name

    @property
    def torch_device(self) -> str:
        """What torch calls it: ``"cpu"`` for a simulated ``cpu:N`` device.

        A ``/part`` suffix (``"cuda:0/1"``) names a slice of one physical device, each
        slice its own budget: a benchmark on a single GPU can then stand for several.
        """
        physical = self.name.split("/")[0]
        return "cpu" if physical.split(":")[0] == "cpu" else physical

    @property
    def cuda_index(self) -> int | None:
        """The CUDA ordinal of the physical device, or ``None`` for the host."""
        if not self.is_cuda:
            return None
        _, _, digits = self.torch_device.partition(":")
        return int(digits) if digits.isdigit() else 0

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")


def discover_devices(*, fraction: float = 1.0) -> list[Device]:
    """The visible CUDA devices with their memory: NVML first, torch's counters otherwise.

    ``fraction`` leaves headroom (activations, the CUDA context). NVML numbers devices
    by PCI order and ignores ``CUDA_VISIBLE_DEVICES``; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so the two agree, or pass devices explicitly.

    :raises InvalidSettingError: ``fraction`` outside (0, 1].
    """
    number(
        "fraction",
        fraction,
        strict=True,
        maximum=1.0,
    )
    lib = nvml()
    if lib is not None:
        try:
            count = lib.nvmlDeviceGetCount()
            devices = []
            for i in range(count):
                info = lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(i))
                devices.append(Device(f"cuda:{i}", int(info.total * fraction), i))
            return devices
        except Exception:
            logger.warning("NVML could not list devices; asking torch", exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                lib.nvmlShutdown()
    try:
        cuda = torch.cuda
    except ImportError:
        return []
    if not cuda.is_available():
        return []
    devices = []
    for i in range(cuda.device_count()):
        _, total = cuda.mem_get_info(i)
        devices.append(Device(f"cuda:{i}", int(total * fraction), i))
    return devices


def device_memory_used(device: Device) -> int | None:
    """Bytes in use on ``device`` as the driver sees them (NVML, else torch), if known."""
    index = device.cuda_index
    if index is None:
        return None
    lib = nvml()
    if lib is not None:
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            return int(lib.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            logger.debug("NVML memory query failed", exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                lib.nvmlShutdown()
    try:
        free, total = torch.cuda.mem_get_info(index)
    except Exception:
        return None
    return int(total - free)


def nvml_nvlink_pairs() -> list[tuple[int, int]]:
    """Pairs of device indices NVML reports as NVLink peers; empty where NVML cannot tell."""
    lib = nvml()
    if lib is None:
        return []
    pairs: list[tuple[int, int]] = []
    try:
        count = lib.nvmlDeviceGetCount()
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, j in itertools.combinations(range(count), 2):
            status = lib.nvmlDeviceGetP2PStatus(
                handles[i], handles[j], lib.NVML_P2P_CAPS_INDEX_NVLINK
            )
            if status == lib.NVML_P2P_STATUS_OK:
                pairs.append((i, j))
    except Exception:
        logger.debug("NVML topology query failed; treating devices as unlinked", exc_info=True)
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()
    return pairs
