"""A loopback HTTP server that enforces a known API quota, for tests and benchmarks.

Real providers cannot be asked to misbehave on cue, and a mocked transport would never
exercise connection pools, keep-alive or the time requests spend on the wire. This server
speaks just enough HTTP/1.1 (keep-alive, ``Content-Length`` bodies) over a real TCP socket
and limits each API key (the ``Authorization: Bearer`` value) the way providers do: a
request-rate token bucket, a token-rate bucket charged ``X-Tokens`` per request, and a
concurrency cap. Past any of them it answers ``429`` with ``Retry-After`` (whole seconds,
as RFC 9110 writes it) and ``retry-after-ms`` (the precise wait, as OpenAI sends it).
Rejected requests cost nothing, as with most providers.

It runs on the caller's event loop (asyncio or trio, through anyio) and logs every
accepted and rejected request with the loop's clock, so a test can check any window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream

from .._core._validate import number, seconds, validator, whole
from ..errors import InvalidSettingError

__all__ = ["Limit", "QuotaServer"]

_MAX_HEAD = 65536
_positive = validator(number, strict=True, finite=False)
_count = validator(whole, minimum=1)


def _rate(instance: object, attribute: Any, value: float | None) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _slots(instance: object, attribute: Any, value: int | None) -> None:
    if value is not None:
        _count(instance, attribute, value)


@attrs.frozen(kw_only=True)
class Limit:
    """What the server allows one key: ``None`` leaves that dimension unlimited."""

    requests: float | None = attrs.field(default=None, validator=_rate)
    requests_burst: float | None = attrs.field(default=None, validator=_rate)
    tokens: float | None = attrs.field(default=None, validator=_rate)
    tokens_burst: float | None = attrs.field(default=None, validator=_rate)
    concurrency: int | None = attrs.field(default=None, validator=_slots)


class _Bucket:
    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate)


class _KeyState:
    __slots__ = ("in_flight", "requests", "tokens")

    def __init__(self, limit: Limit, now: float) -> None:
        self.in_flight = 0
        self.requests = (
            None
            if limit.requests is None
            else _Bucket(limit.requests, limit.requests_burst or max(1.0, limit.requests), now)
        )
        self.tokens = (
            None
            if limit.tokens is None
            else _Bucket(limit.tokens, limit.tokens_burst or max(1.0, limit.tokens), now)
        )


class QuotaServer:
    """``async with QuotaServer(limit=Limit(requests=50)) as server:`` serves ``server.url``.

    :param limit: the quota every key gets, unless ``limits`` names the key.
    :param limits: per-key quotas.
    :param latency: seconds each accepted request takes, unless it sends ``X-Delay``.
    :param failing: keys answered with ``500`` (change it while running to heal a key).
    :param refuse_with: the status past a limit: ``429``, or ``503`` as providers that
        shed load answer (both carry ``Retry-After``).
    """

    def __init__(
        self,
        limit: Limit | None = None,
        *,
        limits: Mapping[str, Limit] | None = None,
        latency: float = 0.0,
        failing: Collection[str] = (),
        refuse_with: int = 429,
    ) -> None:
        if refuse_with not in (429, 503):
            raise InvalidSettingError(f"`refuse_with` must be 429 or 503 (got {refuse_with!r})")
        seconds("latency", latency)
        self.refuse_with = refuse_with
        self.limit = limit if limit is not None else Limit()
        self.limits = dict(limits or {})
        self.latency = latency
        self.failing: set[str] = set(failing)
        #: ``(time, key, tokens)`` of every accepted request, in arrival order.
        self.accepted: list[tuple[float, str, int]] = []
        #: ``(time, key)`` of every request refused past a limit (429 or 503).
        self.rejected: list[tuple[float, str]] = []
        #: ``(time, key)`` of every request answered 500 because its key was failing.
        self.failed: list[tuple[float, str]] = []
        self.peak_in_flight: dict[str, int] = {}
        self._keys: dict[str, _KeyState] = {}
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_limit(self, limit: Limit, key: str | None = None) -> None:
        """Change the quota of ``key`` (or the default one) from now on, buckets full."""
        if key is None:
            self.limit = limit
            self._keys.clear()
        else:
            self.limits[key] = limit
            self._keys.pop(key, None)

    def in_flight(self, key: str) -> int:
        state = self._keys.get(key)
        return 0 if state is None else state.in_flight

    async def __aenter__(self) -> QuotaServer:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self._listener = listener
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        task_group.start_soon(listener.serve, self._serve)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None and self._listener is not None
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()

    async def _serve(self, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    head = await reader.receive_until(b"\r\n\r\n", _MAX_HEAD)
                    lines = head.decode("latin-1").split("\r\n")
                    headers: dict[str, str] = {}
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                    length = int(headers.get("content-length", "0"))
                    if length:
                        await reader.receive_exactly(length)
                    status, extra, body = await self._respond(headers)
                    reply = [f"HTTP/1.1 {status} {_REASONS[status]}"]
                    reply += [f"{name}: {value}" for name, value in extra.items()]
                    reply += [
                        "Content-Type: application/json",
                        f"Content-Length: {len(body)}",
                        "",
                        "",
                    ]
                    await stream.send("\r\n".join(reply).encode("latin-1") + body)
                except (
                    anyio.EndOfStream,
                    anyio.IncompleteRead,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    anyio.DelimiterNotFound,
                    ValueError,
                ):
                    return

    async def _respond(self, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
        now = anyio.current_time()
        auth = headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() or headers.get("x-api-key", "default")
        if key in self.failing:
            self.failed.append((now, key))
            return 500, {}, b'{"error": "key failing"}'
        tokens = int(headers.get("x-tokens", "0"))
        limit = self.limits.get(key, self.limit)
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState(limit, now)
        wait = 0.0
        for bucket, amount in ((state.requests, 1.0), (state.tokens, float(tokens))):
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.wait_for(amount))
        if limit.concurrency is not None and state.in_flight >= limit.concurrency:
            wait = max(wait, 0.05)
        if wait > 0:
            self.rejected.append((now, key))
            retry = {"Retry-After": str(math.ceil(wait)), "retry-after-ms": f"{wait * 1000:.0f}"}
            return self.refuse_with, retry, b'{"error": "rate limited"}'
        if state.requests is not None:
            state.requests.level -= 1.0
        if state.tokens is not None:
            state.tokens.level -= tokens
        self.accepted.append((now, key, tokens))
        state.in_flight += 1
        self.peak_in_flight[key] = max(self.peak_in_flight.get(key, 0), state.in_flight)
        try:
            delay = float(headers.get("x-delay", self.latency))
            if delay > 0:
                await anyio.sleep(delay)
        finally:
            state.in_flight -= 1
        body = json.dumps({"key": key, "usage": {"total_tokens": tokens}}).encode()
        return 200, {}, body


_REASONS = {
    200: "OK",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
