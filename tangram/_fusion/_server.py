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

The code is written to a file in the request's sandbox and run as ``python FILE`` /
``bash FILE``, as SandboxFusion runs it: as one ``-c`` argument, code over 128 KiB could
not start and came back as the code's own failure (exit 126).

What the request and the code control is answered as theirs, never as tangram's failure
(a 503 the model could trigger at will, counted and logged at ERROR): a ``fetch_files``
entry the code made unreadable (a symlink, a FIFO, a directory, over the backend's
``max_file``) is skipped, as SandboxFusion skips a missing one, and named in
``message``; ``files`` that clash (``a`` and ``a/b``) or do not fit in the sandbox's
disk are refused 422. Each limit below bounds what one request costs the trainer's
process: the body read (``MAX_BODY``), the files written (``MAX_FILES``), the time a
command holds its cores (``MAX_RUN_TIMEOUT``), the bytes fetched (``MAX_FETCH_FILES``,
``MAX_FETCH_BYTES``: one file asked for under several spellings, ``out`` and
``./out``, is read once) and how long a silent connection holds a thread
(``IDLE_TIMEOUT``).

HTTP comes from the standard library's threading server, its framing and what a
connection may cost in :mod:`._http`: a thread per connection reads the request and
waits on the event loop that owns the scheduler (through an anyio portal), so a slow
client never blocks the loop and no dependency is added.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio.to_thread
from anyio.from_thread import BlockingPortal

from .._core._demand import Elastic
from .._frameworks import _session
from .._frameworks._failures import is_infrastructure, record
from .._sandbox._backend import RunResult
from .._sandbox._pool import Sandbox, _relative, utf8
from ..errors import InvalidSettingError
from ._http import (
    BACKLOG,
    IDLE_TIMEOUT,
    MAX_BODY,
    MAX_CONNECTIONS,
    REQUEST_DEADLINE,
    BoundedServer,
    JsonHandler,
    quote,
)

__all__ = [
    "DEFAULT_PORT",
    "BACKLOG",
    "IDLE_TIMEOUT",
    "LANGUAGES",
    "MAX_BODY",
    "MAX_BRACKETS",
    "MAX_CONNECTIONS",
    "MAX_FETCH_BYTES",
    "MAX_FETCH_FILES",
    "MAX_FILES",
    "MAX_RUN_TIMEOUT",
    "REQUEST_DEADLINE",
    "RequestError",
    "run_code",
    "serve",
]

logger = logging.getLogger("tangram.frameworks.fusion")

#: SandboxFusion's own default port, so a URL written for it needs no change.
DEFAULT_PORT = 8080
LANGUAGES = ("python", "bash")
_DEFAULT_RUN_TIMEOUT = 10.0  # SandboxFusion's default
#: The longest ``run_timeout`` served, in seconds; a longer one is refused (422). A
#: request holds its cores for up to this long, and 1e19 s overflowed the CPU rlimit.
MAX_RUN_TIMEOUT = 3600.0
#: The most ``[`` and ``{`` bytes a body may hold, strings included; more is refused (413)
#: before it is parsed. Each is a list or dict once parsed, 56 bytes and more for 2 bytes
#: of body: 63 MiB of ``[[],[],...]`` cost 1.6 GiB. A request has a few; code with 100,000
#: is a program of megabytes of literals.
MAX_BRACKETS = 100_000
#: The most entries of ``files`` one request may write (422 above).
MAX_FILES = 1024
#: The most entries of ``fetch_files`` one request may ask for (422 above).
MAX_FETCH_FILES = 1024
#: The most bytes one request fetches, all files together, counted in base64 as they are
#: answered (4 bytes per 3): past it a file is skipped, unread, and named in ``message``.
#: Each file's size is read first (a ``stat`` run in the sandbox, without following a
#: link), so one request costs the trainer at most about twice this.
MAX_FETCH_BYTES = 256 << 20

