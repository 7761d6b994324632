"""SandboxFusion's ``run_code`` HTTP API, served from tangram's sandbox pool.

verl reaches a code sandbox over HTTP in two places it configures by URL alone: its
SandboxFusion reward (``reward.sandbox_fusion.url``, through
``verl.utils.reward_score.sandbox_fusion``) and tool YAMLs written for
``SandboxFusionTool`` (``sandbox_fusion_url``). Serving the same API from tangram lets
both run unchanged against tangram's pool: each request runs in a fresh sandbox, under a
grant of the scheduler, beside the rollout's own tool calls.

The request and response are SandboxFusion's (``sandbox/server/sandbox_api.py``):
``POST /run_code`` with ``{code, language, stdin, run_timeout, compile_timeout,
memory_limit_MB, files, fetch_files}``, answered with ``{status, message,
compile_result, run_result: {status, execution_time, return_code, stdout, stderr},
executor_pod_name, files}``; ``GET /v1/ping`` answers ``"pong"``. Served languages are
``python`` (the pool's interpreter) and ``bash``; ``compile_timeout`` and
``memory_limit_MB`` are accepted and unused (nothing is compiled; the pool's memory limit
applies).

HTTP comes from the standard library's threading server: a thread per connection reads
the request and waits on the event loop that owns the scheduler (through an anyio
portal), so a slow client never blocks the loop and no dependency is added.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import http.server
import json
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio.to_thread
from anyio.from_thread import BlockingPortal

from .._core._demand import Elastic
from .._frameworks import _session
from .._frameworks._failures import is_infrastructure, record
from .._sandbox._backend import RunResult
from .._sandbox._pool import Sandbox

__all__ = ["DEFAULT_PORT", "LANGUAGES", "RequestError", "run_code", "serve"]

logger = logging.getLogger("tangram.frameworks.fusion")

#: SandboxFusion's own default port, so a URL written for it needs no change.
DEFAULT_PORT = 8080
LANGUAGES = ("python", "bash")
_DEFAULT_RUN_TIMEOUT = 10.0  # SandboxFusion's default


class RequestError(ValueError):
    """A request SandboxFusion would refuse (HTTP 422): the caller's mistake, not tangram's."""


class UnservedLanguageError(RequestError):
    """A language SandboxFusion knows that tangram's pool does not run (HTTP 501)."""


