"""Where a quota meets httpx: the transport, a request rewritten for its key, the response
stream that holds the request's slot until the body is read or closed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
import httpx

from .._runtime._run import AcquireContext
from ._keys import KeyState

__all__ = ["QuotaTransport", "ReleasingStream", "outgoing"]


class _Sender(Protocol):
    """What :class:`QuotaTransport` sends through: a :class:`~tangram.quota.Quota`."""

    async def send(
        self, request: httpx.Request, transport: httpx.AsyncBaseTransport
    ) -> httpx.Response: ...


def outgoing(
    request: httpx.Request,
    key: KeyState,
    trace: Callable[[str, dict[str, Any]], Awaitable[None]],
) -> httpx.Request:
    """``request`` as it goes out with ``key``: its URL and headers, and ``trace`` hooked in."""
    url = request.url
    headers = request.headers.copy()
    if key.key.url is not None:
        base = httpx.URL(key.key.url)
        url = url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        # The Host the client wrote is the old URL's: httpx writes the key's.
        headers.pop("host", None)
    headers.update(key.key.headers)
    if "transfer-encoding" in headers:
        # A streamed body was read whole (a retry resends it): it goes out as the bytes
        # it is, framed by the length httpx gives it, not as chunks it no longer is.
        del headers["transfer-encoding"]
        headers.pop("content-length", None)
    return httpx.Request(
        request.method,
        url,
        headers=headers,
        content=request.content,
        extensions={**request.extensions, "trace": trace},
    )


class ReleasingStream(httpx.AsyncByteStream):
    """The response body; closing it gives the request's slot back.

    The slot covers the whole exchange, body included, as the provider counts it.
    """

    def __init__(
        self, inner: httpx.AsyncByteStream | Any, context: AcquireContext, key: KeyState
    ) -> None:
        self._inner = inner
        self._context: AcquireContext | None = context
        self._key = key

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        context, self._context = self._context, None
        if context is None:
            return
        self._key.in_flight -= 1
        try:
            await context.__aexit__(None, None, None)
        finally:
            close = getattr(self._inner, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


class QuotaTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends every request through a :class:`Quota`.

    Wraps ``transport`` (default ``httpx.AsyncHTTPTransport()``), so connection pooling,
    HTTP/2 and proxies stay httpx's business.
    """

    def __init__(self, quota: _Sender, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.quota = quota
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.quota.send(request, self.transport)

    async def aclose(self) -> None:
        await self.transport.aclose()
