"""GPU model services with evict-on-execution: a pool of devices, a service protocol, torch.

The paper's GPU manager deploys every model service up front with its state backed up in
host memory. A service is *resident* (on a device) or *evicted* (host memory only); an
action on an evicted service first restores it, evicting least-recently-used idle services
when memory is short. Restoring from host memory takes a fraction of a cold load.

How it maps onto the runtime: every device is one resource kind, ``gpu_mem:<device>``
(bytes), and :meth:`GpuPool.capacity` hands those to ``Runtime(capacity=...)``. A
*replica* (a service on a device, or on an NVLink chunk of devices for a multi-GPU
service) holds ``runtime.acquire({"gpu_mem:<device>": memory})`` while actions use it, so
the runtime only ever grants memory that running replicas can hold. Idle resident replicas
hold no lease: they are a cache the pool evicts (LRU) to make room for a granted one, which
is why a granted replica always fits once the idle ones are gone, and why a replica with a
running action is never evicted.

Torch is imported lazily (inside :class:`TorchService`), so the pool, the protocol and the
placement logic import without it; NVML (``pynvml`` from nvidia-ml-py) is optional and
guarded at every call, since it imports fine on a machine without a GPU but fails to init.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import copy
import enum
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from .._core._units import parse_size
from .._runtime._run import Runtime, current_runtime
from ..errors import (
    GpuError,
    GpuOutOfMemoryError,
    GpuPoolClosedError,
    GpuServiceError,
    TangramError,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_RESTORE_BANDWIDTH",
    "Device",
    "GpuError",
    "GpuOutOfMemoryError",
    "GpuPool",
    "GpuPoolClosedError",
    "GpuServiceError",
    "ModelService",
    "ServiceHandle",
    "TorchService",
    "discover_devices",
    "nvlink_groups",
    "nvml_nvlink_pairs",
    "place",
]

logger = logging.getLogger("tangram.gpu")

#: The resource-kind prefix of one device's memory in the runtime's capacity.
KIND_PREFIX = "gpu_mem:"
#: Host-to-device bandwidth assumed for a restore before one was measured (bytes/s).
DEFAULT_RESTORE_BANDWIDTH = 20e9
_EWMA = 0.3
#: Restore times a running replica holds its grant before it may be drained for a waiter.
_TENURE = 2.0


# -- devices and topology ------------------------------------------------------------------


def _to_bytes(value: object) -> int:
    if isinstance(value, str):
        return int(parse_size(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`memory` must be bytes or a size like '16GiB' (got {value!r})")
    return int(value)


def _check_memory(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"`memory` must be > 0 bytes (got {value!r})")


@attrs.frozen
class Device:
    """One device the pool places services on, with the memory it may fill.

    ``Device("cuda:0", memory="80GiB")`` is a GPU; ``Device("cpu:0", memory="64MiB")``
    is a simulated budget on the host (tests, and the benchmark without a GPU), which runs
    the very same code with torch's ``"cpu"`` device.
    """

    name: str
    memory: int = attrs.field(converter=_to_bytes, validator=_check_memory)
    index: int | None = None

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
        _, _, number = self.torch_device.partition(":")
        return int(number) if number.isdigit() else 0

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")


def _nvml() -> Any:
    """The initialised ``pynvml`` module, or ``None`` where NVML is missing or has no GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on a GPU-less host
        return None
    return pynvml