# What a put of the request's own files into a fresh sandbox (nothing has run in it yet)
# fails with because of those files: more than its disk holds, a name too long.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENAMETOOLONG})
# What a get fails with because of what the code left at a fetched name: missing, not a
# regular file, behind a symlink, not readable, over ``max_file``, or a name too long.
_UNREADABLE = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EACCES,
        errno.EPERM,
        errno.ELOOP,
        errno.ENXIO,
        errno.EFBIG,
        errno.ENAMETOOLONG,
        errno.EOVERFLOW,
    }
)
# Each fetched file's size, read without following a link, before any is read: a file
# that cannot fit what is left of ``MAX_FETCH_BYTES`` is skipped unread (-1: missing or
# not a regular file, which ``get`` then refuses on its own).
_SIZES = (
    "import json, os, stat, sys\n"
    "for p in json.load(sys.stdin):\n"
    "    try:\n"
    "        s = os.lstat(p)\n"
    "    except (OSError, ValueError):\n"
    "        print(-1)\n"
    "        continue\n"
    "    print(s.st_size if stat.S_ISREG(s.st_mode) else -1)\n"
)
_SIZES_TIMEOUT = 30.0
# One body parsed at a time: parsing holds the GIL, so nothing is lost, and the peak of
# parsing (up to ~18x the body) is paid once, not once per connection.
_PARSING = threading.Lock()
_SHOWN_SKIPS = 10  # fetch_files skipped and named in ``message``; the rest are counted


class RequestError(ValueError):
    """A request SandboxFusion would refuse (HTTP 422): the caller's mistake, not tangram's."""


class UnservedLanguageError(RequestError):
    """A language SandboxFusion knows that tangram's pool does not run (HTTP 501)."""


def _path(field: str, path: object) -> str:
    """``path`` as the work-dir-relative name the pool uses, or the request's error."""
    try:
        if not isinstance(path, str):
            raise InvalidSettingError("a path must be a string")
        utf8("the path", path)
        return _relative(path)
    except InvalidSettingError as exc:
        raise RequestError(f"`{field}` entry {quote.repr(path)}: {exc}") from None


def _request(body: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError("the body must be a JSON object")
    code = body.get("code")
    if not isinstance(code, str):
        raise RequestError("`code` must be a string")
    if "\0" in code:  # as a program's argument it could not be passed either
        raise RequestError("`code` contains a NUL byte")
    try:
        source = utf8("`code`", code)
    except InvalidSettingError as exc:
        raise RequestError(str(exc)) from None
    language = body.get("language")
    if not isinstance(language, str):
        raise RequestError("`language` must be a string")
    if language not in LANGUAGES:
        raise UnservedLanguageError(
            f"language {quote.repr(language)} is not served by tangram (served: {list(LANGUAGES)})"
        )
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError("`stdin` must be a string or null")
    timeout = body.get("run_timeout", _DEFAULT_RUN_TIMEOUT)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_RUN_TIMEOUT  # NaN too
    ):
        raise RequestError(
            f"`run_timeout` must be a number of seconds > 0 and <= {MAX_RUN_TIMEOUT:g} "
            f"(got {quote.repr(timeout)})"
        )
    return {
        "code": source,
        "language": language,
        "stdin": stdin,
        "timeout": float(timeout),
        "files": _files(body.get("files") or {}),
        "fetch": _fetch_list(body.get("fetch_files") or []),
    }


