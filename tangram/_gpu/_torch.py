"""An in-process torch module as a model service: one host buffer, one copy per restore.

torch is read through :data:`~tangram._gpu._optional.torch`, imported when a service
first loads, so importing this module (and ``tangram.gpu``) costs nothing without it.
"""

from __future__ import annotations

import collections
import copy
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import attrs

from .._core import _validate
from .._core._units import format_size
from ..errors import GpuOutOfMemoryError, GpuServiceError, InvalidSettingError, SettingTypeError
from ._checks import check_bool
from ._devices import Device
from ._optional import torch
from ._service import ModelService

__all__ = ["TorchService"]

# Factories run one at a time in the whole process. The pool loads its services in worker
# threads at once, and a factory that calls ``torch.manual_seed`` then builds draws from
# the one global generator every thread shares: run together, two such factories mixed
# their draws (different weights in 2 pools of 40). Only the factory call is held; packing
# the weights into the host buffer and pinning it, the slow part, still run in parallel.
_BUILDING = threading.Lock()


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _raise_oom(exc: BaseException, what: str) -> None:
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

    :param factory: builds the module (called once, in a worker thread, one factory at a
        time in the process: one that seeds torch's global generator builds the same
        weights as it would alone).
    :param memory: device bytes per replica on each of its devices; default: the largest
        stage's tensors (all of them with one stage) plus ``headroom`` for activations.
        A declared size below those tensors is refused when the pool loads the service.
    :param gpus: devices per replica, one pipeline stage on each.
    :param split: how the module is cut into ``gpus`` stages (see above).
    :param empty_cache: on eviction, hand the freed CUDA memory back to the driver
        (``torch.cuda.empty_cache``). Needed when another process (an inference server)
        shares the GPU; when only in-process torch services do, ``False`` lets torch's
        caching allocator reuse the block and skips a ``cudaFree``/``cudaMalloc`` pair
        per round trip.
    :raises SettingTypeError: an argument of the wrong type.
    :raises InvalidSettingError: an argument out of range, or settings that conflict.
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
        self._empty_cache = check_bool("empty_cache", empty_cache)
        if not callable(factory):
            raise SettingTypeError(f"`factory` must build a torch.nn.Module (got {factory!r})")
        if check_bool("writeback", writeback) and max_replicas != 1:
            raise InvalidSettingError(
                "`writeback` needs `max_replicas=1`: replicas would overwrite each other's "
                f"state (got max_replicas={max_replicas!r})"
            )
        _validate.number("headroom", headroom)
        if split is not None and not callable(split):
            counts = list(split) if isinstance(split, Sequence) else None
            if (
                counts is None
                or len(counts) != gpus
                or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts
                )
            ):
                raise InvalidSettingError(
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
        """Build the module and pack its tensors into the host buffer, in a worker thread.

        :raises GpuOutOfMemoryError: the declared ``memory`` is smaller than the tensors.
        :raises GpuServiceError: the factory or ``split`` failed.
        """
        await anyio.to_thread.run_sync(self._load)

    def _load(self) -> None:
        if self._stages:
            return
        try:
            with _BUILDING:
                module = self._factory()
        except Exception as exc:
            raise GpuServiceError(f"could not build {self.name!r}: {exc}") from exc
        if not isinstance(module, torch.nn.Module):
            raise SettingTypeError(
                f"`factory` of {self.name!r} must return a Module (got {module!r})"
            )
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
        largest = max(stage.size for stage in self._stages)
        if self.memory is not None and largest > self.memory:
            # A restore allocates the stage's whole region: a declared memory below it
            # would let the runtime grant less than the device then holds.
            where = "its largest stage" if len(parts) > 1 else "its parameters and buffers"
            self._stages, self._names = [], {}
            raise GpuOutOfMemoryError(
                f"{self.name!r} holds {format_size(largest)} per device ({where}), more "
                f"than its declared memory={format_size(self.memory)}: declare at least "
                f"{format_size(largest)} plus room for activations, or leave `memory` unset "
                "to have it measured"
            )
        self._flat = flat
        self.nbytes = sum(size for _, spans in plans for *_, size in spans)
        if self.memory is None:
            self.memory = max(1, int(largest * (1.0 + self._headroom)))

    def _cut(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The pipeline stages of ``module``: itself alone, or ``gpus`` parts as ``split`` says."""
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
            size = format_size(max(stage.size for stage in self._stages))
            _raise_oom(exc, f"restoring {self.name!r} ({size} per device) onto {where}")
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
        assert self._flat is not None
        if nbytes is None:
            return torch.empty_like(self._flat, device=target)
        return torch.empty(nbytes, dtype=torch.uint8, device=target)

    async def evict(self, replica: int) -> None:
        await anyio.to_thread.run_sync(self._evict, replica)

    def _evict(self, replica: int) -> None:
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
