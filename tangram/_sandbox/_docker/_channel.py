"""The host's end of the Docker runner's channel: frames with a size cap, and a log relay.

A frame is a fixed header (metadata length, data length), JSON metadata, then raw data:
stdout, stdin and file contents travel as bytes, not base64 inside JSON, so a file move
costs a copy rather than an encode at both ends. The header is checked before a byte of
the body is buffered, so whatever writes on the channel, the host holds at most one capped
frame; anything that is not a frame is a :class:`ChannelError`, which the backend turns
into a broken sandbox. The runner (:mod:`tangram._sandbox._docker._runner`) has its own copy of
the header format, since its source is sent into the container alone.

What the runner writes on stderr reaches the trainer's log through :class:`LogRelay`: a
few short records a minute, so not even a runner gone wrong floods the training job's
logs.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from typing import Any

__all__ = ["CHUNK", "ChannelError", "FrameReader", "LogRelay", "encode"]

HEADER = struct.Struct(">IQ")
"""Metadata length, data length; the same format as the runner's."""
CHUNK = 1 << 20
"""Most data bytes in one frame of a file move or of stdin (the runner's ``CHUNK``)."""
META_LIMIT = 64 << 10
"""Largest reply metadata: a reply's JSON is a handful of fields and a short message."""


class ChannelError(Exception):
    """What came on the channel is not a well-formed, authentic frame."""


def encode(meta: dict[str, Any], data: bytes = b"") -> bytes:
    """One frame, as one buffer: written in one call, it is never cut by a cancellation."""
    body = json.dumps(meta).encode()
    return b"".join((HEADER.pack(len(body), len(data)), body, data))


class FrameReader:
    """Frames from the bytes of the runner's stdout, never buffering past one capped frame."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next(self, data_limit: int) -> tuple[dict[str, Any], bytes] | None:
        """The next complete frame, or None until more bytes come.

        :raises ChannelError: the header announces more than ``data_limit`` data bytes (or
            more metadata than a reply has), or the metadata is not a JSON object.
        """
        if len(self._buffer) < HEADER.size:
            return None
        meta_len, data_len = HEADER.unpack_from(self._buffer)
        if meta_len > META_LIMIT or data_len > data_limit:
            raise ChannelError(
                f"a frame of {meta_len} + {data_len} bytes (at most {META_LIMIT} + {data_limit})"
            )
        end = HEADER.size + meta_len + data_len
        if len(self._buffer) < end:
            return None
        try:
            meta = json.loads(bytes(self._buffer[HEADER.size : HEADER.size + meta_len]))
        except ValueError as exc:
            raise ChannelError(f"a frame whose metadata is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ChannelError(f"a frame whose metadata is not an object: {meta!r:.100}")
        data = bytes(self._buffer[HEADER.size + meta_len : end])
        del self._buffer[:end]
        return meta, data


class LogRelay:
    """The runner's stderr into the host's log: short records, a few per minute.

    A token bucket (``burst`` records, refilled over ``per`` seconds) rather than a count
    per action: the runner writes there only when something is wrong, and then a few
    lines say what; the rest is dropped and counted in the next record that gets through.
    """

    def __init__(
        self,
        logger: logging.Logger,
        name: str,
        *,
        record_chars: int = 500,
        burst: int = 5,
        per: float = 60.0,
    ) -> None:
        self._logger = logger
        self._name = name
        self._record_chars = record_chars
        self._burst = burst
        self._per = per
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._dropped = 0

    def feed(self, data: bytes) -> None:
        now = time.monotonic()
        self._tokens = min(
            self._burst, self._tokens + (now - self._stamp) * self._burst / self._per
        )
        self._stamp = now
        if self._tokens < 1:
            self._dropped += len(data)
            return
        self._tokens -= 1
        shown = data[: self._record_chars].decode(errors="replace")
        note = f" [cut: {len(data)} bytes in all]" if len(data) > self._record_chars else ""
        if self._dropped:
            note += f" [{self._dropped} bytes dropped before]"
            self._dropped = 0
        self._logger.warning("sandbox %s runner: %s%s", self._name, shown, note)