def _request(body: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError("the body must be a JSON object")
    code = body.get("code")
    if not isinstance(code, str):
        raise RequestError("`code` must be a string")
    language = body.get("language")
    if not isinstance(language, str):
        raise RequestError("`language` must be a string")
    if language not in LANGUAGES:
        raise UnservedLanguageError(
            f"language {language!r} is not served by tangram (served: {list(LANGUAGES)})"
        )
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError("`stdin` must be a string or null")
    timeout = body.get("run_timeout", _DEFAULT_RUN_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise RequestError(f"`run_timeout` must be a positive number (got {timeout!r})")
    files = body.get("files") or {}
    if not isinstance(files, Mapping):
        raise RequestError("`files` must map paths to base64 contents")
    decoded: dict[str, bytes] = {}
    for path, content in files.items():
        if content is None:
            continue
        try:
            decoded[str(path)] = base64.b64decode(content, validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise RequestError(f"`files[{path!r}]` is not base64: {exc}") from exc
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise RequestError("`fetch_files` must be a list of paths")
    return {
        "code": code,
        "language": language,
        "stdin": stdin,
        "timeout": float(timeout),
        "files": decoded,
        "fetch": fetch,
    }


def _response(result: RunResult, files: Mapping[str, str]) -> dict[str, Any]:
    ok = result.exit_code == 0 and not result.timed_out
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": "TimeLimitExceeded" if result.timed_out else "Finished",
            "execution_time": result.exec_seconds,
            "return_code": result.exit_code,
            "stdout": result.stdout.decode(errors="replace"),
            "stderr": result.stderr.decode(errors="replace"),
        },
        "executor_pod_name": None,
        "files": dict(files),
    }


async def run_code(
    body: Mapping[str, Any],
    *,
    config: str | os.PathLike[str] | None = None,
    cpu: int | Elastic = 1,
    kind: str = "sandbox_fusion",
) -> dict[str, Any]:
    """One ``run_code`` request, run in a fresh sandbox of this loop's pool.

    :raises RequestError: a request SandboxFusion would refuse, or a language not served.
    :raises SandboxBrokenError: the sandbox died (tangram's failure, not the code's).
    """
    request = _request(body)
    async with _session.session(config) as resources:
        pool = resources.sandbox_pool()
        async with pool.sandbox(f"fusion-{uuid.uuid4().hex}") as sandbox:
            try:
                for path, content in request["files"].items():
                    await sandbox.put(path, content)
            except (TypeError, ValueError) as exc:
                raise RequestError(f"`files`: {exc}") from exc
            result = await _run(sandbox, request, cpu, kind)
            fetched: dict[str, str] = {}
            for path in request["fetch"]:
                with contextlib.suppress(FileNotFoundError):  # as SandboxFusion: skipped
                    fetched[path] = base64.b64encode(await sandbox.get(path)).decode()
    return _response(result, fetched)


async def _run(
    sandbox: Sandbox, request: Mapping[str, Any], cpu: int | Elastic, kind: str
) -> RunResult:
    try:
        if request["language"] == "python":
            return await sandbox.run(
                code=request["code"],
                stdin=request["stdin"],
                cpu=cpu,
                timeout=request["timeout"],
                kind=kind,
            )
        return await sandbox.run(
            ["bash", "-c", request["code"]],
            stdin=request["stdin"],
            cpu=cpu,
            timeout=request["timeout"],
            kind=kind,
        )
    except ValueError as exc:  # a NUL byte in the code: refused before it was queued
        raise RequestError(str(exc)) from exc


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], portal: BlockingPortal, options: Mapping[str, Any]
    ) -> None:
        super().__init__(address, _Handler)
        self.portal = portal
        self.options = dict(options)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # the base's name
        logger.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/ping":
            self._send(200, "pong")
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/run_code":
            self._send(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as exc:
            self._send(422, {"detail": f"invalid JSON: {exc}"})
            return
        options = self.server.options
        try:
            response = self.server.portal.call(functools.partial(run_code, body, **options))
        except UnservedLanguageError as exc:
            self._send(501, {"detail": str(exc)})
        except RequestError as exc:
            self._send(422, {"detail": str(exc)})
        except Exception as exc:
            if not is_infrastructure(exc) and isinstance(exc, ValueError):
                # A bad argument in the request (a NUL byte in the code): the caller's.
                self._send(422, {"detail": str(exc)})
                return
            # SandboxFusion answers its own failures as status SandboxError; the 503 with it
            # makes verl's client log the call as failed at ERROR, not as the code's verdict.
            if not is_infrastructure(exc):
                logger.exception("run_code failed")
            record(options["kind"], exc)
            message = f"tangram could not run the code: {type(exc).__name__}: {exc}"
            self._send(503, {"status": "SandboxError", "message": message, "detail": message})
        else:
            self._send(200, response)


@contextlib.asynccontextmanager
async def serve(
    config: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    cpu: int | Elastic = 1,
    kind: str = "sandbox_fusion",
) -> AsyncIterator[str]:
    """Serve ``run_code`` on ``host:port`` while the block runs; yields the base URL.

    The scheduler and pool are this loop's (:func:`tangram._frameworks._session.session`),
    started before the port opens, so a bad config fails here. ``port=0`` picks a free
    port. Point verl at ``<url>/run_code``.

    :raises ConfigError: no config, or one without ``[sandbox]``.
    :raises OSError: the address is taken.
    """
    _session.check(config, needs=("sandbox",))
    async with _session.session(config), BlockingPortal() as portal:
        options = {"config": config, "cpu": cpu, "kind": kind}
        server = await anyio.to_thread.run_sync(_Server, (host, port), portal, options)
        thread = threading.Thread(target=server.serve_forever, name="tangram-fusion", daemon=True)
        thread.start()
        try:
            bound_host, bound_port = server.server_address[:2]
            yield f"http://{bound_host!s}:{bound_port}"
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(server.shutdown)
                server.server_close()
