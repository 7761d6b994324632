"""External inference servers as model services: sleep and wake them over HTTP (httpx).

vLLM and SGLang can give their GPU memory back without exiting, which is what
evict-on-execution needs from a server that owns its own CUDA context:

- vLLM (``VLLM_SERVER_DEV_MODE=1``, started with ``--enable-sleep-mode``):
  ``POST /sleep?level=1`` offloads the weights to host memory and drops the KV cache;
  ``POST /wake_up`` brings them back; ``GET /is_sleeping`` answers
  ``{"is_sleeping": bool}`` (vllm/entrypoints/serve/sleep/api_router.py).
- SGLang (started with ``--enable-memory-saver``): ``POST /release_memory_occupation``
  and ``POST /resume_memory_occupation``, each with a JSON body (``{}``: every tag)
  (sglang/srt/entrypoints/http_server.py).

A server is started on its GPUs and cannot move, so each server is one replica bound to
its devices (:meth:`ModelService.slots`); the pool only decides *when* it is awake.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx

from .._core._validate import seconds
from ..errors import GpuOutOfMemoryError, GpuServiceError, InvalidSettingError, SettingTypeError
from ._devices import Device
from ._service import ModelService

__all__ = ["HttpModelService", "SglangService", "VllmService"]

Request = Callable[[httpx.AsyncClient, Any], Awaitable[Any]]


async def completions(client: httpx.AsyncClient, item: Any) -> Any:
    """The default request: ``POST /v1/completions`` with ``item`` as the JSON body."""
    response = await client.post("/v1/completions", json=item)
    response.raise_for_status()
    return response.json()


class HttpModelService(ModelService):
    """A model served by external HTTP servers, one per replica, slept when evicted.

    :param servers: base URL of each server -> the device names it runs on.
    :param memory: device bytes one server holds awake (per device).
    :param request: sends one item of a batch and returns its result (default: an
        OpenAI-style ``POST /v1/completions``). A batch's items are sent concurrently so
        the server's own continuous batching merges them.
    :param timeout: seconds for sleep/wake calls (a wake can take seconds).
    :param transport: the httpx transport (tests hand a real server's, or a mock).
    :raises SettingTypeError: an argument of the wrong type (also a ``TypeError``).
    :raises InvalidSettingError: no server, servers on unequal numbers of devices, a
        memory that is not a size, or a timeout that is not above zero.
    """

    def __init__(
        self,
        name: str,
        servers: Mapping[str, Sequence[str]],
        *,
        memory: int | str,
        request: Request = completions,
        timeout: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not isinstance(servers, Mapping) or not all(
            isinstance(url, str)
            and isinstance(devices, Sequence)
            and not isinstance(devices, str)
            and all(isinstance(d, str) for d in devices)
            for url, devices in servers.items()
        ):
            raise SettingTypeError(
                "`servers` must map each server's URL to the device names it runs on, like "
                f"{{'http://host:8000': ['cuda:0']}} (got {servers!r})"
            )
        if not servers:
            raise InvalidSettingError(f"`servers` must name at least one server (got {servers!r})")
        gpus = {len(devices) for devices in servers.values()}
        if len(gpus) != 1 or 0 in gpus:
            raise InvalidSettingError(
                f"every server must run on the same, non-zero number of devices (got {servers!r})"
            )
        if not callable(request):
            raise SettingTypeError(f"`request` must be an async function (got {request!r})")
        seconds("timeout", timeout, strict=True)
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise SettingTypeError(
                f"`transport` must be an httpx.AsyncBaseTransport (got {transport!r})"
            )
        super().__init__(
            name, memory=memory, gpus=gpus.pop(), max_replicas=len(servers), batching=True
        )
        self._urls = list(servers)
        self._slots = [tuple(devices) for devices in servers.values()]
        self._request = request
        self._timeout = timeout
        self._transport = transport
        self._clients: list[httpx.AsyncClient] = []

    def slots(self) -> Sequence[tuple[str, ...]]:
        return self._slots

    async def load(self) -> None:
        """Connect, and put every server to sleep so its memory matches the pool's books."""
        if not self._clients:
            self._clients = [
                httpx.AsyncClient(base_url=url, timeout=self._timeout, transport=self._transport)
                for url in self._urls
            ]
        for replica in range(len(self._clients)):
            if await self._awake(replica):
                await self.evict(replica)

    async def _awake(self, replica: int) -> bool:
        return True

    async def _call(self, replica: int, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._clients[replica].request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GpuServiceError(f"{self.name!r} at {self._urls[replica]}: {exc}") from exc
        if response.status_code >= 400:
            text = response.text[:200]
            if "out of memory" in text.lower():
                raise GpuOutOfMemoryError(f"{self.name!r} {path}: {text}")
            raise GpuServiceError(
                f"{self.name!r} {method} {path} -> HTTP {response.status_code}: {text}"
            )
        return response

    async def run(self, replica: int, batches: Sequence[Any]) -> list[Any]:
        results: list[list[Any]] = [[None] * len(batch) for batch in batches]
        client = self._clients[replica]
        # The first failure is raised as itself, not inside the task group's
        # ExceptionGroup, so the action that sent the item reads what the server said.
        errors: list[GpuServiceError] = []

        async def one(i: int, j: int, item: Any) -> None:
            try:
                results[i][j] = await self._request(client, item)
            except Exception as exc:
                error = GpuServiceError(f"{self.name!r} request failed: {exc}")
                error.__cause__ = exc
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for i, batch in enumerate(batches):
                for j, item in enumerate(batch):
                    tg.start_soon(one, i, j, item)
        if errors:
            raise errors[0]
        return results

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.aclose()


class VllmService(HttpModelService):
    """vLLM servers: evict is ``POST /sleep?level=1``, restore is ``POST /wake_up``.

    Level 1 keeps the weights in host memory (a fast wake); level 2 would discard them
    and need a reload, which is a cold load, not an eviction.
    """

    async def _awake(self, replica: int) -> bool:
        response = await self._call(replica, "GET", "/is_sleeping")
        return not bool(response.json().get("is_sleeping", False))

    async def evict(self, replica: int) -> None:
        await self._call(replica, "POST", "/sleep", params={"level": "1"})

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await self._call(replica, "POST", "/wake_up")


class SglangService(HttpModelService):
    """SGLang servers: ``/release_memory_occupation`` and ``/resume_memory_occupation``.

    SGLang has no "is it released?" query, so ``load`` releases unconditionally.
    """

    async def evict(self, replica: int) -> None:
        await self._call(replica, "POST", "/release_memory_occupation", json={})

    async def restore(self, replica: int, devices: tuple[Device, ...]) -> None:
        await self._call(replica, "POST", "/resume_memory_occupation", json={})