def _files(files: object) -> dict[str, bytes]:
    """``files`` decoded, keyed by the pool's path; clashes refused before any is written.

    A file and a directory of one name (``a`` and ``a/b``, in either order) cannot both
    be written: found at the put, the refusal was an ``OSError``, answered as tangram's.
    """
    if not isinstance(files, Mapping):
        raise RequestError("`files` must map paths to base64 contents")
    if len(files) > MAX_FILES:
        raise RequestError(f"`files` has {len(files)} entries, over the {MAX_FILES} served")
    decoded: dict[str, bytes] = {}
    for path, content in files.items():
        if content is None:
            continue
        name = _path("files", path)
        try:
            decoded[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise RequestError(f"`files[{quote.repr(path)}]` is not base64: {exc}") from None
    for name in decoded:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in decoded:
                raise RequestError(
                    f"`files` has both {quote.repr('/'.join(parts[:depth]))} and "
                    f"{quote.repr(name)} below it: one name cannot be a file and a directory"
                )
    return decoded


def _fetch_list(fetch: object) -> list[tuple[str, str]]:
    """``fetch_files`` as (the name asked for, the pool's path) pairs."""
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise RequestError("`fetch_files` must be a list of paths")
    if len(fetch) > MAX_FETCH_FILES:
        raise RequestError(
            f"`fetch_files` has {len(fetch)} entries, over the {MAX_FETCH_FILES} served"
        )
    return [(asked, _path("fetch_files", asked)) for asked in fetch]


def _response(result: RunResult, files: Mapping[str, bytes], message: str) -> dict[str, Any]:
    ok = result.exit_code == 0 and not result.timed_out
    return {
        "status": "Success" if ok else "Failed",
        "message": message,
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
    response = await _serve_request(_request(body), config=config, cpu=cpu, kind=kind)
    response["files"] = {name: data.decode() for name, data in response["files"].items()}
    return response


async def _serve_request(
    request: Mapping[str, Any],
    *,
    config: str | os.PathLike[str] | None,
    cpu: int | Elastic,
    kind: str,
) -> dict[str, Any]:
    """A checked request (:func:`_request`) run; its ``files`` answered as base64 bytes."""
    script = _script_name(request["language"], request["files"])
    async with _session.session(config) as resources:
        pool = resources.sandbox_pool()
        async with pool.sandbox(f"fusion-{uuid.uuid4().hex}") as sandbox:
            try:
                for path, content in request["files"].items():
                    await sandbox.put(path, content)
                await sandbox.put(script, request["code"])
            except OSError as exc:
                # The sandbox is fresh: only the request's own files can fill it.
                if exc.errno not in _NO_ROOM:
                    raise
                raise RequestError(
                    f"`files` and `code` do not fit in the sandbox: {exc.strerror or exc}"
                ) from None
            result = await _run(sandbox, request, script, cpu, kind)
            fetched, skipped = await _fetch(sandbox, request["fetch"], cpu, kind)
    return _response(result, fetched, _skipped_message(skipped))


def _script_name(language: str, files: Mapping[str, bytes]) -> str:
    """A name for the code in the work dir that none of the request's files uses."""
    taken = {name.split("/", 1)[0] for name in files}
    suffix = ".py" if language == "python" else ".sh"
    while True:
        name = f".tangram-run-{secrets.token_hex(8)}{suffix}"
        if name not in taken:
            return name


async def _fetch(
    sandbox: Sandbox, fetch: Sequence[tuple[str, str]], cpu: int | Elastic, kind: str
) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """The files asked for, base64, and those skipped with why.

    Each file is read once, under the first name it was asked by: ``big``, ``./big`` and
    ``././big`` are one file, and each spelling read it again (64 of a 1 MiB file were
    64 MiB in the answer). The sizes are read first, in the sandbox: a file whose base64
    does not fit what is left of ``MAX_FETCH_BYTES`` is skipped unread (read whole, a
    second file up to the backend's ``max_file`` cost the trainer 512 MiB to skip it).
    What the code left unreadable is skipped, as SandboxFusion skips a missing file:
    its doing, never tangram's failure. A missing file is skipped without a word, as
    there.
    """
    fetched: dict[str, bytes] = {}
    skipped: list[tuple[str, str]] = []
    first: dict[str, str] = {}
    for asked, path in fetch:
        first.setdefault(path, asked)
    sizes = await _sizes(sandbox, list(first), cpu, kind) if first else {}
    over = f"over the {MAX_FETCH_BYTES} bytes fetched per request"
    total = 0
    done: set[str] = set()
    for asked, path in fetch:
        if path in done:
            if first[path] != asked:
                skipped.append((asked, f"the same file as {quote.repr(first[path])}"))
            continue
        done.add(path)
        if sizes is None:
            skipped.append((asked, "its size could not be read"))
            continue
        room = MAX_FETCH_BYTES - total
        if _base64_size(sizes.get(path, -1)) > room:
            skipped.append((asked, over))
            continue
        try:
            data = await sandbox.get(path)
        except OSError as exc:
            if not _unreadable(exc):
                raise
            if not isinstance(exc, FileNotFoundError):
                skipped.append((asked, exc.strerror or str(exc)))
            continue
        if _base64_size(len(data)) > room:  # it grew since its size was read
            skipped.append((asked, over))
            continue
        encoded = base64.b64encode(data)
        del data
        total += len(encoded)
        fetched[asked] = encoded
    return fetched, skipped


def _base64_size(size: int) -> int:
    return 4 * ((size + 2) // 3) if size > 0 else 0


async def _sizes(
    sandbox: Sandbox, paths: Sequence[str], cpu: int | Elastic, kind: str
) -> dict[str, int] | None:
    """Each path's size (-1: missing or not a regular file), or None if unknown.

    Run in the sandbox after the code, from its work dir, as the code ran: ``get`` has no
    size bound below the backend's ``max_file``. The code can only make this fail (a full
    process table, say), so None skips the fetch as the code's doing.
    """
    try:
        result = await sandbox.run(
            [sandbox.python, "-I", "-c", _SIZES],
            stdin=json.dumps(list(paths)),
            cpu=cpu,
            timeout=_SIZES_TIMEOUT,
            kind=kind,
        )
    except InvalidSettingError:  # a path no command can be given: not the pool's fault
        return None
    lines = result.stdout.split()
    if result.exit_code != 0 or result.timed_out or len(lines) != len(paths):
        return None
    try:
        return dict(zip(paths, map(int, lines), strict=True))
    except ValueError:
        return None


def _unreadable(exc: OSError) -> bool:
    # A refusal raised with a message alone (``PermissionError("... not a regular file")``)
    # has no errno: its class says what it is.
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    return exc.errno in _UNREADABLE


def _skipped_message(skipped: Sequence[tuple[str, str]]) -> str:
    if not skipped:
        return ""
    shown = "; ".join(f"{quote.repr(asked)} ({why})" for asked, why in skipped[:_SHOWN_SKIPS])
    more = len(skipped) - _SHOWN_SKIPS
    return f"fetch_files skipped: {shown}" + (f"; and {more} more" if more > 0 else "")


async def _run(
    sandbox: Sandbox, request: Mapping[str, Any], script: str, cpu: int | Elastic, kind: str
) -> RunResult:
    # The code runs from its file, relative to the work dir the command starts in (where
    # SandboxFusion's code finds its ``files`` too).
    argv = [sandbox.python if request["language"] == "python" else "bash", script]
    try:
        return await sandbox.run(
            argv, stdin=request["stdin"], cpu=cpu, timeout=request["timeout"], kind=kind
        )
    except InvalidSettingError as exc:  # a lone surrogate in stdin: refused before it ran
        raise RequestError(str(exc)) from exc


class _Handler(JsonHandler):
    """SandboxFusion's two routes: ``GET /v1/ping`` and ``POST /run_code``."""

    server: _Server

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/ping":
            self.send_json(200, "pong")
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        raw = self.body()
        if raw is None:
            return
        if self.path.rstrip("/") != "/run_code":
            self.send_json(404, {"detail": "Not Found"})
            return
        brackets = raw.count(b"[") + raw.count(b"{")
        if brackets > MAX_BRACKETS:
            raw.clear()
            detail = f"the body holds {brackets} `[` and `{{`, over the {MAX_BRACKETS} served"
            self.send_json(413, {"detail": detail})
            return
        try:
            with _PARSING:
                body = json.loads(raw or b"null")
                raw.clear()  # the parsed request, then the checked one, are all kept
                request = _request(body)
                del body  # the run keeps only what it uses: the parse cost is paid here
        except UnservedLanguageError as exc:
            self.send_json(501, {"detail": str(exc)})
            return
        except RequestError as exc:
            self.send_json(422, {"detail": str(exc)})
            return
        except (ValueError, RecursionError) as exc:  # bad JSON, not UTF-8, nested too deep
            self.send_json(422, {"detail": f"invalid JSON: {type(exc).__name__}: {exc}"[:500]})
            return
        finally:
            raw.clear()
        options = self.server.options
        try:
            response = self.server.portal.call(
                functools.partial(_serve_request, request, **options)
            )
        except Exception as exc:
            if isinstance(exc, RequestError):
                self.send_json(422, {"detail": str(exc)})
                return
            if not is_infrastructure(exc) and isinstance(exc, ValueError):
                # A bad argument in the request (a NUL byte in the code): the caller's.
                self.send_json(422, {"detail": str(exc)})
                return
            # SandboxFusion answers its own failures as status SandboxError; the 503 with it
            # makes verl's client log the call as failed at ERROR, not as the code's verdict.
            if not is_infrastructure(exc):
                logger.exception("run_code failed")
            record(options["kind"], exc)
            message = f"tangram could not run the code: {type(exc).__name__}: {exc}"
            self.send_json(503, {"status": "SandboxError", "message": message, "detail": message})
        else:
            del request
            self.send_json(200, response)


class _Server(BoundedServer):
    """The server, with the event loop's portal and the options each request runs with."""

    def __init__(
        self, address: tuple[str, int], portal: BlockingPortal, options: Mapping[str, Any]
    ) -> None:
        self.portal = portal
        self.options = dict(options)
        super().__init__(address, _Handler)


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
