"""The seam for any way of serving a model: load cold once, then restore, run, evict.

The pool (``_pool.py``) decides when and where; a :class:`ModelService` only does what it
is told on the devices it is given. :class:`~tangram._gpu._torch.TorchService` serves an
in-process torch module, :class:`~tangram._gpu._http.HttpModelService` an inference
server that sleeps and wakes over HTTP.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from .._core._units import format_size
from .._core._validate import whole
from ..errors import SettingTypeError
from ._checks import check_bool
from ._devices import Device, to_bytes

__all__ = ["ModelService"]


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
    :raises SettingTypeError: an argument of the wrong type.
    :raises InvalidSettingError: a count below one, or a memory that is not a size.
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
            raise SettingTypeError(f"`name` must be a non-empty string (got {name!r})")
        for setting, value in (("gpus", gpus), ("max_replicas", max_replicas)):
            whole(setting, value, minimum=1)
        if max_batch is not None:
            whole("max_batch", max_batch, minimum=1)
        self.name = name
        self.memory: int | None = None if memory is None else to_bytes(memory)
        self.gpus = gpus
        self.max_replicas = max_replicas
        self.batching = check_bool("batching", batching)
        self.max_batch = max_batch

    def __repr__(self) -> str:
        memory = "unknown" if self.memory is None else format_size(self.memory)
        return f"<{type(self).__name__} {self.name!r} memory={memory}>"

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