def discover_devices(*, fraction: float = 1.0) -> list[Device]:
    """The visible CUDA devices with their memory: NVML first, torch's counters otherwise.

    ``fraction`` leaves headroom (activations, the CUDA context). NVML numbers devices
    by PCI order and ignores ``CUDA_VISIBLE_DEVICES``; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so the two agree, or pass devices explicitly.
    """
    nvml = _nvml()
    if nvml is not None:
        try:
            count = nvml.nvmlDeviceGetCount()
            devices = []
            for i in range(count):
                info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i))
                devices.append(Device(f"cuda:{i}", int(info.total * fraction), i))
            return devices
        except Exception:
            logger.warning("NVML could not list devices; asking torch", exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        _, total = torch.cuda.mem_get_info(i)
        devices.append(Device(f"cuda:{i}", int(total * fraction), i))
    return devices


def device_memory_used(device: Device) -> int | None:
    """Bytes in use on ``device`` as the driver sees them (NVML, else torch), if known."""
    index = device.cuda_index
    if index is None:
        return None
    nvml = _nvml()
    if nvml is not None:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            logger.debug("NVML memory query failed", exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
    try:
        import torch

        free, total = torch.cuda.mem_get_info(index)
    except Exception:
        return None
    return int(total - free)


def nvml_nvlink_pairs() -> list[tuple[int, int]]:
    """Pairs of device indices NVML reports as NVLink peers; empty where NVML cannot tell."""
    nvml = _nvml()
    if nvml is None:
        return []
    pairs: list[tuple[int, int]] = []
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, j in itertools.combinations(range(count), 2):
            status = nvml.nvmlDeviceGetP2PStatus(
                handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK
            )
            if status == nvml.NVML_P2P_STATUS_OK:
                pairs.append((i, j))
    except Exception:
        logger.debug("NVML topology query failed; treating devices as unlinked", exc_info=True)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return pairs


def nvlink_groups(
    devices: Iterable[int], links: Iterable[tuple[int, int]]
) -> list[tuple[int, ...]]:
    """Split device indices into NVLink-connected groups (connected components, sorted).

    A device with no link is a group of its own. Pure, so a fake topology tests it.
    """
    parent = {d: d for d in devices}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for a, b in links:
        if a in parent and b in parent:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for d in parent:
        groups.setdefault(root(d), []).append(d)
    return sorted(tuple(sorted(g)) for g in groups.values())


def place(
    groups: Sequence[Sequence[int]], free: Mapping[int, float], count: int
) -> tuple[int, ...] | None:
    """Pick ``count`` devices among ``free`` (device -> score, higher is better) for one replica.

    Topology first, score second, as the paper's NVLink-local chunks of 1/2/4/8: an aligned
    chunk of a power-of-two size inside one NVLink group; else any ``count`` devices of one
    group; else (no group has room) ``count`` devices across groups, which still runs but
    talks over PCIe. Among equals, the set with the highest total score wins, so a replica
    lands where memory is freest. ``None`` when fewer than ``count`` devices are free.
    """
    if count < 1:
        raise ValueError(f"`count` must be >= 1 (got {count})")
    best: tuple[tuple[int, float], tuple[int, ...]] | None = None

    def consider(tier: int, chosen: Sequence[int]) -> None:
        nonlocal best
        key = (-tier, sum(free[d] for d in chosen))
        if best is None or key > best[0]:
            best = (key, tuple(sorted(chosen)))

    aligned = count & (count - 1) == 0
    for group in groups:
        members = sorted(group)
        if aligned:
            for start in range(0, len(members) - count + 1, count):
                chunk = members[start : start + count]
                if all(d in free for d in chunk):
                    consider(0, chunk)
        inside = sorted((d for d in members if d in free), key=lambda d: -free[d])
        if len(inside) >= count:
            consider(1, inside[:count])
    if best is None:
        anywhere = sorted(free, key=lambda d: -free[d])
        if len(anywhere) >= count:
            consider(2, anywhere[:count])
    return None if best is None else best[1]


# -- the service protocol ------------------------------------------------------------------


class ModelService(abc.ABC):
    """One model behind the pool: load cold once, then restore, run, evict, many times.

    The seam for any way of serving a model. ``replica`` numbers a copy of the service on
    its own devices (elastic replicas); a service that runs one copy only sets
    ``max_replicas = 1``. ``run`` gets the batches of every action the pool merged into
    one run (one element when ``batching`` is off) and returns one result per batch.

    :param name: what actions name: ``pool.use(name)``.
    :param memory: device bytes one replica holds on each of its devices while resident.
    :param gpus: devices per replica (a tensor-parallel server, or the stages of a
        :class:`TorchService` pipeline).
    :param max_replicas: copies the pool may run at once when actions queue up.
    :param batching: whether waiting actions may be merged into one ``run``.
    :param max_batch: most actions merged into one run (``None``: no limit); for a
        batching service also the actions one replica takes before the pool counts it
        full and weighs starting another.
    """

    def __init__(
        self,
        name: str,
        *,
        memory: int | str | None = None,
        gpus: int = 1,
        max_replicas: int = 1,
        batching: bool = True,
        max_batch: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty string (got {name!r})")
        for label, value in (("gpus", gpus), ("max_replicas", max_replicas)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{label}` must be a whole number >= 1 (got {value!r})")
        if max_batch is not None and (
            isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1
        ):
            raise ValueError(f"`max_batch` must be None or a whole number >= 1 (got {max_batch!r})")
        self.name = name
        self.memory: int | None = None if memory is None else _to_bytes(memory)
        self.gpus = gpus
        self.max_replicas = max_replicas
        self.batching = batching
        self.max_batch = max_batch

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} memory={self.memory}>"

    def slots(self) -> Sequence[tuple[str, ...]] | None:
        """Device names each replica is bound to, or ``None`` to place it anywhere.

        An external server is started on its GPUs and cannot move: its replicas are fixed.
        """
        return None

    @abc.abstractmethod
    async def load(self) -> None:
        """Cold start: build the host-memory state restores copy from (once, up front)."""

    @abc.abstractmethod
    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        """Bring ``replica`` onto ``devices`` from host memory.

        :raises GpuOutOfMemoryError: the device had no room; leave nothing allocated.
        """

    @abc.abstractmethod
    async def evict(self, replica: int) -> None:
        """Free ``replica``'s device memory; its state stays in host memory."""

    @abc.abstractmethod
    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        """Run the merged ``batches`` on a resident ``replica``; one result per batch."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Free host state (the pool evicted every replica before)."""


# -- torch modules ------------------------------------------------------------------------


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _raise_oom(exc: BaseException, what: str) -> None:
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    ):
        raise GpuOutOfMemoryError(f"{what}: out of device memory ({exc})") from exc


class TorchService(ModelService):
    """An in-process torch module, evicted to host memory and restored by one copy.

    ``factory`` builds the module (a cold load: read weights, build the graph); it runs
    once. Its parameters and buffers are then packed into one flat host buffer allocated
    once: pinned when CUDA is present, because only pinned memory copies to the device
    asynchronously at full bandwidth, and pinning is itself slow enough that doing it per
    eviction would eat the saving. On a CPU-only torch pinning is unavailable, so the
    buffer is a plain host tensor; the rest is the same code.

    A restore allocates one flat device buffer and fills it with a single non-blocking
    copy (then one stream synchronise where CUDA needs it): one large transfer runs at the
    bus's bandwidth, where a copy per tensor pays a launch and a sync-free gap for each of
    hundreds of small ones. The replica is the module's skeleton (tensors on torch's
    ``meta`` device, no memory) with every parameter and buffer made a view into that
    device buffer. Evicting drops the device buffer; the host buffer is the truth, so the
    state is bitwise the same after any number of round trips. With ``writeback=True``
    eviction first copies the device buffer back into the same host buffer (a module
    whose buffers change while serving; one replica only).

    With ``gpus=k`` one replica spans ``k`` devices as a pipeline of ``k`` stages (a
    layer split, not tensor parallelism): stage ``i`` runs on the replica's ``i``-th
    device, and its output is moved to the next stage's device. Each stage's tensors are
    one region of the host buffer, restored by one copy into its own device buffer, so a
    model too big for one device still restores at bus bandwidth, every device in
    parallel. The stages come from ``split``: ``None`` cuts an ``nn.Sequential`` into
    ``k`` runs of consecutive children with the largest run's bytes as small as possible;
    a list of ``k`` counts gives the children per stage; a callable gets the module and
    returns the ``k`` stage modules, each called with the previous one's output. A
    tensor two stages share (tied weights) is copied into both stages' regions.

    ``run`` concatenates the merged batches along dimension 0, runs the module once under
    ``inference_mode`` and splits the output back; results come back on the host.

    :param factory: builds the module (called once, in a worker thread).
    :param memory: device bytes per replica on each of its devices; default: the largest
        stage's tensors (all of them with one stage) plus ``headroom`` for activations.
    :param gpus: devices per replica, one pipeline stage on each.
    :param split: how the module is cut into ``gpus`` stages (see above).
    :param empty_cache: on eviction, hand the freed CUDA memory back to the driver
        (``torch.cuda.empty_cache``). Needed when another process (an inference server)
        shares the GPU; when only in-process torch services do, ``False`` lets torch's
        caching allocator reuse the block and skips a ``cudaFree``/``cudaMalloc`` pair
        per round trip.
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], torch.nn.Module],
        *,
        memory: int | str | None = None,
        headroom: float = 0.25,
        max_replicas: int = 1,
        batching: bool = True,
        max_batch: int | None = None,
        writeback: bool = False,
        empty_cache: bool = True,
        gpus: int = 1,
        split: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            name,
            memory=memory,
            gpus=gpus,
            max_replicas=max_replicas,
            batching=batching,
            max_batch=max_batch,
        )
        self._empty_cache = empty_cache
        if not callable(factory):
            raise TypeError(f"`factory` must build a torch.nn.Module (got {factory!r})")
        if writeback and max_replicas != 1:
            raise ValueError("`writeback` needs `max_replicas=1`: replicas would overwrite")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or headroom < 0:
            raise ValueError(f"`headroom` must be a number >= 0 (got {headroom!r})")
        if split is not None and not callable(split):
            counts = list(split) if isinstance(split, Sequence) else None
            if (
                counts is None
                or len(counts) != gpus
                or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts
                )
            ):
                raise ValueError(
                    f"`split` must be a callable or {gpus} whole numbers >= 1, the children "
                    f"of an nn.Sequential per stage (got {split!r})"
                )
        self._factory = factory
        self._split = split
        self._headroom = float(headroom)
        self._writeback = writeback
        self._stages: list[_Stage] = []
        self._flat: torch.Tensor | None = None
        self._names: dict[str, tuple[int, int]] = {}  # name -> (stage, layout index)
        self._modules: dict[int, list[torch.nn.Module]] = {}  # skeleton copies per replica
        # Per replica, each stage's module (bound to the device) and its device buffer.
        self._replicas: dict[int, list[tuple[torch.nn.Module, torch.Tensor]]] = {}
        self.pinned = False
        self.nbytes = 0

    @property
    def stage_bytes(self) -> list[int]:
        """Bytes of each stage's region of the host buffer (one entry per device)."""
        return [stage.size for stage in self._stages]

    async def load(self) -> None:
        await anyio.to_thread.run_sync(self._load)

    def _load(self) -> None:
        import torch

        if self._stages:
            return
        try:
            module = self._factory()
        except Exception as exc:
            raise GpuServiceError(f"could not build {self.name!r}: {exc}") from exc
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"`factory` of {self.name!r} returned {module!r}, not a Module")
        module.eval()
        parts = self._cut(module)
        known: dict[int, str] = {}
        for name, tensor in _named_tensors(module):
            known.setdefault(id(tensor), name)
        # Each stage is one aligned region of the buffer; each tensor is aligned in it.
        plans: list[tuple[int, list[tuple[str, torch.Tensor, int, int]]]] = []
        offset = 0
        owners: dict[int, int] = {}
        for number, part in enumerate(parts):
            spans = []
            start = offset
            for name, tensor in _named_tensors(part):
                if owners.setdefault(id(tensor), number) != number and self._writeback:
                    raise GpuServiceError(
                        f"{self.name!r}: stages share {known.get(id(tensor), name)!r}; "
                        "`writeback` would write "
                        "two copies of it back"
                    )
                size = tensor.numel() * tensor.element_size()
                spans.append((name, tensor, offset - start, size))
                offset += _aligned(size)
            plans.append((start, spans))
        # Pinned only where CUDA exists: a CPU-only build cannot pin at all.
        self.pinned = torch.cuda.is_available()
        flat = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=self.pinned)
        ends = [start for start, _ in plans[1:]] + [flat.numel()]
        for number, ((start, spans), part, end) in enumerate(zip(plans, parts, ends, strict=True)):
            region = flat[start:end]
            memo: dict[int, Any] = {}
            layout = []
            for index, (name, tensor, at, size) in enumerate(spans):
                _view(region, at, size, tensor.dtype, tensor.shape).copy_(tensor.detach())
                meta = torch.empty_like(tensor, device="meta")
                is_param = isinstance(tensor, torch.nn.Parameter)
                twin = torch.nn.Parameter(meta, requires_grad=False) if is_param else meta
                memo[id(tensor)] = twin
                layout.append((id(twin), at, size, tensor.dtype, tensor.shape, is_param))
                fallback = name if len(parts) == 1 else f"stage{number}.{name}"
                self._names.setdefault(known.get(id(tensor), fallback), (number, index))
            # deepcopy with every tensor pre-mapped to a meta twin copies the structure,
            # not the weights: the host holds one copy of them, the flat buffer.
            skeleton = copy.deepcopy(part, memo)
            index_of = {key: i for i, (key, *_) in enumerate(layout)}
            slots = []
            for sub_number, sub in enumerate(skeleton.modules()):
                for attr, value in itertools.chain(sub._parameters.items(), sub._buffers.items()):
                    if value is not None:
                        slots.append(
                            (sub_number, attr, index_of[id(value)], attr in sub._parameters)
                        )
            self._stages.append(
                _Stage(skeleton, start, end - start, [entry[1:] for entry in layout], slots)
            )
        self._flat = flat
        self.nbytes = sum(size for _, spans in plans for *_, size in spans)
        if self.memory is None:
            largest = max(stage.size for stage in self._stages)
            self.memory = max(1, int(largest * (1.0 + self._headroom)))

    def _cut(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The pipeline stages of ``module``: itself alone, or ``gpus`` parts as ``split`` says."""
        import torch

        split, count = self._split, self.gpus
        if split is None and count == 1:
            return [module]
        if callable(split):
            try:
                parts = list(split(module))
            except Exception as exc:
                raise GpuServiceError(f"`split` of {self.name!r} failed: {exc}") from exc
            if len(parts) != count or not all(isinstance(p, torch.nn.Module) for p in parts):
                raise GpuServiceError(
                    f"`split` of {self.name!r} must return {count} modules (got {parts!r})"
                )
            return parts
        if not isinstance(module, torch.nn.Sequential):
            raise GpuServiceError(
                f"{self.name!r} spans {count} devices: its module must be an nn.Sequential, "
                f"or pass `split=` a function returning the stages (got {type(module).__name__})"
            )
        children = list(module.named_children())
        if split is None:
            sizes = [
                sum(t.numel() * t.element_size() for _, t in _named_tensors(child))
                for _, child in children
            ]
            if len(children) < count:
                raise GpuServiceError(
                    f"{self.name!r} has {len(children)} layers for {count} devices"
                )
            counts = _balance(sizes, count)
        else:
            counts = list(split)
            if sum(counts) != len(children):
                raise GpuServiceError(
                    f"`split` of {self.name!r} covers {sum(counts)} layers of {len(children)}"
                )
        # The stages keep the children's names, so their tensors keep the module's names.
        bounds = list(itertools.accumulate(counts, initial=0))
        return [
            torch.nn.Sequential(collections.OrderedDict(children[a:b]))
            for a, b in itertools.pairwise(bounds)
        ]

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await anyio.to_thread.run_sync(self._restore, replica, devices)

    def _restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        import torch

        if not self._stages or self._flat is None:
            raise GpuServiceError(f"{self.name!r} was restored before it was loaded")
        if len(devices) != len(self._stages):
            raise GpuServiceError(
                f"{self.name!r} has {len(self._stages)} stages for {len(devices)} devices"
            )
        targets = [torch.device(device.torch_device) for device in devices]
        storages: list[torch.Tensor] = []
        try:
            # Every copy is issued before any is waited for: the devices fill in parallel.
            for stage, target in zip(self._stages, targets, strict=True):
                if len(self._stages) == 1:
                    storage = self._allocate(target)
                else:
                    storage = self._allocate(target, stage.size)
                storage.copy_(self._flat[stage.start : stage.start + stage.size], non_blocking=True)
                storages.append(storage)
            for target in dict.fromkeys(t for t in targets if t.type == "cuda"):
                torch.cuda.current_stream(target).synchronize()
        except Exception as exc:
            storages.clear()
            if any(t.type == "cuda" for t in targets):
                torch.cuda.empty_cache()
            where = ", ".join(device.name for device in devices)
            _raise_oom(exc, f"restoring {self.name!r} onto {where}")
            raise GpuServiceError(f"could not restore {self.name!r}: {exc}") from exc
        modules = self._modules.get(replica)
        if modules is None:
            modules = self._modules[replica] = [copy.deepcopy(s.skeleton) for s in self._stages]
        for stage, module, storage in zip(self._stages, modules, storages, strict=True):
            stage.bind(module, storage)
        self._replicas[replica] = list(zip(modules, storages, strict=True))

    def _allocate(self, target: torch.device, nbytes: int | None = None) -> torch.Tensor:
        """Device storage for one stage of a replica, ``nbytes`` long (``None``: the whole
        host buffer, the only stage). A seam tests use to inject a failed allocation."""
        import torch

        assert self._flat is not None
        if nbytes is None:
            return torch.empty_like(self._flat, device=target)
        return torch.empty(nbytes, dtype=torch.uint8, device=target)

    async def evict(self, replica: int) -> None:
        await anyio.to_thread.run_sync(self._evict, replica)

    def _evict(self, replica: int) -> None:
        import torch

        held = self._replicas.pop(replica, None)
        if held is None:
            return
        storages = []
        for stage, (module, storage) in zip(self._stages, held, strict=True):
            stage.bind(module, None)  # the views would keep the device buffer alive
            storages.append(storage)
        del held, module, storage
        if self._writeback and self._flat is not None:
            for stage, storage in zip(self._stages, storages, strict=True):
                self._flat[stage.start : stage.start + stage.size].copy_(storage, non_blocking=True)
            for device in dict.fromkeys(s.device for s in storages if s.is_cuda):
                torch.cuda.current_stream(device).synchronize()
        cuda = any(storage.is_cuda for storage in storages)
        storages.clear()
        if cuda and self._empty_cache:
            # Back to the driver, not only torch's cache: another process (an inference
            # server) may be the one waiting for this memory.
            torch.cuda.empty_cache()

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        return await anyio.to_thread.run_sync(self._run, replica, list(batches))

    def _run(self, replica: int, batches: list[Any]) -> list[Any]:
        import torch

        held = self._replicas[replica]
        sizes = [len(batch) for batch in batches]
        value = batches[0] if len(batches) == 1 else torch.cat(batches)
        with torch.inference_mode():
            for number, (module, storage) in enumerate(held):
                # From the host the copy may overlap; between stages it must not race.
                value = _move(value, storage.device, non_blocking=number == 0)
                value = module(value)
            out = _move(value, torch.device("cpu"))
        return [out] if len(batches) == 1 else list(torch.split(out, sizes))

    def host_state(self) -> dict[str, torch.Tensor]:
        """Views of the host buffer restores copy from (one buffer for the service's life).

        Named as in the module (a ``stage<i>.`` prefix for a tensor a ``split`` function
        made that the module does not hold).
        """
        if self._flat is None:
            return {}
        state = {}
        for name, (number, index) in self._names.items():
            stage = self._stages[number]
            at, size, dtype, shape, _ = stage.layout[index]
            region = self._flat[stage.start : stage.start + stage.size]
            state[name] = _view(region, at, size, dtype, shape)
        return state

    def replica_state(self, replica: int) -> dict[str, torch.Tensor]:
        """The resident replica's tensors by the names of :meth:`host_state` (empty when
        evicted); each lives on its stage's device."""
        held = self._replicas.get(replica)
        if held is None:
            return {}
        state = {}
        for name, (number, index) in self._names.items():
            stage = self._stages[number]
            at, size, dtype, shape, _ = stage.layout[index]
            state[name] = _view(held[number][1], at, size, dtype, shape)
        return state

    async def aclose(self) -> None:
        self._replicas.clear()
        self._modules.clear()
        self._flat = None
        self._stages = []


_ALIGN = 64


def _aligned(size: int) -> int:
    """``size`` rounded up so the next view starts aligned for any dtype."""
    return -(-size // _ALIGN) * _ALIGN


@attrs.define(eq=False)
class _Stage:
    """One pipeline stage of a :class:`TorchService`: its skeleton and its buffer region."""

    skeleton: torch.nn.Module
    start: int  # byte offset of the region in the host buffer
    size: int
    # Per tensor: (byte offset in the region, bytes, dtype, shape, is a parameter).
    layout: list[tuple[int, int, torch.dtype, torch.Size, bool]]
    # Where each tensor sits in the module tree: (module number, attribute, layout
    # index, is a parameter); the same for the skeleton and every copy of it.
    slots: list[tuple[int, str, int, bool]]

    def bind(self, module: torch.nn.Module, storage: torch.Tensor | None) -> None:
        """Point ``module``'s tensors at views into ``storage`` (``None``: back to meta).

        Rebinding a kept copy of the skeleton costs a few attribute writes per tensor,
        where a fresh ``deepcopy`` per restore cost milliseconds of Python for a small
        model. Tied tensors stay tied: they share one layout entry.
        """
        import torch

        tensors: list[torch.Tensor] = []
        for start, size, dtype, shape, is_param in self.layout:
            if storage is None:
                view = torch.empty(shape, dtype=dtype, device="meta")
            else:
                view = _view(storage, start, size, dtype, shape)
            tensors.append(torch.nn.Parameter(view, requires_grad=False) if is_param else view)
        subs = list(module.modules())
        for number, attr, index, is_param in self.slots:
            tensor = tensors[index]
            if is_param:
                assert isinstance(tensor, torch.nn.Parameter)
                subs[number]._parameters[attr] = tensor
            else:
                subs[number]._buffers[attr] = tensor


def _balance(sizes: Sequence[int], parts: int) -> list[int]:
    """Counts of consecutive ``sizes`` in ``parts`` non-empty runs, the largest sum least.

    The classic linear partition: a replica needs ``memory`` on each of its devices, so
    the largest stage sets what every device must give.
    """
    n = len(sizes)
    prefix = list(itertools.accumulate(sizes, initial=0))
    # best[j][i]: the least largest run splitting the first i sizes into j runs.
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n - parts + j + 1):
            for m in range(j - 1, i):
                cost = max(best[j - 1][m], prefix[i] - prefix[m])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, m
    counts = []
    i = n
    for j in range(parts, 0, -1):
        m = cut[j][i]
        counts.append(i - m)
        i = m
    return counts[::-1]


def _move(value: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``value`` on ``device``: a tensor, or tuples, lists and dicts of them."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device, non_blocking=non_blocking) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device, non_blocking=non_blocking) for k, v in value.items()}
    return value


def _view(
    flat: torch.Tensor, start: int, size: int, dtype: torch.dtype, shape: torch.Size
) -> torch.Tensor:
    return flat[start : start + size].view(dtype).view(shape)


# -- the pool ------------------------------------------------------------------------------


class _Residency(enum.Enum):
    EVICTED = "evicted"
    RESTORING = "restoring"
    RESIDENT = "resident"
    EVICTING = "evicting"


@attrs.define(eq=False)
class _Call:
    batch: Any
    done: anyio.Event = attrs.field(factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None


@attrs.define(eq=False)
class _Replica:
    state: _ServiceState
    index: int
    devices: tuple[Device, ...]
    residency: _Residency = _Residency.EVICTED
    alive: bool = False  # a holder task is waiting for or holding a memory grant
    leased: bool = False
    draining: bool = False  # takes no newcomer: its grant goes to a waiting replica
    granted_at: float = -math.inf
    users: int = 0
    last_used: float = -math.inf
    pending: list[_Call] = attrs.field(factory=list)
    ready: anyio.Event = attrs.field(factory=anyio.Event)
    wake: anyio.Event = attrs.field(factory=anyio.Event)
    error: BaseException | None = None
    scope: anyio.CancelScope | None = None
    lock: anyio.Lock = attrs.field(factory=anyio.Lock)


@attrs.define(eq=False)
class _ServiceState:
    service: ModelService
    replicas: list[_Replica] = attrs.field(factory=list)
    restore_seconds: float | None = None
    run_seconds: float | None = None
    restores: int = 0
    warmed: int = 0
    evictions: int = 0
    hits: int = 0
    runs: int = 0
    batched: int = 0


class _PoolState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class GpuPool:
    """Model services sharing devices, restored per action and evicted when idle (EOE).

    ``async with GpuPool([judge, teacher], devices=...) as pool:`` loads every service
    cold into host memory; ``Runtime(capacity=pool.capacity())`` schedules the devices'
    memory; ``async with pool.use("judge") as svc: scores = await svc(batch)`` runs an
    action on a replica of the service, restoring it first when it is not resident.

    Placement: an action joins a live replica of its service that has a seat (fewer
    actions than ``max_batch`` when the service batches, else none), or starts one where
    the service is still resident, else on the device (or NVLink chunk) with the most free
    memory; a multi-GPU replica waits for room inside one NVLink group rather than straddle
    two. When every live replica is full, another one starts only if ``max_replicas``
    allows it, a device has room without waiting, and, when it would need a restore, the
    action's place in line is longer than that restore: a full replica frees a seat every
    ``run seconds / max_batch``, so a short line is served sooner where it is. The
    replica's memory grant is passed to the runtime with the restore time (0 when
    resident) plus the service's learnt run time as its estimate, so the policy sees what
    the action will really cost.

    While replicas wait for their grant, the least loaded running replicas that have held
    theirs for at least two restore times (then the longest held) stop taking newcomers,
    as many as the waiters need beyond the free memory, and give their grant back once
    their actions end; every other replica keeps serving. Without this a busy service,
    joined continuously, would hold its devices for as long as it stays busy; the tenure
    keeps a restore to at most a third of a replica's time on its devices.

    :param services: the model services (names unique).
    :param devices: devices and the memory each may fill (default: every visible GPU).
    :param runtime: the runtime grants come from (default: the current one at each use).
    :param links: NVLink peer pairs of device indices (default: as NVML reports them).
    :param warm: when the pool is entered, restore idle replicas onto the devices with
        room (one of each service in order, then a second of each, and so on), so the
        first actions pay no restore. They hold no grant and are evicted like any idle
        replica. ``False`` leaves the devices empty until an action needs them (a GPU
        shared with processes the pool does not know about).
    """

    def __init__(
        self,
        services: Sequence[ModelService],
        *,
        devices: Sequence[Device] | None = None,
        runtime: Runtime | None = None,
        links: Iterable[tuple[int, int]] | None = None,
        warm: bool = True,
    ) -> None:
        if not isinstance(warm, bool):
            raise TypeError(f"`warm` must be True or False (got {warm!r})")
        states: dict[str, _ServiceState] = {}
        for service in services:
            if not isinstance(service, ModelService):
                raise TypeError(f"services must be tangram.gpu.ModelService (got {service!r})")
            if service.name in states:
                raise ValueError(f"two services are named {service.name!r}")
            states[service.name] = _ServiceState(service)
        if devices is not None:
            devices = list(devices)
            if not devices or not all(isinstance(d, Device) for d in devices):
                raise TypeError("`devices` must be a non-empty list of tangram.gpu.Device")
            if len({d.name for d in devices}) != len(devices):
                raise ValueError("device names must be unique")
        self._services = states
        self._devices: list[Device] = devices or []
        self._runtime = runtime
        self._links = None if links is None else list(links)
        self._groups: list[tuple[int, ...]] = []
        self._resident: dict[str, int] = {}
        self._leased: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._warm = warm
        # Set (and replaced) whenever a replica stops: an action blocked by its service's
        # draining replicas waits on it, then looks again.
        self._stopped: anyio.Event | None = None
        self._state = _PoolState.NEW
        self._task_group: anyio.abc.TaskGroup | None = None
        self._clock = 0

    def __repr__(self) -> str:
        names = ", ".join(self._services)
        return f"<tangram.gpu.GpuPool {self._state.value} services=[{names}]>"

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(self._devices)

    def capacity(self) -> dict[str, int]:
        """Runtime capacity of the devices: ``{"gpu_mem:<device>": bytes}``."""
        if not self._devices:
            raise GpuPoolClosedError("devices are discovered when the pool is entered")
        return {d.kind: d.memory for d in self._devices}

    async def __aenter__(self) -> GpuPool:
        if self._state is not _PoolState.NEW:
            raise GpuPoolClosedError(
                f"a GpuPool can be entered once (this one is {self._state.value})"
            )
        if not self._devices:
            self._devices = await anyio.to_thread.run_sync(discover_devices)
            if not self._devices:
                raise GpuError(
                    "no CUDA device is visible; pass devices=[Device('cpu:0', memory=...)] "
                    "to run on the host"
                )
        for i, device in enumerate(self._devices):
            self._resident[device.name] = self._leased[device.name] = self._peak[device.name] = 0
            self._locks[device.name] = anyio.Lock()
            if device.index is None:
                self._devices[i] = attrs.evolve(device, index=i)
        links = self._links
        if links is None:
            links = await anyio.to_thread.run_sync(nvml_nvlink_pairs)
        self._groups = nvlink_groups((d.index for d in self._devices if d.index is not None), links)
        # Cold loads run together (each reads its own weights); the first error is raised
        # as itself, not inside an ExceptionGroup, so ``except GpuError`` catches it.
        errors: list[Exception] = []
        async with anyio.create_task_group() as loading:
            for state in self._services.values():
                loading.start_soon(self._load, state, errors)
        if errors:
            self._state = _PoolState.CLOSED
            with anyio.CancelScope(shield=True):
                for state in self._services.values():
                    with contextlib.suppress(Exception):
                        await state.service.aclose()
            raise errors[0]
        by_name = {d.name: d for d in self._devices}
        try:
            for state in self._services.values():
                self._check_fits(state, by_name)
            if self._warm:
                await self._fill()
        except BaseException:
            self._state = _PoolState.CLOSED
            with anyio.CancelScope(shield=True):
                for state in self._services.values():
                    for replica in state.replicas:
                        if replica.residency is not _Residency.EVICTED:
                            with contextlib.suppress(Exception):
                                await self._evict(replica)
                    with contextlib.suppress(Exception):
                        await state.service.aclose()
            raise
        self._stopped = anyio.Event()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._state = _PoolState.OPEN
        return self

    async def _load(self, state: _ServiceState, errors: list[Exception]) -> None:
        service = state.service
        try:
            await service.load()
        except GpuError as exc:
            errors.append(exc)
        except Exception as exc:
            error = GpuServiceError(f"could not load {service.name!r}: {exc}")
            error.__cause__ = exc
            errors.append(error)
        else:
            if service.memory is None:
                errors.append(GpuServiceError(f"{service.name!r} gave no `memory` after loading"))

    async def _fill(self) -> None:
        """Restore idle replicas onto the devices with room, before any action comes.

        Nothing runs yet and an idle resident replica costs nothing (it is evicted the
        moment a granted replica needs its memory), so the devices start full rather than
        empty: one replica of each service in declared order, then a second of each while
        there is room, and so on, up to ``max_replicas``, never two of a service on one
        device, evicting nothing. The plan is made first, on the books; the restores then
        run together, serialised per device by the device locks, so separate devices fill
        in parallel. A failed restore leaves its replica evicted: the first action on it
        restores it as it would have without warming.
        """
        planned = {d.name: self._resident[d.name] for d in self._devices}
        counts = dict.fromkeys(self._services, 0)
        plan: list[_Replica] = []
        placed = True
        while placed:
            placed = False
            for name, state in self._services.items():
                if counts[name] >= state.service.max_replicas:
                    continue
                devices = self._warm_devices(state, planned)
                if devices is None:
                    continue
                replica = self._replica_on(state, devices)
                assert state.service.memory is not None
                for device in devices:
                    planned[device.name] += state.service.memory
                counts[name] += 1
                plan.append(replica)
                placed = True
        async with anyio.create_task_group() as restoring:
            for replica in plan:
                restoring.start_soon(self._warm_one, replica)

    def _warm_devices(
        self, state: _ServiceState, planned: Mapping[str, int]
    ) -> tuple[Device, ...] | None:
        """Devices with room for one more idle replica of ``state``'s service, or ``None``."""
        service = state.service
        need = service.memory
        assert need is not None
        taken = {d.name for r in state.replicas for d in r.devices}
        slots = service.slots()
        if slots is not None:
            by_name = {d.name: d for d in self._devices}
            for slot in slots:
                option = tuple(by_name[n] for n in slot)
                if not any(d.name in taken for d in option) and all(
                    d.memory - planned[d.name] >= need for d in option
                ):
                    return option
            return None
        capable = {
            d.index: float(d.memory - planned[d.name])
            for d in self._devices
            if d.index is not None and d.name not in taken and d.memory >= need
        }
        pick = place(self._groups, {i: f for i, f in capable.items() if f >= need}, service.gpus)
        if pick is None:
            return None
        if not self._linked(pick):
            # As for an action: a replica stays where it was restored, so it is not put
            # across NVLink groups while one group could hold it once memory frees up.
            wider = place(self._groups, capable, service.gpus)
            if wider is not None and self._linked(wider):
                return None
        by_index = {d.index: d for d in self._devices}
        return tuple(by_index[i] for i in pick)

    @contextlib.asynccontextmanager
    async def _holding(self, replica: _Replica) -> AsyncIterator[None]:
        """Hold what a restore or an eviction of ``replica`` must hold.

        Its devices' locks in name order, so two replicas never deadlock, then its own.
        """
        async with contextlib.AsyncExitStack() as stack:
            for device in sorted(replica.devices, key=lambda d: d.name):
                await stack.enter_async_context(self._locks[device.name])
            await stack.enter_async_context(replica.lock)
            yield

    async def _warm_one(self, replica: _Replica) -> None:
        state = replica.state
        memory = state.service.memory
        assert memory is not None
        async with self._holding(replica):
            if any(d.memory - self._resident[d.name] < memory for d in replica.devices):
                return  # the plan leaves room; evict nothing for a replica nobody asked for
            try:
                await self._restore(replica)
            except Exception:
                logger.warning(
                    "could not warm %r onto %s; it stays evicted until an action needs it",
                    state.service.name,
                    ", ".join(d.name for d in replica.devices),
                    exc_info=True,
                )
                return
            state.warmed += 1

    def _check_fits(self, state: _ServiceState, by_name: Mapping[str, Device]) -> None:
        service = state.service
        assert service.memory is not None
        slots = service.slots()
        if slots is not None:
            for slot in slots:
                unknown = [n for n in slot if n not in by_name]
                if unknown:
                    raise ValueError(f"{service.name!r} is bound to unknown devices {unknown}")
        big_enough = [d for d in self._devices if d.memory >= service.memory]
        if len(big_enough) < service.gpus:
            raise GpuOutOfMemoryError(
                f"{service.name!r} needs {service.memory} bytes on {service.gpus} device(s); "
                f"the largest device has {max(d.memory for d in self._devices)}"
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every replica, evict what is resident, close the services; safe twice."""
        if self._state is _PoolState.CLOSED:
            return
        self._state = _PoolState.CLOSED
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            for state in self._services.values():
                for replica in state.replicas:
                    if replica.residency is not _Residency.EVICTED:
                        with contextlib.suppress(Exception):
                            await self._evict(replica)
                try:
                    await state.service.aclose()
                except Exception:
                    logger.exception("could not close %r", state.service)

    def _check_open(self) -> None:
        if self._state is not _PoolState.OPEN:
            raise GpuPoolClosedError(
                f"the GPU pool is {self._state.value}: use it inside `async with pool:`"
            )

    # -- actions ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ServiceHandle]:
        """One action on service ``name``: wait for a resident replica, call it, let go.

        The replica's memory stays granted while any action uses it, so it cannot be
        evicted under a running action; when the last action leaves it stays resident,
        idle and evictable, for the next action to find.

        :raises GpuOutOfMemoryError: the restore found no room (nothing is left held).
        :raises GpuServiceError: the service failed to restore or to run.
        """
        self._check_open()
        state = self._services.get(name)
        if state is None:
            raise LookupError(f"no service named {name!r} (have {sorted(self._services)})")
        runtime = self._runtime if self._runtime is not None else current_runtime()
        while (replica := self._attach(state, runtime)) is None:
            # Only the service's own draining replicas stand where it could go: the
            # first to stop frees its devices (and makes room under ``max_replicas``).
            assert self._stopped is not None
            await self._stopped.wait()
            self._check_open()
        replica.users += 1
        try:
            await replica.ready.wait()
            if replica.error is not None:
                raise replica.error
            yield ServiceHandle(self, replica)
        finally:
            replica.users -= 1
            replica.last_used = self._tick()
            if replica.users == 0:
                if not replica.leased and replica.scope is not None:
                    replica.scope.cancel()  # nobody waits for it any more: withdraw
                replica.wake.set()

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _attach(self, state: _ServiceState, runtime: Runtime) -> _Replica | None:
        """The replica this action runs on: a live one, or one started for it.

        ``None`` when the service's own draining replicas block every option (their
        devices, or ``max_replicas``): the action waits for one of them to stop.
        """
        self._yield()
        service = state.service
        alive = [r for r in state.replicas if r.alive]
        live = [r for r in alive if r.error is None and not r.draining]
        if live:
            least = min(live, key=lambda r: r.users)
            # Elastic: another copy only when every live one is full and a device has
            # room now (a copy that waits for memory helps no one sooner).
            if least.users < _seats(service) or len(alive) >= service.max_replicas:
                return least
            devices = self._choose(state, need_room_now=True)
            if devices is None or self._queue_on(least, devices):
                return least
        else:
            if len(alive) >= service.max_replicas:
                return None
            devices = self._choose(state, need_room_now=False)
            if devices is None:
                return None
        replica = self._replica_on(state, devices)
        self._start(replica, runtime)
        return replica

    def _queue_on(self, least: _Replica, devices: tuple[Device, ...]) -> bool:
        """Whether a newcomer finding every replica full waits on ``least`` rather than
        start a new replica on ``devices``.

        A full replica frees a seat every ``run seconds / seats`` on average, so the
        newcomer's wait there is its place in line times that; a new replica on
        ``devices`` costs a restore unless it is resident there. The simulator found
        (mopd-2048 at 16 GPUs) that restoring a third replica of the busiest teacher at
        once cost more than queueing on the two it had. Before any run was measured the
        line's length is unknown, and a new replica starts as it always did.
        """
        state = least.state
        resident = any(
            r.devices == devices and r.residency is _Residency.RESIDENT and not r.alive
            for r in state.replicas
        )
        if resident or state.run_seconds is None:
            return False
        seats = _seats(state.service)
        place_in_line = least.users - seats + 1
        return place_in_line * state.run_seconds / seats < self._restore_estimate(state)

    def _yield(self) -> None:
        """Choose running replicas to drain until the waiting ones' memory is on the way.

        A busy service keeps joining its replica, which would hold its devices for as long
        as the service stays busy and starve one waiting for them. So the least loaded
        running replicas on the devices the waiters need, that have held their grant for
        ``_TENURE`` restore times (then the longest held), stop taking newcomers, as many
        as the waiters need beyond the free memory on each device; every other replica
        keeps serving. Draining every replica whenever any waited (tried in the
        simulator) made each busy service ask for a new replica in turn, so one waiter
        rotated the whole pool. The tenure keeps a restore to at most a third of a
        replica's time on its devices.
        """
        replicas = [r for state in self._services.values() for r in state.replicas]
        deficit = dict.fromkeys(self._leased, 0)
        for r in replicas:
            if r.alive and not r.leased and r.users > 0:
                assert r.state.service.memory is not None
                for d in r.devices:
                    deficit[d.name] += r.state.service.memory
        if not any(deficit.values()):
            return
        for d in self._devices:
            deficit[d.name] -= max(0, d.memory - self._leased[d.name])
        running = [r for r in replicas if r.alive and r.leased]
        for r in running:
            if r.draining:
                assert r.state.service.memory is not None
                for d in r.devices:
                    deficit[d.name] -= r.state.service.memory
        if all(v <= 0 for v in deficit.values()):
            return
        now = anyio.current_time()
        candidates = sorted(
            (
                r
                for r in running
                if not r.draining
                and r.ready.is_set()  # restored: a first restore's time is known by now
                and now - r.granted_at >= _TENURE * self._restore_estimate(r.state)
            ),
            key=lambda r: (r.users, r.granted_at),
        )
        for r in candidates:
            if any(deficit[d.name] > 0 for d in r.devices):
                r.draining = True
                assert r.state.service.memory is not None
                for d in r.devices:
                    deficit[d.name] -= r.state.service.memory

    def _replica_on(self, state: _ServiceState, devices: tuple[Device, ...]) -> _Replica:
        for replica in state.replicas:
            if replica.devices == devices and not replica.alive:
                return replica
        used = {r.index for r in state.replicas}
        index = next(i for i in itertools.count() if i not in used)
        replica = _Replica(state, index, devices)
        state.replicas.append(replica)
        return replica

    def _free_now(self, device: Device) -> int:
        """Memory not granted and not asked for by a replica waiting for its grant."""
        asked = 0
        for state in self._services.values():
            for r in state.replicas:
                if r.alive and not r.leased and device in r.devices:
                    assert state.service.memory is not None
                    asked += state.service.memory
        return device.memory - self._leased[device.name] - asked

    def _choose(self, state: _ServiceState, *, need_room_now: bool) -> tuple[Device, ...] | None:
        service = state.service
        assert service.memory is not None
        need = service.memory
        busy = {d.name for r in state.replicas if r.alive for d in r.devices}
        by_name = {d.name: d for d in self._devices}
        slots = service.slots()
        if slots is not None:
            options = [tuple(by_name[n] for n in slot) for slot in slots]
            options = [o for o in options if not any(d.name in busy for d in o)]
        else:
            cached = [
                r.devices
                for r in state.replicas
                if not r.alive and r.residency is _Residency.RESIDENT
            ]
            options = [o for o in cached if not any(d.name in busy for d in o)]
            if not options or need_room_now:
                free = {
                    d.index: float(self._free_now(d))
                    for d in self._devices
                    if d.index is not None and d.name not in busy and d.memory >= need
                }
                roomy = {i: f for i, f in free.items() if f >= need}
                pick = place(self._groups, roomy, service.gpus)
                if not need_room_now and (pick is None or not self._linked(pick)):
                    # Too few devices have room now, or only across NVLink groups: a
                    # multi-GPU replica would talk over PCIe for as long as it stays
                    # resident, so it waits for memory on well-linked devices instead.
                    wider = place(self._groups, free, service.gpus)
                    if pick is None or (wider is not None and self._linked(wider)):
                        pick = wider
                by_index = {d.index: d for d in self._devices}
                if pick is not None:
                    options.append(tuple(by_index[i] for i in pick))

        def score(option: tuple[Device, ...]) -> tuple[bool, bool, int]:
            free = min(self._free_now(d) for d in option)
            resident = any(
                r.devices == option and r.residency is _Residency.RESIDENT for r in state.replicas
            )
            return (free >= need, resident, free)

        options = [o for o in options if not need_room_now or score(o)[0]]
        if not options:
            return None
        return max(options, key=score)

    def _linked(self, devices: Sequence[int]) -> bool:
        """Whether ``devices`` lie in one NVLink group."""
        return any(set(devices) <= set(group) for group in self._groups)

    def _start(self, replica: _Replica, runtime: Runtime) -> None:
        assert self._task_group is not None
        replica.alive = True
        replica.draining = False
        replica.error = None
        replica.ready = anyio.Event()
        replica.wake = anyio.Event()
        replica.scope = anyio.CancelScope()
        self._task_group.start_soon(self._hold, replica, runtime)

    @staticmethod
    def _restore_estimate(state: _ServiceState) -> float:
        """Seconds a restore of the service takes: learnt, else assumed from its size."""
        if state.restore_seconds is not None:
            return state.restore_seconds
        assert state.service.memory is not None
        return state.service.memory / DEFAULT_RESTORE_BANDWIDTH

    def _estimate(self, replica: _Replica) -> float | None:
        state = replica.state
        restore = 0.0
        if replica.residency is not _Residency.RESIDENT:
            restore = self._restore_estimate(state)
        if state.run_seconds is None:
            return restore if restore > 0 else None
        return restore + state.run_seconds

    async def _hold(self, replica: _Replica, runtime: Runtime) -> None:
        """Hold the replica's memory grant while actions use it; run their batches."""
        state = replica.state
        try:
            while True:
                assert replica.scope is not None
                with replica.scope:
                    await self._lease_and_serve(replica, runtime)
                # The scope is cancelled when the last waiting action left before the
                # grant came. Another action may have joined since, before this task
                # saw the cancellation: it waits on ``ready``, so ask again for it.
                if replica.users == 0 or self._state is not _PoolState.OPEN:
                    break
                replica.scope = anyio.CancelScope()
        except Exception as exc:
            if isinstance(exc, TangramError):
                replica.error = exc
            else:
                replica.error = GpuServiceError(f"{state.service.name!r}: {exc}")
                replica.error.__cause__ = exc
        finally:
            if replica.error is None and (replica.users or replica.pending):
                replica.error = GpuPoolClosedError("the replica stopped (the pool closed)")
            replica.alive = False
            replica.draining = False
            replica.scope = None
            replica.last_used = self._tick()
            replica.ready.set()
            for call in replica.pending:
                call.error = replica.error or GpuPoolClosedError("the replica stopped")
                call.done.set()
            replica.pending.clear()
            if self._stopped is not None:
                self._stopped.set()
                self._stopped = anyio.Event()

    async def _lease_and_serve(self, replica: _Replica, runtime: Runtime) -> None:
        state = replica.state
        memory = state.service.memory
        assert memory is not None
        demand = {d.kind: memory for d in replica.devices}
        context = runtime.acquire(
            demand, kind=f"gpu:{state.service.name}", estimate=self._estimate(replica)
        )
        async with context as lease:
            replica.leased = True
            replica.granted_at = anyio.current_time()
            for d in replica.devices:
                self._leased[d.name] += memory
            try:
                await self._make_resident(replica)
                lease.started_at = anyio.current_time()
                replica.ready.set()
                await self._serve(replica)
            finally:
                replica.leased = False
                for d in replica.devices:
                    self._leased[d.name] -= memory

    async def _serve(self, replica: _Replica) -> None:
        state = replica.state
        service = state.service
        while True:
            if not replica.pending:
                if replica.users == 0:
                    return
                await replica.wake.wait()
                replica.wake = anyio.Event()
                continue
            limit = (service.max_batch or len(replica.pending)) if service.batching else 1
            calls, replica.pending = replica.pending[:limit], replica.pending[limit:]
            started = anyio.current_time()
            try:
                results = await service.run(replica.index, [c.batch for c in calls])
                if len(results) != len(calls):
                    raise GpuServiceError(
                        f"{service.name!r} returned {len(results)} results for {len(calls)} batches"
                    )
            except Exception as exc:
                error = (
                    exc
                    if isinstance(exc, GpuError)
                    else GpuServiceError(f"{service.name!r} failed to run: {exc}")
                )
                if error is not exc:
                    error.__cause__ = exc
                for call in calls:
                    call.error = error
                    call.done.set()
                continue
            seconds = anyio.current_time() - started
            state.run_seconds = _ewma(state.run_seconds, seconds)
            state.runs += 1
            state.batched += len(calls)
            for call, result in zip(calls, results, strict=True):
                call.result = result
                call.done.set()

    async def _make_resident(self, replica: _Replica) -> None:
        """Restore ``replica`` once its grant came, evicting LRU idle replicas for room."""
        state = replica.state
        memory = state.service.memory
        assert memory is not None
        async with self._holding(replica):
            if replica.residency is _Residency.RESIDENT:
                state.hits += 1
                return
            for device in replica.devices:
                while device.memory - self._resident[device.name] < memory:
                    victim = self._victim(device, replica)
                    if victim is None:  # pragma: no cover - the runtime's grant prevents it
                        raise GpuOutOfMemoryError(
                            f"no idle service to evict on {device.name} for {state.service.name!r}"
                        )
                    # A victim on several devices may be evicted for a restore on another
                    # of them meanwhile: wait for that, then look again, never twice.
                    async with victim.lock:
                        if victim.residency is _Residency.RESIDENT and not victim.leased:
                            await self._evict(victim)
            await self._restore(replica)
            state.restores += 1

    async def _restore(self, replica: _Replica) -> None:
        """Restore ``replica`` where its memory is free; on failure nothing stays held.

        The caller holds the replica's device locks and its own lock.
        """
        state = replica.state
        memory = state.service.memory
        assert memory is not None
        replica.residency = _Residency.RESTORING
        for device in replica.devices:
            self._resident[device.name] += memory
            self._peak[device.name] = max(self._peak[device.name], self._resident[device.name])
        started = anyio.current_time()
        try:
            await state.service.restore(replica.index, replica.devices)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await state.service.evict(replica.index)
            replica.residency = _Residency.EVICTED
            for device in replica.devices:
                self._resident[device.name] -= memory
            if isinstance(exc, MemoryError) and not isinstance(exc, GpuError):
                raise GpuOutOfMemoryError(
                    f"restoring {state.service.name!r}: out of memory ({exc})"
                ) from exc
            raise
        state.restore_seconds = _ewma(state.restore_seconds, anyio.current_time() - started)
        replica.residency = _Residency.RESIDENT

    def _victim(self, device: Device, keep: _Replica) -> _Replica | None:
        """The replica on ``device`` to evict: one another restore is evicting already,
        else the least recently used resident one that holds no grant."""
        idle = [
            r
            for state in self._services.values()
            for r in state.replicas
            if r is not keep
            and device in r.devices
            and r.residency in (_Residency.RESIDENT, _Residency.EVICTING)
            and not r.leased
        ]
        return min(
            idle, key=lambda r: (r.residency is _Residency.RESIDENT, r.last_used), default=None
        )

    async def _evict(self, replica: _Replica) -> None:
        state = replica.state
        memory = state.service.memory
        assert memory is not None
        replica.residency = _Residency.EVICTING
        try:
            with anyio.CancelScope(shield=True):
                await state.service.evict(replica.index)
        except Exception:
            # Its memory may still be held: keep counting it, and say so.
            replica.residency = _Residency.RESIDENT
            logger.exception("could not evict %r replica %d", state.service.name, replica.index)
            raise
        replica.residency = _Residency.EVICTED
        state.evictions += 1
        for device in replica.devices:
            self._resident[device.name] -= memory

    # -- introspection ---------------------------------------------------------------------

    def residency(self) -> dict[str, list[tuple[str, ...]]]:
        """Where each service is resident now: ``{name: [device names per replica]}``."""
        return {
            name: [
                tuple(d.name for d in r.devices)
                for r in state.replicas
                if r.residency is _Residency.RESIDENT
            ]
            for name, state in self._services.items()
        }

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Per device: capacity, resident and granted bytes, the peak, the driver's count."""
        return {
            d.name: {
                "capacity": d.memory,
                "resident": self._resident.get(d.name, 0),
                "granted": self._leased.get(d.name, 0),
                "peak": self._peak.get(d.name, 0),
                "driver_used": device_memory_used(d),
            }
            for d in self._devices
        }

    def service_stats(self) -> dict[str, dict[str, float | int | None]]:
        """Per service: restores actions waited for, restores made when the pool was
        entered (``warmed``), evictions, resident hits, runs, actions run, timings."""
        return {
            name: {
                "restores": s.restores,
                "warmed": s.warmed,
                "evictions": s.evictions,
                "hits": s.hits,
                "runs": s.runs,
                "batched": s.batched,
                "restore_seconds": s.restore_seconds,
                "run_seconds": s.run_seconds,
                "replicas_live": sum(r.alive for r in s.replicas),
            }
            for name, s in self._services.items()
        }


def _seats(service: ModelService) -> int:
    """Actions one replica serves before it counts as full: a batching service's
    ``max_batch``, else one (``max_batch=None`` merges all that wait, but a second replica
    on a free device still serves the next action sooner, as it always did)."""
    return service.max_batch if service.batching and service.max_batch else 1


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + _EWMA * (new - old)


class ServiceHandle:
    """A resident replica lent to one action: ``await svc(batch)`` runs a batch on it.

    Calls from every action on the replica queue together; when the service batches, the
    next run takes all of them at once.
    """

    __slots__ = ("_pool", "_replica")

    def __init__(self, pool: GpuPool, replica: _Replica) -> None:
        self._pool = pool
        self._replica = replica

    def __repr__(self) -> str:
        names = ",".join(d.name for d in self._replica.devices)
        return f"<tangram.gpu.ServiceHandle {self.name!r} on {names}>"

    @property
    def name(self) -> str:
        return self._replica.state.service.name

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._replica.devices

    @property
    def replica(self) -> int:
        return self._replica.index

    async def __call__(self, batch: Any) -> Any:
        replica = self._replica
        if not replica.alive:
            raise GpuPoolClosedError("the action ended: use the handle inside its `async with`")
        call = _Call(batch)
        replica.pending.append(call)
        replica.wake.set()
        try:
            await call.done.wait()
        except BaseException:
            with contextlib.suppress(ValueError):
                replica.pending.remove(call)
            raise
        if call.error is not None:
            raise call.error
        return call.result
