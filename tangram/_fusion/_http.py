"""The HTTP framing of ``tangram serve-sandbox-fusion``: what a connection may cost.

A request's body, a connection's thread and its time are the trainer's, and the client
is the model's code's caller: each is bounded here, apart from what the API does with a
request (:mod:`._server`). The standard library's threading server serves it, a thread
per connection, so a slow client never blocks the event loop and no dependency is added.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import reprlib
import socket
import threading
import time
from typing import Any

__all__ = [
    "BACKLOG",
    "IDLE_TIMEOUT",
    "MAX_BODY",
    "MAX_CONNECTIONS",
    "REQUEST_DEADLINE",
    "BoundedServer",
    "JsonHandler",
    "json_parts",
    "quote",
]

logger = logging.getLogger("tangram.frameworks.fusion")

#: The largest request body read, in bytes; a larger ``Content-Length`` is refused (413)
#: before any of it is read. A SandboxFusion request is code and a few small files (verl
#: sends code of some KiB and no files): 16 MiB holds code and about 12 MiB of files in
#: base64. It bounds what one request costs the trainer, with ``MAX_BRACKETS``: the body
#: read, then parsed one at a time (a lock: parsing holds the GIL anyway), at most about
#: 18x its size at the peak (measured: +283 MiB for 16 MiB of ``["ab","ab",...]``, an
#: object per 5 bytes; ``[1.5,...]`` +213 MiB, ``[0,...]`` +131 MiB), then dropped before
#: the code runs.
MAX_BODY = 16 << 20
#: The most connections served at once, each by a thread; the next ones wait, unaccepted,
#: in the listen backlog (``BACKLOG``) until one ends, costing no thread and no memory
#: here. With ``MAX_BODY`` this bounds the bodies in flight: 64 x 16 MiB = 1 GiB.
MAX_CONNECTIONS = 64
#: Connections the kernel holds unaccepted past ``MAX_CONNECTIONS`` (capped by the
#: system's ``somaxconn``); past them a client's connect waits or is refused by the kernel.
BACKLOG = 1024
#: Seconds a connection may stay silent (a half-sent request, an idle keep-alive) before
#: it is closed: each holds a thread. A request line and headers, once begun, must all
#: arrive within this too (a byte at a time would otherwise hold the thread forever).
IDLE_TIMEOUT = 15.0
#: Seconds from a request's first byte to the end of its body: past it the connection is
#: closed. A 16 MiB body arrives in it at 280 KiB/s.
REQUEST_DEADLINE = 60.0

# Request values quoted in an error: bounded in length and depth, as a request can hold
# a 60 MiB string or a list nested as deep as the JSON parser allows.
quote = reprlib.Repr()
quote.maxstring = quote.maxother = 80


def json_parts(payload: Any) -> list[bytes]:
    """``payload`` as JSON, in parts: a ``files`` of base64 bytes (JSON-safe as they are) is
    written as it is, so the answer is never one more str and one more bytes of it all."""
    files = payload.get("files") if isinstance(payload, dict) else None
    if not files:
        return [json.dumps(payload).encode()]
    rest = json.dumps({key: value for key, value in payload.items() if key != "files"})
    parts = [rest[:-1].encode(), b', "files": {']
    for n, (name, data) in enumerate(files.items()):
        parts += [b", " if n else b"", json.dumps(name).encode(), b': "', data, b'"']
    parts.append(b"}}")
    return parts


class BoundedServer(http.server.ThreadingHTTPServer):
    """A threading server that serves at most ``MAX_CONNECTIONS`` at once and stops
    reading a connection at its deadline."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(
        self, address: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler]
    ) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self._late: set[socket.socket] = set()
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        # Past MAX_CONNECTIONS nothing is accepted: the next connection waits in the
        # backlog, with no thread. The wait is short so that serve_forever still sees a
        # shutdown; the listening socket stays readable, so it comes straight back here.
        if not self._slots.acquire(timeout=0.2):
            raise OSError("all connections taken")  # the base's skip: nothing accepted
        try:
            return super().get_request()
        except BaseException:
            self._slots.release()
            raise

    def shutdown_request(self, request: Any) -> None:
        try:
            self.deadline(request, None)
            with self._lock:
                self._late.discard(request)
            super().shutdown_request(request)
        finally:
            self._slots.release()

    def deadline(self, connection: socket.socket, at: float | None) -> None:
        """Stop reading ``connection`` at ``at`` (``time.monotonic``), or never (None)."""
        with self._lock:
            if at is None:
                self._deadlines.pop(connection, None)
            else:
                self._deadlines[connection] = at

    def late(self, connection: socket.socket) -> bool:
        """Whether ``connection``'s reading was stopped at its deadline."""
        with self._lock:
            return connection in self._late

    def service_actions(self) -> None:
        # Run by serve_forever at least every poll interval (0.5 s). A socket's timeout
        # bounds one recv: a byte at a time, each within it, held a thread forever. A
        # connection past its deadline has its reading shut: the read blocked on it ends.
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, at in self._deadlines.items() if at <= now]
            for sock in late:
                del self._deadlines[sock]
                self._late.add(sock)
        for sock in late:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 framing: deadlines, a body read whole within ``MAX_BODY``, JSON answers,
    refusals that close the connection. The API's handler adds ``do_GET`` and ``do_POST``."""

    protocol_version = "HTTP/1.1"
    # Read by StreamRequestHandler.setup as the socket's timeout: a connection silent this
    # long (a half-sent request, an idle keep-alive) is closed, and its thread ends.
    timeout = IDLE_TIMEOUT
    server: BoundedServer
    _started = 0.0

    def log_message(self, format: str, *args: Any) -> None:  # the base's name
        logger.debug("%s " + format, self.address_string(), *args)

    def handle_one_request(self) -> None:
        # The request's first byte is awaited for the idle timeout; from it, the request
        # line and headers must arrive within the idle timeout, and the body within
        # REQUEST_DEADLINE (set by do_POST).
        try:
            if not self.rfile.peek(1):  # type: ignore[attr-defined]
                self.close_connection = True
                return
        except OSError:  # silent past the idle timeout, or reset
            self.close_connection = True
            return
        self._started = time.monotonic()
        self.server.deadline(self.connection, self._started + self.timeout)
        try:
            super().handle_one_request()
        finally:
            self.server.deadline(self.connection, None)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.server.late(self.connection):
            self.refuse(408, f"the request's headers took over {self.timeout:g} s to arrive")
            return False
        return True

    def send_json(self, status: int, payload: Any) -> None:
        parts = json_parts(payload)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(sum(map(len, parts))))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            for part in parts:
                self.wfile.write(part)
        except OSError:  # the client hung up: nobody to answer
            self.close_connection = True

    def refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` and close: the rest of the body is not read, so the connection
        cannot carry another request."""
        self.close_connection = True
        self.send_json(status, {"detail": detail})
        with contextlib.suppress(OSError):
            self.wfile.flush()
            # What the client already sent is drained (briefly, and not all of a huge
            # body): a close with unread data resets the connection, which can lose the
            # answer on its way.
            self.connection.settimeout(0.5)
            for _ in range(16):
                if not self.connection.recv(1 << 16):
                    break

    def body(self) -> bytearray | None:
        """The request's body, or None once a refusal was answered."""
        if self.headers.get("Transfer-Encoding") is not None:
            self.refuse(411, "a body must come with a Content-Length")
            return None
        declared = self.headers.get_all("Content-Length") or ["0"]
        text = declared[0].strip()
        if len(set(declared)) > 1 or not (text.isascii() and text.isdigit()):
            self.refuse(400, f"bad Content-Length: {quote.repr(', '.join(declared))}")
            return None
        if len(text) > 18 or int(text) > MAX_BODY:  # 19 digits and more: over it anyway
            self.refuse(413, f"the body is over the {MAX_BODY} bytes served")
            return None
        self.server.deadline(self.connection, self._started + REQUEST_DEADLINE)
        # In pieces: one read of the declared size allocated all of it at once, before a
        # byte arrived (64 MiB per connection that declared it and sent nothing).
        length, body = int(text), bytearray()
        while len(body) < length:
            piece = self.rfile.read1(min(length - len(body), 1 << 20))
            if not piece:  # the client hung up mid-body, or took too long to send it
                if self.server.late(self.connection):
                    self.refuse(408, f"the request took over {REQUEST_DEADLINE:g} s to arrive")
                self.close_connection = True
                return None
            body += piece
        self.server.deadline(self.connection, None)
        return body  # not copied: json.loads reads a bytearray
